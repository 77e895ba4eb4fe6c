"""Operator profiles: the one place where the device chooses how a few primitives are written.

One model definition; a profile swaps only these primitives, when a cell is built:

* ``portable`` -- MindSpore's own operators with their framework gradients: broadcasting
  arithmetic, ``ReduceSum``/``ReduceMean``, the ``LayerNorm`` primitive and its gradient,
  ``MatMul``/``BiasAdd`` differentiated automatically, built-in activations. What Ascend and GPU
  run; on CPU it is tested against PyTorch like the other profile (docs/install.md, "The operator profile").
* ``cpu`` -- MindSpore 2.10's CPU kernels, measured (docs/benchmarks.md): broadcasts and
  reductions as matrix products with a ones vector (its CPU reductions and broadcasting binary
  operators keep 8-16 bytes of host buffers per element), hand-written backward passes for
  Linear, LayerNorm, RMSNorm and row scaling (no reduction kernels; CPU ``LayerNormGrad`` is
  slow), and the accurate custom activation kernels (``orb.models.kernels``).

``auto`` is ``cpu`` on CPU and ``portable`` elsewhere. The environment variable
``ORB_OPS_PROFILE`` overrides the configured choice (config key ``ops_profile``); the choice is made with the device
(:func:`orb.device.ops_profile`), below the models, so that what decides a compiled graph is read without them.
"""

from typing import Optional

from orb.device import ops_profile


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
