"""The host's BLAS thread pools (numpy's and SciPy's OpenBLAS, or MKL, FlexiBLAS) sized for a process of this project.

The host-side numerics of training and inference are 3x3 solves, QRs and determinants per structure and small
fits: a pool of BLAS worker threads never speeds them up, but OpenBLAS's workers spin (``sched_yield``) after
each call they take part in. A short fine-tuning on the demo spent 1.2 of its 7 s of CPU time in numpy's spinning
worker (57,000 ``sched_yield`` calls); on a busy host, or an NPU node with one process per device and a pool of
one thread per core in each, that time is taken from the kernels. The libraries are found among those loaded
(``/proc/self/maps``, Linux): no import of numpy or SciPy here, nothing loaded, and nothing done without that file.
"""

import contextlib
import ctypes
import os
from typing import Dict, Iterator, List

# numpy 1.x wheels' OpenBLAS (64-bit integers: suffix 64_), SciPy's (and numpy 2's: scipy_ prefix), plain OpenBLAS,
# MKL's runtime, FlexiBLAS: each library exports one of each list
SETTERS = ("openblas_set_num_threads64_", "scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads",
           "openblas_set_num_threads", "MKL_Set_Num_Threads", "flexiblas_set_num_threads")
GETTERS = ("openblas_get_num_threads64_", "scipy_openblas_get_num_threads64_", "scipy_openblas_get_num_threads",
           "openblas_get_num_threads", "MKL_Get_Max_Threads", "flexiblas_get_num_threads")
USER_SETTINGS = ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "MKL_NUM_THREADS", "FLEXIBLAS_NUM_THREADS")


def loaded_blas_libraries() -> List[str]:
    """Paths of the BLAS libraries loaded in this process (a file name with ``blas`` or ``mkl_rt``), each once."""
    try:
        with open("/proc/self/maps") as f:
            paths = [line.split(None, 5)[-1].strip() for line in f if ".so" in line]
    except OSError:
        return []
    return list(dict.fromkeys(p for p in paths if any(n in os.path.basename(p) for n in ("blas", "mkl_rt"))))


def _call(path: str, names, *args):
    """The first of ``names`` that the library at ``path`` exports, called; None if it is not loaded (never loaded
    here: RTLD_NOLOAD) or exports none of them."""
    try:
        lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD)
    except OSError:  # not loaded as a library (a mapped data file), or a replaced file ("(deleted)")
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


def _set(path: str, threads: int) -> None:
    _call(path, SETTERS, ctypes.c_int(max(1, int(threads))))


def set_host_blas_threads(threads: int) -> None:
    """Every loaded BLAS library at ``threads`` or fewer (a pool is never grown past what it started with: one
    thread per core, unless told otherwise), unless the user set a BLAS library's thread count
    (:data:`USER_SETTINGS`). A library loaded later reads its own default: call this after numpy and SciPy are
    imported."""
    if any(os.environ.get(name) for name in USER_SETTINGS):
        return
    for path, count in blas_threads().items():
        _set(path, min(threads, count))


@contextlib.contextmanager
def blas_threads_set_to(threads: int) -> Iterator[None]:
    """Every loaded BLAS library at ``threads`` inside the block, then as before (the benchmarks' calibration of
    numpy's BLAS, whatever a command set its pool to)."""
    before = blas_threads()
    for path in before:
        _set(path, threads)
    try:
        yield
    finally:
        for path, count in before.items():
            _set(path, count)
