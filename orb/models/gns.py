"""The graph network both orb families share (orb-models' ``gns.py``): embeddings, the encoder, the
attention interaction layers, the unused decoder, online normalisers, reference energies and
net-torque removal. Family modules (``orb_v2``, ``orb_v3``) add their edge features and heads.

Parameter paths equal PyTorch's state-dict keys. One thing is computed differently but
equivalently, for speed: the first edge-MLP layer over ``[e, h_sender, h_receiver]`` is
``e W_e + (h W_s)[senders] + (h W_r)[receivers] + b``: node projections are computed once per
node, not once per edge.
"""

import math
from typing import Optional

import numpy as np
import mindspore as ms
from mindspore import Parameter, Tensor, lazy_inline, nn, ops

from orb.models.blocks import EdgeInput, Linear, MLP, MLPLayerNorm, ScaleRows, SegmentSum, segment_mean, segment_sum
from orb.models.config import ModelConfig
from orb.models.primitives import Broadcasts
from orb.models.sums import segment_total, total
from orb.precision import sum_form


def polynomial_envelope(r: Tensor, r_max: float, p: int) -> Tensor:
    """Smooth cutoff 1 - (p+1)(p+2)/2 x^p + p(p+2) x^(p+1) - p(p+1)/2 x^(p+2), x = r/r_max, 0 beyond r_max."""
    x = r / r_max
    xp = ops.pow(x, p)
    env = 1.0 - (p + 1.0) * (p + 2.0) / 2.0 * xp + p * (p + 2.0) * xp * x - p * (p + 1.0) / 2.0 * xp * x * x
    return env * (r < r_max).astype(r.dtype)


class EmbeddingTable(nn.Cell):
    """Lookup table with a PyTorch-named ``weight`` (num_embeddings, dim)."""

    def __init__(self, num: int, dim: int, rng: np.random.Generator):
        super().__init__()
        bound = math.sqrt(3.0)
        self.weight = Parameter(Tensor(rng.uniform(-bound, bound, (num, dim)).astype(np.float32)), name="weight")

    def construct(self, index: Tensor) -> Tensor:
        return ops.gather(self.weight, index, 0)


class AtomEmbedding(nn.Cell):
    def __init__(self, num_elements: int, dim: int, rng: np.random.Generator):
        super().__init__()
        self.embeddings = EmbeddingTable(num_elements + 1, dim, rng)

    def construct(self, numbers: Tensor) -> Tensor:
        return self.embeddings(numbers)


def style(cfg: ModelConfig):
    """(activation, normalisation) of the family: orb-v2 shifted softplus and LayerNorm, orb-v3 SiLU and RMSNorm."""
    return ("silu", "rms_norm") if cfg.family == "orb_v3" else ("ssp", "layer_norm")


class Encoder(nn.Cell):
    def __init__(self, cfg: ModelConfig, rng: np.random.Generator, edge_features: int):
        super().__init__()
        d, h, k = cfg.latent_dim, cfg.mlp_hidden_dim, cfg.num_mlp_layers
        self._node_fn = MLPLayerNorm(d, h, d, k, rng, *style(cfg))
        self._edge_fn = MLPLayerNorm(edge_features, h, d, k, rng, *style(cfg))

    def construct(self, node_features: Tensor, edge_features: Tensor):
        return self._node_fn(node_features), self._edge_fn(edge_features)


