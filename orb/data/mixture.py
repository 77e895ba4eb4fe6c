"""Training data as one stream: named sources (the user's target data, replay data) mixed in fixed shares.

A :class:`Source` is the rows of one database that a run uses (all of them, or a chosen subset),
each structure weighted in the loss by its row's ``weight`` times the source's ``loss_weight``. A
:class:`Mixture` concatenates sources: position ``i`` of the mixture is a position of one source,
and each structure knows its source. The trainer, the batch plan and the data workers see one
dataset; validation sets are single sources with names (``val``, ``replay_val``).

:class:`MixedSampler` puts a fixed number of replay structures into every step (stratified, not
random shares): an epoch is one pass over the target, the replay structures continue one seeded
stream across epochs, and both are pure functions of (seed, epoch), so a resumed run and every
data-parallel rank compute the same global batches.
"""

from functools import cached_property
from typing import List, Optional, Sequence

import numpy as np

from orb.data.dataset import AseDbDataset
from orb.data.graphs import AtomGraphs


def replay_per_step(batch_size: int, fraction: float) -> int:
    """Replay structures in a full global batch: the fraction of it, rounded, at least one when mixing."""
    return 0 if fraction <= 0 else max(1, int(round(fraction * batch_size)))


class Source:
    """Positions ``positions`` (default: all) of ``dataset``, named; loss weights scaled by ``loss_weight``;
    predicted by the model's heads (``head`` 0) or its replay heads (1)."""

    def __init__(self, name: str, dataset: AseDbDataset, positions: Optional[Sequence[int]] = None,
                 loss_weight: float = 1.0, head: int = 0):
        self.name, self.dataset, self.loss_weight, self.head = name, dataset, float(loss_weight), int(head)
        self.positions = np.arange(len(dataset)) if positions is None else np.asarray(positions, np.int64)
        if len(self.positions) == 0:
            raise ValueError(f"source {name} of {dataset.source} has no structures")

    def __len__(self) -> int:
        return len(self.positions)

    def __repr__(self) -> str:
        return f"Source({self.name!r}, {self.dataset.path!r}, {len(self)} structures)"

    @property
    def path(self) -> str:
        return self.dataset.path

    @property
    def source(self) -> str:
        """The user's data as messages name it (:attr:`AseDbDataset.source`)."""
        return self.dataset.source

    @property
    def has_stress(self) -> bool:
        return self.dataset.has_stress

    @property
    def stress_rows(self) -> int:
        """How many of the source's structures hold a stress label."""
        return int(self.dataset.stress_labelled()[self.positions].sum())

    @cached_property
    def natoms(self) -> np.ndarray:
        return self.dataset.natoms[self.positions]

    @cached_property
    def ids(self) -> np.ndarray:
        return self.dataset.ids[self.positions]

    @property
    def weights(self) -> np.ndarray:
        return self.dataset.weights[self.positions] * self.loss_weight

    def edge_capacities(self) -> np.ndarray:
        return self.dataset.edge_capacities()[self.positions]

    def energies(self) -> np.ndarray:
        """The stored energy of each structure, in the source's order (:meth:`AseDbDataset.energies`)."""
        return self.dataset.energies()[self.positions]

    def composition(self):
        """(position in this source, atomic number, count) for every element of its structures: the database's
        (:meth:`AseDbDataset.composition`) without the rows the source leaves out (a held-out validation part)."""
        positions, numbers, counts = self.dataset.composition()
        mine = np.full(len(self.dataset), -1, np.int64)
        mine[self.positions] = np.arange(len(self.positions))
        kept = mine[positions] >= 0
        return mine[positions][kept], numbers[kept], counts[kept]

    def get(self, index: int, rotation_seed=None) -> AtomGraphs:
        return self.get_many([index], [rotation_seed])[0]

    def get_many(self, indices: Sequence[int], rotation_seeds: Sequence) -> List[AtomGraphs]:
        graphs = self.dataset.get_many([int(self.positions[i]) for i in indices], rotation_seeds)
        for graph in graphs:
            if self.loss_weight != 1.0:
                graph.weight = graph.weight * graph.weight.dtype.type(self.loss_weight)
            graph.head = np.array([self.head], np.int64)
        return graphs

    def row(self, index: int):
        return self.dataset.row(int(self.positions[index]))


class Mixture:
    """Sources as one dataset, in order: positions ``starts[s]`` to ``starts[s + 1]`` are source ``s``'s."""

    def __init__(self, sources: List[Source]):
        if not sources:
            raise ValueError("a mixture needs at least one source")
        self.sources = list(sources)
        self.starts = np.cumsum([0] + [len(s) for s in self.sources])
        self.source_of = np.repeat(np.arange(len(self.sources)), [len(s) for s in self.sources])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __repr__(self) -> str:
        return f"Mixture({self.sources!r})"

    @property
    def names(self) -> List[str]:
        return [s.name for s in self.sources]

    @property
    def path(self) -> str:
        return self.sources[0].path

    @property
    def has_stress(self) -> bool:
        """Whether any source has stress (the run's stress training: orb.training.run_data.trains_stress)."""
        return any(source.has_stress for source in self.sources)

    @cached_property
    def natoms(self) -> np.ndarray:
        return np.concatenate([s.natoms for s in self.sources])

    @property
    def weights(self) -> np.ndarray:
        return np.concatenate([s.weights for s in self.sources])

    def edge_capacities(self) -> np.ndarray:
        return np.concatenate([s.edge_capacities() for s in self.sources])

    def locate(self, index: int):
        """(source, position in that source) of mixture position ``index``."""
        s = int(self.source_of[index])
        return self.sources[s], int(index - self.starts[s])

    def get(self, index: int, rotation_seed=None) -> AtomGraphs:
        return self.get_many([index], [rotation_seed])[0]

    def get_many(self, indices: Sequence[int], rotation_seeds: Sequence) -> List[AtomGraphs]:
        """:meth:`get` of several positions, each source's rows read together, in the order asked."""
        graphs: List[Optional[AtomGraphs]] = [None] * len(indices)
        for s, source in enumerate(self.sources):
            mine = [k for k, i in enumerate(indices) if self.source_of[i] == s]
            if mine:
                positions = [int(indices[k] - self.starts[s]) for k in mine]
                for k, graph in zip(mine, source.get_many(positions, [rotation_seeds[k] for k in mine])):
                    graphs[k] = graph
        return graphs

    def row_id(self, index: int):
        """The database row id of mixture position ``index``, with its source's name when there are several."""
        source, position = self.locate(index)
        row = int(source.ids[position])
        return row if len(self.sources) == 1 else [source.name, row]


