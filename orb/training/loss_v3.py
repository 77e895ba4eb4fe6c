"""orb-v3's fine-tuning loss and metrics (``model.loss`` of orb-models 0.5.5), for direct and conservative models.

Terms (weights from the config's ``loss_weights``):

* energy: Huber (delta 0.01) of the normalised per-atom energy, averaged over structures;
* forces: MACE's conditional Huber (delta 0.01 x 1, 0.7, 0.4, 0.1 for normalised target forces of
  norm < 100, < 200, < 300, above) averaged over every force component; conservative models
  compare -dE/dpositions, direct ones the force head (plus the ZBL forces);
* stress: Huber of the normalised stress (conservative: all 6 components; direct: the diagonal
  plus 0.1 x the off-diagonal, each with its own normaliser); OMol models have none;
* confidence: cross-entropy of the 50-bin force-error classifier (atoms whose error exceeds
  0.3 eV/Å are ignored), averaged over the remaining atoms;
* equigrad (conservative, weight 0 by default): the mean Frobenius norm of dE/dG, the energy's
  gradient with respect to an infinitesimal rotation.

Each structure's terms are multiplied by its loss weight (1 unless rows or sources are weighted;
``graph_weight`` carries it divided by the global batch's structures); the denominators count
structures and atoms. orb-models' order of operations in training mode is reproduced: predictions are normalised with
the normalisers' statistics *before* this batch updates them, targets and the physical metrics
with the statistics after. The denominators of the averages (structures, atoms, components) are
summed over data-parallel ranks, so the loss summed over ranks is the global batch's.
"""

import numpy as np
from mindspore import ops

from orb.models.orb_v3 import CONFIDENCE_MAX_ERROR, six_components
from orb.models.sums import total
from orb.training.loss_base import NormalisedLoss

SUM_KEYS = ("loss", "loss_energy", "loss_forces", "loss_stress", "loss_confidence", "loss_equigrad", "energy_mae",
            "energy_per_atom_mae", "forces_mae", "forces_cosine", "forces_within_0.03", "stress_mae",
            "energy_per_atom_reference_mae", "confidence_accuracy", "rotational_grad_rms", "num_graphs",
            "num_atoms", "num_stress")
HUBER_DELTA = 0.01


def huber(pred, target, delta):
    """torch's huber_loss, element-wise (delta may be a tensor)."""
    diff = ops.abs(pred - target)
    return ops.where(diff < delta, 0.5 * diff * diff, delta * (diff - 0.5 * delta))


def conditional_huber_deltas(target, broadcasts):
    """MACE's per-atom delta from the norm of the normalised target force, broadcast to (N, 3)."""
    norm = ops.norm(target, dim=1)
    factor = ops.where(norm < 100.0, 1.0, ops.where(norm < 200.0, 0.7, ops.where(norm < 300.0, 0.4, 0.1)))
    return broadcasts.column((HUBER_DELTA * factor).reshape(-1, 1), target.shape[1])


