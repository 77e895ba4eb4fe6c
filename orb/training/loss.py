"""orb-v2's fine-tuning loss and metrics (``GraphRegressor.loss`` of orb-models 0.4.2).

Loss = w_E * loss_energy + w_F * loss_forces + w_S * loss_stress, each an L1 error in normalised
units averaged over structures:

* energy: target t = (E - reference(Z)) / n_atoms, error |norm_E(t) - head| per structure;
* forces: |head - norm_F(F)| averaged over xyz, then over the atoms of a structure;
* stress: |head - norm_S(S)| averaged over the 6 Voigt components.

In training mode every normaliser first absorbs the batch targets (cumulative mean and unbiased
variance, BatchNorm with momentum None) and the updated statistics are used. Metrics are
returned as sums over structures (atoms for ``forces_cosine``) so that epoch averages and
data-parallel reductions are exact; :func:`orb.metrics.metrics_from_sums` turns them into averages
(metric names and units: :data:`orb.metrics.METRICS`).
"""

from typing import Dict, Optional

import numpy as np
from mindspore import nn, ops

from orb.metrics import FORCE_THRESHOLD, metrics_from_sums
from orb.models.blocks import segment_sum

SUM_KEYS = ("loss", "loss_energy", "loss_forces", "loss_stress", "energy_mae", "energy_per_atom_mae", "forces_mae",
            "forces_cosine", "forces_within_0.03", "stress_mae", "energy_per_atom_reference_mae", "num_graphs",
            "num_atoms")


class OrbLoss(nn.Cell):
    """Loss and metric sums of a :class:`~orb.models.orb_v2.GraphRegressor` on a (padded) batch.

    ``construct(*loss_inputs, *stats)`` takes the tensors of :func:`orb.data.tensors.loss_inputs`
    followed by the six normaliser statistics (mean and variance for energy, forces, stress):
    :meth:`current_stats` in evaluation, :meth:`update_stats` in training.
    """

    def __init__(self, model, energy_weight: float = 1.0, forces_weight: float = 1.0, stress_weight: float = 1.0,
                 has_stress: bool = True, allreduce=None):
        super().__init__()
        self.model = model
        self.has_stress = bool(has_stress)
        self.energy_weight = float(energy_weight)
        self.forces_weight = float(forces_weight)
        self.stress_weight = float(stress_weight) if has_stress else 0.0
        self.allreduce = allreduce

    def current_stats(self):
        e = self.model.graph_head.normalizer.stats()
        f = self.model.node_head.normalizer.stats()
        s = self.model.stress_head.normalizer.stats()
        return e[0], e[1], f[0], f[1], s[0], s[1]

    def energy_target(self, numbers, node_graph, n_node, energy):
        """Per-atom energy residual after the reference energies, (E - sum_i ref[Z_i]) / n."""
        reference = self.model.reference_energy(numbers, node_graph, n_node.shape[0])
        return (energy - reference) / ops.maximum(n_node, 1.0), reference

    def update_stats(self, numbers, positions, vectors, senders, receivers, node_graph, n_node, nonperiodic, cell,
                     unit_shifts, charge, spin, graph_mask, graph_weight, energy, forces, stress):
        """Absorb a training batch's targets into the normalisers; returns the new statistics."""
        node_mask = ops.gather(graph_mask, node_graph, 0)
        target, _ = self.energy_target(numbers, node_graph, n_node, energy)
        e_norm = self.model.graph_head.normalizer
        f_norm = self.model.node_head.normalizer
        s_norm = self.model.stress_head.normalizer
        e_mean, e_var, e_count = e_norm.updated_stats(target, graph_mask, self.allreduce)
        f_mean, f_var, f_count = f_norm.updated_stats(forces, node_mask.reshape(-1, 1), self.allreduce)
        e_norm.commit(e_mean, e_var, e_count)
        f_norm.commit(f_mean, f_var, f_count)
        if self.has_stress:
            s_mean, s_var, s_count = s_norm.updated_stats(stress, graph_mask.reshape(-1, 1), self.allreduce)
            s_norm.commit(s_mean, s_var, s_count)
        else:
            s_mean, s_var = s_norm.stats()
        return e_mean, e_var, f_mean, f_var, s_mean, s_var

    def construct(self, numbers, positions, vectors, senders, receivers, node_graph, n_node, nonperiodic, cell,
                  unit_shifts, charge, spin, graph_mask, graph_weight, energy, forces, stress, e_mean, e_var, f_mean,
                  f_var, s_mean, s_var):
        num_graphs = n_node.shape[0]
        e_raw, f_raw, s_raw = self.model(numbers, positions, vectors, senders, receivers, node_graph, n_node,
                                         nonperiodic, cell, unit_shifts, charge, spin)
        e_raw = e_raw.reshape(-1)
        node_mask = ops.gather(graph_mask, node_graph, 0)
        atoms = ops.maximum(n_node, 1.0)

        target, reference = self.energy_target(numbers, node_graph, n_node, energy)
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
        force_abs = ops.abs(force_pred - forces)
        forces_mae = segment_sum(force_abs.mean(1), node_graph, num_graphs) / atoms
        norms = ops.norm(force_pred, dim=1) * ops.norm(forces, dim=1)
        cosine = (force_pred * forces).sum(1) / ops.maximum(norms, 1e-8)
        within = (ops.amax(force_abs, 1) < FORCE_THRESHOLD).astype(forces.dtype)
        all_within = (segment_sum(within, node_graph, num_graphs) == n_node).astype(forces.dtype)
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
        return loss, ops.stop_gradient(sums)


def sums_to_metrics(sums, has_stress: bool = True) -> Dict[str, float]:
    """Averages from a vector of sums in :data:`SUM_KEYS` order."""
    return metrics_from_sums(dict(zip(SUM_KEYS, np.asarray(sums, dtype=np.float64))), has_stress)


def compute_loss(model, batch, training: bool = False, loss_cell: Optional[OrbLoss] = None) -> Dict[str, float]:
    """Loss and metrics of ``model`` on an :class:`~orb.data.graphs.AtomGraphs` batch (PyTorch ``model.loss``).

    ``training=True`` updates the normalisers first, as orb-models does in ``model.train()``.
    """
    from orb.data.tensors import loss_inputs

    cell = loss_cell or OrbLoss(model, has_stress=batch.stress is not None)
    inputs = loss_inputs(batch)
    stats = cell.update_stats(*inputs) if training else cell.current_stats()
    loss, sums = cell(*inputs, *stats)
    metrics = sums_to_metrics(sums.asnumpy(), cell.has_stress)
    metrics["loss_value"] = float(loss.asnumpy())
    return metrics

