"""The project's on-disk cache: what is costly to recompute and safe to keep between runs.

Compiled native code (``orb.native``), each database's row census and neighbour counts
(``orb.data.dataset``), indexes of non-SQLite data (``orb.data.formats``) and the starting model's
replay descriptors and pseudo-labels (``orb.training.replay``) live in ``ORB_CACHE_DIR`` (default
``~/.cache/orb_mindspore``), or in a per-user temporary folder when that is not writable (a
read-only home on a cluster node). Compiled code -- MindSpore's graphs (``orb.graph_cache``) and the native
libraries -- goes to ``ORB_COMPILE_CACHE_DIR`` when it is set: it depends on the code, the machine and the model,
never on a user's data, so one folder can serve runs whose data caches are apart (the test suite's private caches).

Every entry is a :class:`CacheEntry`: named by a hash of **everything that determines its content**
(its kind; the code that computes it: a digest of its source and the versions of the libraries that take
part; and the caller's identity parts: the data's identity, the model's name, graph settings and weights,
the operator profile, the precision), written atomically and synced (``orb.files``), and read through a
check: a damaged, empty or implausible file (a full disk, a power loss) is ignored with one warning and
computed again, never fatal.
"""

import contextlib
import hashlib
import logging
import os
import sqlite3
import tempfile
import threading
from typing import Callable, Iterator, List, Optional, Tuple, TypeVar

import numpy as np

from orb.files import exclusive, remove_stale_temporaries, write_atomically
from orb.signals import STOP

log = logging.getLogger("orb")
# One cache read at a time in a process: numpy's header parsing (ast.literal_eval) from two threads at once can fail
# in CPython 3.11 ("SystemError: AST constructor recursion depth mismatch"), and a read that fails is taken for a
# damaged file and removed (seen: 3 threads standing in for ranks recounted a neighbour count they had just kept).
_READING = threading.RLock()
T = TypeVar("T")
# Raised when the way entries are named or stored changes: every entry of an older layout misses.
LAYOUT_VERSION = 3  # 3: <kind>-<identity>-<code>


COMPILED_DIR = "ORB_COMPILE_CACHE_DIR"


