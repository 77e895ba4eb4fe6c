"""Building blocks with PyTorch-compatible parameter names and numerics.

Parameter names follow orb-models' state_dict (``weight``/``bias`` for Linear and LayerNorm,
``NN-<i>`` for MLP layers), so a MindSpore parameter path equals the PyTorch key.
"""

import math
from typing import Sequence

import numpy as np
from mindspore import Parameter, Tensor, nn, ops

from orb.models.kernels import shifted_softplus_op



def uniform(shape, bound: float, rng: np.random.Generator) -> np.ndarray:
    return rng.uniform(-bound, bound, size=shape).astype(np.float32)


class Linear(nn.Cell):
    """y = x W^T + b with W of shape (out, in), PyTorch's default initialisation."""

    def __init__(self, in_dim: int, out_dim: int, rng: np.random.Generator, bias: bool = True):
        super().__init__()
        bound = 1.0 / math.sqrt(in_dim)
        self.weight = Parameter(Tensor(uniform((out_dim, in_dim), bound, rng)), name="weight")
        self.has_bias = bias
        if bias:
            self.bias = Parameter(Tensor(uniform((out_dim,), bound, rng)), name="bias")
        self.matmul = ops.MatMul(transpose_b=True)

    def construct(self, x: Tensor) -> Tensor:
        y = self.matmul(x, self.weight)
        if self.has_bias:
            y = y + self.bias
        return y



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
        centred = x - x.mean(-1, keep_dims=True)
        rstd = ops.rsqrt(ops.square(centred).mean(-1, keep_dims=True) + self.eps)
        xhat = centred * rstd
        g = dout * weight
        dx = rstd * (g - g.mean(-1, keep_dims=True) - xhat * (g * xhat).mean(-1, keep_dims=True))
        rows = dout.reshape(-1, dout.shape[-1])
        return dx, (rows * xhat.reshape(rows.shape)).sum(0), rows.sum(0)


class LayerNorm(nn.Cell):
    """LayerNorm over the last axis with PyTorch's eps (1e-5) and names (weight, bias)."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.weight = Parameter(Tensor(np.ones(dim, np.float32)), name="weight")
        self.bias = Parameter(Tensor(np.zeros(dim, np.float32)), name="bias")
        self.function = _LayerNormFunction(eps)

    def construct(self, x: Tensor) -> Tensor:
        return self.function(x, self.weight, self.bias)


class MLP(nn.Cell):
    """Linear -> ssp -> ... -> Linear (no activation after the last layer); layers named NN-<i>.

    ssp(x) = softplus(x) - ln 2 is the shifted softplus. (Folding the shift into the next bias would
    save a pass over the activations but loses precision to cancellation in the matmul.)
    """

    def __init__(self, sizes: Sequence[int], rng: np.random.Generator):
        super().__init__()
        self.ssp = shifted_softplus_op()
        self.layer_names = tuple(f"NN-{i}" for i in range(len(sizes) - 1))
        for name, d_in, d_out in zip(self.layer_names, sizes[:-1], sizes[1:]):
            self.insert_child_to_cell(name, Linear(d_in, d_out, rng))

    def layer(self, i: int) -> Linear:
        return getattr(self, self.layer_names[i])

    def construct(self, x: Tensor) -> Tensor:
        return self.tail(x, 0)

    def tail(self, x: Tensor, start: int) -> Tensor:
        """Apply layers ``start..`` to ``x``, with ssp before every layer after ``start``.

        ``tail(h, 1)`` continues the MLP from the pre-activation ``h`` of the first layer.
        """
        for i, name in enumerate(self.layer_names):
            if i >= start:
                if i > 0:
                    x = self.ssp(x)
                x = getattr(self, name)(x)
        return x


class MLPLayerNorm(nn.Cell):
    """An MLP followed by LayerNorm (orb's ``mlp_and_layer_norm``)."""

    def __init__(self, in_dim: int, hidden_dim: int, out_dim: int, num_hidden: int, rng: np.random.Generator):
        super().__init__()
        self.mlp = MLP([in_dim] + [hidden_dim] * num_hidden + [out_dim], rng)
        self.layer_norm = LayerNorm(out_dim)

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
