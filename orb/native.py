"""Build the project's small C++ sources once per machine and cache the shared libraries.

Used for the accurate CPU activations (``orb.models.kernels``) and the neighbour search that
builds graphs on the host (``orb.data.neighbours``). A source is compiled with the system's
g++ (or ``$CXX``) into the project's cache (``orb.cache``: ``ORB_COMPILE_CACHE_DIR`` or ``ORB_CACHE_DIR``,
default ``~/.cache/orb_mindspore``), keyed by the source, the flags and the CPU's instruction-set flags
(``-march=native`` code must never run on another CPU), written atomically. Without a compiler
the caller falls back to its portable path.
"""

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
from functools import lru_cache
from typing import Callable, Optional

from orb import cache
from orb.signals import children_start_blocked

log = logging.getLogger("orb")
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fPIC", "-shared"]


def cpu_signature() -> str:
    """The CPU's instruction-set flags (what ``-march=native`` compiles for)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()}"


def compiler_flags() -> list:
    """FLAGS, and on a CPU with AVX-512 its full vector width (g++ prefers 256-bit vectors there: the activation
    kernels ran 25-35 % faster with 512, measured on a full orb-v2 call); the option is x86's, so never elsewhere."""
    return FLAGS + (["-mprefer-vector-width=512"] if "avx512f" in cpu_signature().split() else [])


def _compile(compiler: str, source: str, flags: list) -> Callable[[str], None]:
    def compile_to(tmp: str) -> None:
        with children_start_blocked():  # a job's stop signal to every process is the run's to handle, not g++'s
            try:
                subprocess.run([compiler, *flags, "-o", tmp, source], check=True, capture_output=True, text=True)
            except subprocess.CalledProcessError:
                if flags == FLAGS:
                    raise
                # the vector-width option came with GCC 8: an older compiler builds with the plain flags
                subprocess.run([compiler, *FLAGS, "-o", tmp, source], check=True, capture_output=True, text=True)
        os.chmod(tmp, 0o755)

    return compile_to


@lru_cache(maxsize=None)
def build(source: str, fallback: str, cpu: Optional[str] = None) -> Optional[str]:
    """Path of ``source``'s compiled library (built on first use), or None when it cannot be built,
    with one warning saying why and what is used instead (``fallback``, e.g. "using X; install g++
    for Y"). A cached library that does not load (cut short by a full disk) is built again. ``cpu``: the
    instruction-set flags it is built for (default: this CPU's, :func:`cpu_signature`)."""
    with open(source, "rb") as f:
        text = f.read()
    stem = os.path.splitext(os.path.basename(source))[0]
    flags = compiler_flags()
    entry = cache.CacheEntry(f"native_{stem}", ("orb.native",), (hashlib.sha256(text).hexdigest(), flags,
                                                               cpu or cpu_signature(), os.environ.get("CXX", "g++"),
                                                               platform.libc_ver()), ".so", compiled=True)
    cached = entry.read(lambda path: ctypes.CDLL(path) and path)
    if cached is not None:
        return cached
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if compiler is None:
        log.warning("no C++ compiler found to build %s: %s", os.path.basename(source), fallback)
        return None
    try:
        entry.write(_compile(compiler, source, flags), f"compiled {os.path.basename(source)}")
    except subprocess.CalledProcessError as exc:
        log.warning("building %s failed (%s): %s", os.path.basename(source), (exc.stderr or str(exc)).strip()[:200],
                    fallback)
        return None
    if entry.kept_in is None:  # no writable cache folder, or the write failed (said): the portable path
        log.warning("%s: %s", os.path.basename(source), fallback)
    return entry.kept_in