class AttentionInteraction(nn.Cell):
    """One message-passing step with sigmoid attention gates and a polynomial distance envelope.

    ``conditioned`` (orb-v3 OMol): first adds ``_cond_node_proj(cond)`` to the node latents, where it
    stays (orb-models' "additive" node conditioning); other models pass ``cond=None``.

    ``lazy_inline(policy="front")``: the compiler's front end parses this layer once and inlines the
    copies afterwards, instead of parsing 15 (orb-v2) or 5 (orb-v3) unrolled copies. The backend
    sees the same inlined graph as without it (so it runs on every device, not only Ascend where
    non-inlined reuse is supported); compile time and compiler memory fall (docs/benchmarks.md).
    Its rule: ``construct`` arguments are positional, without defaults.
    """

    @lazy_inline(policy="front")
    def __init__(self, cfg: ModelConfig, rng: np.random.Generator, conditioned: bool = False):
        super().__init__()
        d, h, k = cfg.latent_dim, cfg.mlp_hidden_dim, cfg.num_mlp_layers
        self.latent_dim = d
        self.hidden_dim = h
        self._node_mlp = MLPLayerNorm(3 * d, h, d, k, rng, *style(cfg))
        self._edge_mlp = MLPLayerNorm(3 * d, h, d, k, rng, *style(cfg))
        self._receive_attn = Linear(d, 1, rng)
        self._send_attn = Linear(d, 1, rng)
        self.conditioned = conditioned
        if conditioned:
            self._cond_node_proj = Linear(d, d, rng)
        self.scale_rows = ScaleRows()
        self.segment_sum = SegmentSum()
        self.edge_input = EdgeInput()

    def construct(self, nodes: Tensor, edges: Tensor, senders: Tensor, receivers: Tensor, cutoff: Tensor,
                  cond: Optional[Tensor]):
        d = self.latent_dim
        if self.conditioned:
            nodes = nodes + self._cond_node_proj(cond)
        receive_gate = ops.sigmoid(self._receive_attn(edges)) * cutoff
        send_gate = ops.sigmoid(self._send_attn(edges)) * cutoff

        first = self._edge_mlp.mlp.layer(0)
        w = first.effective_weight()  # (h, 3d) acting on [edge, sender node, receiver node]
        node_part = first.product(nodes, ops.concat((w[:, d:2 * d], w[:, 2 * d:]), 0))  # (N, 2h)
        pre = self.edge_input(first.product(edges, w[:, :d]), node_part, first.bias, senders, receivers)
        new_edges = self._edge_mlp.after_first_layer(pre)

        num_nodes = nodes.shape[0]
        sent = self.segment_sum(self.scale_rows(new_edges, send_gate), senders, num_nodes)
        received = self.segment_sum(self.scale_rows(new_edges, receive_gate), receivers, num_nodes)
        new_nodes = self._node_mlp(ops.concat((nodes, received, sent), 1))
        return nodes + new_nodes, edges + new_edges


class DecoderFn(nn.Cell):
    def __init__(self, cfg: ModelConfig, rng: np.random.Generator):
        super().__init__()
        sizes = [cfg.latent_dim] + [cfg.mlp_hidden_dim] * cfg.num_mlp_layers + [cfg.decoder_out_dim]
        self.mlp = MLP(sizes, rng, style(cfg)[0])

    def construct(self, x: Tensor) -> Tensor:
        return self.mlp(x)


class Decoder(nn.Cell):
    """orb's node decoder: in every checkpoint, read by no head (never run here, never trained)."""

    def __init__(self, cfg: ModelConfig, rng: np.random.Generator):
        super().__init__()
        self.node_fn = DecoderFn(cfg, rng)

    def construct(self, x: Tensor) -> Tensor:
        return self.node_fn(x)


class RunningStats(nn.Cell):
    """BatchNorm1d(1, affine=False, momentum=None) buffers: a cumulative mean and unbiased variance."""

    def __init__(self, mean: float, var: float, count: int, count_shape: tuple):
        super().__init__()
        self.running_mean = Parameter(Tensor(np.array([mean], np.float32)), name="running_mean", requires_grad=False)
        self.running_var = Parameter(Tensor(np.array([var], np.float32)), name="running_var", requires_grad=False)
        self.num_batches_tracked = Parameter(
            Tensor(np.full(count_shape, count, np.int64)), name="num_batches_tracked", requires_grad=False)


class ScalarNormalizer(nn.Cell):
    """Normalises a target as (x - mean) / sqrt(var) with running statistics (no eps, as orb)."""

    def __init__(self, mean: float = 0.0, std: float = 1.0, count: int = 0, count_shape: tuple = ()):
        super().__init__()
        self.bn = RunningStats(mean, std * std, count, count_shape)
        # the statistics' update is a mean over every training step: computed in float64 where the device has it
        # (the sums' form, orb.models.sums), in the statistics' own type elsewhere
        self.update_in_float64 = sum_form() == "float64"

    def stats(self):
        return self.bn.running_mean, self.bn.running_var

    def batch_sums(self, values: Tensor, mask: Tensor) -> Tensor:
        """(3,) [count, sum of (x - mean), sum of (x - mean)^2] of ``values`` where ``mask`` (a 0/1 tensor of their
        shape), shifted by the running mean: sums over data-parallel ranks need one reduction, not two passes, and
        the shift (the same on every rank) keeps the variance free of cancellation."""
        shifted = (ops.stop_gradient(values) - self.bn.running_mean) * mask
        return ops.stack((total(mask), total(shifted), total(shifted * shifted)))

    def updated_stats(self, sums: Tensor):
        """Statistics after one training batch from its :meth:`batch_sums` (summed over ranks), and the new count.

        With ``f = 1 / (count + 1)``: mean <- mean + f (batch_mean - mean) and var <- var + f (batch_var_unbiased -
        var), PyTorch's cumulative average (the first batch replaces the statistics exactly), computed in float64
        and rounded once where the device has float64, as PyTorch's CPU kernel does: in float32, ``1 - f`` rounded
        near 1 moved a mean counted over 2e7 batches by one float32 step per batch whatever the batch (0.5 eV/atom
        per million steps). A batch with fewer than two values leaves the statistics unchanged (PyTorch raises).
        """
        mean, var = self.bn.running_mean, self.bn.running_var
        old_count = self.bn.num_batches_tracked
        wide = ms.float64 if self.update_in_float64 else mean.dtype
        n, shifted_sum, shifted_square_sum = ops.unstack(sums.astype(wide))
        offset = shifted_sum / ops.maximum(n, 1.0)  # batch_mean - mean
        batch_var = (shifted_square_sum - offset * shifted_sum) / ops.maximum(n - 1.0, 1.0)
        factor = 1.0 / (old_count.astype(wide) + 1.0).reshape(-1)
        valid = n > 1.5
        new_mean = ops.where(valid, (mean.astype(wide) + factor * offset).astype(mean.dtype), mean)
        new_var = ops.where(valid, (var.astype(wide) + factor * (batch_var - var.astype(wide))).astype(var.dtype), var)
        new_count = old_count + valid.astype(old_count.dtype)
        return new_mean, new_var, new_count

    def commit(self, mean: Tensor, var: Tensor, count: Tensor):
        ops.assign(self.bn.running_mean, mean)
        ops.assign(self.bn.running_var, var)
        ops.assign(self.bn.num_batches_tracked, count)
        return mean


