"""What the benchmarks share: the checkout's paths (and the checkout on ``sys.path``, for ``orb``), median timing,
the PyTorch peer's runner, memory readings and the host's matrix-multiply calibration."""

import json
import os
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)
from orb.device import resident_gb  # noqa: E402,F401 -- the benchmarks' reading of their own memory
DEMO = os.path.join(ROOT, "data", "demo_train.db")
MPTRJ = os.path.join(ROOT, "tests", "data", "10_mptraj_systems.db")
CHILDREN = os.path.join(HERE, "children")  # child programs run with this interpreter (they import orb)
PEER = os.path.join(HERE, "peer")  # child programs run with the PyTorch interpreter (self-contained)


def child(name: str) -> str:
    """The path of child program ``name`` (``children/``), run with ``sys.executable``."""
    return os.path.join(CHILDREN, name)


def run_timed(command, **popen) -> tuple:
    """``subprocess.run(command, capture_output=True, text=True, **popen)`` with its wall time and the CPU time of every
    process it started, summed: (result, wall s, CPU s)."""
    import resource

    start, before = time.time(), resource.getrusage(resource.RUSAGE_CHILDREN)
    result = subprocess.run(command, capture_output=True, text=True, **popen)
    wall, after = time.time() - start, resource.getrusage(resource.RUSAGE_CHILDREN)
    return result, wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def run_torch(torch_python: str, script: str, args: list, timeout: int = 3600) -> dict:
    """Run PyTorch peer program ``script`` (``peer/``; prints one JSON line) with the PyTorch interpreter."""
    result = subprocess.run([torch_python, os.path.join(PEER, script), *args], capture_output=True, text=True,
                            timeout=timeout,
                            env=dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2")))
    if result.returncode != 0:
        raise RuntimeError(f"PyTorch benchmark failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def peak_memory_gb() -> float:
    """This process's peak resident memory (VmHWM: unlike ru_maxrss, not inherited across fork/exec)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1e6
    return float("nan")


def gemm_rate() -> float:
    """The host's float32 matrix-multiply rate (GFLOP/s, numpy's BLAS with the threads it starts with: 2 here, or
    what OPENBLAS_NUM_THREADS or OMP_NUM_THREADS says, whatever a command set the pool to since): recorded before
    and after a benchmark, so a run during which the shared host's speed moved shows it."""
    from orb.host_blas import blas_threads_set_to

    a = np.random.default_rng(0).random((1024, 1024), np.float32)
    with blas_threads_set_to(starting_blas_threads()):
        return 2 * 1024 ** 3 / median_time(lambda: a @ a, 9) / 1e9


def starting_blas_threads() -> int:
    """The threads OpenBLAS starts with: the first of OPENBLAS_NUM_THREADS, GOTO_NUM_THREADS, OMP_NUM_THREADS set,
    at most the cores, else the cores."""
    from orb.device import omp_threads

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    for name in ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS"):
        if omp_threads(name) > 0:
            return min(omp_threads(name), cores)
    return cores


def mindspore_gemm_rate(n: int = 1024) -> float:
    """MindSpore's own float32 MatMul rate (GFLOP/s) on an n x n square (the size :func:`gemm_rate` times), compiled
    as the models' products are, in the process's kernel threads: beside numpy's in each table, since the two
    libraries' kernels are not equally fast on every processor."""
    import mindspore as ms
    from mindspore import nn, ops

    from orb.device import graph_mode

    class Product(nn.Cell):
        def __init__(self):
            super().__init__()
            self.matmul = ops.MatMul()

        def construct(self, a):
            return self.matmul(a, a)[0, 0]  # (one number back: no 16 MB copy in the timing)

    a = ms.Tensor(np.random.default_rng(0).random((n, n), np.float32))
    product = Product()
    with graph_mode():
        product(a).asnumpy()
        return 2 * n ** 3 / median_time(lambda: product(a).asnumpy(), 9) / 1e9


def calibration(before: float, after: float) -> str:
    """The host's GEMM rate before and after a run, flagging a run during which it moved by over 20 %."""
    change = after / before - 1
    steady = "; over 20 %: the host was not steady, repeat the run" if abs(change) > 0.2 else ""
    return f"{before:.0f} GFLOP/s before, {after:.0f} after ({change:+.0%}{steady})"
