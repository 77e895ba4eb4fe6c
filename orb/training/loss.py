"""orb-v2's fine-tuning loss and metrics (``GraphRegressor.loss`` of orb-models 0.4.2).

Loss = w_E * loss_energy + w_F * loss_forces + w_S * loss_stress, each an L1 error in normalised
units averaged over structures:

* energy: target t = (E - reference(Z)) / n_atoms, error |norm_E(t) - head| per structure;
* forces: |head - norm_F(F)| averaged over xyz, then over the atoms of a structure;
* stress: |head - norm_S(S)| averaged over the 6 Voigt components.

Each structure's error is multiplied by its loss weight (``graph_weight``: the structure's weight
over the number of structures in the global batch; 1 / that number unless rows or sources are
weighted). In training mode every normaliser first absorbs the batch targets (cumulative mean and unbiased
variance, BatchNorm with momentum None) and the updated statistics are used. Metrics are
returned as sums over structures (atoms for ``forces_cosine``) so that epoch averages and
data-parallel reductions are exact; :func:`orb.metrics.metrics_from_sums` turns them into averages
(metric names and units: :data:`orb.metrics.METRICS`).
"""

from typing import Dict, Optional

import mindspore as ms
import numpy as np
from mindspore import nn, ops

from orb.metrics import BY_ELEMENT, ELEMENT_BINS, FORCE_THRESHOLD, forces_by_element, metrics_from_sums
from orb.models.blocks import segment_sum
from orb.models.primitives import Broadcasts

SUM_KEYS = ("loss", "loss_energy", "loss_forces", "loss_stress", "energy_mae", "energy_per_atom_mae", "forces_mae",
            "forces_cosine", "forces_within_0.03", "stress_mae", "energy_per_atom_reference_mae", "num_graphs",
            "num_atoms")


