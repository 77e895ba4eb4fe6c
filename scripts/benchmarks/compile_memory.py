"""``compile-memory``: what a process keeps of each compilation once its cell is freed: resident memory after each of
several prediction cells of distinct shapes is compiled (or loaded from the compile cache), run and freed."""

import os
import subprocess
import sys

from .common import CHILDREN, ROOT


def bench_compile_memory(args) -> None:
    """One fresh process per case (compile cache off, then a new cache folder filled and read again): each round
    builds a model of another width (a graph of its own), predicts one structure, frees both and hands memory back
    (``gc.collect``, ``ms_memory_recycle``, ``release_host_memory``); the table gives the resident memory after it."""
    import tempfile

    rows = {}
    with tempfile.TemporaryDirectory(prefix="orb-compile-memory-") as folder:
        cases = [("compiled, no compile cache", {"ORB_COMPILE_CACHE": "0"}),
                 ("compiled into the cache", {"ORB_CACHE_DIR": folder}),
                 ("loaded from the cache", {"ORB_CACHE_DIR": folder})]
        for label, env in cases:
            result = subprocess.run([sys.executable, os.path.join(CHILDREN, "compile_memory.py"), args.model,
                                     str(args.rounds)], cwd=ROOT, capture_output=True, text=True,
                                    env=dict(os.environ, PYTHONPATH=ROOT, **env))
            if result.returncode:
                raise SystemExit(f"compile-memory: the measuring process failed:\n{result.stderr[-3000:]}")
            rows[label] = [line.split()[2] for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    print(f"| {args.model}: resident GB | before | " + " | ".join(f"after model {k}" for k in range(1, args.rounds + 1))
          + " |")
    print("|---|" + "---|" * (args.rounds + 1))
    for label, values in rows.items():
        print(f"| {label} | " + " | ".join(values) + " |")
