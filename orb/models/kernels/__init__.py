"""Accurate float32 activations for MindSpore's CPU backend, as AOT custom operators.

MindSpore 2.10's CPU ``Softplus``, ``Sigmoid`` and ``Exp`` kernels are accurate to only ~1e-6
(tens to hundreds of ulps); through 15 layers that moves orb-v2's energies by ~3e-4 eV against
PyTorch. ``activations.cc`` computes orb-v2's shifted softplus and its derivative, orb-v3's SiLU
with its first and second derivatives (conservative models train through a gradient), and
exp(min(x, 0)) to ~1 ulp and, being auto-vectorised, faster than the built-in kernels. It is compiled once with the system's g++
into a cache folder (``ORB_KERNEL_CACHE``, default ``~/.cache/orb_mindspore``), keyed by the
source, the flags and the CPU's instruction-set flags (``-march=native`` code must never run
on another CPU), falling back to a temporary folder if the cache is not writable.

Kernel mode (environment variable ``ORB_KERNELS`` or :func:`set_kernel_mode`):

* ``auto`` (default): the custom kernels on CPU when they can be built, else MindSpore's built-ins;
* ``builtin``: MindSpore's built-in operators everywhere -- exactly what Ascend and GPU run,
  so that path can be tested on a CPU.
"""

import hashlib
import logging
import math
import os
import platform
import shutil
import subprocess
import tempfile
from functools import lru_cache
from typing import Optional

log = logging.getLogger("orb")
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "activations.cc")
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fPIC", "-shared"]
MODES = ("auto", "builtin")
_mode: Optional[str] = None


def set_kernel_mode(mode: str) -> None:
    """Choose ``auto`` or ``builtin`` kernels for models built from now on (overrides ``ORB_KERNELS``)."""
    global _mode
    if mode not in MODES:
        raise ValueError(f"kernel mode must be one of {MODES}, got {mode!r}")
    _mode = mode


def kernel_mode() -> str:
    mode = _mode or os.environ.get("ORB_KERNELS", "auto") or "auto"
    if mode not in MODES:
        raise ValueError(f"ORB_KERNELS must be one of {MODES}, got {mode!r}")
    return mode


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


def _cache_dirs():
    configured = os.environ.get("ORB_KERNEL_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "orb_mindspore")
    return [configured, os.path.join(tempfile.gettempdir(), f"orb_mindspore-{os.getuid()}")]


def _writable_dir(candidates) -> Optional[str]:
    for folder in candidates:
        try:
            os.makedirs(folder, exist_ok=True)
            if os.access(folder, os.W_OK):
                return folder
        except OSError:
            continue
    return None


def _compile(compiler: str, folder: str, target: str) -> bool:
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
    os.close(fd)
    try:
        subprocess.run([compiler, *FLAGS, "-o", tmp, SOURCE], check=True, capture_output=True, text=True)
        os.chmod(tmp, 0o755)
        os.replace(tmp, target)  # atomic: concurrent workers never load a half-written library
        return True
    except (subprocess.CalledProcessError, OSError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        log.warning("building %s failed (%s): using MindSpore's built-in kernels", SOURCE, detail.strip()[:200])
        return False
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


@lru_cache(maxsize=1)
def library_path() -> Optional[str]:
    """Path of the compiled kernel library, building it if needed; None if it cannot be built."""
    with open(SOURCE, "rb") as f:
        source = f.read()
    tag = hashlib.sha256(source + " ".join(FLAGS).encode() + _cpu_signature().encode()).hexdigest()[:16]
    name = f"orb_activations_{tag}.so"
    for folder in _cache_dirs():
        if os.path.exists(os.path.join(folder, name)):
            return os.path.join(folder, name)
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if compiler is None:
        log.warning("no C++ compiler found: using MindSpore's built-in Softplus/Exp kernels (~1e-6 less accurate); "
                    "install g++ for PyTorch-level accuracy")
        return None
    folder = _writable_dir(_cache_dirs())
    if folder is None:
        log.warning("no writable folder for the kernel cache (%s): using MindSpore's built-in kernels",
                    " or ".join(_cache_dirs()))
        return None
    target = os.path.join(folder, name)
    return target if _compile(compiler, folder, target) else None


def _custom_library() -> Optional[str]:
    """The library to use for the model being built, or None for MindSpore's built-in operators."""
    import mindspore as ms

    if kernel_mode() == "builtin" or ms.get_context("device_target") != "CPU":
        return None
    return library_path()


def uses_custom_kernels() -> bool:
    return _custom_library() is not None


def shifted_softplus_op():
    """ssp(x) = softplus(x) - ln 2 as an operator: the accurate custom kernel on CPU, else built-in ops."""
    from mindspore import ops

    path = _custom_library()
    if path is None:
        softplus = ops.Softplus()  # the primitive: ops.softplus adds a threshold select (and its gradient)
        return lambda x: softplus(x) - math.log(2.0)
    same = lambda *shapes: shapes[0]  # noqa: E731  (output shape/dtype = first input's)
    grad = ops.Custom(f"{path}:OrbSoftplusGrad", out_shape=same, out_dtype=same, func_type="aot")

    def bprop(x, out, dout):
        return (grad(x, dout),)

    return ops.Custom(f"{path}:OrbShiftedSoftplus", out_shape=same, out_dtype=same, func_type="aot", bprop=bprop)


def exp_nonpositive_op():
    """exp(min(x, 0)) as a MindSpore operator (accurate custom kernel on CPU, else ``ops.exp``)."""
    from mindspore import ops

    path = _custom_library()
    if path is None:
        return lambda x: ops.exp(ops.minimum(x, 0.0))
    same = lambda *shapes: shapes[0]  # noqa: E731

    def bprop(x, out, dout):
        return (dout * out * (x <= 0).astype(x.dtype),)

    return ops.Custom(f"{path}:OrbExpNonpositive", out_shape=same, out_dtype=same, func_type="aot", bprop=bprop)


def silu_op():
    """SiLU x sigmoid(x), differentiable twice: the accurate custom kernels on CPU, else built-in ops."""
    from mindspore import ops

    path = _custom_library()
    if path is None:
        return lambda x: x * ops.sigmoid(x)  # Sigmoid's gradient is itself differentiable
    same = lambda *shapes: shapes[0]  # noqa: E731
    second = ops.Custom(f"{path}:OrbSiluGrad2", out_shape=same, out_dtype=same, func_type="aot")

    def first_bprop(x, g, out, dout):  # d/dx (g silu'(x)) = g silu''(x); d/dg = silu'(x)
        return second(x, g * dout), first(x, dout)

    first = ops.Custom(f"{path}:OrbSiluGrad", out_shape=same, out_dtype=same, func_type="aot", bprop=first_bprop)

    def bprop(x, out, dout):
        return (first(x, dout),)

    return ops.Custom(f"{path}:OrbSilu", out_shape=same, out_dtype=same, func_type="aot", bprop=bprop)
