"""Compile trace for ``benchmark.py suite``: imported by every Python process started with this folder on
``PYTHONPATH`` (the suite's workers and the commands they run), it times each MindSpore ``Cell.compile`` and each
graph the compile cache serves (``orb.graph_cache``), notes each process's CPU time at its exit, and appends one JSON
line per event to ``$ORB_SUITE_TRACE/compile-<pid>.jsonl``. It changes nothing else; without ``ORB_SUITE_TRACE`` it only runs the
sitecustomize it hides, if any."""

import importlib.abc
import importlib.util
import json
import os
import sys
import time

FOLDER = os.environ.get("ORB_SUITE_TRACE")
SHORTEST = 0.05  # s: MindSpore calls Cell.compile at every graph-mode call; a call that compiled nothing is not kept
_inside_cache = [0]  # GraphCache.compile calls under way in this process (its own Cell.compile calls are its)


def _write(record: dict) -> None:
    record.update(pid=os.getpid(), test=os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0],
                  program=os.path.basename(sys.argv[0]) if sys.argv else "")
    try:
        with open(os.path.join(FOLDER, f"compile-{os.getpid()}.jsonl"), "a") as f:
            f.write(json.dumps(record) + "\n")
    except OSError:  # (the folder gone, a full disk: the traced process goes on untouched)
        pass


def _trace_cells(module) -> None:
    original = module.Cell.compile

    def compile(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return original(self, *args, **kwargs)
        finally:
            seconds = time.perf_counter() - start
            if seconds >= SHORTEST:
                _write(dict(event="cell", cell=type(self).__name__, seconds=seconds, in_cache=_inside_cache[0] > 0))

    module.Cell.compile = compile


def _trace_graph_cache(module) -> None:
    original = module.GraphCache.compile

    def compile(self, cell, inputs, kind, settings):
        start = time.perf_counter()
        _inside_cache[0] += 1
        try:
            source = original(self, cell, inputs, kind, settings)
        finally:
            _inside_cache[0] -= 1
        seconds = time.perf_counter() - start
        key, parts, shapes = None, None, None
        if settings is not None:
            import hashlib

            digest = lambda value: hashlib.sha256(repr(value).encode()).hexdigest()[:16]  # noqa: E731
            identity = module.graph_identity(kind, cell, inputs, settings)
            key = digest(identity)
            # (each part's own digest: graphs that differ in one part only, e.g. the shapes, are found in the trace)
            names = ("kind", "specs", "parameters", "structure", "settings", "precision", "profile", "context",
                     "sum form")
            if len(identity) == len(names):  # (else graph_identity changed: no parts, and the tracer's test says so)
                parts = dict(zip(names, map(digest, identity)))
                shapes = [list(shape) for shape, _ in identity[1]][:4]
        _write(dict(event="graph", kind=kind, source=source, key=key, parts=parts, shapes=shapes, seconds=seconds))
        return source

    module.GraphCache.compile = compile


PATCHES = {"mindspore.nn.cell": _trace_cells, "orb.graph_cache": _trace_graph_cache}


class _Finder(importlib.abc.MetaPathFinder):
    """Patches each module of PATCHES right after it is first imported."""

    def find_spec(self, name, path, target=None):
        if name not in PATCHES:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            PATCHES[name](module)

        spec.loader.exec_module = exec_module
        return spec


def _next_sitecustomize() -> None:
    """Run the sitecustomize this one hides (the first further on sys.path), as Python would have."""
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        path = os.path.join(os.path.abspath(entry or "."), "sitecustomize.py")
        if os.path.dirname(path) != here and os.path.isfile(path):
            with open(path) as f:
                exec(compile(f.read(), path, "exec"), {"__name__": "sitecustomize", "__file__": path})
            return


def _trace_process() -> None:
    """At the process's exit: its CPU time, and whether it imported MindSpore (a process killed or ended by os._exit
    leaves no record)."""
    import atexit
    import resource

    def record():
        usage = resource.getrusage(resource.RUSAGE_SELF)
        _write(dict(event="process", cpu=usage.ru_utime + usage.ru_stime, mindspore="mindspore" in sys.modules))

    atexit.register(record)


if FOLDER:
    sys.meta_path.insert(0, _Finder())
    _trace_process()
_next_sitecustomize()
