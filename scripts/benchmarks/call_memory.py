"""``call-memory``: a prediction's peak memory by precision, model and structure size (a process of its own each):
what decides how many atoms a batched call of orb-properties, orb-relax, orb-evaluate or orb-md may hold."""

import os
import subprocess
import sys
import tempfile

from .common import CHILDREN, ROOT


def bench_call_memory(args) -> None:
    """Each case one fresh process: a full-size model of ``--models`` with random weights, from a checkpoint, through
    ``ORBCalculator`` in ``--precisions``, one call on a rattled Cu fcc cell of ``--sizes`` (conventional cells
    repeated: 32, 108, 256 ... atoms), then two more (new geometries); the peak resident memory (VmHWM) after them,
    and its growth per atom from one size to the next."""
    sizes = [int(s) for s in args.sizes.split(",")]
    print("| model | precision | " + " | ".join(f"{4 * n ** 3} atoms: peak GB, call s" for n in sizes)
          + " | growth per atom (MB) |")
    print("|---|---|" + "---|" * (len(sizes) + 1))
    with tempfile.TemporaryDirectory(prefix="orb-call-memory-") as folder:
        for name in args.models.split(","):
            path = os.path.join(folder, f"{name}.ckpt")
            _child(name, path, "float32-high", 0)  # the weights, in a process of their own
            for precision in args.precisions.split(","):
                cells, peaks = [], []
                for n in sizes:
                    _, peak_gb, seconds = _child(name, path, precision, n)[-1]
                    peaks.append(float(peak_gb))
                    cells.append(f"{float(peak_gb):.2f}, {float(seconds):.2f}")
                growth = [(peaks[k + 1] - peaks[k]) * 1024 / (4 * (sizes[k + 1] ** 3 - sizes[k] ** 3))
                          for k in range(len(sizes) - 1)]
                print(f"| {name} | {precision} | " + " | ".join(cells) + " | "
                      + ", ".join(f"{g:.1f}" for g in growth) + " |", flush=True)


def _child(name: str, path: str, precision: str, n: int) -> list:
    """The measuring process's ``RESULT`` lines, split (none for n 0, which writes the checkpoint)."""
    result = subprocess.run([sys.executable, os.path.join(CHILDREN, "call_memory.py"), name, path, precision, str(n)],
                            cwd=ROOT, capture_output=True, text=True,
                            env=dict(os.environ, PYTHONPATH=ROOT, ORB_COMPILE_CACHE="0"))
    lines = [line.split() for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    if result.returncode or (n and not lines):
        raise SystemExit(f"call-memory: the measuring process failed:\n{result.stderr[-3000:]}")
    return lines
