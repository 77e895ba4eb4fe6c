"""Compiled graphs kept between processes: a restart, a requeue, a second tool loads them instead of compiling.

MindSpore 2.10's compile cache keeps a process's graphs as ``<path>/rank_<id>/graph_cache/compile_cache_<i>.mindir``,
``i`` the position of the compilation among the process's cache-enabled ones, and loads file ``i`` for the process's
``i``-th compilation whatever graph that is: a run whose batch shapes came in another order computed with another
shape's graph (measured: garbage numbers). So here the cache is never handed to MindSpore whole:

* every graph is kept under its own identity (:func:`graph_identity`: the cell's kind, its inputs' shapes and types,
  its parameters' names, shapes, types and trainability, the constants of every sub-cell and primitive, the owner's
  settings, the precision, operator profile and device, the code and MindSpore's version) as a
  :class:`orb.cache.CacheEntry`, an ``.npz`` whose CRC is checked when read (a damaged entry is rebuilt, never
  loaded);
* MindSpore's cache is switched on only around the compilations made here (:func:`compile_cell`), in a
  folder of this process's own, which holds, during each compilation, only the file staged for it at the position
  MindSpore will look at: it can load that graph or nothing. If its count is not where this module thinks, it finds
  nothing, compiles, and the file it writes says where the count is;
* MindSpore's own check of the entry script's source (its "dependency files") is replaced by the code digest in the
  identity, so a graph compiled under ``finetune.py`` is found by ``orb-md`` and by the test suite.

``ORB_COMPILE_CACHE=0`` (or a run's ``compile_cache: false``) compiles everything afresh. Where MindSpore does not
keep a graph (a kind it cannot serialise), it is compiled each time, said once.
"""

import errno
import hashlib
import logging
import os
import re
import shutil
import tempfile
from typing import Dict, List, Optional, Tuple

import numpy as np

from orb.signals import STOP

log = logging.getLogger("orb")

KIND = "graphs"
CODE = ("orb",)  # every module of the package: a graph's content is the code that builds its cells
SWITCH = "MS_COMPILER_CACHE_ENABLE"
# MindSpore's name for a process's i-th kept graph: under msrun prefixed by the cluster role (MS_WORKER); never its
# backend's kernel graphs (backend_compile_cache_<i>.mindir), which are not what it loads for a front-end graph
GRAPH_FILE = re.compile(r"((?:MS_[A-Z_]+)?)compile_cache_(\d+)\.mindir")
VOLATILE = ("arguments_key", "current_phase", "sequence_modified", "phase_cache")  # what MindSpore sets per compilation


