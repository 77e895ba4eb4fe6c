"""Build the project's small C++ sources once per machine and cache the shared libraries.

Used for the accurate CPU activations (``orb.models.kernels``) and the neighbour search that
builds graphs on the host (``orb.data.neighbours``). A source is compiled with the system's
g++ (or ``$CXX``) into the project's cache (``orb.cache``: ``ORB_CACHE_DIR``, default
``~/.cache/orb_mindspore``), keyed by the source, the flags and the CPU's instruction-set flags
(``-march=native`` code must never run on another CPU), written atomically. Without a compiler
the caller falls back to its portable path.
"""

import hashlib
import logging
import os
import platform
import shutil
import subprocess
from functools import lru_cache
from typing import Optional

from orb import cache

log = logging.getLogger("orb")
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fPIC", "-shared"]


def _cpu_signature() -> str:
    """The CPU's instruction-set flags (what ``-march=native`` compiles for)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()}"


def _compile(compiler: str, source: str, target: str) -> Optional[str]:
    """Compile ``source`` to ``target``; the compiler's message on failure, else None."""

    def compile_to(tmp: str) -> None:
        subprocess.run([compiler, *FLAGS, "-o", tmp, source], check=True, capture_output=True, text=True)
        os.chmod(tmp, 0o755)

    try:
        cache.write_atomically(target, compile_to, suffix=".so")  # concurrent workers never load half a library
        return None
    except (subprocess.CalledProcessError, OSError) as exc:
        return (getattr(exc, "stderr", "") or str(exc)).strip()[:200]


@lru_cache(maxsize=None)
def build(source: str, fallback: str) -> Optional[str]:
    """Path of ``source``'s compiled library (built on first use), or None when it cannot be built,
    with one warning saying why and what is used instead (``fallback``, e.g. "using X; install g++
    for Y")."""
    with open(source, "rb") as f:
        text = f.read()
    tag = hashlib.sha256(text + " ".join(FLAGS).encode() + _cpu_signature().encode()).hexdigest()[:16]
    name = f"orb_{os.path.splitext(os.path.basename(source))[0]}_{tag}.so"
    cached = cache.find(name)
    if cached is not None:
        return cached
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if compiler is None:
        log.warning("no C++ compiler found to build %s: %s", os.path.basename(source), fallback)
        return None
    folder = cache.writable_dir()
    if folder is None:
        log.warning("no writable folder to cache %s (%s): %s", os.path.basename(source),
                    " or ".join(cache.cache_dirs()), fallback)
        return None
    target = os.path.join(folder, name)
    error = _compile(compiler, source, target)
    if error is not None:
        log.warning("building %s failed (%s): %s", os.path.basename(source), error, fallback)
        return None
    return target
