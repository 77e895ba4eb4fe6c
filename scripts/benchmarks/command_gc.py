"""``command-gc``: what Python's garbage collector costs a short command, as orb runs it and as Python would: the
same ``orb-evaluate`` run as a program (no collection while MindSpore is imported, what exists then frozen out of
the collector: :func:`orb.device.import_mindspore`) and run by a driver (not the program: nothing frozen) that makes
``gc.disable`` do nothing (Python's collector throughout, as before), alternated."""

import os
import sys
import tempfile

import numpy as np

from .common import ROOT, run_timed

DRIVER = ("import gc, runpy, sys\n"
          "gc.disable = lambda: None\n"
          "sys.argv = sys.argv[1:]\n"
          "try:\n"
          "    runpy.run_path(sys.argv[0], run_name='__main__')\n"
          "except SystemExit as stop:\n"
          "    sys.exit(stop.code)\n")


def timed(command, env) -> tuple:
    """(wall s, CPU s of the process and its children) of ``command``, which must succeed."""
    result, wall, cpu = run_timed(command, env=env, cwd=ROOT)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{result.stderr[-2000:]}")
    return wall, cpu


def bench_command_gc(args) -> None:
    """``--rounds`` alternations of orb-evaluate on the demo's validation structures (its graph from a compile cache
    folder of this run, filled by a first run not counted), medians."""
    script = os.path.join(ROOT, "scripts", "evaluate.py")
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, ORB_CACHE_DIR=os.path.join(tmp, "cache"))

        def command(python_gc: bool, k: int) -> list:
            run = [script, "--checkpoint", os.path.join(ROOT, "data", "demo_pretrained.ckpt"), "--data",
                   os.path.join(ROOT, "data", "demo_val.db"), "--output_dir", os.path.join(tmp, f"eval_{k}")]
            return [sys.executable, "-c", DRIVER, *run] if python_gc else [sys.executable, *run]

        timed(command(False, 0), env)  # (the graph compiled and kept)
        figures = {False: [], True: []}
        for k in range(args.rounds):
            for python_gc in (False, True):
                figures[python_gc].append(timed(command(python_gc, 1 + 2 * k + python_gc), env))
    print("| orb-evaluate's collector | wall (s) | CPU (s) |")
    print("|---|---|---|")
    for python_gc, label in ((True, "Python's throughout (a driver)"), (False, "orb's (run as a program)")):
        wall, cpu = np.median(np.array(figures[python_gc]), axis=0)
        print(f"| {label} | {wall:.2f} | {cpu:.2f} |")
