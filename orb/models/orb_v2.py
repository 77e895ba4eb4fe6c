"""orb-v2 in MindSpore: MoleculeGNS backbone with attention interaction layers and three heads.

Every formula follows orb-models 0.4.2 (its ``gns.py`` and ``graph_regressor.py``); parameter paths equal the
PyTorch state_dict keys. Two things are computed differently but equivalently, for speed:

* the first edge-MLP layer over ``[e, h_sender, h_receiver]`` is ``e W_e + (h W_s)[senders] +
  (h W_r)[receivers] + b``: node projections are computed once per node, not once per edge;
* the decoder, whose output no head reads, is kept for checkpoint compatibility but not run.
"""

import math
from typing import Optional

import numpy as np
from mindspore import Parameter, Tensor, nn, ops

from orb.models import reference_energies
from orb.models.kernels import exp_nonpositive_op
from orb.models.config import ModelConfig
from orb.models.blocks import Linear, MLP, MLPLayerNorm, ScaleRows, segment_mean, segment_sum


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


class Encoder(nn.Cell):
    def __init__(self, cfg: ModelConfig, rng: np.random.Generator):
        super().__init__()
        n_in = 3 + cfg.num_rbf
        self._node_fn = MLPLayerNorm(cfg.latent_dim, cfg.mlp_hidden_dim, cfg.latent_dim, cfg.num_mlp_layers, rng)
        self._edge_fn = MLPLayerNorm(n_in, cfg.mlp_hidden_dim, cfg.latent_dim, cfg.num_mlp_layers, rng)

    def construct(self, node_features: Tensor, edge_features: Tensor):
        return self._node_fn(node_features), self._edge_fn(edge_features)


class AttentionInteraction(nn.Cell):
    """One message-passing step with sigmoid attention gates and a polynomial distance envelope."""

    def __init__(self, cfg: ModelConfig, rng: np.random.Generator):
        super().__init__()
        d, h, k = cfg.latent_dim, cfg.mlp_hidden_dim, cfg.num_mlp_layers
        self.latent_dim = d
        self.hidden_dim = h
        self._node_mlp = MLPLayerNorm(3 * d, h, d, k, rng)
        self._edge_mlp = MLPLayerNorm(3 * d, h, d, k, rng)
        self._receive_attn = Linear(d, 1, rng)
        self._send_attn = Linear(d, 1, rng)
        self.matmul_t = ops.MatMul(transpose_b=True)
        self.scale_rows = ScaleRows()

    def construct(self, nodes: Tensor, edges: Tensor, senders: Tensor, receivers: Tensor, cutoff: Tensor):
        d, h = self.latent_dim, self.hidden_dim
        receive_gate = ops.sigmoid(self._receive_attn(edges)) * cutoff
        send_gate = ops.sigmoid(self._send_attn(edges)) * cutoff

        first = self._edge_mlp.mlp.layer(0)
        w = first.weight  # (h, 3d) acting on [edge, sender node, receiver node]
        node_part = self.matmul_t(nodes, ops.concat((w[:, d:2 * d], w[:, 2 * d:]), 0))  # (N, 2h)
        from_sender = ops.bias_add(node_part[:, :h], first.bias)  # the bias is added per node, not per edge
        pre = (self.matmul_t(edges, w[:, :d])
               + ops.gather(from_sender, senders, 0) + ops.gather(node_part[:, h:], receivers, 0))
        new_edges = self._edge_mlp.after_first_layer(pre)

        num_nodes = nodes.shape[0]
        sent = segment_sum(self.scale_rows(new_edges, send_gate), senders, num_nodes)
        received = segment_sum(self.scale_rows(new_edges, receive_gate), receivers, num_nodes)
        new_nodes = self._node_mlp(ops.concat((nodes, received, sent), 1))
        return nodes + new_nodes, edges + new_edges


class DecoderFn(nn.Cell):
    def __init__(self, cfg: ModelConfig, rng: np.random.Generator):
        super().__init__()
        sizes = [cfg.latent_dim] + [cfg.mlp_hidden_dim] * cfg.num_mlp_layers + [cfg.decoder_out_dim]
        self.mlp = MLP(sizes, rng)

    def construct(self, x: Tensor) -> Tensor:
        return self.mlp(x)


class Decoder(nn.Cell):
    """orb-v2's node decoder: in every checkpoint, read by no head (never run here, never trained)."""

    def __init__(self, cfg: ModelConfig, rng: np.random.Generator):
        super().__init__()
        self.node_fn = DecoderFn(cfg, rng)

    def construct(self, x: Tensor) -> Tensor:
        return self.node_fn(x)