class NormalisedLoss(nn.Cell):
    """The online normalisers of a model's targets, as a loss cell uses them.

    In training, orb-models updates each normaliser (cumulative mean and unbiased variance,
    BatchNorm with momentum None) from the batch's targets. Here the new statistics are computed
    first (:meth:`new_stats`, no side effect), the loss is evaluated with the statistics before and
    after the batch (``construct(*loss_inputs, *old, *new)``: the model's forward pass reads the
    old ones, as PyTorch's does), and :meth:`commit` stores the new ones after the gradient. In
    evaluation both are :meth:`current_stats`. Subclasses list their normalisers and what each
    absorbs (:meth:`absorbed`).
    """

    sum_keys = ()  # the metric sums construct returns, in order (then the per-element force sums)

    def __init__(self, normalizers, allreduce=None, replay_normalizers=()):
        super().__init__()
        self.normalizers = nn.CellList(list(normalizers) + list(replay_normalizers))
        self.replay_offset = len(normalizers) if replay_normalizers else 0  # where the replay heads' ones start
        self.allreduce = allreduce  # sum over data-parallel ranks, so the statistics are the global batch's
        self.broadcasts = Broadcasts()

    def absorbed(self, numbers, node_graph, n_node, graph_mask, energy, forces, stress, head):
        """[(values, mask, update?, replay rows)] per normaliser of the model's own heads: the targets a training
        batch feeds it, and a 0/1 tensor (broadcasting against ``mask``) of the rows the replay heads predict."""
        raise NotImplementedError

    @staticmethod
    def replay_rows(head, node_graph):
        """0/1 float of the structures (B,) and the atoms (N, 1) the replay heads predict."""
        graphs = (head == 1).astype(ms.float32)
        return graphs, ops.gather(graphs, node_graph, 0).reshape(-1, 1)

    def current_stats(self):
        stats = ()
        for normalizer in self.normalizers:
            stats = stats + tuple(t + 0.0 for t in normalizer.stats())  # values, not the parameters themselves
        return stats

    def new_stats(self, numbers, positions, vectors, senders, receivers, node_graph, n_node, nonperiodic, cell,
                  unit_shifts, charge, spin, head, graph_mask, graph_weight, energy, forces, stress):
        """(statistics after absorbing the batch's targets, their counts); nothing is stored yet. With replay heads
        each normaliser absorbs only the structures its heads predict."""
        entries = self.absorbed(numbers, node_graph, n_node, graph_mask, energy, forces, stress, head)
        if self.replay_offset:
            entries = ([(v, m * (1.0 - r), u, r) for v, m, u, r in entries]
                       + [(v, m * r, u, r) for v, m, u, r in entries])
        # every normaliser's batch sums in one vector: one sum over data-parallel ranks per step
        sums = ops.concat([normalizer.batch_sums(values, mask)
                           for normalizer, (values, mask, _, _) in zip(self.normalizers, entries)])
        if self.allreduce is not None:
            sums = self.allreduce(sums)
        stats, counts = (), ()
        for k, (normalizer, (_, _, update, _)) in enumerate(zip(self.normalizers, entries)):
            if update:
                mean, var, count = normalizer.updated_stats(sums[3 * k:3 * k + 3])
            else:  # e.g. no stress labels: the statistics stay
                mean, var = normalizer.stats()
                count = normalizer.bn.num_batches_tracked + 0
            stats, counts = stats + (mean, var), counts + (count,)
        return stats, counts

    def row_stats(self, stats, k, replay_rows, ndim: int = 1):
        """(mean, var) of the ``k``-th normaliser in ``stats``; with replay heads per row, the replay copy's where
        ``replay_rows`` (bool, shaped to broadcast against ``ndim``-dimensional values)."""
        mean, var = stats[2 * k], stats[2 * k + 1]
        if self.replay_offset:
            j = k + self.replay_offset
            mean, var = self.model.pick_stats(replay_rows, (stats[2 * j], stats[2 * j + 1]), (mean, var), ndim)
        return mean, var

    def commit(self, stats, counts):
        done = ()
        for i, normalizer in enumerate(self.normalizers):
            done = done + (normalizer.commit(stats[2 * i], stats[2 * i + 1], counts[i]),)
        return done

    @property
    def num_sums(self) -> int:
        """Length of the metric-sum vector: the named sums, then per atomic number the force error and atoms."""
        return len(self.sum_keys) + 2 * ELEMENT_BINS

    def metrics(self, sums, by_element: bool = False) -> Dict:
        """Averages (:data:`orb.metrics.METRICS`) from accumulated metric sums; ``by_element`` adds the force MAE
        of each element present (``forces_mae_by_element``)."""
        sums = np.asarray(sums, dtype=np.float64)
        n = len(self.sum_keys)
        out = metrics_from_sums(dict(zip(self.sum_keys, sums[:n])), self.has_stress)
        if by_element:
            out[BY_ELEMENT] = forces_by_element(sums[n:n + ELEMENT_BINS], sums[n + ELEMENT_BINS:])
        return out

    @staticmethod
    def force_metrics(force_pred, forces, node_graph, n_node, atoms):
        """Per structure: force MAE (eV/Å) and whether every component is within FORCE_THRESHOLD;
        per atom: cosine of predicted and true forces, and the error averaged over x, y, z.
        ``force_pred`` carries no gradient."""
        num_graphs = n_node.shape[0]
        force_abs = ops.abs(force_pred - forces)
        atom_error = force_abs.mean(1)
        forces_mae = segment_sum(atom_error, node_graph, num_graphs) / atoms
        norms = ops.norm(force_pred, dim=1) * ops.norm(forces, dim=1)
        cosine = (force_pred * forces).sum(1) / ops.maximum(norms, 1e-8)
        within = (ops.amax(force_abs, 1) < FORCE_THRESHOLD).astype(forces.dtype)
        all_within = (segment_sum(within, node_graph, num_graphs) == n_node).astype(forces.dtype)
        return forces_mae, cosine, all_within, atom_error

    @staticmethod
    def with_element_sums(sums, atom_error, numbers, node_mask):
        """The metric sums followed by, per atomic number, the summed per-atom force error and the atom count."""
        return ops.concat((sums, segment_sum(atom_error * node_mask, numbers, ELEMENT_BINS),
                           segment_sum(node_mask, numbers, ELEMENT_BINS)))

    def residual_per_atom(self, numbers, node_graph, n_node, energy, head):
        """(E - sum_i ref[Z_i]) / atoms: the per-atom energy the energy normaliser tracks."""
        reference = self.model.reference_energy(numbers, node_graph, n_node.shape[0], head)
        return (energy - reference) / ops.maximum(n_node, 1.0)

    @staticmethod
    def replay_normalizers(model, names):
        """The replay heads' copies of the normalisers at ``names`` (paths below the heads), or none."""
        if model.replay_heads is None:
            return []
        out = []
        for name in names:
            cell = model.replay_heads
            for part in name.split("."):
                cell = getattr(cell, part)
            out.append(cell)
        return out


