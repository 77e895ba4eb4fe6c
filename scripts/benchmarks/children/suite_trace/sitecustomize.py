"""Compile trace for ``benchmark.py suite``: imported by every Python process started with this folder on
``PYTHONPATH`` (the suite's workers and the commands they run), it times each MindSpore ``Cell.compile`` and each
graph the compile cache serves (``orb.graph_cache``) and appends one JSON line per event to
``$ORB_SUITE_TRACE/compile-<pid>.jsonl``. It changes nothing else; without ``ORB_SUITE_TRACE`` it does nothing."""

import importlib.abc
import importlib.util
import json
import os
import sys
import time

FOLDER = os.environ.get("ORB_SUITE_TRACE")


def _write(record: dict) -> None:
    record.update(pid=os.getpid(), test=os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0],
                  program=os.path.basename(sys.argv[0]) if sys.argv else "")
    with open(os.path.join(FOLDER, f"compile-{os.getpid()}.jsonl"), "a") as f:
        f.write(json.dumps(record) + "\n")


def _trace_cells(module) -> None:
    original = module.Cell.compile

    def compile(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return original(self, *args, **kwargs)
        finally:
            _write(dict(event="cell", cell=type(self).__name__, seconds=time.perf_counter() - start))

    module.Cell.compile = compile


def _trace_graph_cache(module) -> None:
    original = module.GraphCache.compile

    def compile(self, cell, inputs, kind, settings):
        start = time.perf_counter()
        source = original(self, cell, inputs, kind, settings)
        key = None
        if settings is not None:
            import hashlib

            key = hashlib.sha256(repr(module.graph_identity(kind, cell, inputs, settings)).encode()).hexdigest()[:16]
        _write(dict(event="graph", kind=kind, source=source, key=key, seconds=time.perf_counter() - start))
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


if FOLDER:
    sys.meta_path.insert(0, _Finder())
