"""Building blocks with PyTorch-compatible parameter names and numerics.

Parameter names follow orb-models' state_dict (``weight``/``bias`` for Linear and LayerNorm,
``NN-<i>`` for MLP layers), so a MindSpore parameter path equals the PyTorch key. Linear,
LayerNorm, RMSNorm and ScaleRows are built in the operator profile in force when they are made
(``orb.models.ops_profile``): ``_Cpu*`` and ``_Portable*`` are the two forms of each.
"""

import math
from typing import Optional, Sequence

import numpy as np
from mindspore import Parameter, Tensor, nn, ops
from mindspore.ops.operations._grad_ops import BiasAddGrad  # (BiasAdd's own gradient: autodiff's bits)

from orb.models import sums
from orb.device import ops_profile
from orb.models import kernels
from orb.models.ops_profile import activation as profile_activation
from orb.models.ops_profile import custom_kernel_library
from orb.precision import half_rounding, is_float64, numpy_dtype
from orb.models.primitives import MATMUL as _MATMUL
from orb.models.primitives import cpu_column as _cpu_column
from orb.models.primitives import cpu_column_sum as _cpu_column_sum
from orb.models.primitives import cpu_row as _cpu_row
from orb.models.primitives import cpu_row_mean as _cpu_row_mean
from orb.models.primitives import cpu_row_sum as _cpu_row_sum


def uniform(shape, bound: float, rng: np.random.Generator) -> np.ndarray:
    return rng.uniform(-bound, bound, size=shape).astype(np.float32)


class _CpuLinear(nn.Cell):
    """x W^T + b with the backward written as three matrix products (no reduction kernels)."""

    def __init__(self):
        super().__init__()
        self.matmul_t = ops.MatMul(transpose_b=True)
        self.matmul_ta = ops.MatMul(transpose_a=True)

    def construct(self, x, weight, bias):
        return ops.bias_add(self.matmul_t(x, weight), bias)

    def bprop(self, x, weight, bias, out, dout):
        return _MATMUL(dout, weight), self.matmul_ta(dout, x), _cpu_column_sum(dout)


class _PortableLinear(nn.Cell):
    """x W^T + b by MatMul and BiasAdd, differentiated by MindSpore (as ``nn.Dense``)."""

    def __init__(self):
        super().__init__()
        self.matmul_t = ops.MatMul(transpose_b=True)
        self.bias_add = ops.BiasAdd()

    def construct(self, x, weight, bias):
        return self.bias_add(self.matmul_t(x, weight), bias)


