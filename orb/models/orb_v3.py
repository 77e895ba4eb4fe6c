"""orb-v3 in MindSpore: the shared graph network (``orb.models.gns``) with Bessel x spherical-harmonic edge
features, ZBL pair repulsion, and either direct heads or forces and stress as derivatives of the energy.

Formulas follow orb-models 0.5.5 (``gns.py``, ``forcefield_heads.py``, ``conservative_regressor.py``,
``direct_regressor.py``, ``pair_repulsion.py``, ``nn_util.py``); parameter paths equal the PyTorch
state_dict keys, registered in the same order. Deliberate differences, both for structures that
are not periodic (cell = 0): the ZBL stress of direct models is 0 (PyTorch divides by det = 0 and
returns NaN or inf), and the stress of conservative models is 0 with finite gradients (PyTorch
returns 0 but its backward gives NaN), so a training batch may mix molecules and crystals.

Conservative models rebuild the edge vectors inside the differentiated function from positions,
cell and integer cell shifts, after a zero strain ``eps`` and a zero rotation generator ``G``:
forces = -dE/dpositions, stress = (dE/deps) / |det cell|, rotational gradient = dE/dG. The
rotation is ``I + G - G^T``: at G = 0 it has the value and first derivative of orb-models'
``matrix_exp(G - G^T)``, which is all any of these quantities (and their gradients) use.
"""

import math
from typing import Optional

import numpy as np
from mindspore import Parameter, Tensor, nn, ops

from orb.models import reference_energies
from orb.models.blocks import MLP, segment_mean, segment_sum
from orb.models.primitives import MATMUL, Broadcasts
from orb.models.sums import gather_per_segment, segment_total
from orb.models.repulsion import PairRepulsion, per_volume, voigt
from orb.models.config import ModelConfig
from orb.models.gns import (AtomEmbedding, AttentionInteraction, Decoder, Encoder, LinearReferenceEnergy, OrbModel,
                            ScalarNormalizer, count_parameters, polynomial_envelope, remove_net_torque, style)
from orb.precision import numpy_dtype, traced_for_every_size

SH_COMPONENTS = 16  # real spherical harmonics up to l = 3
CONFIDENCE_BINS = 50
CONFIDENCE_MAX_ERROR = 0.3  # eV/Å


def _buffer(value, name: str) -> Parameter:
    """A non-trainable tensor that is part of the state dict (a PyTorch buffer)."""
    return Parameter(Tensor(np.asarray(value)), name=name, requires_grad=False)


class BesselBasis(nn.Cell):
    """sqrt(2 / r_max) sin(n pi r / r_max) / r, n = 1..num (buffers as PyTorch's ``rbf_transform``)."""

    def __init__(self, r_max: float, num: int):
        super().__init__()
        self.bessel_weights = _buffer(np.float32(np.pi / r_max) * np.arange(1, num + 1, dtype=np.float32),
                                      "bessel_weights")
        self.r_max = _buffer(np.float32(r_max), "r_max")
        self.prefactor = _buffer(np.float32(math.sqrt(2.0 / r_max)), "prefactor")
        self.broadcasts = Broadcasts()

    def construct(self, r: Tensor) -> Tensor:
        x = self.broadcasts.column(r.reshape(-1, 1), self.bessel_weights.shape[0])
        return self.prefactor * (ops.sin(self.broadcasts.row(self.bessel_weights, r.shape[0]) * x) / x)