class OrbV3Loss(NormalisedLoss):
    """Loss and metric sums of an orb-v3 model on a (padded) batch.

    ``construct(*loss_inputs, *old, *new)`` takes the tensors of :func:`orb.data.tensors.loss_inputs` and the
    normalisers' statistics before and after this batch (see :class:`~orb.training.loss_base.NormalisedLoss`).
    """

    sum_keys = SUM_KEYS

    def __init__(self, model, energy_weight: float = 1.0, forces_weight: float = 1.0, stress_weight: float = 1.0,
                 has_stress: bool = True, allreduce=None, confidence_weight: float = 1.0,
                 equigrad_weight: float = 0.0):
        if model.cfg.conservative:
            names = ["energy.normalizer", "grad_forces_normalizer", "grad_stress_normalizer"]
            normalizers = [model.heads.energy.normalizer, model.grad_forces_normalizer, model.grad_stress_normalizer]
        else:
            names = ["energy.normalizer", "forces.normalizer"] + (
                ["stress.diag_normalizer", "stress.offdiag_normalizer"] if model.cfg.has_stress else [])
            normalizers = [model.heads.energy.normalizer, model.heads.forces.normalizer]
            if model.cfg.has_stress:
                normalizers += [model.heads.stress.diag_normalizer, model.heads.stress.offdiag_normalizer]
        super().__init__(normalizers, allreduce, self.replay_normalizers(model, names))
        self.model = model
        self.conservative = model.cfg.conservative
        self.has_stress = bool(has_stress) and model.cfg.has_stress
        self.weights = (float(energy_weight), float(forces_weight), float(stress_weight) if self.has_stress else 0.0,
                        float(confidence_weight), float(equigrad_weight) if self.conservative else 0.0)

    def absorbed(self, numbers, node_graph, n_node, graph_mask, energy, forces, stress, head):
        stress, with_stress = self.stress_where_labelled(stress)
        stress_mask = (graph_mask * with_stress).reshape(-1, 1)
        graphs, nodes = self.replay_rows(head, node_graph)
        out = [(self.residual_per_atom(numbers, node_graph, n_node, energy, head), graph_mask, True, graphs),
               (forces, self.broadcasts.column(ops.gather(graph_mask, node_graph, 0).reshape(-1, 1), 3), True, nodes)]
        if self.conservative:
            out.append((stress, self.broadcasts.column(stress_mask, 6), self.has_stress, graphs.reshape(-1, 1)))
        elif self.model.cfg.has_stress:
            three = self.broadcasts.column(stress_mask, 3)
            out += [(stress[:, :3], three, self.has_stress, graphs.reshape(-1, 1)),
                    (stress[:, 3:], three, self.has_stress, graphs.reshape(-1, 1))]
        return out

    # ----------------------------------------------------------------- loss
    def _global(self, x):
        return self.allreduce(x) if self.allreduce is not None else x

    def construct(self, numbers, positions, vectors, senders, receivers, node_graph, n_node, nonperiodic, cell,
                  unit_shifts, charge, spin, head, graph_mask, graph_weight, energy, forces, stress, *stats):
        half = len(stats) // 2
        old, new = stats[:half], stats[half:]
        replay, replay_nodes = head == 1, ops.gather(head, node_graph, 0) == 1
        num_graphs = n_node.shape[0]
        node_mask = ops.gather(graph_mask, node_graph, 0)
        atoms = ops.maximum(n_node, 1.0)
        graphs_total = ops.maximum(self._global(graph_mask.sum()), 1.0)
        atoms_total = ops.maximum(self._global(node_mask.sum()), 1.0)
        weight = graph_weight * graphs_total  # each structure's loss weight (0 for padding)
        node_weight = ops.gather(weight, node_graph, 0)
        weight3 = self.broadcasts.column(node_weight.reshape(-1, 1), 3)
        outputs = self.model(numbers, positions, vectors, senders, receivers, node_graph, n_node, nonperiodic, cell,
                             unit_shifts, charge, spin, head)
        reference = self.model.reference_energy(numbers, node_graph, num_graphs, head)
        e_mean_o, e_var_o = self.row_stats(old, 0, replay)
        e_mean_n, e_var_n = self.row_stats(new, 0, replay)
        f_mean_o, f_var_o = self.row_stats(old, 1, replay_nodes, 2)
        f_mean_n, f_var_n = self.row_stats(new, 1, replay_nodes, 2)
        f_std_o, f_std_n = ops.sqrt(f_var_o), ops.sqrt(f_var_n)

        if self.conservative:
            _, energy_raw, forces_raw, stress_raw, logits, _, rotational = outputs
            energy_pred = ((energy_raw - reference) / atoms - e_mean_o) / ops.sqrt(e_var_o)
            forces_pred = (forces_raw - f_mean_o) / f_std_o
            forces_error = ops.abs(forces_raw - forces).mean(1)  # the confidence head's target
        else:
            head_energy, energy_nozbl, forces_head, stress_head, logits, pair_e, pair_f, pair_s = outputs
            energy_pred = head_energy + pair_e / atoms / ops.sqrt(e_var_o)
            forces_pred = forces_head + pair_f / f_std_o
            forces_error = ops.abs(forces_pred * f_std_n + f_mean_n - forces).mean(1)

        # energy
        energy_target = ((energy - reference) / atoms - e_mean_n) / ops.sqrt(e_var_n)
        loss_energy = total(huber(energy_pred, energy_target, HUBER_DELTA) * graph_weight)
        energy_phys = (energy_pred * ops.sqrt(e_var_n) + e_mean_n) * n_node + reference
        energy_abs = ops.abs(ops.stop_gradient(energy_phys) - energy)

        # forces
        forces_target = (forces - f_mean_n) / f_std_n
        deltas = conditional_huber_deltas(forces_target, self.broadcasts)
        loss_forces = total(huber(forces_pred, forces_target, deltas) * weight3) / (3.0 * atoms_total)
        forces_phys = ops.stop_gradient(forces_pred * f_std_n + f_mean_n)
        forces_mae, cosine, all_within, atom_error = self.force_metrics(forces_phys, forces, node_graph, n_node, atoms)

        # stress
        stress, with_stress = self.stress_where_labelled(stress)
        loss_stress, stress_mae = self._stress(outputs, stress, old, new, graph_weight * with_stress, replay)
        stress_mae = stress_mae * with_stress

        # confidence
        bins, valid = self._confidence_bins(ops.stop_gradient(forces_error))
        valid = valid * node_mask
        log_probs = ops.log_softmax(logits, -1)
        picked = (log_probs * ops.one_hot(bins, logits.shape[1], 1.0, 0.0)).sum(1)
        loss_confidence = -total(picked * valid * node_weight) / ops.maximum(self._global(valid.sum()), 1.0)
        correct = (ops.argmax(logits, -1) == bins).astype(forces.dtype) * valid

        # equigrad
        rot_norm = ops.zeros_like(graph_mask)
        if self.conservative:
            rot_norm = ops.sqrt(ops.square(rotational).reshape(num_graphs, 9).sum(1) + 1e-30)
        loss_equigrad = total(rot_norm * graph_weight)

        w = self.weights
        loss = (w[0] * loss_energy + w[1] * loss_forces + w[2] * loss_stress + w[3] * loss_confidence
                + w[4] * loss_equigrad)
        m = graph_mask
        scale = graphs_total  # step terms weighted by the structures of the step (epoch averages)
        steps = ops.stack((loss * scale, loss_energy * scale, loss_forces * scale, loss_stress * scale,
                           loss_confidence * scale, loss_equigrad * w[4] * scale))
        g, a = self.metric_sums(
            (energy_abs, energy_abs / atoms, forces_mae, all_within, stress_mae, ops.abs((energy - reference) / atoms),
             rot_norm, ops.ones_like(m), with_stress), m, (cosine, correct, ops.ones_like(node_mask)), node_mask)
        sums = ops.concat((steps, g[:3], a[:1], g[3:6], a[1:2], g[6:8], a[2:], g[8:]))  # in SUM_KEYS order
        return loss, ops.stop_gradient(self.with_element_sums(sums, atom_error, numbers, node_mask))

    def _stress(self, outputs, stress, old, new, graph_weight, replay):
        """(stress loss term, per-structure stress MAE (B,))."""
        if not self.has_stress:
            zero = ops.zeros_like(graph_weight)
            return total(zero), zero
        weight6 = self.broadcasts.column(graph_weight.reshape(-1, 1), 6)
        if self.conservative:
            stress_raw = outputs[3]
            s_mean_o, s_var_o = self.row_stats(old, 2, replay, 2)
            s_mean_n, s_var_n = self.row_stats(new, 2, replay, 2)
            s_std_o, s_std_n = ops.sqrt(s_var_o), ops.sqrt(s_var_n)
            pred = (stress_raw - s_mean_o) / s_std_o
            target = (stress - s_mean_n) / s_std_n
            loss = total(huber(pred, target, HUBER_DELTA) * weight6) / 6.0
            phys = pred * s_std_n + s_mean_n
        else:
            stress_head, pair_s = outputs[3], outputs[7]
            _, d_var_o = self.row_stats(old, 2, replay, 2)
            _, o_var_o = self.row_stats(old, 3, replay, 2)
            d_mean_n, d_var_n = self.row_stats(new, 2, replay, 2)
            o_mean_n, o_var_n = self.row_stats(new, 3, replay, 2)
            std_o = six_components(ops.sqrt(d_var_o), ops.sqrt(o_var_o))
            mean_n = six_components(d_mean_n, o_mean_n)
            std_n = six_components(ops.sqrt(d_var_n), ops.sqrt(o_var_n))
            pred = stress_head + pair_s / std_o  # normalise(denormalise(head) + ZBL) with the old statistics
            target = (stress - mean_n) / std_n
            per = huber(pred, target, HUBER_DELTA) * weight6
            loss = (total(per[:, :3]) + 0.1 * total(per[:, 3:])) / 3.0
            phys = pred * std_n + mean_n
        stress_mae = ops.abs(ops.stop_gradient(phys) - stress).mean(1)
        return loss, stress_mae

    def _confidence_bins(self, error):
        """Bin index of each atom's force error and whether it counts (errors above 0.3 eV/Å are ignored)."""
        edges = self.model.heads.confidence.bin_edges
        clamped = ops.clamp(error, 0.0, CONFIDENCE_MAX_ERROR)
        below = (self.broadcasts.row(edges, error.shape[0])
                 < self.broadcasts.column(clamped.reshape(-1, 1), edges.shape[0]))
        bins = ops.clamp(below.astype(np.int32).sum(1) - 1, 0, edges.shape[0] - 2)
        valid = (error <= CONFIDENCE_MAX_ERROR).astype(error.dtype)
        return bins, valid
