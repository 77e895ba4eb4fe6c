"""An epoch's steps as arrays: which structures every rank takes at every step, their totals and buckets.

A sampler turns an epoch into :class:`Shards` (one flat order of dataset positions and the
boundaries of every rank's part of every step), a pure function of (seed, epoch), so every
data-parallel rank computes the same plan. Everything derived from it -- each step's atoms and
edge capacity per rank, the bucket all ranks pad to -- is computed with whole-array operations:
an epoch of 1.58 M structures is planned in a fraction of a second, not a Python loop per step.
"""

from dataclasses import dataclass
from typing import Iterator, List, Sequence, Tuple, Union

import numpy as np

from orb.data.buckets import Bucket, assign_buckets, plan_buckets, round_up


@dataclass(frozen=True)
class Shards:
    """Rank ``r``'s structures at step ``s``: ``order[bounds[s * world + r]:bounds[s * world + r + 1]]``."""

    order: np.ndarray
    bounds: np.ndarray
    world: int

    def __len__(self) -> int:
        """Steps."""
        return (len(self.bounds) - 1) // self.world

    def part(self, step: int, rank: int) -> np.ndarray:
        k = step * self.world + rank
        return self.order[self.bounds[k]:self.bounds[k + 1]]

    def global_batch(self, step: int) -> np.ndarray:
        return self.order[self.bounds[step * self.world]:self.bounds[(step + 1) * self.world]]


def even_shards(order: np.ndarray, batch_sizes: np.ndarray, world: int) -> Shards:
    """Consecutive global batches of ``batch_sizes`` structures of ``order``, each split among ``world`` ranks as
    evenly as possible (the first ranks take one more when it does not divide; a rank may take none)."""
    sizes = np.asarray(batch_sizes, np.int64)[:, None]
    parts = sizes // world + (np.arange(world)[None, :] < sizes % world)
    return Shards(np.asarray(order, np.int64), np.concatenate([[0], np.cumsum(parts.ravel())]), world)


def fixed_batches(order: np.ndarray, batch_size: int, world: int) -> Shards:
    """``order`` in global batches of ``batch_size`` (the last one holds the rest), split among the ranks."""
    full, rest = divmod(len(order), batch_size)
    return even_shards(order, np.array([batch_size] * full + ([rest] if rest else []), np.int64), world)


def pack_by_size(natoms: np.ndarray, edges: np.ndarray, limit: Bucket, world: int) -> Shards:
    """Every structure once, the largest first, packed into global batches that fill ``limit`` (nodes, edges,
    graphs; a structure larger than it alone) -- an evaluation pass pads little whatever the rows' order --
    each split among the ranks as a training batch is. The batches do not depend on ``world``, so an
    evaluation's metrics do not either.
    """
    natoms, edges = np.asarray(natoms, np.int64), np.asarray(edges, np.int64)
    order = np.lexsort((natoms, edges))[::-1]
    starts, nodes, total, graphs = [0], 0, 0, 0
    for k, i in enumerate(order):
        n, e = int(natoms[i]), int(edges[i])
        if graphs and not limit.holds(nodes + n, total + e, graphs + 1):
            starts.append(k)
            nodes, total, graphs = 0, 0, 0
        nodes, total, graphs = nodes + n, total + e, graphs + 1
    bounds = starts + [len(order)]
    order = order.astype(np.int64)
    if world > 1:  # rank r takes every world-th structure of a batch, so that the ranks' parts weigh alike
        order = np.concatenate([np.concatenate([order[a + r:b:world] for r in range(world)])
                                for a, b in zip(bounds[:-1], bounds[1:])])
    return even_shards(order, np.diff(np.array(bounds, np.int64)), world)


EVAL_FILL = 2.0  # an evaluation step holds about this many training batches' worth of atoms and edges
EVAL_GRAPHS = 4  # ... and up to this many times the structures (small ones packed together)


def eval_limit(natoms: np.ndarray, edges: np.ndarray, batch_size: int, multiple: int = 8) -> Bucket:
    """How much one evaluation step may hold: :data:`EVAL_FILL` times an average (global) batch of ``batch_size``
    of these structures (no gradients are kept: less memory than the training step of the same shape)."""
    nodes = round_up(int(np.ceil(EVAL_FILL * batch_size * float(np.mean(natoms)))) + 1, multiple)
    total = round_up(max(int(np.ceil(EVAL_FILL * batch_size * float(np.mean(edges)))), 1), multiple)
    return Bucket(nodes, total, EVAL_GRAPHS * batch_size + 1)