class ReferenceEnergy(nn.Cell):
    def __init__(self, coefficients: np.ndarray):
        super().__init__()
        self.weight = Parameter(Tensor(np.asarray(coefficients, np.float32)), name="weight")


class LinearReferenceEnergy(nn.Cell):
    """Per-element energies of each graph's atoms, as orb-models computes them: exact per-element atom counts
    (integers, exact in float32 below 2^24 atoms of one element) times the table, a product per element
    present. Gathering each atom's energy and summing N of them in float32 instead grew a rounding error
    with the structure (-0.04 eV at 1,024 Cu atoms, and a change with the atoms' order)."""

    def __init__(self, coefficients: np.ndarray):
        super().__init__()
        self.linear = ReferenceEnergy(coefficients)
        self.broadcasts = Broadcasts()

    def construct(self, numbers: Tensor, node_graph: Tensor, num_graphs: int) -> Tensor:
        weight = self.linear.weight
        # The weight has entries for Z = 0..117; Z = 118 gets a reference energy of 0.
        table = ops.concat((weight, ops.zeros(1, weight.dtype)))
        width = table.shape[0]
        counts = segment_sum(ops.ones(numbers.shape, weight.dtype), node_graph * width + numbers,
                             num_graphs * width).reshape(num_graphs, width)
        return self.broadcasts.row_sum(counts * self.broadcasts.row(table, num_graphs)).reshape(-1)


def cross(a: Tensor, b: Tensor) -> Tensor:
    """Row-wise cross product of (n, 3) tensors."""
    a0, a1, a2 = ops.unstack(a, 1)
    b0, b1, b2 = ops.unstack(b, 1)
    return ops.stack((a1 * b2 - a2 * b1, a2 * b0 - a0 * b2, a0 * b1 - a1 * b0), 1)


def solve_symmetric_3x3(m: Tensor, b: Tensor) -> Tensor:
    """Solve m x = b for a batch of 3x3 matrices (B, 3, 3) by the adjugate; x = 0 where det = 0."""
    a, bb, c, d, e, f, g, h, i = ops.unstack(m.reshape(-1, 9), 1)
    co00, co01, co02 = e * i - f * h, f * g - d * i, d * h - e * g
    det = a * co00 + bb * co01 + c * co02
    adj = ops.stack((
        ops.stack((co00, c * h - bb * i, bb * f - c * e), 1),
        ops.stack((co01, a * i - c * g, c * d - a * f), 1),
        ops.stack((co02, bb * g - a * h, a * e - bb * d), 1),
    ), 1)
    ok = ops.abs(det) > 1e-30
    safe_det = ops.where(ok, det, ops.ones_like(det))
    x = (adj @ b.reshape(-1, 3, 1)).reshape(-1, 3) / safe_det.reshape(-1, 1)
    return x * ok.astype(x.dtype).reshape(-1, 1)