class Linear(nn.Cell):
    """y = x W^T + b with W of shape (out, in), PyTorch's default initialisation; x is 2-D.

    :meth:`add_adapter` gives it a low-rank adapter (LoRA): the layer then computes with
    ``W + (alpha / rank) B A`` (``lora_b`` (out, rank) starts at zero, so the layer starts unchanged);
    :meth:`merged_weight` is that sum, what an exported checkpoint holds in place of ``weight``."""

    def __init__(self, in_dim: int, out_dim: int, rng: np.random.Generator, bias: bool = True):
        super().__init__()
        bound = 1.0 / math.sqrt(in_dim)
        self.weight = Parameter(Tensor(uniform((out_dim, in_dim), bound, rng)), name="weight")
        self.has_bias = bias
        self.adapted = False
        self.rounding = half_rounding()  # a mixed precision's casts around the product, or None
        self.matmul = ops.MatMul(transpose_b=True)
        self.plain = bias and self.rounding is None  # (then no adapter either: add_adapter clears it)
        if bias:
            self.bias = Parameter(Tensor(uniform((out_dim,), bound, rng)), name="bias")
            self.function = _CpuLinear() if ops_profile() == "cpu" else _PortableLinear()

    def add_adapter(self, rank: int, alpha: float, rng: np.random.Generator, path: str) -> None:
        """A rank-``rank`` adapter; ``path`` (this layer's parameter path) names its parameters uniquely."""
        out_dim, in_dim = self.weight.shape
        real = self.weight.asnumpy().dtype  # float64 in a model built in precision float64
        self.lora_a = Parameter(Tensor(uniform((rank, in_dim), 1.0 / math.sqrt(in_dim), rng).astype(real)),
                                name=f"{path}.lora_a")
        self.lora_b = Parameter(Tensor(np.zeros((out_dim, rank), real)), name=f"{path}.lora_b")
        self.lora_scale = float(alpha) / rank
        self.lora_product = ops.BatchMatMul()  # (a MatMul here was taken for the layers' transposed MatMul in graph mode)
        self.adapted = True
        self.plain = False

    def effective_weight(self) -> Tensor:
        if self.adapted:
            return self.weight + self.lora_scale * self.lora_product(self.lora_b, self.lora_a)
        return self.weight

    def merged_weight(self) -> np.ndarray:
        """The weight this layer computes with, as a plain layer's ``weight`` (in its float type)."""
        weight = self.weight.asnumpy()
        if not self.adapted:
            return weight
        delta = self.lora_b.asnumpy().astype(np.float64) @ self.lora_a.asnumpy().astype(np.float64)
        return (weight.astype(np.float64) + self.lora_scale * delta).astype(weight.dtype)

    def product(self, x: Tensor, weight: Tensor) -> Tensor:
        """x weight^T in this layer's precision (mixed modes: half operands and result, float32 out)."""
        if self.rounding is None:
            return self.matmul(x, weight)
        return self.rounding.full(self.matmul(self.rounding.half(x), self.rounding.half(weight)))

    def construct(self, x: Tensor) -> Tensor:
        if self.plain:  # one branch to compile for most layers, not three
            return self.function(x, self.weight, self.bias)
        return self.general(x)

    def general(self, x: Tensor) -> Tensor:
        """An adapted layer, a mixed precision's or one without a bias."""
        weight = self.effective_weight()
        if self.rounding is not None:  # the bias is added in float32, to the product's half-precision result
            y = self.product(x, weight)
            return ops.bias_add(y, self.bias) if self.has_bias else y
        if self.has_bias:
            return self.function(x, weight, self.bias)
        return self.matmul(x, weight)


class _CpuScaleRows(nn.Cell):
    """x * gate, the gate expanded by a product and its gradient a row sum (``cpu`` profile)."""

    def construct(self, x, gate):
        return x * _cpu_column(gate, x.shape[1])

    def bprop(self, x, gate, out, dout):
        return dout * _cpu_column(gate, x.shape[1]), _cpu_row_sum(dout * x)


class _PortableScaleRows(nn.Cell):
    """x * gate with the gate broadcast by ``BroadcastTo`` (see :class:`~orb.models.primitives.Broadcasts`)."""

    def construct(self, x, gate):
        return x * ops.broadcast_to(gate, x.shape)


class ScaleRows(nn.Cell):
    """x * gate for x (rows, width) and gate (rows, 1)."""

    def __init__(self):
        super().__init__()
        self.function = _CpuScaleRows() if ops_profile() == "cpu" else _PortableScaleRows()

    def construct(self, x, gate):
        return self.function(x, gate)


class _PortableSegmentSum(nn.Cell):
    """:func:`segment_sum`, differentiated by MindSpore."""

    def construct(self, data, segment_ids, num_segments):
        return sums.scatter_sum(data, segment_ids, num_segments)


class _CpuSegmentSum(_PortableSegmentSum):
    """:func:`segment_sum` whose gradient is the gather of each row's segment alone (``cpu`` profile). MindSpore's
    also checks every row's segment id against the range: a LogicalAnd and a Select over the whole (rows, width)
    gradient, 5 % of the kernel time of a batched conservative orb-v3 call (orb-md, 32 structures). The ids are in
    range by construction, and one that is not fails the Gather loudly rather than reading another segment.
    (Primitive instances: a functional ``ops.zeros_like`` in this bprop failed to compile, "func graph is empty".)"""

    def __init__(self):
        super().__init__()
        self.gather = ops.Gather()
        self.zeros_like = ops.ZerosLike()

    def bprop(self, data, segment_ids, num_segments, out, dout):
        return self.gather(dout, segment_ids, 0), self.zeros_like(segment_ids), 0


