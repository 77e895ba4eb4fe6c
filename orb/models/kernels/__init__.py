"""Accurate float32 activations for MindSpore's CPU backend, as AOT custom operators.

MindSpore 2.10's CPU ``Softplus``, ``Sigmoid`` and ``Exp`` kernels are accurate to only ~1e-6
(tens to hundreds of ulps); through 15 layers that moves orb-v2's energies by ~3e-4 eV against
PyTorch. ``activations.cc`` computes orb-v2's shifted softplus and its derivative, orb-v3's SiLU
with its first and second derivatives (conservative models train through a gradient), and
exp(min(x, 0)) to ~1 ulp and, being auto-vectorised, faster than the built-in kernels; and LayerNorm and
RMSNorm's forward passes, a row at a time (MindSpore's CPU LayerNorm kernel takes 4.7 ns an element, a tenth of a
full orb-v2 call; their backward passes are the cells' own, differentiable operators); and an edge MLP's first layer
finished per edge, its node parts gathered and added in one pass (``edge_input_kernel``). It is
compiled once per machine with the system's g++ and cached (``orb.native``).

Each activation factory takes the library to use (``None``: MindSpore's built-in operators); the operator profile
(``orb.models.ops_profile``) decides which: the library for the ``cpu`` profile on the CPU, built-in
operators for the ``portable`` profile and on every other device. The norm factories take the library's path: the
cells that call them keep their built-in form for when there is none (``orb.models.blocks``).

The kernels run on one thread (MindSpore's own spread over its kernel pool): on a host of many cores their share of a
call grows.
"""

import math
import os
from typing import Optional

from orb.native import build

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "activations.cc")


def library_path() -> Optional[str]:
    """Path of the compiled kernel library, building it if needed; None if it cannot be built."""
    return build(SOURCE, "using MindSpore's built-in Softplus/Exp kernels (~1e-6 less accurate); install g++ for "
                         "PyTorch-level accuracy")


def _kernel(path: str, name: str, inputs: int, bprop=None):
    """Kernel ``name`` of the library at ``path`` as an operator of ``inputs`` inputs whose output has the first
    input's shape and type. The shape comes from the library's ``<name>InferShape`` (``out_shape=None`` with the
    registration below): a Python ``out_shape`` fails in graphs whose input shapes are dynamic ("The pointer[value] is
    null", MindSpore 2.10)."""
    from mindspore import ops
    from mindspore.ops import CustomRegOp, DataType

    registration = CustomRegOp(f"orb_{name}")
    for k in range(inputs):
        registration = registration.input(k, f"x{k}")
    registration = registration.output(0, "y").dtype_format(*[DataType.None_None] * (inputs + 1)).target("CPU")
    return ops.Custom(f"{path}:{name}", out_shape=None, out_dtype=lambda *types: types[0], func_type="aot",
                      bprop=bprop, reg_info=registration.get_op_info())


def shifted_softplus_op(path: Optional[str] = None):
    """ssp(x) = softplus(x) - ln 2 as an operator: the accurate custom kernel on CPU, else built-in ops."""
    from mindspore import ops

    if path is None:
        softplus = ops.Softplus()  # the primitive: ops.softplus adds a threshold select (and its gradient)
        return lambda x: softplus(x) - math.log(2.0)
    grad = _kernel(path, "OrbSoftplusGrad", 2)

    def bprop(x, out, dout):
        return (grad(x, dout),)

    return _kernel(path, "OrbShiftedSoftplus", 1, bprop)


def composed_shifted_softplus_op():
    """ssp(x) = log1p(exp(-|x|)) + max(x, 0) - ln 2 from elementwise operators, for float64: MindSpore 2.10's CPU
    Softplus is 3e-6 off in float64 too."""
    from mindspore import ops

    return lambda x: ops.log1p(ops.exp(-ops.abs(x))) + ops.relu(x) - math.log(2.0)


def exp_nonpositive_op(path: Optional[str] = None):
    """exp(min(x, 0)) as a MindSpore operator (accurate custom kernel on CPU, else ``ops.exp``)."""
    from mindspore import ops

    if path is None:
        return lambda x: ops.exp(ops.minimum(x, 0.0))

    def bprop(x, out, dout):
        return (dout * out * (x <= 0).astype(x.dtype),)

    return _kernel(path, "OrbExpNonpositive", 1, bprop)


def silu_op(path: Optional[str] = None):
    """SiLU x sigmoid(x), differentiable twice: the accurate custom kernels on CPU, else built-in ops."""
    from mindspore import ops

    if path is None:
        return lambda x: x * ops.sigmoid(x)  # Sigmoid's gradient is itself differentiable
    second = _kernel(path, "OrbSiluGrad2", 2)

    def first_bprop(x, g, out, dout):  # d/dx (g silu'(x)) = g silu''(x); d/dg = silu'(x)
        return second(x, g * dout), first(x, dout)

    first = _kernel(path, "OrbSiluGrad", 2, first_bprop)

    def bprop(x, out, dout):
        return (first(x, dout),)

    return _kernel(path, "OrbSilu", 1, bprop)


def layer_norm_kernel(path: str):
    """LayerNorm's forward, ``kernel(x, weight, bias, eps)`` (``eps`` a float32 scalar tensor), as the library's
    kernel; no gradient of its own: the cell that calls it writes its backward pass."""
    return _kernel(path, "OrbLayerNorm", 4)


def edge_input_kernel(path: str):
    """An edge MLP's first layer finished per edge, ``kernel(x, table, bias, senders, receivers)`` = ``(x +
    (table[senders, :w] + bias)) + table[receivers, w:]`` (``x`` (E, w), ``table`` (N, 2w), int32 indices), as the
    library's kernel; no gradient of its own (:class:`orb.models.blocks.EdgeInput` writes it)."""
    return _kernel(path, "OrbEdgeInput", 5)


def rms_norm_kernel(path: str):
    """RMSNorm's forward, ``kernel(x, weight, eps)``, as the library's kernel (the calling cell writes its backward
    pass)."""
    return _kernel(path, "OrbRMSNorm", 3)