class OrbLoss(NormalisedLoss):
    """Loss and metric sums of an orb-v2 :class:`~orb.models.orb_v2.GraphRegressor` on a (padded) batch.

    ``construct(*loss_inputs, *old, *new)`` takes the tensors of :func:`orb.data.tensors.loss_inputs`
    followed by the normalisers' statistics before and after the batch (mean and variance for energy,
    forces, stress); orb-models 0.4.2 uses the updated statistics throughout.
    """

    sum_keys = SUM_KEYS

    def __init__(self, model, energy_weight: float = 1.0, forces_weight: float = 1.0, stress_weight: float = 1.0,
                 has_stress: bool = True, allreduce=None):
        names = ("graph_head.normalizer", "node_head.normalizer", "stress_head.normalizer")
        super().__init__([model.graph_head.normalizer, model.node_head.normalizer, model.stress_head.normalizer],
                         allreduce, self.replay_normalizers(model, names))
        self.model = model
        self.has_stress = bool(has_stress)
        self.energy_weight = float(energy_weight)
        self.forces_weight = float(forces_weight)
        self.stress_weight = float(stress_weight) if has_stress else 0.0

    def absorbed(self, numbers, node_graph, n_node, graph_mask, energy, forces, stress, head):
        node_mask = ops.gather(graph_mask, node_graph, 0)
        graphs, nodes = self.replay_rows(head, node_graph)
        return [(self.residual_per_atom(numbers, node_graph, n_node, energy, head), graph_mask, True, graphs),
                (forces, self.broadcasts.column(node_mask.reshape(-1, 1), 3), True, nodes),
                (stress, self.broadcasts.column(graph_mask.reshape(-1, 1), 6), self.has_stress, graphs.reshape(-1, 1))]

    def construct(self, numbers, positions, vectors, senders, receivers, node_graph, n_node, nonperiodic, cell,
                  unit_shifts, charge, spin, head, graph_mask, graph_weight, energy, forces, stress, *stats):
        new = stats[len(stats) // 2:]  # orb-models 0.4.2 uses the updated statistics throughout
        replay, replay_nodes = head == 1, ops.gather(head, node_graph, 0) == 1
        e_mean, e_var = self.row_stats(new, 0, replay)
        f_mean, f_var = self.row_stats(new, 1, replay_nodes, 2)
        s_mean, s_var = self.row_stats(new, 2, replay, 2)
        num_graphs = n_node.shape[0]
        e_raw, f_raw, s_raw = self.model(numbers, positions, vectors, senders, receivers, node_graph, n_node,
                                         nonperiodic, cell, unit_shifts, charge, spin, head)
        e_raw = e_raw.reshape(-1)
        node_mask = ops.gather(graph_mask, node_graph, 0)
        atoms = ops.maximum(n_node, 1.0)

        reference = self.model.reference_energy(numbers, node_graph, num_graphs, head)
        target = (energy - reference) / atoms
        e_std = ops.sqrt(e_var)
        energy_err = ops.abs((target - e_mean) / e_std - e_raw)
        energy_pred = (e_raw * e_std + e_mean) * n_node + reference

        f_std = ops.sqrt(f_var)
        force_err = ops.abs(f_raw - (forces - f_mean) / f_std).mean(1)
        node_mae = segment_sum(force_err, node_graph, num_graphs) / atoms

        s_std = ops.sqrt(s_var)
        stress_err = ops.abs((stress - s_mean) / s_std - s_raw).mean(1)

        per_graph = self.energy_weight * energy_err + self.forces_weight * node_mae
        if self.has_stress:
            per_graph = per_graph + self.stress_weight * stress_err
        loss = (per_graph * graph_weight).sum()

        # Metrics, in physical units where not loss_*; no gradient flows through them.
        force_pred = ops.stop_gradient(f_raw * f_std + f_mean)
        forces_mae, cosine, all_within, atom_error = self.force_metrics(force_pred, forces, node_graph, n_node, atoms)
        stress_mae = ops.abs(ops.stop_gradient(s_raw * s_std + s_mean) - stress).mean(1)  # unreported without stress
        energy_abs = ops.abs(ops.stop_gradient(energy_pred) - energy)
        m = graph_mask
        sums = ops.stack((
            (per_graph * m).sum(),
            (energy_err * m).sum(),
            (node_mae * m).sum(),
            (stress_err * m).sum(),
            (energy_abs * m).sum(),
            (energy_abs / atoms * m).sum(),
            (forces_mae * m).sum(),
            (cosine * node_mask).sum(),
            (all_within * m).sum(),
            (stress_mae * m).sum(),
            (ops.abs(target) * m).sum(),
            m.sum(),
            node_mask.sum(),
        ))
        return loss, ops.stop_gradient(self.with_element_sums(sums, atom_error, numbers, node_mask))


def compute_loss(model, batch, training: bool = False, loss_cell: Optional[OrbLoss] = None) -> Dict[str, float]:
    """Loss and metrics of ``model`` on an :class:`~orb.data.graphs.AtomGraphs` batch (PyTorch ``model.loss``).

    ``training=True`` updates the normalisers first, as orb-models does in ``model.train()``.
    """
    from orb.data.tensors import loss_inputs

    cell = loss_cell or OrbLoss(model, has_stress=batch.stress is not None)
    inputs = loss_inputs(batch)
    old = cell.current_stats()
    new, counts = cell.new_stats(*inputs) if training else (old, None)
    loss, sums = cell(*inputs, *old, *new)
    if training:
        cell.commit(new, counts)
    metrics = cell.metrics(sums.asnumpy())
    metrics["loss_value"] = float(loss.asnumpy())
    return metrics