class GraphCache:
    """The process's one gateway to MindSpore's compile cache (see the module's docstring)."""

    def __init__(self):
        self.enabled: Optional[bool] = None  # decided at the first compilation
        self.scratch: Optional[str] = None
        self.index = 0  # MindSpore's count of this process's cache-enabled compilations
        self.prefix: Optional[str] = None  # MindSpore's file-name prefix, once seen
        self.loaded: List[str] = []
        self.kept: List[str] = []
        self._said = set()

    def usable(self) -> bool:
        if self.enabled is None:
            self.enabled = self._enable()
        return self.enabled

    def _enable(self) -> bool:
        from orb.device import compile_cache_on

        if not compile_cache_on():
            return False
        import mindspore as ms

        try:
            import mindspore.graph.api as api

            if not hasattr(api, "_get_compile_cache_dep_files"):
                raise AttributeError("mindspore.graph.api._get_compile_cache_dep_files")
            api._get_compile_cache_dep_files = lambda: []  # the identity's code digest decides, not the entry script
            from orb.files import owner_tag

            remove_stale_scratch(tempfile.gettempdir())
            self.scratch = tempfile.mkdtemp(prefix=f"{SCRATCH}{owner_tag()}-")
            os.environ[SWITCH] = "0"  # (a user's MS_COMPILER_CACHE_ENABLE=1 would load graphs by position)
            ms.set_context(compile_cache_path=self.scratch)
        except Exception as exc:  # another MindSpore: compile as without the cache
            self._say("cache", f"compiled graphs are not kept: this MindSpore's compile cache cannot be driven ({exc})")
            return False
        import atexit

        atexit.register(shutil.rmtree, self.scratch, True)
        return True

    def _say(self, key: str, message: str) -> None:
        if key not in self._said:
            self._said.add(key)
            log.info(message)

    def compile(self, cell, inputs, kind: str, settings) -> str:
        """Compile ``cell`` for ``inputs``: from the cache when it holds this graph (``"cache"``), else compiled and
        kept (``"compiled"``); without the cache ``"uncached"``."""
        if settings is None or not self.usable():
            compile_cell_now(cell, inputs)
            return "uncached"
        try:
            return self._compile_kept(cell, inputs, kind, settings)
        except OSError as exc:  # the scratch folder's disk full, or gone: the run goes on without the cache
            if not str(exc.filename or "").startswith(self.scratch) or exc.errno not in SCRATCH_FAILURES:
                raise
            log.warning("compiled graphs are not kept from now on: %s (%s)", exc.strerror or exc, exc.filename or
                        self.scratch)
            self.enabled = False
            compile_cell_now(cell, inputs)
            return "uncached"

    def _compile_kept(self, cell, inputs, kind: str, settings) -> str:
        object.__setattr__(cell, "_orb_graph", (kind, settings))  # (for CompiledThroughCache: not in its identity)
        from orb.cache import CacheEntry, load_arrays, one_builder

        identity = graph_identity(kind, cell, inputs, settings)
        entry = CacheEntry(KIND, CODE, identity, ".npz", libraries=("mindspore",), compiled=True)
        read = lambda: entry.read(load_arrays, valid=lambda arrays: "mindir" in arrays)  # noqa: E731
        stored = read()
        if stored is None:
            with one_builder(entry, f"{kind} graph") as waited:  # a job's other ranks load what one of them compiles
                if not waited:
                    return self._compile_from(entry, read(), cell, inputs, kind)  # (compiled and kept under the lock)
                stored = read()  # the other's graph, loaded after the lock (or, if it kept none, compiled here)
        return self._compile_from(entry, stored, cell, inputs, kind)

    def _compile_from(self, entry, stored: Optional[dict], cell, inputs, kind: str) -> str:
        """Compile ``cell`` with ``stored`` (the cache's entry, or None) where MindSpore looks: loaded, else compiled
        and kept."""
        staged = self._stage(stored["mindir"].tobytes() if stored is not None else None)
        try:
            self._compile_enabled(cell, inputs)
        except Exception:
            if stored is None:
                raise
            log.warning("the cached graph %s could not be loaded: compiling it again", entry.read_from)
            self._clear()
            from orb.cache import mark_damaged

            try:
                os.remove(entry.read_from)
            except OSError:
                mark_damaged(entry.read_from, compiled=True)
            compile_cell_now(cell, inputs)
            return "uncached"
        written = self._written()
        if staged is not None and [item[:3] for item in written] == [staged]:
            self.index += 1
            self.loaded.append(kind)
            self._clear()
            return "cache"
        return self._keep(entry, [item for item in written if item[:3] != staged], kind)

    def _compile_enabled(self, cell, inputs) -> None:
        os.environ[SWITCH] = "1"  # (MindSpore reads it at every compilation; its context key is deprecated)
        try:
            compile_cell_now(cell, inputs)
        finally:
            os.environ[SWITCH] = "0"

    def _folders(self) -> List[str]:
        return [os.path.join(self.scratch, name, "graph_cache") for name in sorted(os.listdir(self.scratch))
                if name.startswith("rank_")]

    def _rank_folder(self) -> str:
        """Where MindSpore keeps this process's graphs: the folder it wrote before, else its rank's (a staged file in
        a wrong folder is only not found: the graph is compiled, and the folder it lands in is used from then on)."""
        found = self._folders()
        if found:
            return found[0]
        return os.path.join(self.scratch, f"rank_{_rank()}", "graph_cache")

    def _graph_files(self) -> List[Tuple[str, str, int]]:
        """(folder, prefix, position) of every graph file MindSpore's folders hold: ``<prefix>compile_cache_<i>.mindir``,
        the prefix the process's cluster role under msrun (``MS_WORKER``), else empty."""
        found = []
        for folder in self._folders():
            for name in os.listdir(folder):
                match = GRAPH_FILE.fullmatch(name)
                if match:
                    found.append((folder, match.group(1), int(match.group(2))))
        return found

    def _prefix(self) -> str:
        """The prefix of MindSpore's file names here: the one it wrote before, else its role's (a staged file under a
        wrong name is only not found, as in a wrong folder)."""
        if self.prefix is None:
            return _role()
        return self.prefix

    def _clear(self) -> None:
        for folder, prefix, position in self._graph_files():
            os.remove(os.path.join(folder, f"{prefix}compile_cache_{position}.mindir"))

    def _stage(self, mindir: Optional[bytes]) -> Optional[Tuple[str, int, str]]:
        """Leave only this compilation's graph (or none) where MindSpore looks; returns its (prefix, position,
        digest). MindSpore makes the files it writes read-only (0400): each is removed before it is written again."""
        self._clear()
        if mindir is None:
            return None
        folder = self._rank_folder()
        os.makedirs(folder, exist_ok=True)
        prefix = self._prefix()
        hash_file = os.path.join(folder, f"{prefix}compile_dependency.hash")
        if os.path.lexists(hash_file):
            os.remove(hash_file)
        with open(hash_file, "w"):
            pass  # the hash of no dependency files (see _enable)
        with open(os.path.join(folder, f"{prefix}compile_cache_{self.index}.mindir"), "wb") as f:
            f.write(mindir)
        return prefix, self.index, hashlib.sha256(mindir).hexdigest()

    def _written(self) -> List[Tuple[str, int, str, str]]:
        """(prefix, position, digest, path) of every graph file in the process's folder after a compilation."""
        found = []
        for folder, prefix, position in self._graph_files():
            path = os.path.join(folder, f"{prefix}compile_cache_{position}.mindir")
            with open(path, "rb") as f:
                found.append((prefix, position, hashlib.sha256(f.read()).hexdigest(), path))
        return sorted(found, key=lambda item: (item[1], item[0]))

    def _keep(self, entry, fresh: List[Tuple[str, int, str, str]], kind: str) -> str:
        """After a compilation MindSpore did itself: keep the graph it wrote (``fresh``: the files it wrote), and take
        its count from the file's position (it moves on by itself; a staged file it passed over stays unread)."""
        if not fresh:
            self._clear()
            self._say(f"unkept {kind}", f"MindSpore kept no {kind} graph: it is compiled in every process")
            return "compiled"
        self.prefix, position, _, path = fresh[-1]  # (the staged file, if MindSpore passed it over, is not in fresh)
        self.index = position + 1
        with open(path, "rb") as f:
            mindir = np.frombuffer(f.read(), dtype=np.uint8)
        self._clear()
        if entry.write(lambda tmp: np.savez(tmp, mindir=mindir), f"compiled {kind} graph"):
            self.kept.append(kind)
        return "compiled"