class SegmentSum(nn.Cell):
    """:func:`segment_sum` as a cell, in the profile in force when it is built: the messages' sums, whose gradient
    is as large as the edges' latents."""

    def __init__(self):
        super().__init__()
        self.function = _CpuSegmentSum() if ops_profile() == "cpu" else _PortableSegmentSum()

    def construct(self, data, segment_ids, num_segments):
        return self.function(data, segment_ids, num_segments)


class _ComposedEdgeInput(nn.Cell):
    """:class:`EdgeInput` from MindSpore's operators, differentiated by MindSpore: the ``portable`` profile's form,
    float64's, and the ``cpu`` profile's without g++."""

    def __init__(self):
        super().__init__()
        self.halves = ops.Split(1, 2)
        self.bias_add = ops.BiasAdd()
        self.gather = ops.Gather()

    def construct(self, x, table, bias, senders, receivers):
        sender_part, receiver_part = self.halves(table)
        from_sender = self.bias_add(sender_part, bias)  # the bias added per node, not per edge
        return x + self.gather(from_sender, senders, 0) + self.gather(receiver_part, receivers, 0)


class _KernelEdgeInput(nn.Cell):
    """:class:`EdgeInput` as one pass of the library's kernel (``cpu`` profile): the composed form's two gathers and
    two adds wrote and read three (edges, width) intermediates, 12 % of the kernel time of a 256-atom orb-v2 call.
    The same operations in the same order: the same bits. Its gradient is MindSpore's of the composed form, written
    out (each gather's a segment sum, the bias's ``BiasAddGrad``: the same bits), differentiable again; primitives
    only (the composed form's gradient taken here compiled a training step a third slower)."""

    def __init__(self, path: str):
        super().__init__()
        self.kernel = kernels.edge_input_kernel(path)
        self.segment_sum = ops.UnsortedSegmentSum()
        self.bias_grad = BiasAddGrad()
        self.concat = ops.Concat(1)
        self.zeros_like = ops.ZerosLike()

    def construct(self, x, table, bias, senders, receivers):
        return self.kernel(x, table, bias, senders, receivers)

    def bprop(self, x, table, bias, senders, receivers, out, dout):
        num_nodes = table.shape[0]
        from_sender = self.segment_sum(dout, senders, num_nodes)
        from_receiver = self.segment_sum(dout, receivers, num_nodes)
        return (dout, self.concat((from_sender, from_receiver)), self.bias_grad(from_sender),
                self.zeros_like(senders), self.zeros_like(receivers))


class EdgeInput(nn.Cell):
    """An edge MLP's first layer finished per edge: ``(x + (table[senders, :w] + bias)) + table[receivers, w:]``,
    ``x`` (E, w) the edges' own product, ``table`` (N, 2w) the nodes' sender and receiver products side by side
    (one product for both), ``bias`` the layer's, added per node. The library's kernel where the ``cpu`` profile has
    one (float32; graphs of one shape and of every size alike), else MindSpore's operators."""

    def __init__(self):
        super().__init__()
        path = custom_kernel_library()
        self.composed = _ComposedEdgeInput()
        self.kernel = _KernelEdgeInput(path) if path is not None else None

    def construct(self, x, table, bias, senders, receivers):
        if self.kernel is None:
            return self.composed(x, table, bias, senders, receivers)
        return self.kernel(x, table, bias, senders, receivers)


class _CpuLayerNorm(nn.Cell):
    """Fused LayerNorm forward with an analytic backward (MindSpore's CPU LayerNormGrad is slow).

    The backward recomputes the mean and 1/std from ``x`` instead of reading the kernel's
    auxiliary outputs: their meaning differs between backends (MindSpore 2.10's CPU kernel returns
    the variance, Ascend's the reciprocal standard deviation), the recomputation does not.
    """

    def __init__(self, eps: float):
        super().__init__()
        self.eps = eps
        path = custom_kernel_library()
        self.norm = ops.LayerNorm(begin_norm_axis=-1, begin_params_axis=-1, epsilon=eps)
        self.fused = path is not None  # the library's kernel: a row at a time, 6x MindSpore's CPU LayerNorm
        self.kernel = kernels.layer_norm_kernel(path) if self.fused else None
        self.epsilon = Tensor(np.array(eps, np.float32))

    def construct(self, x, weight, bias):
        if self.fused:
            return self.kernel(x, weight, bias, self.epsilon)
        return self.norm(x, weight, bias)[0]

    def bprop(self, x, weight, bias, out, dout):
        rows, width = x.shape
        centred = x - _cpu_column(_cpu_row_mean(x), width)
        rstd = _cpu_column(ops.rsqrt(_cpu_row_mean(ops.square(centred)) + self.eps), width)
        xhat = centred * rstd
        g = dout * _cpu_row(weight, rows)
        mean_g, mean_gx = _cpu_row_mean(g), _cpu_row_mean(g * xhat)
        dx = rstd * (g - _cpu_column(mean_g, width) - xhat * _cpu_column(mean_gx, width))
        return dx, _cpu_column_sum(dout * xhat), _cpu_column_sum(dout)


