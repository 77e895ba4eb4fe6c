"""Accurate float32 activations for MindSpore's CPU backend, as AOT custom operators.

MindSpore 2.10's CPU ``Softplus`` and ``Exp`` kernels are accurate to only ~3e-6 absolute
(tens of ulps); through 15 layers that moves orb-v2's energies by ~3e-4 eV against PyTorch.
``activations.cc`` computes orb's shifted softplus, its derivative and exp(min(x, 0)) to ~1 ulp and, being
auto-vectorised, faster than the built-in kernels. It is compiled once with the system's g++
into a cache folder (``ORB_KERNEL_CACHE``, default ``~/.cache/orb_mindspore``). Without a
compiler, or on Ascend/GPU, the built-in operators are used (a warning says so on CPU).
"""

import hashlib
import logging
import math
import os
import shutil
import subprocess
import tempfile
from functools import lru_cache
from typing import Optional

log = logging.getLogger("orb")
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "activations.cc")
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fPIC", "-shared"]


def _cache_dir() -> str:
    return os.environ.get("ORB_KERNEL_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "orb_mindspore")


@lru_cache(maxsize=1)
def library_path() -> Optional[str]:
    """Path of the compiled kernel library, building it if needed; None if it cannot be built."""
    if os.environ.get("ORB_DISABLE_CUSTOM_KERNELS"):
        return None
    with open(SOURCE, "rb") as f:
        source = f.read()
    tag = hashlib.sha256(source + " ".join(FLAGS).encode()).hexdigest()[:16]
    target = os.path.join(_cache_dir(), f"orb_activations_{tag}.so")
    if os.path.exists(target):
        return target
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if compiler is None:
        log.warning("no C++ compiler found: using MindSpore's built-in Softplus/Exp kernels (less accurate)")
        return None
    os.makedirs(_cache_dir(), exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=_cache_dir())
    os.close(fd)
    try:
        subprocess.run([compiler, *FLAGS, "-o", tmp, SOURCE], check=True, capture_output=True, text=True)
        os.replace(tmp, target)  # atomic: concurrent workers never load a half-written library
    except (subprocess.CalledProcessError, OSError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        log.warning("building %s failed (%s): using MindSpore's built-in kernels", SOURCE, detail.strip()[:200])
        return None
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return target


def _on_cpu() -> bool:
    import mindspore as ms

    return ms.get_context("device_target") == "CPU"


def shifted_softplus_op():
    """ssp(x) = softplus(x) - ln 2 as an operator: the accurate custom kernel on CPU, else built-in ops."""
    from mindspore import ops

    path = library_path() if _on_cpu() else None
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

    path = library_path() if _on_cpu() else None
    if path is None:
        return lambda x: ops.exp(ops.minimum(x, 0.0))
    same = lambda *shapes: shapes[0]  # noqa: E731

    def bprop(x, out, dout):
        return (dout * out * (x <= 0).astype(x.dtype),)

    return ops.Custom(f"{path}:OrbExpNonpositive", out_shape=same, out_dtype=same, func_type="aot", bprop=bprop)