class CompiledThroughCache:
    """Mixin for the cells compiled through the cache (the training, evaluation, prediction and descriptor steps):
    a compilation MindSpore starts by itself, at a call, goes through the cache too.

    MindSpore 2.10 names a cell's graph by a number it gives each kind of arguments; freeing the first compiled cell
    of a process (or ``ms_memory_recycle()``) renumbers them, and every other cell's next call then compiled its
    graph afresh, outside the cache (measured: 1.4 s for the demo model, 2-14 s per graph in the test suite). Here
    such a call loads the graph the cache keeps instead, through :func:`compile_cell` (a stop signal
    meanwhile is honoured after it). Where the phase MindSpore will look for cannot be predicted (:func:`_phase`),
    or a prediction proves wrong once, MindSpore decides alone, as without this mixin. The prediction computes
    MindSpore's key of the arguments, as its own call does again: about 40 us a call for a step's 13 inputs."""

    def compile(self, *args, **kwargs):
        graph = getattr(self, "_orb_graph", None)
        phase = _phase(self, args) if graph is not None and not kwargs else None
        if phase is None or (phase in self.compile_cache and _executor().has_compiled(phase)):
            return super().compile(*args, **kwargs)
        GRAPHS._say("renumbered", "MindSpore let go of a compiled graph (a freed cell renumbered its graphs): "
                                  "loading it again from the compile cache")
        kind, settings = graph
        compile_cell(self, *args, kind=kind, settings=settings)
        if getattr(self, "compile_phase", None) != phase:  # MindSpore names graphs otherwise than predicted here
            _PREDICTING[0] = False
            GRAPHS._say("unpredicted", "MindSpore's graph names are not those expected: graphs it lets go of are "
                                       "compiled again by MindSpore itself")

    @property
    def compile_phase(self):
        return self._compile_phase

    @compile_phase.setter
    def compile_phase(self, value):
        """MindSpore's ``Cell.compile`` sets the phase at every call, before it looks for the graph, and ``Cell``'s
        setter hands it to every sub-cell, two ``Cell.__setattr__`` calls each (the demo model's 170 sub-cells: 0.6-0.8
        ms a call; full orb-v2's 467: 2.2 ms; ``benchmark.py cell-call``). A call to a graph still compiled compiles
        nothing (the condition is MindSpore's own, checked right after): the phase is handed down only where a
        compilation may follow, and kept here (MindSpore's parallel strategy reads the top cell's)."""
        if value in self.compile_cache and _executor().has_compiled(value):
            self.__dict__["_compile_phase"] = value
        else:
            from mindspore import nn

            nn.Cell.compile_phase.fset(self, value)  # MindSpore's own setter: to every sub-cell


