"""Static batch shapes: a few padded bucket sizes chosen from the dataset's size distribution.

A graph-mode step compiles once per input shape. Batches are padded up to the smallest bucket
that fits, so a run compiles at most ``len(buckets)`` times. The bucket of a step is chosen from
each structure's atom count and edge capacity (an upper bound on its edges under any rotation,
computed once before training), so every data-parallel rank can compute every rank's needs and
all ranks pick the same bucket at every step; the largest bucket fits the worst possible batch,
checked before training.
"""

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import numpy as np

from orb.data.graphs import AtomGraphs, pad_batch
from orb.errors import ConfigError

MAX_BUCKETS = 16


@dataclass(frozen=True, order=True)
class Bucket:
    """A padded batch shape: nodes, edges and graphs (one more node and graph than a batch may hold,
    for the padding)."""

    num_nodes: int
    num_edges: int
    num_graphs: int

    def holds(self, nodes: int, edges: int, graphs: int) -> bool:
        return nodes < self.num_nodes and edges <= self.num_edges and graphs < self.num_graphs

    def fits(self, batch: AtomGraphs) -> bool:
        return self.holds(batch.num_nodes, batch.num_edges, batch.num_graphs)


def smallest_first(buckets: Sequence[Bucket]) -> List[Bucket]:
    """Buckets in the order a batch tries them: fewest edges (most of a step's work) first."""
    return sorted(buckets, key=lambda b: (b.num_edges, b.num_nodes))


