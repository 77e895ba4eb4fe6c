"""Building blocks with PyTorch-compatible parameter names and numerics.

Parameter names follow orb-models' state_dict (``weight``/``bias`` for Linear and LayerNorm,
``NN-<i>`` for MLP layers), so a MindSpore parameter path equals the PyTorch key.
"""

import math
from typing import Sequence

import numpy as np
from mindspore import Parameter, Tensor, nn, ops

from orb.models.kernels import shifted_softplus_op, silu_op


def uniform(shape, bound: float, rng: np.random.Generator) -> np.ndarray:
    return rng.uniform(-bound, bound, size=shape).astype(np.float32)


# Memory: MindSpore 2.10's CPU kernels for reductions (ReduceSum/ReduceMean) and for binary
# operators that broadcast (x + bias, x * column) each keep host index/work buffers of 8-16 bytes
# per element of their input for the life of the compiled graph (22 MB per kernel on a 2720 x 512
# activation, measured with heaptrack); over orb's 15 layers, forward and backward, that was
# ~3 GB. So large activations are reduced by matrix products with a ones vector, biases are added
# with BiasAdd and other operands are expanded to the full shape first (see :func:`expand_column`).
#
# The MatMul primitive, not functional ops.matmul: the gradient of ops.matmul (MatMulExt)
# transposes its operands with Transpose kernels where MatMul's gradient uses its transpose flags
# (8 % of a conservative orb-v3 training step, which differentiates the backward passes below once
# more). A primitive instance also avoids a MindSpore 2.10 failure seen with functional ops.tile
# inside a custom bprop ("func graph is empty" on recompilation).
_MATMUL = ops.MatMul()


def expand_column(x: Tensor, width: int) -> Tensor:
    """A (rows, 1) column repeated to (rows, width), as the product x @ ones(1, width).

    Neither broadcasting binary operators (per-element buffers, see above) nor BroadcastTo
    (MindSpore 2.10's CPU kernel: 1.5 ms for a 1776 x 256 float32 result, 12 % of an orb-v2
    training step) nor Tile (its gradient is a ReduceSum: 3 % of a conservative orb-v3 step): the
    product is as fast as Tile and its gradient is a matrix product too (a row sum).
    """
    return _MATMUL(x, ops.ones((1, width), x.dtype))


def expand_row(x: Tensor, height: int) -> Tensor:
    """A (width,) vector repeated to (height, width), as ones(height, 1) @ x (see :func:`expand_column`)."""
    return _MATMUL(ops.ones((height, 1), x.dtype), x.reshape(1, -1))


def row_sum(x: Tensor) -> Tensor:
    """Sum over the last axis of a 2-D tensor, keeping it: (rows, cols) -> (rows, 1)."""
    return _MATMUL(x, ops.ones((x.shape[-1], 1), x.dtype))


def row_mean(x: Tensor) -> Tensor:
    return row_sum(x) * (1.0 / x.shape[-1])


def column_sum(x: Tensor) -> Tensor:
    """Sum over the first axis of a 2-D tensor: (rows, cols) -> (cols,)."""
    return _MATMUL(ops.ones((1, x.shape[0]), x.dtype), x).reshape(-1)


class _LinearFunction(nn.Cell):
    """x W^T + b with the backward written as three matrix products (no reduction kernels)."""

    def __init__(self):
        super().__init__()
        self.matmul_t = ops.MatMul(transpose_b=True)
        self.matmul_ta = ops.MatMul(transpose_a=True)

    def construct(self, x, weight, bias):
        return ops.bias_add(self.matmul_t(x, weight), bias)

    def bprop(self, x, weight, bias, out, dout):
        return _MATMUL(dout, weight), self.matmul_ta(dout, x), column_sum(dout)


class Linear(nn.Cell):
    """y = x W^T + b with W of shape (out, in), PyTorch's default initialisation; x is 2-D."""

    def __init__(self, in_dim: int, out_dim: int, rng: np.random.Generator, bias: bool = True):
        super().__init__()
        bound = 1.0 / math.sqrt(in_dim)
        self.weight = Parameter(Tensor(uniform((out_dim, in_dim), bound, rng)), name="weight")
        self.has_bias = bias
        if bias:
            self.bias = Parameter(Tensor(uniform((out_dim,), bound, rng)), name="bias")
            self.function = _LinearFunction()
        else:
            self.matmul = ops.MatMul(transpose_b=True)

    def construct(self, x: Tensor) -> Tensor:
        if self.has_bias:
            return self.function(x, self.weight, self.bias)
        return self.matmul(x, self.weight)


class ScaleRows(nn.Cell):
    """x * gate with gate (rows, 1), the gate's gradient as a row sum (see :func:`row_sum`)."""

    def construct(self, x, gate):
        return x * expand_column(gate, x.shape[1])

    def bprop(self, x, gate, out, dout):
        return dout * expand_column(gate, x.shape[1]), row_sum(dout * x)


