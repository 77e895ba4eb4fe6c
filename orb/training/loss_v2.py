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

from mindspore import ops

from orb.models.sums import segment_total, total
from orb.training.loss_base import NormalisedLoss

SUM_KEYS = ("loss", "loss_energy", "loss_forces", "loss_stress", "energy_mae", "energy_per_atom_mae", "forces_mae",
            "forces_cosine", "forces_within_0.03", "stress_mae", "energy_per_atom_reference_mae", "num_graphs",
            "num_atoms", "num_stress")


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
        stress, with_stress = self.stress_where_labelled(stress)
        return [(self.residual_per_atom(numbers, node_graph, n_node, energy, head), graph_mask, True, graphs),
                (forces, self.broadcasts.column(node_mask.reshape(-1, 1), 3), True, nodes),
                (stress, self.broadcasts.column((graph_mask * with_stress).reshape(-1, 1), 6), self.has_stress,
                 graphs.reshape(-1, 1))]

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
        node_mae = segment_total(force_err, node_graph, num_graphs) / atoms

        s_std = ops.sqrt(s_var)
        stress, with_stress = self.stress_where_labelled(stress)
        stress_err = ops.abs((stress - s_mean) / s_std - s_raw).mean(1) * with_stress

        per_graph = self.energy_weight * energy_err + self.forces_weight * node_mae
        if self.has_stress:
            per_graph = per_graph + self.stress_weight * stress_err
        loss = total(per_graph * graph_weight)

        # Metrics, in physical units where not loss_*; no gradient flows through them.
        force_pred = ops.stop_gradient(f_raw * f_std + f_mean)
        forces_mae, cosine, all_within, atom_error = self.force_metrics(force_pred, forces, node_graph, n_node, atoms)
        stress_mae = ops.abs(ops.stop_gradient(s_raw * s_std + s_mean) - stress).mean(1) * with_stress
        energy_abs = ops.abs(ops.stop_gradient(energy_pred) - energy)
        g, a = self.metric_sums(
            (per_graph, energy_err, node_mae, stress_err, energy_abs, energy_abs / atoms, forces_mae, all_within,
             stress_mae, ops.abs(target), ops.ones_like(graph_mask), with_stress), graph_mask,
            (cosine, ops.ones_like(node_mask)), node_mask)
        sums = ops.concat((g[:7], a[:1], g[7:11], a[1:], g[11:]))  # in SUM_KEYS order
        return loss, ops.stop_gradient(self.with_element_sums(sums, atom_error, numbers, node_mask))
