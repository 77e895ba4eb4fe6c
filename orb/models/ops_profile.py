"""Operator profiles: the one place where the device chooses how a few primitives are written.

One model definition; a profile swaps only these primitives, when a cell is built:

* ``portable`` -- MindSpore's own operators with their framework gradients: broadcasting
  arithmetic, ``ReduceSum``/``ReduceMean``, the ``LayerNorm`` primitive and its gradient,
  ``MatMul``/``BiasAdd`` differentiated automatically, built-in activations. What Ascend and GPU
  run; on CPU it is tested against PyTorch like the other profile (docs/ascend.md).
* ``cpu`` -- MindSpore 2.10's CPU kernels, measured (docs/benchmarks.md): broadcasts and
  reductions as matrix products with a ones vector (its CPU reductions and broadcasting binary
  operators keep 8-16 bytes of host buffers per element), hand-written backward passes for
  Linear, LayerNorm, RMSNorm and row scaling (no reduction kernels; CPU ``LayerNormGrad`` is
  slow), and the accurate custom activation kernels (``orb.models.kernels``).

``auto`` is ``cpu`` on CPU and ``portable`` elsewhere. The environment variable
``ORB_OPS_PROFILE`` overrides the configured choice (config key ``ops_profile``).
"""

import os
from typing import Optional

from orb.errors import ConfigError

PROFILES = ("auto", "portable", "cpu")
ENVIRONMENT = "ORB_OPS_PROFILE"
_configured: Optional[str] = None


def _check(name: str, source: str) -> str:
    if name not in PROFILES:
        raise ConfigError(f"{source} must be one of {', '.join(PROFILES)}, got {name!r}")
    return name


def set_ops_profile(name: str) -> None:
    """The configured profile for cells built from now on (``ORB_OPS_PROFILE``, if set, still wins)."""
    global _configured
    _configured = _check(name, "ops_profile")


def requested_profile() -> str:
    """``auto``, ``portable`` or ``cpu``: the environment's choice, else the configured one, else ``auto``."""
    from_environment = os.environ.get(ENVIRONMENT, "")
    if from_environment:
        return _check(from_environment, ENVIRONMENT)
    return _configured or "auto"


def choose_profile(requested: str, device_target: str) -> str:
    """``portable`` or ``cpu`` for a requested profile on a device: ``auto`` is ``cpu`` on the CPU and ``portable``
    elsewhere; ``cpu`` anywhere but the CPU is refused (its forms are measured on, and its custom kernels
    compiled for, the CPU backend: they must never reach an NPU or a GPU)."""
    if requested == "auto":
        return "cpu" if device_target == "CPU" else "portable"
    if requested == "cpu" and device_target != "CPU":
        source = f"{ENVIRONMENT}=cpu (environment)" if os.environ.get(ENVIRONMENT) else "ops_profile: cpu"
        raise ConfigError(f"{source} is for the CPU only, and this run is on {device_target}: use ops_profile auto "
                          f"or portable{' and unset ' + ENVIRONMENT if os.environ.get(ENVIRONMENT) else ''}")
    return requested


def ops_profile() -> str:
    """The profile cells are built with now: ``portable`` or ``cpu``."""
    import mindspore as ms

    return choose_profile(requested_profile(), ms.get_context("device_target"))


def custom_kernel_library() -> Optional[str]:
    """The accurate CPU kernels' library for cells built now (the ``cpu`` profile, on the CPU, with g++), else None:
    MindSpore's built-in operators (the AOT kernels are CPU code: never on an NPU or a GPU)."""
    import mindspore as ms

    from orb.models import kernels

    from orb.precision import is_float64

    if ops_profile() != "cpu" or ms.get_context("device_target") != "CPU" or is_float64():
        return None  # the kernels are float32 code: float64 uses MindSpore's float64 operators
    return kernels.library_path()


def uses_custom_kernels() -> bool:
    return custom_kernel_library() is not None


def activation(name: str):
    """The operator of activation ``name`` (``ssp``: orb-v2's shifted softplus; ``silu``: orb-v3's; ``exp_nonpositive``:
    exp(min(x, 0))) in the current profile."""
    from orb.models import kernels
    from orb.precision import is_float64

    if name == "ssp" and is_float64():
        return kernels.composed_shifted_softplus_op()
    factory = {"ssp": kernels.shifted_softplus_op, "silu": kernels.silu_op,
               "exp_nonpositive": kernels.exp_nonpositive_op}[name]
    return factory(custom_kernel_library())


def describe_profile() -> str:
    """For start-up logs and reports: the operator profile and what it runs."""
    if ops_profile() == "portable":
        return "ops profile portable (MindSpore's operators and their gradients)"
    kernels = "accurate custom CPU kernels" if uses_custom_kernels() else "built-in activations (no g++)"
    return f"ops profile cpu (ones-vector products, hand-written backward passes, {kernels})"