class _PortableLayerNorm(nn.Cell):
    """MindSpore's LayerNorm primitive, differentiated by its own gradient kernel (fused on Ascend). Only the
    normalised output is used: the auxiliary outputs' meaning is the backend's business."""

    def __init__(self, eps: float):
        super().__init__()
        self.norm = ops.LayerNorm(begin_norm_axis=-1, begin_params_axis=-1, epsilon=eps)

    def construct(self, x, weight, bias):
        return self.norm(x, weight, bias)[0]


class _Float64LayerNorm(nn.Cell):
    """LayerNorm composed of float64 means: MindSpore 2.10's LayerNorm kernel is 2e-7 off in float64 on the CPU
    (float32-like), which moved orb-v2's float64 energies by 7e-6 eV/atom from PyTorch's."""

    def __init__(self, eps: float):
        super().__init__()
        self.eps = eps

    def construct(self, x, weight, bias):
        centred = x - ops.mean(x, -1, True)
        return centred * ops.rsqrt(ops.mean(ops.square(centred), -1, True) + self.eps) * weight + bias


class LayerNorm(nn.Cell):
    """LayerNorm over the last axis with PyTorch's eps (1e-5) and names (weight, bias)."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.weight = Parameter(Tensor(np.ones(dim, np.float32)), name="weight")
        self.bias = Parameter(Tensor(np.zeros(dim, np.float32)), name="bias")
        if is_float64():
            self.function = _Float64LayerNorm(eps)
        else:
            self.function = _CpuLayerNorm(eps) if ops_profile() == "cpu" else _PortableLayerNorm(eps)

    def construct(self, x: Tensor) -> Tensor:
        return self.function(x, self.weight, self.bias)




class _CpuRMSNorm(nn.Cell):
    """x / sqrt(mean(x^2) + eps) * w with its backward written out (matrix-product reductions); the backward
    is made of differentiable operators, so conservative models can train through it (``cpu`` profile)."""

    def __init__(self, eps: float):
        super().__init__()
        self.eps = eps
        path = custom_kernel_library()
        self.fused = path is not None  # the library's kernel, one pass a row in place of seven operators
        self.kernel = kernels.rms_norm_kernel(path) if self.fused else None
        self.epsilon = Tensor(np.array(eps, np.float32))

    def construct(self, x, weight):
        if self.fused:
            return self.kernel(x, weight, self.epsilon)
        rstd = ops.rsqrt(_cpu_row_mean(ops.square(x)) + self.eps)
        return x * _cpu_column(rstd, x.shape[1]) * _cpu_row(weight, x.shape[0])

    def bprop(self, x, weight, out, dout):
        rows, width = x.shape
        rstd = _cpu_column(ops.rsqrt(_cpu_row_mean(ops.square(x)) + self.eps), width)
        xhat = x * rstd
        g = dout * _cpu_row(weight, rows)
        dx = rstd * (g - xhat * _cpu_column(_cpu_row_mean(g * xhat), width))
        return dx, _cpu_column_sum(dout * xhat)


class _PortableRMSNorm(nn.Cell):
    """x / sqrt(mean(x^2) + eps) * w by ReduceMean, BroadcastTo (see :class:`~orb.models.primitives.Broadcasts`)
    and element-wise operators, differentiated (twice, if need be) by MindSpore."""

    def __init__(self, eps: float):
        super().__init__()
        self.eps = eps

    def construct(self, x, weight):
        rstd = ops.rsqrt(ops.mean(ops.square(x), -1, True) + self.eps)
        return x * ops.broadcast_to(rstd, x.shape) * ops.broadcast_to(weight.reshape(1, -1), x.shape)


class RMSNorm(nn.Cell):
    """RMSNorm over the last axis with torch's default eps for float32 (machine epsilon 1.1920929e-07:
    orb-v3's outputs move by 1e-2 eV with eps 1e-6) and a ``weight``, no bias."""

    def __init__(self, dim: int, eps: Optional[float] = None):
        super().__init__()
        eps = float(np.finfo(numpy_dtype()).eps) if eps is None else eps  # torch's default: the input type's
        self.weight = Parameter(Tensor(np.ones(dim, np.float32)), name="weight")
        self.function = _CpuRMSNorm(eps) if ops_profile() == "cpu" else _PortableRMSNorm(eps)

    def construct(self, x: Tensor) -> Tensor:
        return self.function(x, self.weight)