def cache_dirs(subfolder: str = "", compiled: bool = False) -> List[str]:
    """Candidate cache folders, preferred first. ``compiled`` (compiled code): :data:`COMPILED_DIR` when set, then
    the others (a read-only shared folder of graphs still lets a run keep what it lacks in the user's cache)."""
    configured = os.environ.get("ORB_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "orb_mindspore")
    # $TMPDIR read now, not once per process as tempfile does: a job's own temporary folder (Slurm sets one per job)
    fallback = os.path.join(os.environ.get("TMPDIR") or tempfile.gettempdir(), f"orb_mindspore-{os.getuid()}")
    folders = [os.environ.get(COMPILED_DIR) or configured] if compiled else []
    return list(dict.fromkeys(os.path.join(folder, subfolder) if subfolder else folder
                              for folder in folders + [configured, fallback]))


def writable_dir(subfolder: str = "", compiled: bool = False) -> Optional[str]:
    """The first cache folder that exists or can be made and is writable, or None."""
    for folder in cache_dirs(subfolder, compiled):
        try:
            os.makedirs(folder, exist_ok=True)
            if os.access(folder, os.W_OK):
                return folder
        except OSError:
            continue
    return None


def digest(*parts) -> str:
    """A stable hash of ``parts`` (their ``repr``): how every cache entry is named."""
    return hashlib.sha256(repr(parts).encode()).hexdigest()


_SOURCE_DIGESTS = {}
SOURCE_SUFFIXES = (".py", ".cc", ".json")


def source_digest(*modules: str) -> str:
    """A hash of the source files of ``modules`` (a package: every source file under it): the code version of an
    entry that this code computes (a model's outputs, the neighbour counts of its graphs), so that an edit to
    it, an upgrade of the project included, misses every entry an older version made instead of reusing it."""
    import importlib.util

    key = tuple(sorted(modules))
    if key not in _SOURCE_DIGESTS:
        files = []
        for name in key:
            spec = importlib.util.find_spec(name)
            if spec.submodule_search_locations:
                for root in spec.submodule_search_locations:
                    files += [os.path.join(folder, f) for folder, _, names in os.walk(root) for f in names
                              if f.endswith(SOURCE_SUFFIXES)]
            else:  # a module, and the sources beside it that share its name (neighbours.py: neighbours.cc)
                stem = os.path.splitext(spec.origin)[0]
                files += [stem + suffix for suffix in SOURCE_SUFFIXES if os.path.exists(stem + suffix)]
        sha = hashlib.sha256()
        for path in sorted(set(files)):
            sha.update(os.path.relpath(path, os.path.dirname(os.path.dirname(__file__))).encode())
            with open(path, "rb") as f:
                sha.update(f.read())
        _SOURCE_DIGESTS[key] = sha.hexdigest()
    return _SOURCE_DIGESTS[key]


def library_versions(*names: str) -> tuple:
    """(name, version) of each installed package ``names``: part of an entry's code version when a library computes
    some of its content (ase parses the files an index copies; MindSpore's kernels give a model's outputs)."""
    from importlib.metadata import PackageNotFoundError, version

    def installed(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "absent"

    return tuple((name, installed(name)) for name in names)


class CacheEntry:
    """One cached artefact: ``kind`` (its subfolder and name prefix), the code computing it and ``identity`` (every
    input that determines its content) name it; ``extension`` is its file type.

    ``code``: the project's modules that compute the content, hashed by :func:`source_digest` -- not a version number
    bumped by hand, which an edit could forget (the index and census caches had one), so any change to them, an
    upgrade of the project included, misses every entry an older version made; ``libraries``: the installed packages
    whose version does too (:func:`library_versions`). The name is ``<kind>-<identity's hash>-<code's hash>``. An
    entry of other code is not removed when a new one is written: another installation sharing the cache (two
    virtual environments, two versions of the project on a cluster) may be reading it. ``compiled``: compiled code,
    kept where :func:`cache_dirs` puts it."""

    def __init__(self, kind: str, code: Tuple[str, ...], identity: tuple, extension: str,
                 libraries: Tuple[str, ...] = (), compiled: bool = False):
        if isinstance(code, str):
            raise TypeError("code is a tuple of module names")
        version = (source_digest(*code) if code else "", library_versions(*libraries))
        self.kind, self.extension, self.compiled = kind, extension, compiled
        self.name = (f"{kind}-{digest(LAYOUT_VERSION, kind, identity)[:24]}-{digest(LAYOUT_VERSION, version)[:16]}"
                     f"{extension}")
        self.read_from: Optional[str] = None  # the file read back, when it was
        self.kept_in: Optional[str] = None  # the file written, when it was

    def paths(self) -> List[str]:
        """The cached files of this entry, in the cache folders' order (but one found damaged that could not be
        removed: :func:`mark_damaged`)."""
        return [path for path in (os.path.join(folder, self.name) for folder in cache_dirs(self.kind, self.compiled))
                if os.path.isfile(path) and not is_marked_damaged(path)]

    def path(self) -> Optional[str]:
        """The cached file in any cache folder, or None."""
        found = self.paths()
        return found[0] if found else None

    def read(self, load: Callable[[str], T], valid: Callable[[T], bool] = lambda _: True) -> Optional[T]:
        """``load(path)`` of the first cached file that can be read and is ``valid``; one that cannot, or is not, is
        ignored with one warning (and removed where we may), so it is rebuilt. The next folder's copy is tried too: a
        damaged file in a read-only folder, which cannot be removed, had its rebuilt copy ignored at every start."""
        for path in self.paths():
            value = self._read_one(path, load, valid)
            if value is not None:
                return value
        return None

    def _read_one(self, path: str, load: Callable[[str], T], valid: Callable[[T], bool]) -> Optional[T]:
        try:
            if os.path.getsize(path) == 0:
                raise ValueError("empty file")
            with _READING:
                value = load(path)
            if not valid(value):
                raise ValueError("implausible content")
        except Exception as exc:  # any failure to read a cache file means: compute it again
            STOP.raise_if_raised()  # (a stop that landed in the read, as an extension's ImportError: the file stays)
            log.warning("cache file %s is damaged (%s): computing it again", path, str(exc).strip()[:120] or
                        type(exc).__name__)
            try:
                os.remove(path)
            except FileNotFoundError:
                pass
            except OSError:  # a read-only cache folder: skipped from now on, not read and warned of at every start
                mark_damaged(path, self.compiled)
            return None
        self.read_from = path
        return value

    def write(self, save: Callable[[str], None], what: str) -> Optional[str]:
        """``save(temporary)`` written atomically into the cache; the path, or None with one warning (``what`` names
        the content) when no cache folder is writable or the write fails (a full disk): the run goes on."""
        folder = writable_dir(self.kind, self.compiled)
        if folder is None:
            log.warning("no writable folder to keep the %s (%s): computed again at the next start; set %s",
                        what, " or ".join(cache_dirs(self.kind, self.compiled)),
                        COMPILED_DIR if self.compiled and os.environ.get(COMPILED_DIR) else "ORB_CACHE_DIR")
            return None
        # a killed writer's copy (an index can be as large as its data); on a shared cache folder another node's
        # writer may have a process id that is not alive here, so only copies untouched for an hour go
        remove_stale_temporaries(folder, min_age=3600.0)
        path = os.path.join(folder, self.name)
        try:
            write_atomically(path, save, suffix=self.extension)
        except (OSError, sqlite3.Error) as exc:  # a full disk: OSError, or sqlite3's own error for an index
            reason = (exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc).strip()) or type(exc).__name__
            log.warning("could not keep the %s in %s (%s): computed again at the next start", what, folder, reason)
            return None
        self.kept_in = path
        return path


LOCKS = "locks"  # the subfolder of the entries' build locks (orb.files.exclusive)


@contextlib.contextmanager
def one_builder(entry: CacheEntry, what: str) -> Iterator[bool]:
    """Held by one process at a time among those sharing ``entry``'s cache folder, from before it builds the entry to
    after it has written it: the others wait (one line, ``what`` naming the entry), then read it instead of building
    it too (on one host a data-parallel job's ranks compiled the same graph at the same moment, each at a fraction of
    the cores, and each wrote it). Yields whether this process waited: it then reads the entry and leaves the block
    before using it (the others' loads must not queue behind its own), and builds it outside the block if the other
    made none (a full disk: the others must not build it one after another). :func:`orb.files.exclusive` on
    ``<cache>/<kind>/locks/<entry>.lock``; a stop signal ends the wait. Where no folder is writable or locks do not
    work, each process builds it, as without the lock."""
    from orb.signals import STOP

    folder = writable_dir(os.path.join(entry.kind, LOCKS), entry.compiled)
    if folder is None:
        yield False
        return
    with exclusive(os.path.join(folder, entry.name + ".lock"), f"another process is building the {what} (a rank of "
                   f"this job, or another run sharing the cache): waiting for it",
                   give_up=lambda: STOP.received is not None) as waited:
        yield waited


DAMAGED = "damaged"  # the subfolder of markers of damaged cache files that could not be removed


def _marker(path: str, folder: str) -> str:
    return os.path.join(folder, digest(os.path.realpath(path))[:32] + ".json")


def _marker_dirs(compiled: bool = False) -> List[str]:
    """Where markers are kept, stable places first: the configured cache, the user's own (``$TMPDIR`` is a job's
    or a node's own, where the next job or another node's rank would not see a marker), the per-user fallback. Of
    compiled code: its own folder, then the user's own, which every run reading its entries sees whatever their
    data caches."""
    home = os.path.join(os.path.expanduser("~"), ".cache", "orb_mindspore", DAMAGED)
    folders = cache_dirs(DAMAGED, compiled)
    return list(dict.fromkeys(folders[:1] + [home] + folders[1:]))


def _stamp(path: str) -> list:
    """The file as it is now: a restored or rewritten copy changes its inode or status-change time, which no tool
    sets back (``cp -p`` and ``rsync -a`` restore the size and modification time)."""
    stat = os.stat(path)
    return [os.path.realpath(path), stat.st_size, stat.st_mtime_ns, stat.st_ino, stat.st_ctime_ns]


def mark_damaged(path: str, compiled: bool = False) -> None:
    """Remember that the cache file ``path``, found damaged, could not be removed (a read-only cache folder): a marker
    in the first writable of :func:`_marker_dirs` holding the file's :func:`_stamp`, so every later start skips it
    and uses or makes a copy in another folder (it read the damaged copy, and failed or rebuilt, at every start)."""
    from orb.files import write_json

    for folder in _marker_dirs(compiled):
        try:
            os.makedirs(folder, exist_ok=True)
            write_json(_marker(path, folder), _stamp(path))
            return
        except OSError:
            continue


def is_marked_damaged(path: str) -> bool:
    """Whether ``path``, as it is now, was marked damaged (:func:`mark_damaged`)."""
    import json

    for folder in _marker_dirs(compiled=True):  # (every folder a marker of either kind of entry is kept in)
        marker = _marker(path, folder)
        if os.path.isfile(marker):
            try:
                with open(marker) as f:
                    if json.load(f) == _stamp(path):
                        return True
            except (OSError, ValueError):
                continue
    return False


def load_arrays(path: str) -> dict:
    """Every array of an ``.npz`` cache file (``allow_pickle`` off). Arrays are kept as ``.npz``, not ``.npy``: reading
    a member to its end checks the zip's CRC-32, so damaged values are found (a plain ``.npy`` with zeroed pages
    read back as zeros)."""
    with np.load(path, allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def load_values(path: str) -> np.ndarray:
    """The array ``values`` of an ``.npz`` cache file (:func:`load_arrays`)."""
    return load_arrays(path)["values"]


def everyone_has(found: bool, ranks) -> bool:
    """Whether every data-parallel rank (``ranks``: rank, world_size, sum) found its cached file: a cache is used
    only then, so all ranks take the same path and their collectives match."""
    return ranks.sum(np.array([found], np.float64))[0] == ranks.world_size