@dataclass(frozen=True)
class StepTotals:
    """Per step, what its bucket must hold (the largest rank part's atoms, edge capacity and structures), and
    the atoms and edges of all ranks' parts (what was real of the padded work)."""

    nodes: np.ndarray
    edges: np.ndarray
    graphs: np.ndarray
    real_nodes: int
    real_edges: int

    @staticmethod
    def concatenate(parts: Sequence["StepTotals"]) -> "StepTotals":
        return StepTotals(*(np.concatenate([getattr(p, k) for p in parts]) for k in ("nodes", "edges", "graphs")),
                          sum(p.real_nodes for p in parts), sum(p.real_edges for p in parts))


def step_totals(shards: Shards, natoms: np.ndarray, edges: np.ndarray) -> StepTotals:
    """Each step's largest rank part (by atoms, by edge capacity, by structures), summed with prefix sums."""
    def per_part(values: np.ndarray) -> np.ndarray:
        prefix = np.concatenate([[0], np.cumsum(np.asarray(values, np.int64)[shards.order])])
        return prefix[shards.bounds[1:]] - prefix[shards.bounds[:-1]]

    nodes, totals = per_part(natoms), per_part(edges)
    counts = np.diff(shards.bounds)
    world = shards.world
    return StepTotals(nodes.reshape(-1, world).max(1), totals.reshape(-1, world).max(1),
                      counts.reshape(-1, world).max(1), int(nodes.sum()), int(totals.sum()))


def padding_ratio(totals: StepTotals, buckets: Sequence[Bucket], world: int) -> Tuple[float, float]:
    """Padded over real atoms and edges (capacities) of these steps, all ranks' work counted."""
    chosen = assign_buckets(totals.nodes, totals.edges, totals.graphs, buckets)
    nodes = np.array([b.num_nodes for b in buckets], np.int64)[chosen].sum() * world
    edges = np.array([b.num_edges for b in buckets], np.int64)[chosen].sum() * world
    return float(nodes / max(totals.real_nodes, 1)), float(edges / max(totals.real_edges, 1))


@dataclass(frozen=True)
class Step:
    """One step of one rank: its dataset positions, the bucket all ranks pad to, the global batch size."""

    epoch: int
    indices: Tuple[int, ...]
    bucket: Bucket
    global_count: int


class EpochSteps(Sequence):
    """One rank's steps of an epoch, made when asked for (a 200,000-step epoch is a few arrays)."""

    def __init__(self, shards: Shards, buckets: Sequence[Bucket], chosen: np.ndarray, rank: int, epoch: int,
                 start: int = 0):
        self.shards, self.buckets, self.chosen, self.rank, self.epoch, self.start = (shards, list(buckets), chosen,
                                                                                    rank, epoch, start)

    def __len__(self) -> int:
        return len(self.shards) - self.start

    def __getitem__(self, index: Union[int, slice]):
        if isinstance(index, slice):
            first, stop, stride = index.indices(len(self))
            if stride != 1 or stop < len(self):
                return [self[i] for i in range(first, stop, stride)]
            return EpochSteps(self.shards, self.buckets, self.chosen, self.rank, self.epoch, self.start + first)
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(index)
        s = self.start + index
        world = self.shards.world
        count = int(self.shards.bounds[(s + 1) * world] - self.shards.bounds[s * world])
        return Step(self.epoch, tuple(int(i) for i in self.shards.part(s, self.rank)),
                    self.buckets[int(self.chosen[s])], count)

    def __iter__(self) -> Iterator[Step]:
        for i in range(len(self)):
            yield self[i]


def plan_steps(shards: Shards, natoms: np.ndarray, edges: np.ndarray, buckets: Sequence[Bucket], rank: int,
               epoch: int) -> EpochSteps:
    """This rank's steps of an epoch, each with the smallest bucket that holds every rank's part."""
    totals = step_totals(shards, natoms, edges)
    return EpochSteps(shards, buckets, assign_buckets(totals.nodes, totals.edges, totals.graphs, buckets), rank,
                      epoch)


def evaluation_plan(natoms: np.ndarray, edges: np.ndarray, limit: Bucket, world: int, max_buckets: int = 0,
                    passes: int = 1, fill_graphs: bool = True) -> Tuple[Shards, List[Bucket], StepTotals]:
    """An evaluation pass: every structure once, packed by size within ``limit``, and the buckets planned on
    exactly those steps (``passes``: how often the run repeats them, to weigh compilations against padding), with
    the graph slots its steps fill (``fill_graphs``; a small dense structure alone then has the calculator's and
    orb-md's shape, whose graph it shares), else the limit's (an exported model serves batches of small ones)."""
    shards = pack_by_size(natoms, edges, limit, world)
    totals = step_totals(shards, natoms, edges)
    graphs = min(limit.num_graphs, int(totals.graphs.max(initial=0)) + 1) if fill_graphs else limit.num_graphs
    buckets = plan_buckets(totals.nodes, totals.edges, graphs,
                           (int(totals.nodes.max()), int(totals.edges.max())), max_buckets, len(totals.nodes) * passes)
    return shards, buckets, totals