_PREDICTING = [True]  # False once a prediction of _phase proved wrong in this process


def _executor():
    from mindspore.graph.api import _cell_graph_executor

    return _cell_graph_executor


def _phase(cell, args) -> Optional[str]:
    """The phase MindSpore's ``Cell.compile`` will look for (``_real_phase``: the cell's phase, creation time, id and
    its key of the arguments), or None where that cannot be told here: parameters among the arguments (their ids
    join the key), MindSpore's AST guard or dynamic-shape inputs, another MindSpore."""
    if not _PREDICTING[0] or os.environ.get("MS_DEV_JIT_AST_ENABLE_GUARD") == "1":
        return None
    try:
        from mindspore import Parameter

        if getattr(cell, "_dynamic_shape_inputs", None) is not None or any(isinstance(a, Parameter) for a in args):
            return None
        from mindspore.graph.dynamic_shape._auto_dynamic import is_auto_dynamic

        if is_auto_dynamic():
            return None
        key = _executor()._graph_executor.generate_arguments_key(cell, args, {},
                                                                 getattr(cell, "enable_tuple_broaden", False))
        return f"{cell.phase}.{cell.create_time}.{id(cell)}.{key}"
    except Exception:  # another MindSpore
        STOP.raise_if_raised()  # (not a stop that landed in it: every step call asks, outside any held phase)
        return None


def compile_cell_now(cell, inputs) -> None:
    """``cell.compile(*inputs)`` without the full garbage collection MindSpore runs before every compilation, which
    scans every object of the process (0.07-0.1 s in a tool's process, 0.7 s in one of 2 M objects: the test suite's
    workers): the heap is frozen meanwhile, after a collection of the young generations, where the garbage of the
    last steps sits. Older cyclic garbage (a cell that survived earlier compilations) waits for Python's next full
    collection instead. A heap the caller froze itself is left as it is (MindSpore's collection then scans what is
    not frozen): a command's program froze MindSpore's objects at their import (orb.device.import_mindspore), and
    at a demo fine-tuning's compilations 6-7 thousand others remained, scanned in 2 ms."""
    import gc

    freeze = gc.get_freeze_count() == 0
    if freeze:
        gc.collect(1)
        gc.freeze()  # (MindSpore's gc.collect() then scans nothing; unfreeze puts every object back)
    try:
        compile_method = super(CompiledThroughCache, cell).compile if isinstance(cell, CompiledThroughCache) else \
            cell.compile  # (the cache's own compilation: MindSpore's, not CompiledThroughCache's)
        compile_method(*inputs)
    finally:
        if freeze:
            gc.unfreeze()


def _role() -> str:
    """The prefix MindSpore 2.10 gives its cache files in a process msrun started (its cluster role, ``MS_WORKER``),
    else none (measured: ``rank_1/graph_cache/MS_WORKERcompile_cache_0.mindir`` under msrun)."""
    return os.environ.get("MS_ROLE", "") if os.environ.get("MS_WORKER_NUM") else ""


def _rank() -> str:
    """This process's rank as MindSpore names its cache folder: RANK_ID, else the communication's rank, else 0."""
    if os.environ.get("RANK_ID", "").isdigit():
        return os.environ["RANK_ID"]
    try:
        from mindspore.communication import get_rank

        return str(get_rank())
    except Exception:  # no communication initialised: one process
        return "0"


GRAPHS = GraphCache()
SCRATCH = "orb-graphs-"  # a process's folder for MindSpore's cache files: <temp>/orb-graphs-<pid>@<host>-<random>
SCRATCH_FAILURES = (errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS, errno.ENOENT)  # (its disk: not the run's)


def remove_stale_scratch(folder: str) -> None:
    """The folders of processes that were killed, left in the temporary folder: this host's whose process is gone
    (:func:`orb.files.owner_gone`; a temporary folder on a shared file system holds other nodes' live ones, which a
    bare pid named as gone)."""
    from orb.files import owner_gone, process_alive

    try:
        names = os.listdir(folder)
    except OSError:
        return
    for name in names:
        if not name.startswith(SCRATCH):
            continue
        tag = name[len(SCRATCH):].rpartition("-")[0]  # (mkdtemp's random part has no "-")
        legacy = tag.isdigit() and int(tag) != os.getpid() and not process_alive(int(tag))  # <pid>-<random>
        if legacy or owner_gone(tag):
            shutil.rmtree(os.path.join(folder, name), ignore_errors=True)