def spherical_harmonics(vectors: Tensor, r: Tensor, broadcasts: Broadcasts) -> Tensor:
    """Real spherical harmonics l <= 3 of the edge directions (e3nn's formulas, component normalisation,
    components in the given x, y, z order): (E, 16)."""
    u = vectors / broadcasts.column(ops.maximum(r, 1e-12).reshape(-1, 1), 3)
    x, y, z = ops.split(u, 1, axis=1)  # (E, 1) columns (indexing u[:, i] breaks MindSpore's second derivative)
    s3 = math.sqrt(3.0)
    y2, x2z2 = y * y, x * x + z * z
    s20, s24 = s3 * x * z, s3 / 2.0 * (z * z - x * x)
    w1, w2, w3 = math.sqrt(3.0), math.sqrt(5.0), math.sqrt(7.0)  # each degree's weight, written out: no loops
    return ops.concat((
        ops.ones_like(x),
        x * w1, y * w1, z * w1,
        s20 * w2, s3 * x * y * w2, (y2 - 0.5 * x2z2) * w2, s3 * y * z * w2, s24 * w2,
        math.sqrt(5.0 / 6.0) * (s20 * z + s24 * x) * w3, math.sqrt(5.0) * s20 * y * w3,
        math.sqrt(3.0 / 8.0) * (4.0 * y2 - x2z2) * x * w3, 0.5 * y * (2.0 * y2 - 3.0 * x2z2) * w3,
        math.sqrt(3.0 / 8.0) * z * (4.0 * y2 - x2z2) * w3, math.sqrt(5.0) * s24 * y * w3,
        math.sqrt(5.0 / 6.0) * (s24 * z - s20 * x) * w3), 1)


