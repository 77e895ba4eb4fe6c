"""What every model family's loss shares: the online normalisers of its targets (statistics before and after a
training batch, committed after the gradient), metric sums per structure, and per-element force sums.

A family's loss (:mod:`orb.training.loss_v2`, :mod:`orb.training.loss_v3`) subclasses :class:`NormalisedLoss`;
:mod:`orb.training.engine` picks it by the model's family.

The code that runs in a compiled step uses plain loops over indices, never comprehensions, ``zip`` or ``enumerate``:
MindSpore's compiler spends 10-60 ms on each of those against ~1 ms an operator (docs/benchmarks.md), in every
training and evaluation graph.
"""

from typing import Dict

import numpy as np
from mindspore import nn, ops

from orb.metrics import BY_ELEMENT, ELEMENT_BINS, FORCE_THRESHOLD, forces_by_element, metrics_from_sums
from orb.data.graphs import MISSING_ABOVE
from orb.models.blocks import segment_sum
from orb.models.primitives import Broadcasts
from orb.models.sums import column_totals, segment_total
from orb.precision import mindspore_dtype


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
    online = True  # the normalisers absorb each training batch (orb-models' online_normalisation); False: fixed

    def __init__(self, normalizers, allreduce=None, replay_normalizers=()):
        super().__init__()
        self.normalizers = nn.CellList(list(normalizers) + list(replay_normalizers))
        self.replay_offset = len(normalizers) if replay_normalizers else 0  # where the replay heads' ones start
        self.allreduce = allreduce  # sum over data-parallel ranks, so the statistics are the global batch's
        self.broadcasts = Broadcasts()
        self.real = mindspore_dtype()  # float64 in precision float64, else float32

    def absorbed(self, numbers, node_graph, n_node, graph_mask, energy, forces, stress, head):
        """[(values, mask, update?, replay rows)] per normaliser of the model's own heads: the targets a training
        batch feeds it, and a 0/1 tensor (broadcasting against ``mask``) of the rows the replay heads predict."""
        raise NotImplementedError

    def replay_rows(self, head, node_graph):
        """0/1 float of the structures (B,) and the atoms (N, 1) the replay heads predict."""
        graphs = (head == 1).astype(self.real)
        return graphs, ops.gather(graphs, node_graph, 0).reshape(-1, 1)

    def current_stats(self):
        stats = ()
        for normalizer in self.normalizers:
            mean, var = normalizer.stats()
            stats = stats + (mean + 0.0, var + 0.0)  # values, not the parameters themselves
        return stats

    def new_stats(self, numbers, positions, vectors, senders, receivers, node_graph, n_node, nonperiodic, cell,
                  unit_shifts, charge, spin, head, graph_mask, graph_weight, energy, forces, stress):
        """(statistics after absorbing the batch's targets, their counts); nothing is stored yet. With replay heads
        each normaliser absorbs only the structures its heads predict."""
        entries = self.absorbed(numbers, node_graph, n_node, graph_mask, energy, forces, stress, head)
        if self.replay_offset:
            own, replay = (), ()
            for values, mask, update, rows in entries:
                own = own + ((values, mask * (1.0 - rows), update, rows),)
                replay = replay + ((values, mask * rows, update, rows),)
            entries = own + replay
        # every normaliser's batch sums in one vector: one sum over data-parallel ranks per step
        sums = ()
        for k in range(len(entries)):
            sums = sums + (self.normalizers[k].batch_sums(entries[k][0], entries[k][1]),)
        sums = ops.concat(sums)
        if self.allreduce is not None:
            sums = self.allreduce(sums)
        stats, counts = (), ()
        for k in range(len(entries)):
            normalizer = self.normalizers[k]
            if entries[k][2] and self.online:
                mean, var, count = normalizer.updated_stats(sums[3 * k:3 * k + 3])
            else:  # no stress labels, or online_normalisation off: the statistics stay
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
        for i in range(len(self.normalizers)):
            done = done + (self.normalizers[i].commit(stats[2 * i], stats[2 * i + 1], counts[i]),)
        return done

    @property
    def num_sums(self) -> int:
        """Length of the metric-sum vector: the named sums, then per atomic number the force error and atoms."""
        return len(self.sum_keys) + 2 * ELEMENT_BINS

    def sums_from(self, sums) -> np.ndarray:
        """Metric sums (a vector, or rows of them) a checkpoint holds, in this loss's layout: one saved before
        ``num_stress`` was summed (every structure had stress then, or none was scored) gets ``num_graphs`` there."""
        sums = np.asarray(sums, np.float64)
        n = len(self.sum_keys)
        if sums.shape[-1] == self.num_sums - 1 and self.sum_keys[-1] == "num_stress":
            graphs = sums[..., self.sum_keys.index("num_graphs")]
            sums = np.concatenate([sums[..., :n - 1], graphs[..., None], sums[..., n - 1:]], axis=-1)
        return sums

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
        forces_mae = segment_total(atom_error, node_graph, num_graphs) / atoms
        norms = ops.norm(force_pred, dim=1) * ops.norm(forces, dim=1)
        cosine = (force_pred * forces).sum(1) / ops.maximum(norms, 1e-8)
        within = (ops.amax(force_abs, 1) < FORCE_THRESHOLD).astype(forces.dtype)
        all_within = (segment_sum(within, node_graph, num_graphs) == n_node).astype(forces.dtype)
        return forces_mae, cosine, all_within, atom_error

    @staticmethod
    def with_element_sums(sums, atom_error, numbers, node_mask):
        """The metric sums followed by, per atomic number, the summed per-atom force error and the atom count."""
        return ops.concat((sums, segment_total(atom_error * node_mask, numbers, ELEMENT_BINS),
                           segment_sum(node_mask, numbers, ELEMENT_BINS)))

    @staticmethod
    def stress_where_labelled(stress):
        """(stress with zeros where a structure has no stress label, (B,) 1 where it has one else 0): the data marks a
        structure without one by a value above MISSING_ABOVE (:data:`orb.data.graphs.MISSING_STRESS`), replaced before
        any arithmetic (it would overflow to inf, and inf times 0 is NaN)."""
        labelled = ops.abs(stress) < MISSING_ABOVE
        return ops.select(labelled, stress, ops.zeros_like(stress)), labelled[:, 0].astype(stress.dtype)

    @staticmethod
    def metric_sums(per_graph, graph_mask, per_atom, node_mask):
        """(sums of the ``per_graph`` (B,) values over real structures, sums of the ``per_atom`` (N,) values over real
        atoms), each accurately summed (:mod:`orb.models.sums`: a batch's atoms are a long sum)."""
        graphs = column_totals(ops.stack(per_graph, 1) * graph_mask.reshape(-1, 1))
        return graphs, column_totals(ops.stack(per_atom, 1) * node_mask.reshape(-1, 1))

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