def remove_net_torque(forces: Tensor, positions: Tensor, node_graph: Tensor, n_node: Tensor,
                      nonperiodic: Tensor) -> Tensor:
    """Remove the net torque of non-periodic graphs by the smallest (L2) force change.

    Solves (S - s I) mu = -tau per graph, with r_i = pos_i - mean(pos), tau = sum r_i x f_i,
    S = sum r_i r_i^T, s = sum |r_i|^2, and adds r_i x mu (orb-models' ``remove_net_torque``).
    A tiny diagonal shift (1e-7 of the mean moment) keeps linear molecules and single atoms
    finite (PyTorch falls back to a pseudo-inverse there); periodic graphs are unchanged.
    """
    num_graphs = n_node.shape[0]
    centre = segment_mean(positions, node_graph, n_node)
    r = positions - ops.gather(centre, node_graph, 0)
    tau = segment_total(cross(r, forces), node_graph, num_graphs)
    s = segment_total(ops.square(r).sum(1), node_graph, num_graphs)
    outer = (r.reshape(-1, 3, 1) * r.reshape(-1, 1, 3)).reshape(-1, 9)
    big_s = segment_total(outer, node_graph, num_graphs).reshape(-1, 3, 3)
    eye = ops.eye(3, 3, forces.dtype).reshape(1, 3, 3)
    m = big_s - (s * (1.0 + 1e-7)).reshape(-1, 1, 1) * eye
    flag = nonperiodic.reshape(-1, 1, 1)
    m = m * flag - (1.0 - flag) * eye  # periodic graphs: a harmless -I, their correction is masked below
    mu = solve_symmetric_3x3(m, -tau) * nonperiodic.reshape(-1, 1)
    return forces + cross(r, ops.gather(mu, node_graph, 0))


REPLAY_HEADS = "replay_heads"  # parameters under this path are training-only (never exported)


class ReplayHeads(nn.Cell):
    """Copies of a model's output heads (MLPs, normalisers, reference energies) for replay structures whose level
    of theory differs from the target's (``replay.head: separate``, as MACE's multihead fine-tuning): the
    backbone is shared, each structure is predicted by the heads of its ``head`` index."""

    def __init__(self, cells):
        super().__init__()
        for name, cell in cells.items():
            setattr(self, name, cell)


def copy_parameters(source: nn.Cell, target: nn.Cell) -> None:
    """Set ``target``'s parameters to ``source``'s (two cells of the same structure)."""
    sources, targets = list(source.parameters_and_names()), list(target.parameters_and_names())
    if len(sources) != len(targets):
        raise ValueError(f"cannot copy {len(sources)} parameters into {len(targets)}")
    for (name, value), (other, param) in zip(sources, targets):
        if not (name.endswith(other) or other.endswith(name)) or value.shape != param.shape:
            raise ValueError(f"cannot copy {name} {value.shape} into {other} {param.shape}")
        param.set_data(Tensor(value.asnumpy().copy()))


class OrbModel(nn.Cell):
    """What every orb family shares beyond the backbone: optional replay heads.

    ``add_replay_heads`` adds copies of the heads (:meth:`head_cells`) under ``replay_heads``; a
    structure whose model input ``head`` is 1 is then predicted by them. Without replay heads the
    ``head`` input is ignored.
    """

    def __init__(self):
        super().__init__()
        self.replay_heads = None
        self.sum_form = sum_form()  # how its long sums are compiled (orb.models.sums): part of its graphs' identity

    def head_cells(self) -> dict:
        """{name: cell} of the heads a replay copy duplicates."""
        raise NotImplementedError

    def new_head_cells(self, rng: np.random.Generator) -> dict:
        """Freshly built cells of the same structure as :meth:`head_cells`."""
        raise NotImplementedError

    def add_replay_heads(self) -> None:
        """Replay heads starting as exact copies of the current heads."""
        from orb.models import is_float64_model, to_float64

        current, fresh = self.head_cells(), self.new_head_cells(np.random.default_rng(0))
        for name, cell in fresh.items():
            if is_float64_model(self):
                to_float64(cell)  # (copy_parameters keeps each parameter's type)
            copy_parameters(current[name], cell)
        self.replay_heads = ReplayHeads(fresh)

    def replay_parameters(self) -> list:
        return [] if self.replay_heads is None else list(self.replay_heads.get_parameters())

    @staticmethod
    def by_head(replay_rows, replay_value, value):
        """Row-wise ``replay_value`` where ``replay_rows`` (a (rows,) bool), else ``value``."""
        return ops.where(replay_rows.reshape((-1,) + (1,) * (value.ndim - 1)), replay_value, value)

    @staticmethod
    def pick_stats(replay_rows, replay_stats, stats, ndim: int = 1):
        """Normaliser statistics (mean, var) per row: ``replay_stats`` where ``replay_rows``, else ``stats``
        (shaped to broadcast against ``ndim``-dimensional values of those rows)."""
        rows = replay_rows.reshape((-1,) + (1,) * (ndim - 1))
        return ops.where(rows, replay_stats[0], stats[0]), ops.where(rows, replay_stats[1], stats[1])


BUFFERS = ("running_mean", "running_var", "num_batches_tracked", "bessel_weights", "r_max", "prefactor", "bin_edges")


def count_parameters(model: nn.Cell) -> int:
    """Parameters as PyTorch counts them: every weight, trained or not (decoder and reference energies
    included), but no buffers (normaliser statistics and constants)."""
    return int(sum(np.prod(p.shape) for name, p in model.parameters_and_names()
                   if name.rsplit(".", 1)[-1] not in BUFFERS))