class ChargeSpinEmbedding(nn.Cell):
    """[sin(2 pi v W), cos(2 pi v W)] of a total charge or spin (a spin of 0 embeds to 0)."""

    def __init__(self, dim: int, rng: np.random.Generator, spin: bool):
        super().__init__()
        self.W = Parameter(Tensor(rng.standard_normal(dim // 4).astype(np.float32)), name="W")
        self.spin = spin
        self.broadcasts = Broadcasts()

    def construct(self, values: Tensor) -> Tensor:
        proj = (self.broadcasts.column(values.reshape(-1, 1), self.W.shape[0])
                * self.broadcasts.row(self.W, values.shape[0]) * 2.0 * math.pi)
        emb = ops.concat((ops.sin(proj), ops.cos(proj)), 1)
        if self.spin:
            emb = emb * self.broadcasts.column((values != 0).astype(emb.dtype).reshape(-1, 1), emb.shape[1])
        return emb


class ChargeSpinConditioner(nn.Cell):
    def __init__(self, dim: int, rng: np.random.Generator):
        super().__init__()
        self.charge_embedding = ChargeSpinEmbedding(dim, rng, spin=False)
        self.spin_embedding = ChargeSpinEmbedding(dim, rng, spin=True)

    def construct(self, charge: Tensor, spin: Tensor) -> Tensor:
        return ops.concat((self.charge_embedding(charge), self.spin_embedding(spin)), 1)


class MoleculeGNS(nn.Cell):
    """orb-v3 backbone: (charge/spin conditioned) attention GNS over Bessel x spherical-harmonic edge features."""

    def __init__(self, cfg: ModelConfig, rng: np.random.Generator):
        super().__init__()
        self.cfg = cfg
        self.rbf_transform = BesselBasis(cfg.rbf_radius, cfg.num_rbf)
        self.atom_emb = AtomEmbedding(cfg.num_elements, cfg.latent_dim, rng)
        if cfg.omol:
            self.conditioner = ChargeSpinConditioner(cfg.latent_dim, rng)
        self._encoder = Encoder(cfg, rng, edge_features=cfg.num_rbf * SH_COMPONENTS)
        self.gnn_stacks = nn.CellList([AttentionInteraction(cfg, rng, conditioned=cfg.omol)
                                       for _ in range(cfg.num_message_passing_steps)])
        self._decoder = Decoder(cfg, rng)
        self.broadcasts = Broadcasts()
        if self.broadcasts.cpu:  # 0/1 matrices: rbf @ each_rbf repeats every rbf 16 times, sh @ every_sh the 16 sh
            real = numpy_dtype()
            self.each_rbf = Tensor(np.kron(np.eye(cfg.num_rbf), np.ones((1, SH_COMPONENTS))).astype(real))
            self.every_sh = Tensor(np.kron(np.ones((1, cfg.num_rbf)), np.eye(SH_COMPONENTS)).astype(real))

    @property
    def encoder(self) -> Encoder:
        """The encoder (``_encoder``: orb-models' parameter path, kept for its state dict)."""
        return self._encoder

    def edge_features(self, vectors: Tensor):
        """(E, num_rbf * 16) features: envelope(r) * Bessel_n(r) * Y_m(direction); also the envelope."""
        r = ops.norm(vectors, dim=1)
        envelope = polynomial_envelope(r, self.cfg.cutoff_rmax, self.cfg.polynomial_order).reshape(-1, 1)
        rbf, sh = self.rbf_transform(r), spherical_harmonics(vectors, r, self.broadcasts)
        num_rbf = rbf.shape[1]
        if self.broadcasts.cpu:  # each factor repeated by a product with 0/1 (exact copies; its gradient a product:
            # Tile's, a ReduceSum over 6 axes, took 3 % of a batched conservative call's kernel time)
            outer = MATMUL(rbf, self.each_rbf) * MATMUL(sh, self.every_sh)
        else:
            outer = rbf.reshape(-1, num_rbf, 1) * sh.reshape(-1, 1, SH_COMPONENTS)
        features = outer.reshape(r.shape[0], -1) * self.broadcasts.column(envelope, num_rbf * SH_COMPONENTS)
        return features, envelope

    def construct(self, numbers, vectors, senders, receivers, node_graph, charge, spin):
        features, cutoff = self.edge_features(vectors)
        nodes, edges = self._encoder(self.atom_emb(numbers), features)
        cond = ops.gather(self.conditioner(charge, spin), node_graph, 0) if self.cfg.omol else None
        for layer in self.gnn_stacks:
            nodes, edges = layer(nodes, edges, senders, receivers, cutoff, cond)
        return nodes


class HeadMLP(nn.Cell):
    """The MLP of a head: latent -> hidden (x layers) -> out, with the family's activation."""

    @staticmethod
    def make(cfg: ModelConfig, out_dim: int, rng: np.random.Generator) -> MLP:
        sizes = [cfg.latent_dim] + [cfg.head_mlp_hidden_dim] * cfg.head_num_mlp_layers + [out_dim]
        return MLP(sizes, rng, style(cfg)[0])


class EnergyHead(nn.Cell):
    """Per-atom-average energy: MLP of the mean node latent, normalised per atom, plus reference energies."""

    def __init__(self, cfg: ModelConfig, rng: np.random.Generator):
        super().__init__()
        self.normalizer = ScalarNormalizer(reference_energies.RESIDUAL_MEAN_PER_ATOM,
                                           reference_energies.RESIDUAL_STD_PER_ATOM, 1000, (1,))
        self.mlp = HeadMLP.make(cfg, 1, rng)
        self.reference = LinearReferenceEnergy(reference_energies.vasp_shifted())

    def construct(self, nodes, node_graph, n_node):
        return self.mlp(segment_mean(nodes, node_graph, n_node)).reshape(-1)


class ForceHead(nn.Cell):
    def __init__(self, cfg: ModelConfig, rng: np.random.Generator):
        super().__init__()
        self.normalizer = ScalarNormalizer()
        self.mlp = HeadMLP.make(cfg, 3, rng)

    def construct(self, nodes, positions, node_graph, n_node, nonperiodic):
        """Normalised forces: MLP output minus its per-graph mean, net torque removed where the cell is 0."""
        pred = self.mlp(nodes)
        pred = pred - ops.gather(segment_mean(pred, node_graph, n_node), node_graph, 0)
        return remove_net_torque(pred, positions, node_graph, n_node, nonperiodic)


class StressHead(nn.Cell):
    """Stress from the mean node latent; diagonal and off-diagonal parts have their own normalisers."""

    def __init__(self, cfg: ModelConfig, rng: np.random.Generator):
        super().__init__()
        self.diag_normalizer = ScalarNormalizer()
        self.offdiag_normalizer = ScalarNormalizer()
        self.mlp = HeadMLP.make(cfg, 6, rng)

    def construct(self, nodes, node_graph, n_node):
        return self.mlp(segment_mean(nodes, node_graph, n_node))

    def stats(self):
        """Per-component mean and std, (6,) each."""
        d_mean, d_var = self.diag_normalizer.stats()
        o_mean, o_var = self.offdiag_normalizer.stats()
        return six_components(d_mean, o_mean), six_components(ops.sqrt(d_var), ops.sqrt(o_var))


def six_components(diagonal, off_diagonal):
    """(..., 6) Voigt components from the diagonal's and the off-diagonal's value ((1,) or (rows, 1) each)."""
    reps = (1,) * (diagonal.ndim - 1) + (3,)
    return ops.concat((ops.tile(diagonal, reps), ops.tile(off_diagonal, reps)), -1)


class ConfidenceHead(nn.Cell):
    """Logits of 50 bins of the per-atom force error (0 to 0.3 eV/Å), from detached node latents."""

    def __init__(self, cfg: ModelConfig, rng: np.random.Generator):
        super().__init__()
        self.bin_edges = _buffer(np.linspace(0.0, CONFIDENCE_MAX_ERROR, CONFIDENCE_BINS + 1).astype(np.float32),
                                 "bin_edges")
        self.mlp = HeadMLP.make(cfg, CONFIDENCE_BINS, rng)

    def construct(self, nodes):
        return self.mlp(ops.stop_gradient(nodes))


class Heads(nn.Cell):
    """PyTorch's ``heads`` ModuleDict, in its order."""

    def __init__(self, cfg: ModelConfig, rng: np.random.Generator):
        super().__init__()
        self.energy = EnergyHead(cfg, rng)
        if not cfg.conservative:
            self.forces = ForceHead(cfg, rng)
        self.confidence = ConfidenceHead(cfg, rng)
        if not cfg.conservative and cfg.has_stress:
            self.stress = StressHead(cfg, rng)


class Orbv3(OrbModel):
    """Common parts of the two regressors; see :class:`DirectRegressor` and :class:`ConservativeRegressor`."""

    def energy_head(self, nodes, numbers, node_graph, n_node, energy_head):
        """``energy_head``'s output (normalised per-atom energy) and E_raw without pair repulsion."""
        raw = energy_head(nodes, node_graph, n_node)
        mean, var = energy_head.normalizer.stats()
        energy = (raw * ops.sqrt(var) + mean) * n_node + energy_head.reference(numbers, node_graph, n_node.shape[0])
        return raw, energy

    def energy_from_nodes(self, nodes, numbers, node_graph, n_node, head):
        """Energy head output (normalised per-atom energy) and E_raw without pair repulsion, of each structure's
        heads."""
        raw, energy = self.energy_head(nodes, numbers, node_graph, n_node, self.heads.energy)
        if self.replay_heads is not None:
            replay = head == 1
            r_raw, r_energy = self.energy_head(nodes, numbers, node_graph, n_node, self.replay_heads.energy)
            raw, energy = self.by_head(replay, r_raw, raw), self.by_head(replay, r_energy, energy)
        return raw, energy

    def reference_energy(self, numbers, node_graph, num_graphs, head):
        reference = self.heads.energy.reference(numbers, node_graph, num_graphs)
        if self.replay_heads is not None:
            reference = self.by_head(head == 1, self.replay_heads.energy.reference(numbers, node_graph, num_graphs),
                                     reference)
        return reference

    def energy_stats(self, head):
        """The energy normaliser's (mean, var), per structure of the replay heads' where they predict it."""
        stats = self.heads.energy.normalizer.stats()
        if self.replay_heads is not None:
            stats = self.pick_stats(head == 1, self.replay_heads.energy.normalizer.stats(), stats)
        return stats

    def descriptors(self, numbers, positions, vectors, senders, receivers, node_graph, n_node, nonperiodic, cell,
                    unit_shifts, charge, spin, head):
        """Per structure, the mean of the backbone's node latents (B, latent_dim): how the model sees it
        (replay structures are chosen to be far apart in this space)."""
        return segment_mean(self.model(numbers, vectors, senders, receivers, node_graph, charge, spin), node_graph,
                            n_node)

    def normalise_energy(self, energy, numbers, node_graph, n_node, head, mean, var):
        """(E - reference) / atoms, normalised by (mean, var)."""
        per_atom = ((energy - self.reference_energy(numbers, node_graph, n_node.shape[0], head))
                    / ops.maximum(n_node, 1.0))
        return (per_atom - mean) / ops.sqrt(var)

    def denormalise_energy(self, normalised, numbers, node_graph, n_node, head, mean, var):
        return ((normalised * ops.sqrt(var) + mean) * n_node
                + self.reference_energy(numbers, node_graph, n_node.shape[0], head))

    def backbone_parameters(self):
        return list(self.model.trainable_params())

    def never_trained(self):
        """Parameters no output depends on: the decoder and, in direct models, the force heads' last bias
        (cancelled by the per-structure mean removal)."""
        forces = []
        if not self.cfg.conservative:
            forces = [self.heads.forces.mlp.layer(-1).bias]
            if self.replay_heads is not None:
                forces.append(self.replay_heads.forces.mlp.layer(-1).bias)
        return list(self.model._decoder.get_parameters()) + forces

    def reference_energy_weight(self):
        return self.heads.energy.reference.linear.weight

    def reference_energy_weights(self) -> list:
        """The reference-energy tables of every head (trained or frozen together)."""
        replay = [self.replay_heads.energy.reference.linear.weight] if self.replay_heads is not None else []
        return [self.reference_energy_weight()] + replay

    def num_parameters(self) -> int:
        """Parameters as PyTorch counts them (decoder and reference energies included; buffers excluded)."""
        return count_parameters(self)


class DirectRegressor(Orbv3):
    """orb-v3 direct models: energy, forces (and stress) heads, each plus the ZBL repulsion's analytic part."""

    def __init__(self, cfg: Optional[ModelConfig] = None, seed: int = 0):
        super().__init__()
        cfg = cfg or ModelConfig.from_dict({"name": "orb_v3_direct_20_omat"})
        self.cfg = cfg
        rng = np.random.default_rng(seed)
        self.heads = Heads(cfg, rng)
        self.model = MoleculeGNS(cfg, rng)
        self.pair_repulsion = PairRepulsion()
        self.pair_grad = ops.GradOperation()

    def pair_energy_sum(self, vectors, numbers, senders, receivers):
        return self.pair_repulsion(numbers, vectors, senders, receivers).sum()

    def pair_terms(self, numbers, vectors, senders, receivers, node_graph, cell, num_nodes):
        """ZBL energy (sum over edges, per graph), forces and stress (analytic: from d energy / d vectors)."""
        edge_energy = self.pair_repulsion(numbers, vectors, senders, receivers)
        dv = self.pair_grad(self.pair_energy_sum)(vectors, numbers, senders, receivers)
        num_graphs = cell.shape[0]
        energy = segment_total(segment_sum(edge_energy, senders, num_nodes), node_graph, num_graphs)
        forces = segment_sum(dv, senders, num_nodes) - segment_sum(dv, receivers, num_nodes)
        edge_graph = ops.gather(node_graph, senders, 0)
        outer = (vectors.reshape(-1, 3, 1) * dv.reshape(-1, 1, 3)).reshape(-1, 9)
        virial = segment_total(outer, edge_graph, num_graphs).reshape(-1, 3, 3)
        return energy, forces, voigt(per_volume(virial, cell, signed=True))

    def head_cells(self) -> dict:
        cells = {"energy": self.heads.energy, "forces": self.heads.forces}
        return dict(cells, stress=self.heads.stress) if self.cfg.has_stress else cells

    def new_head_cells(self, rng: np.random.Generator) -> dict:
        cells = {"energy": EnergyHead(self.cfg, rng), "forces": ForceHead(self.cfg, rng)}
        return dict(cells, stress=StressHead(self.cfg, rng)) if self.cfg.has_stress else cells

    def construct(self, numbers, positions, vectors, senders, receivers, node_graph, n_node, nonperiodic, cell,
                  unit_shifts, charge, spin, head):
        """Raw head outputs and the pair terms: (energy head, E_raw without ZBL, forces head, stress head,
        confidence logits, ZBL energy, ZBL forces, ZBL stress)."""
        nodes = self.model(numbers, vectors, senders, receivers, node_graph, charge, spin)
        head_energy, energy = self.energy_from_nodes(nodes, numbers, node_graph, n_node, head)
        forces = self.heads.forces(nodes, positions, node_graph, n_node, nonperiodic)
        stress = self.heads.stress(nodes, node_graph, n_node) if self.cfg.has_stress else ops.zeros(
            (n_node.shape[0], 6), nodes.dtype)
        if self.replay_heads is not None:
            replay = self.replay_heads
            forces = self.by_head(ops.gather(head, node_graph, 0) == 1,
                                  replay.forces(nodes, positions, node_graph, n_node, nonperiodic), forces)
            if self.cfg.has_stress:
                stress = self.by_head(head == 1, replay.stress(nodes, node_graph, n_node), stress)
        pair = self.pair_terms(numbers, vectors, senders, receivers, node_graph, cell, nodes.shape[0])
        return (head_energy, energy, forces, stress, self.heads.confidence(nodes)) + pair

    def force_stats(self, head, node_graph):
        """The force normaliser's (mean, var), per atom of the replay heads' where they predict it."""
        stats = self.heads.forces.normalizer.stats()
        if self.replay_heads is not None:
            stats = self.pick_stats(ops.gather(head, node_graph, 0) == 1, self.replay_heads.forces.normalizer.stats(),
                                    stats, 2)
        return stats

    def stress_stats(self, head):
        """(diagonal mean, var, off-diagonal mean, var), per structure of the replay heads' where they predict it."""
        heads = self.heads.stress
        stats = heads.diag_normalizer.stats() + heads.offdiag_normalizer.stats()
        if self.replay_heads is not None:
            replay = self.replay_heads.stress
            stats = self.pick_stats(head == 1, replay.diag_normalizer.stats() + replay.offdiag_normalizer.stats(),
                                    stats, 2)
        return stats

    def predictions(self, numbers, positions, vectors, senders, receivers, node_graph, n_node, nonperiodic, cell,
                    unit_shifts, charge, spin, head):
        """Energy (B,) eV, forces (N, 3) eV/Å, stress (B, 6) eV/Å^3 and confidence (N, 50) probabilities."""
        _, energy, forces, stress, logits, pair_e, pair_f, pair_s = self.construct(
            numbers, positions, vectors, senders, receivers, node_graph, n_node, nonperiodic, cell, unit_shifts,
            charge, spin, head)
        f_mean, f_var = self.force_stats(head, node_graph)
        forces = forces * ops.sqrt(f_var) + f_mean + pair_f
        if self.cfg.has_stress:
            d_mean, d_var, o_mean, o_var = self.stress_stats(head)
            stress = stress * six_components(ops.sqrt(d_var), ops.sqrt(o_var)) + six_components(d_mean, o_mean) + pair_s
        return energy + pair_e, forces, stress, ops.softmax(logits, -1)


class ConservativeRegressor(Orbv3):
    """orb-v3 conservative models: energy head (plus ZBL, averaged over atoms); forces, stress and rotational
    gradient by automatic differentiation of the energy."""

    def __init__(self, cfg: Optional[ModelConfig] = None, seed: int = 0):
        super().__init__()
        cfg = cfg or ModelConfig.from_dict({"name": "orb_v3_conservative_20_omat"})
        self.cfg = cfg
        rng = np.random.default_rng(seed)
        self.model = MoleculeGNS(cfg, rng)
        self.heads = Heads(cfg, rng)
        self.grad_forces_normalizer = ScalarNormalizer()
        self.grad_stress_normalizer = ScalarNormalizer()
        self.pair_repulsion = PairRepulsion()

    def strained_vectors(self, positions, displacement, generator, cell, unit_shifts, senders, receivers, node_graph):
        """Edge vectors from positions and cell after strain (eps + eps^T)/2 and rotation I + G - G^T."""
        eps = (displacement + displacement.transpose(0, 2, 1)) / 2.0
        rotation = ops.eye(3, 3, positions.dtype).reshape(1, 3, 3) + generator - generator.transpose(0, 2, 1)
        transform = ops.matmul(ops.eye(3, 3, positions.dtype).reshape(1, 3, 3) + eps, rotation)
        moved = ops.matmul(positions.reshape(-1, 1, 3), gather_per_segment(transform, node_graph)).reshape(-1, 3)
        moved_cell = ops.matmul(cell, transform)
        edge_graph = ops.gather(node_graph, senders, 0)
        shifts = ops.matmul(unit_shifts.reshape(-1, 1, 3), gather_per_segment(moved_cell, edge_graph)).reshape(-1, 3)
        return ops.gather(moved, receivers, 0) - ops.gather(moved, senders, 0) + shifts

    def head_cells(self) -> dict:
        return {"energy": self.heads.energy, "grad_forces_normalizer": self.grad_forces_normalizer,
                "grad_stress_normalizer": self.grad_stress_normalizer}

    def new_head_cells(self, rng: np.random.Generator) -> dict:
        return {"energy": EnergyHead(self.cfg, rng), "grad_forces_normalizer": ScalarNormalizer(),
                "grad_stress_normalizer": ScalarNormalizer()}

    def energies(self, positions, displacement, generator, numbers, senders, receivers, node_graph, n_node, cell,
                 unit_shifts, charge, spin, head):
        """(head output (B,), E_raw (B,) with ZBL, ZBL energy (B,), confidence logits) of the strained structure."""
        vectors = self.strained_vectors(positions, displacement, generator, cell, unit_shifts, senders, receivers,
                                        node_graph)
        nodes = self.model(numbers, vectors, senders, receivers, node_graph, charge, spin)
        head_energy, energy = self.energy_from_nodes(nodes, numbers, node_graph, n_node, head)
        node_pair = segment_sum(self.pair_repulsion(numbers, vectors, senders, receivers), senders, nodes.shape[0])
        pair = segment_mean(node_pair, node_graph, n_node)
        return head_energy, energy + pair, pair, self.heads.confidence(nodes)

    def summed_energy(self, positions, displacement, generator, numbers, senders, receivers, node_graph, n_node, cell,
                      unit_shifts, charge, spin, head):
        """(the sum of E_raw over the structures, (the outputs of :meth:`energies`))."""
        head_energy, energy, pair, logits = self.energies(positions, displacement, generator, numbers, senders,
                                                          receivers, node_graph, n_node, cell, unit_shifts, charge,
                                                          spin, head)
        return energy.sum(), (head_energy, energy, pair, logits)

    def construct(self, numbers, positions, vectors, senders, receivers, node_graph, n_node, nonperiodic, cell,
                  unit_shifts, charge, spin, head):
        """(energy head output, E_raw incl. ZBL, forces, stress, confidence logits, ZBL energy, rotational gradient).

        One forward pass and one backward pass from E_raw (``ops.vjp``, as torch.autograd.grad): every output
        stays differentiable with respect to the parameters, so training goes through the forces. In a prediction
        graph for every size, the gradient of the summed E_raw instead (the same numbers: MindSpore 2.10 refuses a
        ``vjp`` cotangent of unknown length)."""
        # two distinct zero tensors: MindSpore merges identical constants, and a gradient with respect to
        # two positions holding one node would come back as one
        displacement = cell * 0.0
        generator = ops.zeros_like(cell)

        if traced_for_every_size():
            (_, (head_energy, energy, pair, logits)), grads = ops.value_and_grad(
                self.summed_energy, grad_position=(0, 1, 2), has_aux=True)(
                positions, displacement, generator, numbers, senders, receivers, node_graph, n_node, cell,
                unit_shifts, charge, spin, head)
        else:
            (head_energy, energy, pair, logits), vjp = ops.vjp(self.energies, positions, displacement, generator,
                                                               numbers, senders, receivers, node_graph, n_node, cell,
                                                               unit_shifts, charge, spin, head)
            grads = vjp((ops.zeros_like(head_energy), ops.ones_like(energy), ops.zeros_like(pair),
                         ops.zeros_like(logits)))
        forces, virial, rotational = -grads[0], grads[1], grads[2]
        stress = voigt(per_volume(virial, cell, signed=False))
        return head_energy, energy, forces, stress, logits, pair, rotational

    def predictions(self, numbers, positions, vectors, senders, receivers, node_graph, n_node, nonperiodic, cell,
                    unit_shifts, charge, spin, head):
        """Energy (B,) eV, forces (N, 3) eV/Å, stress (B, 6) eV/Å^3 and confidence (N, 50) probabilities.

        The energy goes through orb-models' normalise/denormalise round trip (float32 rounding, ~1e-5
        relative), as its ``predict`` does."""
        _, energy, forces, stress, logits, _, _ = self.construct(
            numbers, positions, vectors, senders, receivers, node_graph, n_node, nonperiodic, cell, unit_shifts,
            charge, spin, head)
        mean, var = self.energy_stats(head)
        normalised = self.normalise_energy(energy, numbers, node_graph, n_node, head, mean, var)
        energy = self.denormalise_energy(normalised, numbers, node_graph, n_node, head, mean, var)
        return energy, forces, stress, ops.softmax(logits, -1)
