"""The host's BLAS thread pools (numpy's and SciPy's OpenBLAS, or MKL) sized for a process of this project.

The host-side numerics of training and inference are 3x3 solves, QRs and determinants per structure and small
fits: a pool of BLAS worker threads never speeds them up, but OpenBLAS's workers spin (``sched_yield``) after
each call they take part in. A short fine-tuning on the demo spent 1.2 of its 7 s of CPU time in numpy's spinning
worker (57,000 ``sched_yield`` calls); on a busy host, or an NPU node with one process per device and a pool of
one thread per core in each, that time is taken from the kernels. Read from the loaded libraries (``/proc/self/maps``):
no import of numpy or SciPy here, and nothing on a system without that file.
"""

import contextlib
import ctypes
import os
from typing import Dict, Iterator, List

# OpenBLAS as numpy's wheels (64-bit integers: suffix 64_) and SciPy's (scipy_ prefix) build it, plain OpenBLAS, MKL
SETTERS = ("openblas_set_num_threads64_", "scipy_openblas_set_num_threads", "openblas_set_num_threads",
           "MKL_Set_Num_Threads")
GETTERS = ("openblas_get_num_threads64_", "scipy_openblas_get_num_threads", "openblas_get_num_threads",
           "MKL_Get_Max_Threads")
USER_SETTINGS = ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")  # the user's own choice: kept


def loaded_blas_libraries() -> List[str]:
    """Paths of the BLAS libraries loaded in this process (OpenBLAS, MKL's runtime), each once."""
    try:
        with open("/proc/self/maps") as f:
            paths = [line.split(None, 5)[-1].strip() for line in f if ".so" in line]
    except OSError:
        return []
    names = ("openblas", "mkl_rt")
    return list(dict.fromkeys(p for p in paths if any(n in os.path.basename(p) for n in names)))


def _call(path: str, names, *args):
    try:
        lib = ctypes.CDLL(path)
    except OSError:
        return None
    for name in names:
        function = getattr(lib, name, None)
        if function is not None:
            return function(*args)
    return None


def blas_threads() -> Dict[str, int]:
    """Each loaded BLAS library's thread count."""
    counts = {path: _call(path, GETTERS) for path in loaded_blas_libraries()}
    return {path: int(n) for path, n in counts.items() if n is not None}


def set_host_blas_threads(threads: int) -> None:
    """Every loaded BLAS library at ``threads`` (at least 1), unless the user set ``OPENBLAS_NUM_THREADS`` or
    ``MKL_NUM_THREADS``. A library loaded later reads its own default: call this after numpy is imported."""
    if any(os.environ.get(name) for name in USER_SETTINGS):
        return
    for path in loaded_blas_libraries():
        _call(path, SETTERS, ctypes.c_int(max(1, int(threads))))


@contextlib.contextmanager
def blas_threads_set_to(threads: int) -> Iterator[None]:
    """Every loaded BLAS library at ``threads`` inside the block, then as before (the benchmarks' calibration of
    numpy's BLAS at the host's cores, whatever a command set)."""
    before = blas_threads()
    for path in before:
        _call(path, SETTERS, ctypes.c_int(max(1, int(threads))))
    try:
        yield
    finally:
        for path, count in before.items():
            _call(path, SETTERS, ctypes.c_int(count))