def compile_cell(cell, *inputs, kind: str = "", settings=None) -> str:
    """Compile ``cell`` for these inputs' shapes (once per shape) before its first run, then return
    the compiler's freed memory, so that the run's activations reuse it instead of adding to it. A stop signal
    meanwhile is noted and honoured after it (raised inside MindSpore's parser, it printed its error report and a
    Python stack on stderr). With ``settings`` (what the owner knows decides the graph beyond what
    :func:`graph_identity` reads from the cell: a run's config) the graph is loaded from the compile cache when it
    holds it, else kept there; returns ``"cache"``, ``"compiled"`` or ``"uncached"``."""
    from orb.device import release_host_memory

    with STOP.held():
        source = GRAPHS.compile(cell, inputs, kind, settings)
        release_host_memory()
    return source


def graph_identity(kind: str, cell, inputs, settings) -> tuple:
    """Everything that decides the graph MindSpore compiles for ``cell`` on ``inputs`` (see the module's docstring)."""
    import mindspore as ms

    from orb.device import ops_profile
    from orb.precision import precision, sum_form, traced_for_every_size

    specs = tuple((tuple(t.shape), str(t.dtype)) for t in inputs)
    parameters = tuple((name, tuple(p.shape), str(p.dtype), bool(p.requires_grad))
                       for name, p in cell.parameters_and_names())
    context = tuple((key, str(ms.get_context(key))) for key in ("device_target", "mode", "jit_level", "deterministic")
                    if _has_context(key))
    # the sums' form, read while the graph is traced (whatever form the model was built under), and whether it is
    # traced for inputs of every size (its sums take another form then, whatever its inputs' shapes)
    form = sum_form() + (" for every size" if traced_for_every_size() else "")
    return (kind, specs, parameters, structure_digest(cell), settings, precision(), ops_profile(), context, form)


def _has_context(key: str) -> bool:
    import mindspore as ms

    try:
        ms.get_context(key)
        return True
    except (ValueError, KeyError):
        return False


def structure_digest(cell) -> str:
    """A hash of every sub-cell's class and public constants, and of every primitive's attributes (a Custom kernel's
    library path among them): the constants a compiled graph holds that no parameter or input shows."""
    from mindspore import Parameter, Tensor
    from mindspore.ops import Primitive

    sha = hashlib.sha256()
    for name, sub in cell.cells_and_names():
        sha.update(f"{name}:{type(sub).__module__}.{type(sub).__qualname__}".encode())
        for key in sorted(vars(sub)):
            if key.startswith("_") or key in VOLATILE:
                continue
            sha.update(f"{key}={constant_text(vars(sub)[key], Parameter, Tensor, Primitive)};".encode())
    return sha.hexdigest()


def constant_text(value, Parameter, Tensor, Primitive) -> str:
    """The part of an attribute a graph may hold as a constant, as text ('' for what it cannot: a parameter, whose
    name, shape and type the key holds). A model's settings object (``self.cfg``, whose lengths ``construct`` reads
    as constants: orb-v2's envelope cutoff) is read field by field; it was '' (another cutoff loaded a graph compiled
    for the first)."""
    import dataclasses

    def text(v):
        return constant_text(v, Parameter, Tensor, Primitive)

    if isinstance(value, (bool, int, float, str, type(None))):
        return repr(value)
    if isinstance(value, np.generic):
        return f"{value.dtype}:{value.item()!r}"
    if isinstance(value, Parameter):
        return ""
    if isinstance(value, (tuple, list)):
        return "(" + ",".join(text(v) for v in value) + ")"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k!r}:{text(v)}" for k, v in sorted(value.items(), key=lambda kv: repr(kv[0]))) + "}"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return type(value).__qualname__ + text({f.name: getattr(value, f.name) for f in dataclasses.fields(value)})
    if isinstance(value, Tensor):
        return "tensor:" + hashlib.sha256(value.asnumpy().tobytes()).hexdigest() + str(value.shape) + str(value.dtype)
    if isinstance(value, np.ndarray):
        return "array:" + hashlib.sha256(value.tobytes()).hexdigest() + str(value.shape) + str(value.dtype)
    if isinstance(value, Primitive):
        return f"primitive:{value.name}:{sorted((k, str(v)) for k, v in value.attrs.items())}"
    if "typing" in type(value).__module__ and "mindspore" in type(value).__module__:
        return f"dtype:{value}"  # a mixed precision's half type
    if callable(value):  # a function chosen when the cell was built (an operator profile's form of a primitive)
        return f"callable:{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', type(value).__name__)}"
    return ""


def summary() -> Dict[str, int]:
    """How many graphs this process loaded from the cache and kept in it."""
    return {"loaded": len(GRAPHS.loaded), "kept": len(GRAPHS.kept)}