class MoleculeGNS(nn.Cell):
    """Backbone: atom embedding and edge features -> encoder -> message-passing layers -> node latents."""

    def __init__(self, cfg: ModelConfig, rng: np.random.Generator):
        super().__init__()
        self.cfg = cfg
        self._encoder = Encoder(cfg, rng)
        self.gnn_stacks = nn.CellList([AttentionInteraction(cfg, rng) for _ in range(cfg.num_message_passing_steps)])
        self._decoder = Decoder(cfg, rng)
        self.atom_emb = AtomEmbedding(cfg.num_elements, cfg.latent_dim, rng)
        step = cfg.rbf_radius / cfg.num_rbf
        self.rbf_centres = Tensor(np.arange(cfg.num_rbf, dtype=np.float32) * np.float32(step))
        self.exp_nonpositive = exp_nonpositive_op()

    def edge_features(self, vectors: Tensor):
        """Gaussian RBFs exp(-(r - c_k)^2) of the edge length, then the unit vector; also returns r."""
        r = ops.norm(vectors, dim=1)
        safe = ops.where(r == 0, ops.ones_like(r), r)
        unit = vectors / safe.reshape(-1, 1)
        rbf = self.exp_nonpositive(-ops.square(r.reshape(-1, 1) - self.rbf_centres.reshape(1, -1)))
        return ops.concat((rbf, unit), 1), r

    def construct(self, numbers: Tensor, vectors: Tensor, senders: Tensor, receivers: Tensor) -> Tensor:
        edge_features, r = self.edge_features(vectors)
        cutoff = polynomial_envelope(r, self.cfg.cutoff_rmax, self.cfg.polynomial_order).reshape(-1, 1)
        nodes, edges = self._encoder(self.atom_emb(numbers), edge_features)
        for layer in self.gnn_stacks:
            nodes, edges = layer(nodes, edges, senders, receivers, cutoff)
        return nodes


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

    def stats(self):
        return self.bn.running_mean, self.bn.running_var

    def updated_stats(self, values: Tensor, mask: Tensor, allreduce=None):
        """Statistics after one training batch (masked ``values``), and the new count.

        With ``f = 1 / (count + 1)``: mean <- (1 - f) mean + f batch_mean and var <- (1 - f) var +
        f batch_var_unbiased (the first batch replaces the statistics exactly). ``allreduce`` (a sum over data-parallel ranks) makes the
        batch statistics those of the global batch. A batch with fewer than two values leaves
        the statistics unchanged (PyTorch raises there).
        """
        values = ops.stop_gradient(values)
        mask = ops.broadcast_to(mask, values.shape)
        n = mask.sum()
        total = (values * mask).sum()
        if allreduce is not None:
            n = allreduce(n)
            total = allreduce(total)
        batch_mean = total / ops.maximum(n, 1.0)
        sq = (ops.square(values - batch_mean) * mask).sum()
        if allreduce is not None:
            sq = allreduce(sq)
        batch_var = sq / ops.maximum(n - 1.0, 1.0)
        old_count = self.bn.num_batches_tracked
        factor = 1.0 / (old_count.astype(values.dtype) + 1.0).reshape(-1)
        mean, var = self.bn.running_mean, self.bn.running_var
        valid = n > 1.5
        new_mean = ops.where(valid, (1.0 - factor) * mean + factor * batch_mean, mean)
        new_var = ops.where(valid, (1.0 - factor) * var + factor * batch_var, var)
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
    """Per-element energies summed over each graph's atoms (weight index = atomic number)."""

    def __init__(self, coefficients: np.ndarray):
        super().__init__()
        self.linear = ReferenceEnergy(coefficients)

    def construct(self, numbers: Tensor, node_graph: Tensor, num_graphs: int) -> Tensor:
        # The weight has entries for Z = 0..117; Z = 118 gets a reference energy of 0.
        table = ops.concat((self.linear.weight, ops.zeros(1, self.linear.weight.dtype)))
        return segment_sum(ops.gather(table, numbers, 0), node_graph, num_graphs)


class Head(nn.Cell):
    """MLP head with a target normaliser (graph heads read the per-graph mean of node latents)."""

    def __init__(self, cfg: ModelConfig, out_dim: int, normalizer: ScalarNormalizer, rng: np.random.Generator):
        super().__init__()
        sizes = [cfg.latent_dim] + [cfg.head_mlp_hidden_dim] * cfg.head_num_mlp_layers + [out_dim]
        self.normalizer = normalizer
        self.mlp = MLP(sizes, rng)

    def construct(self, x: Tensor) -> Tensor:
        return self.mlp(x)


class EnergyHead(Head):
    def __init__(self, cfg: ModelConfig, rng: np.random.Generator, coefficients: np.ndarray):
        normalizer = ScalarNormalizer(reference_energies.RESIDUAL_MEAN_PER_ATOM,
                                      reference_energies.RESIDUAL_STD_PER_ATOM, 1000, (1,))
        super().__init__(cfg, 1, normalizer, rng)
        self.reference = LinearReferenceEnergy(coefficients)


def cross(a: Tensor, b: Tensor) -> Tensor:
    """Row-wise cross product of (n, 3) tensors."""
    a0, a1, a2 = a[:, 0], a[:, 1], a[:, 2]
    b0, b1, b2 = b[:, 0], b[:, 1], b[:, 2]
    return ops.stack((a1 * b2 - a2 * b1, a2 * b0 - a0 * b2, a0 * b1 - a1 * b0), 1)