def round_up(x: int, multiple: int) -> int:
    return int(-(-x // multiple) * multiple)


def simulate_batches(natoms: np.ndarray, edges: np.ndarray, batch_size: int, epochs: int = 50,
                     seed: int = 0) -> Tuple[np.ndarray, np.ndarray]:
    """Node and edge-capacity totals of randomly shuffled batches over a number of simulated epochs (one vectorised
    sum per epoch: 1.58 M rows are planned in seconds, not a Python loop over every batch)."""
    rng = np.random.default_rng(seed)
    natoms, edges = np.asarray(natoms, dtype=np.int64), np.asarray(edges, dtype=np.int64)
    starts = np.arange(0, len(natoms), batch_size)
    nodes_out, edges_out = [], []
    for _ in range(epochs):
        order = rng.permutation(len(natoms))
        nodes_out.append(np.add.reduceat(natoms[order], starts))
        edges_out.append(np.add.reduceat(edges[order], starts))
    return np.concatenate(nodes_out), np.concatenate(edges_out)


def largest_batch(natoms: np.ndarray, edges: np.ndarray, batch_size: int) -> Tuple[int, int]:
    """Node and edge totals no batch of ``batch_size`` structures can exceed."""
    return int(np.sort(natoms)[-batch_size:].sum()), int(np.sort(edges)[-batch_size:].sum())


def plan_buckets(natoms: Sequence[int], edges: Sequence[int], batch_size: int, max_buckets: int = 3,
                 multiple: int = 8, seed: int = 0,
                 batches: Optional[Tuple[np.ndarray, np.ndarray]] = None) -> List[Bucket]:
    """At most ``max_buckets`` bucket shapes minimising the expected padded edges (exact, by dynamic programming).

    ``edges``: each structure's edge capacity (:meth:`AseDbDataset.edge_capacities`); edge rows are
    most of a step's work. The largest bucket holds the worst possible batch (the ``batch_size``
    largest structures by atoms and by edges); smaller edge capacities are chosen among quantiles of
    the node and edge totals of sample batches: ``batches`` if given (e.g. the steps a sampler
    plans), else simulated random batches, each with the node capacity of the batches it holds.
    """
    natoms, edges = np.asarray(natoms, dtype=np.int64), np.asarray(edges, dtype=np.int64)
    batch_size = min(batch_size, len(natoms))
    top_nodes, top_edges = largest_batch(natoms, edges, batch_size)
    top = (round_up(top_nodes + 1, multiple), round_up(max(top_edges, 1), multiple))
    nodes, totals = batches if batches is not None else simulate_batches(natoms, edges, batch_size, seed=seed)
    nodes, totals = np.asarray(nodes, np.int64), np.asarray(totals, np.int64)
    order = np.argsort(totals, kind="stable")
    nodes, totals = nodes[order], totals[order]
    caps = sorted({round_up(int(q), multiple) for q in np.quantile(totals, np.linspace(0.05, 0.95, 19))})
    caps = [c for c in caps if c < top[1]] + [top[1]]
    # cost(i, j): padded edges of the batches whose smallest fitting cap is caps[j] when the previous
    # chosen cap is caps[i] (i = -1: none); best[k][j]: least cost with k caps ending at j.
    first = np.searchsorted(totals, caps, side="right")  # batches with total <= cap

    def count(i: int, j: int) -> int:
        return int(first[j] - (first[i] if i >= 0 else 0))

    n = len(caps)
    inf = float("inf")
    best = [[inf] * n for _ in range(max_buckets + 1)]
    back = [[-1] * n for _ in range(max_buckets + 1)]
    for j in range(n):
        best[1][j] = caps[j] * count(-1, j)
    for k in range(2, max_buckets + 1):
        for j in range(n):
            for i in range(j):
                cost = best[k - 1][i] + caps[j] * count(i, j)
                if cost < best[k][j]:
                    best[k][j], back[k][j] = cost, i
    k = min(range(1, max_buckets + 1), key=lambda kk: (best[kk][n - 1], kk))
    chosen, j = [], n - 1
    while j >= 0 and k >= 1:
        chosen.append(j)
        j, k = back[k][j], k - 1
    buckets = []
    for j in sorted(chosen):
        held = nodes[:first[j]]  # the simulated batches within this edge capacity
        node_cap = top[0] if caps[j] == top[1] or not len(held) else min(top[0], round_up(int(held.max()) + 1,
                                                                                          multiple))
        buckets.append(Bucket(node_cap, caps[j], batch_size + 1))
    return buckets


def parse_buckets(spec: Sequence[Sequence[int]], batch_size: int) -> List[Bucket]:
    """Buckets given explicitly as ``[[num_nodes, num_edges], ...]``."""
    return sorted(Bucket(int(n), int(e), batch_size + 1) for n, e in spec)


def bucket_for(shard_natoms: Sequence[np.ndarray], shard_edges: Sequence[np.ndarray],
               buckets: Sequence[Bucket]) -> Bucket:
    """The smallest bucket that holds every shard (each shard: the atom counts and edge capacities of its
    structures): every rank computes the same one from every rank's structures."""
    nodes = max(int(np.sum(s)) for s in shard_natoms)
    edges = max(int(np.sum(s)) for s in shard_edges)
    graphs = max(len(s) for s in shard_natoms)
    for bucket in smallest_first(buckets):
        if bucket.holds(nodes, edges, graphs):
            return bucket
    raise ConfigError(
        f"a batch of {graphs} structures with {nodes} atoms (up to {edges} edges) fits no bucket "
        f"{[(b.num_nodes, b.num_edges) for b in buckets]}; enlarge 'buckets' in the config or leave it empty")


def check_buckets(natoms: Sequence[int], edges: Sequence[int], local_batch: int, buckets: Sequence[Bucket],
                  what: str) -> None:
    """Refuse, before training, buckets that some batch could not fit (the ``local_batch`` largest structures)."""
    natoms = np.asarray(natoms, dtype=np.int64)
    count = min(local_batch, len(natoms))
    nodes, edge_total = largest_batch(natoms, np.asarray(edges, dtype=np.int64), count)
    if not any(b.holds(nodes, edge_total, count) for b in buckets):
        biggest = smallest_first(buckets)[-1]
        raise ConfigError(
            f"config key 'buckets': the largest bucket {[biggest.num_nodes, biggest.num_edges]} cannot hold a batch "
            f"of the {count} largest {what} structures ({nodes} atoms plus one padding atom, up to {edge_total} "
            "edges); enlarge it or leave 'buckets' empty to have them chosen")


def pad_to_bucket(batch: AtomGraphs, bucket: Bucket) -> AtomGraphs:
    return pad_batch(batch, bucket.num_nodes, bucket.num_edges, bucket.num_graphs)


def padding_fraction(natoms: Sequence[int], edges: Sequence[int], batch_size: int, buckets: Sequence[Bucket],
                     seed: int = 0, batches: Optional[Tuple[np.ndarray, np.ndarray]] = None) -> dict:
    """Expected fractions of padded nodes and edges (``batches``' node and edge totals, else simulated shuffled
    batches; edges counted at their capacities, so the true edge padding is a little larger)."""
    natoms, edges = np.asarray(natoms, dtype=np.int64), np.asarray(edges, dtype=np.int64)
    nodes, totals = batches if batches is not None else simulate_batches(natoms, edges, min(batch_size, len(natoms)),
                                                                        epochs=20, seed=seed)
    nodes, totals = np.asarray(nodes, np.int64), np.asarray(totals, np.int64)
    padded_nodes, padded_edges = np.zeros(len(nodes)), np.zeros(len(nodes))
    left = np.ones(len(nodes), bool)
    for bucket in smallest_first(buckets):  # as bucket_for chooses
        fits = left & (nodes < bucket.num_nodes) & (totals <= bucket.num_edges)
        padded_nodes[fits], padded_edges[fits] = bucket.num_nodes, bucket.num_edges
        left &= ~fits
    return {"nodes": float(1 - nodes.sum() / padded_nodes.sum()), "edges": float(1 - totals.sum() / padded_edges.sum())}