class _LayerNormFunction(nn.Cell):
    """Fused LayerNorm forward with an analytic backward (MindSpore's CPU LayerNormGrad is slow).

    The backward recomputes the mean and 1/std from ``x`` instead of reading the kernel's
    auxiliary outputs: their meaning differs between backends (MindSpore 2.10's CPU kernel returns
    the variance, Ascend's the reciprocal standard deviation), the recomputation does not.
    """

    def __init__(self, eps: float):
        super().__init__()
        self.eps = eps
        self.norm = ops.LayerNorm(begin_norm_axis=-1, begin_params_axis=-1, epsilon=eps)

    def construct(self, x, weight, bias):
        return self.norm(x, weight, bias)[0]

    def bprop(self, x, weight, bias, out, dout):
        rows, width = x.shape
        centred = x - expand_column(row_mean(x), width)
        rstd = expand_column(ops.rsqrt(row_mean(ops.square(centred)) + self.eps), width)
        xhat = centred * rstd
        g = dout * expand_row(weight, rows)
        mean_g, mean_gx = row_mean(g), row_mean(g * xhat)
        dx = rstd * (g - expand_column(mean_g, width) - xhat * expand_column(mean_gx, width))
        return dx, column_sum(dout * xhat), column_sum(dout)


class LayerNorm(nn.Cell):
    """LayerNorm over the last axis with PyTorch's eps (1e-5) and names (weight, bias)."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.weight = Parameter(Tensor(np.ones(dim, np.float32)), name="weight")
        self.bias = Parameter(Tensor(np.zeros(dim, np.float32)), name="bias")
        self.function = _LayerNormFunction(eps)

    def construct(self, x: Tensor) -> Tensor:
        return self.function(x, self.weight, self.bias)


ACTIVATIONS = {"ssp": shifted_softplus_op, "silu": silu_op}


class _RMSNormFunction(nn.Cell):
    """x / sqrt(mean(x^2) + eps) * w with its backward written out (matrix-product reductions, see above);
    the backward is made of differentiable operators, so conservative models can train through it."""

    def __init__(self, eps: float):
        super().__init__()
        self.eps = eps

    def construct(self, x, weight):
        rstd = ops.rsqrt(row_mean(ops.square(x)) + self.eps)
        return x * expand_column(rstd, x.shape[1]) * expand_row(weight, x.shape[0])

    def bprop(self, x, weight, out, dout):
        rows, width = x.shape
        rstd = expand_column(ops.rsqrt(row_mean(ops.square(x)) + self.eps), width)
        xhat = x * rstd
        g = dout * expand_row(weight, rows)
        dx = rstd * (g - xhat * expand_column(row_mean(g * xhat), width))
        return dx, column_sum(dout * xhat)


class RMSNorm(nn.Cell):
    """RMSNorm over the last axis with torch's default eps for float32 (machine epsilon 1.1920929e-07:
    orb-v3's outputs move by 1e-2 eV with eps 1e-6) and a ``weight``, no bias."""

    def __init__(self, dim: int, eps: float = float(np.finfo(np.float32).eps)):
        super().__init__()
        self.weight = Parameter(Tensor(np.ones(dim, np.float32)), name="weight")
        self.function = _RMSNormFunction(eps)

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
        self.act = ACTIVATIONS[activation]()
        self.layer_names = tuple(f"NN-{i}" for i in range(len(sizes) - 1))
        for name, d_in, d_out in zip(self.layer_names, sizes[:-1], sizes[1:]):
            self.insert_child_to_cell(name, Linear(d_in, d_out, rng))

    def layer(self, i: int) -> Linear:
        """The i-th Linear layer (negative i counts from the end)."""
        return getattr(self, self.layer_names[i])

    def construct(self, x: Tensor) -> Tensor:
        return self.tail(x, 0)

    def tail(self, x: Tensor, start: int) -> Tensor:
        """Apply layers ``start..`` to ``x``, with the activation before every layer after ``start``.

        ``tail(h, 1)`` continues the MLP from the pre-activation ``h`` of the first layer.
        """
        for i, name in enumerate(self.layer_names):
            if i >= start:
                if i > 0:
                    x = self.act(x)
                x = getattr(self, name)(x)
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
    """Sum rows of ``data`` into ``num_segments`` buckets (correct gradients in every mode)."""
    return ops.unsorted_segment_sum(data, segment_ids, num_segments)


def segment_mean(data: Tensor, segment_ids: Tensor, counts: Tensor) -> Tensor:
    """Mean of rows per segment; ``counts`` (S,) float, empty segments give 0."""
    total = ops.unsorted_segment_sum(data, segment_ids, counts.shape[0])
    denom = ops.maximum(counts, 1.0)
    return total / denom.reshape((-1,) + (1,) * (total.ndim - 1))