def solve_symmetric_3x3(m: Tensor, b: Tensor) -> Tensor:
    """Solve m x = b for a batch of 3x3 matrices (B, 3, 3) by the adjugate; x = 0 where det = 0."""
    a, bb, c = m[:, 0, 0], m[:, 0, 1], m[:, 0, 2]
    d, e, f = m[:, 1, 0], m[:, 1, 1], m[:, 1, 2]
    g, h, i = m[:, 2, 0], m[:, 2, 1], m[:, 2, 2]
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
    tau = segment_sum(cross(r, forces), node_graph, num_graphs)
    s = segment_sum(ops.square(r).sum(1), node_graph, num_graphs)
    outer = (r.reshape(-1, 3, 1) * r.reshape(-1, 1, 3)).reshape(-1, 9)
    big_s = segment_sum(outer, node_graph, num_graphs).reshape(-1, 3, 3)
    eye = ops.eye(3, 3, forces.dtype).reshape(1, 3, 3)
    m = big_s - (s * (1.0 + 1e-7)).reshape(-1, 1, 1) * eye
    flag = nonperiodic.reshape(-1, 1, 1)
    m = m * flag - (1.0 - flag) * eye  # periodic graphs: a harmless -I, their correction is masked below
    mu = solve_symmetric_3x3(m, -tau) * nonperiodic.reshape(-1, 1)
    return forces + cross(r, ops.gather(mu, node_graph, 0))


class NodeHead(Head):
    def __init__(self, cfg: ModelConfig, rng: np.random.Generator):
        super().__init__(cfg, 3, ScalarNormalizer(), rng)

    def forces(self, nodes, positions, node_graph, n_node, nonperiodic):
        """Normalised forces: MLP output minus its per-graph mean, net torque removed if non-periodic."""
        pred = self.mlp(nodes)
        pred = pred - ops.gather(segment_mean(pred, node_graph, n_node), node_graph, 0)
        return remove_net_torque(pred, positions, node_graph, n_node, nonperiodic)


class GraphRegressor(nn.Cell):
    """orb-v2: backbone plus energy, forces and stress heads.

    ``construct`` returns the normalised head outputs (energy per atom residual (B, 1), forces
    (N, 3), stress (B, 6)); :meth:`physical` turns them into eV, eV/Å and eV/Å^3.
    """

    def __init__(self, cfg: Optional[ModelConfig] = None, seed: int = 0,
                 reference_coefficients: Optional[np.ndarray] = None):
        super().__init__()
        cfg = cfg or ModelConfig()
        self.cfg = cfg
        rng = np.random.default_rng(seed)
        coefficients = reference_energies.vasp_shifted() if reference_coefficients is None else reference_coefficients
        self.node_head = NodeHead(cfg, rng)
        self.graph_head = EnergyHead(cfg, rng, coefficients)
        self.stress_head = Head(cfg, 6, ScalarNormalizer(), rng)
        self.model = MoleculeGNS(cfg, rng)

    def construct(self, numbers, positions, vectors, senders, receivers, node_graph, n_node, nonperiodic):
        nodes = self.model(numbers, vectors, senders, receivers)
        pooled = segment_mean(nodes, node_graph, n_node)
        energy = self.graph_head(pooled)
        stress = self.stress_head(pooled)
        forces = self.node_head.forces(nodes, positions, node_graph, n_node, nonperiodic)
        return energy, forces, stress

    def reference_energy(self, numbers, node_graph, num_graphs):
        return self.graph_head.reference(numbers, node_graph, num_graphs)

    def physical(self, energy_raw, forces_raw, stress_raw, numbers, node_graph, n_node):
        """Energy (B,) eV, forces (N, 3) eV/Å and stress (B, 6) eV/Å^3 from normalised head outputs."""
        e_mean, e_var = self.graph_head.normalizer.stats()
        f_mean, f_var = self.node_head.normalizer.stats()
        s_mean, s_var = self.stress_head.normalizer.stats()
        per_atom = energy_raw.reshape(-1) * ops.sqrt(e_var) + e_mean
        energy = per_atom * n_node + self.reference_energy(numbers, node_graph, n_node.shape[0])
        forces = forces_raw * ops.sqrt(f_var) + f_mean
        stress = stress_raw * ops.sqrt(s_var) + s_mean
        return energy, forces, stress

    def backbone_parameters(self):
        return list(self.model.trainable_params())

    def decoder_parameters(self):
        return list(self.model._decoder.trainable_params())

    def num_parameters(self) -> int:
        """Trainable parameters as PyTorch counts them (decoder included; normaliser buffers excluded)."""
        return int(sum(np.prod(p.shape) for p in self.trainable_params()))


def orb_v2(seed: int = 0, **overrides) -> GraphRegressor:
    """orb-v2 with randomly initialised weights; ``overrides`` change :class:`ModelConfig` fields."""
    return GraphRegressor(ModelConfig.from_dict(overrides), seed=seed)