class MLP(nn.Cell):
    """Linear -> act -> ... -> Linear (no activation after the last layer); layers named NN-<i>.

    ``activation``: "ssp" (orb-v2: softplus(x) - ln 2, the shifted softplus; folding the shift into
    the next bias would save a pass but loses precision to cancellation in the matmul) or "silu"
    (orb-v3).
    """

    def __init__(self, sizes: Sequence[int], rng: np.random.Generator, activation: str = "ssp"):
        super().__init__()
        self.act = profile_activation(activation)
        self.layer_names = tuple(f"NN-{i}" for i in range(len(sizes) - 1))
        for name, d_in, d_out in zip(self.layer_names, sizes[:-1], sizes[1:]):
            self.insert_child_to_cell(name, Linear(d_in, d_out, rng))

    def layer(self, i: int) -> Linear:
        """The i-th Linear layer (negative i counts from the end)."""
        return getattr(self, self.layer_names[i])

    def construct(self, x: Tensor) -> Tensor:
        return self.tail(getattr(self, self.layer_names[0])(x), 1)

    def tail(self, x: Tensor, start: int) -> Tensor:
        """Apply layers ``start..`` (``start`` >= 1) to the pre-activation ``x``, the activation before each:
        ``tail(h, 1)`` continues the MLP from its first layer's output ``h``. (No branch in the loop: each ``if``
        of an unrolled loop was a function graph more to compile, in every MLP.)"""
        for name in self.layer_names[start:]:
            x = getattr(self, name)(self.act(x))
        return x


class MLPLayerNorm(nn.Cell):
    """An MLP followed by a normalisation named ``layer_norm`` (orb's ``mlp_and_layer_norm``): LayerNorm
    (orb-v2) or RMSNorm (orb-v3)."""

    def __init__(self, in_dim: int, hidden_dim: int, out_dim: int, num_hidden: int, rng: np.random.Generator,
                 activation: str = "ssp", norm: str = "layer_norm"):
        super().__init__()
        self.mlp = MLP([in_dim] + [hidden_dim] * num_hidden + [out_dim], rng, activation)
        self.layer_norm = LayerNorm(out_dim) if norm == "layer_norm" else RMSNorm(out_dim)

    def construct(self, x: Tensor) -> Tensor:
        return self.layer_norm(self.mlp(x))

    def after_first_layer(self, pre_activation: Tensor) -> Tensor:
        """Finish the block from the first layer's output (bias included)."""
        return self.layer_norm(self.mlp.tail(pre_activation, 1))


def segment_sum(data: Tensor, segment_ids: Tensor, num_segments: int) -> Tensor:
    """Sum rows of ``data`` into ``num_segments`` buckets (correct gradients in every mode), in the data's float type:
    for sums of bounded length (an atom's edges); a structure's atoms into one value: :mod:`orb.models.sums`."""
    return sums.scatter_sum(data, segment_ids, num_segments)


def segment_mean(data: Tensor, segment_ids: Tensor, counts: Tensor) -> Tensor:
    """Mean of rows per segment (a structure's atoms: accurately summed, :mod:`orb.models.sums`); ``counts`` (S,)
    float, empty segments give 0."""
    return sums.segment_mean(data, segment_ids, counts)
