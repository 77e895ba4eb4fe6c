"""Static batch shapes: a few padded bucket sizes chosen from the dataset's size distribution.

A graph-mode step compiles once per input shape. Batches are padded up to the smallest bucket
that fits, so a run compiles at most ``len(buckets)`` times. The bucket of a step is chosen from
atom counts alone (known for every row before any graph is built) and an upper bound on the
edges, so every data-parallel rank can compute every rank's needs and all ranks pick the same
bucket at every step; the largest bucket fits the worst possible batch, checked before training.
"""

from dataclasses import dataclass
from typing import List, Optional, Sequence

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


def round_up(x: int, multiple: int) -> int:
    return int(-(-x // multiple) * multiple)


def edge_bound(natoms: np.ndarray, max_neighbors: int) -> int:
    """Upper bound on the edges of structures with ``natoms`` atoms: at most k per atom."""
    return int(np.asarray(natoms, dtype=np.int64).sum() * max_neighbors)


def simulate_batch_nodes(natoms: np.ndarray, batch_size: int, epochs: int = 50, seed: int = 0) -> np.ndarray:
    """Node totals of randomly shuffled batches over a number of simulated epochs."""
    rng = np.random.default_rng(seed)
    totals = []
    for _ in range(epochs):
        order = natoms[rng.permutation(len(natoms))]
        totals.extend(order[i:i + batch_size].sum() for i in range(0, len(order), batch_size))
    return np.asarray(totals)


def plan_buckets(natoms: Sequence[int], batch_size: int, max_neighbors: int = 20, max_buckets: int = 3,
                 multiple: int = 8, seed: int = 0) -> List[Bucket]:
    """At most ``max_buckets`` bucket shapes minimising the expected padded size (exact, by dynamic programming).

    The largest bucket holds the ``batch_size`` largest structures; the smaller ones are chosen
    among quantiles of simulated batch node totals. Edge capacity is ``max_neighbors`` per node,
    an upper bound for any batch that fits the node capacity.
    """
    natoms = np.asarray(natoms, dtype=np.int64)
    batch_size = min(batch_size, len(natoms))
    top = round_up(int(np.sort(natoms)[-batch_size:].sum()) + 1, multiple)
    totals = np.sort(simulate_batch_nodes(natoms, batch_size, seed=seed))
    caps = sorted({round_up(int(q) + 1, multiple) for q in np.quantile(totals, np.linspace(0.05, 0.95, 19))})
    caps = [c for c in caps if c < top] + [top]
    # cost(i, j): padded nodes of the batches whose smallest fitting cap is caps[j] when the
    # previous chosen cap is caps[i] (i = -1: none); best[k][j]: least cost with k caps ending at j.
    first = np.searchsorted(totals + 1, caps, side="right")  # batches with total + 1 <= cap

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
        chosen.append(caps[j])
        j, k = back[k][j], k - 1
    return [Bucket(c, c * max_neighbors, batch_size + 1) for c in sorted(chosen)]


def parse_buckets(spec: Sequence[Sequence[int]], batch_size: int) -> List[Bucket]:
    """Buckets given explicitly as ``[[num_nodes, num_edges], ...]``."""
    return sorted(Bucket(int(n), int(e), batch_size + 1) for n, e in spec)


def bucket_for(shard_natoms: Sequence[np.ndarray], buckets: Sequence[Bucket], max_neighbors: int) -> Bucket:
    """The smallest bucket that holds every shard (each shard: the atom counts of its structures)."""
    nodes = max(int(np.sum(s)) for s in shard_natoms)
    edges = max(edge_bound(s, max_neighbors) for s in shard_natoms)
    graphs = max(len(s) for s in shard_natoms)
    for bucket in sorted(buckets):
        if bucket.holds(nodes, edges, graphs):
            return bucket
    raise ConfigError(
        f"a batch of {graphs} structures with {nodes} atoms (up to {edges} edges) fits no bucket "
        f"{[(b.num_nodes, b.num_edges) for b in buckets]}; enlarge 'buckets' in the config or leave it empty")


def check_buckets(natoms: Sequence[int], local_batch: int, buckets: Sequence[Bucket], max_neighbors: int,
                  what: str) -> None:
    """Refuse, before training, buckets that some batch could not fit (the ``local_batch`` largest structures)."""
    largest = np.sort(np.asarray(natoms, dtype=np.int64))[-local_batch:]
    biggest = max(buckets)
    if not biggest.holds(int(largest.sum()), edge_bound(largest, max_neighbors), len(largest)):
        raise ConfigError(
            f"config key 'buckets': the largest bucket {[biggest.num_nodes, biggest.num_edges]} cannot hold a batch "
            f"of the {len(largest)} largest {what} structures ({int(largest.sum())} atoms, up to "
            f"{edge_bound(largest, max_neighbors)} edges at {max_neighbors} neighbours per atom, plus one padding "
            "atom); enlarge it or leave 'buckets' empty to have them chosen")


def pad_to_bucket(batch: AtomGraphs, bucket: Bucket) -> AtomGraphs:
    return pad_batch(batch, bucket.num_nodes, bucket.num_edges, bucket.num_graphs)


def padding_fraction(natoms: Sequence[int], batch_size: int, buckets: Sequence[Bucket],
                     max_neighbors: int = 20, seed: int = 0) -> Optional[dict]:
    """Expected fraction of padded nodes (simulated shuffled batches)."""
    natoms = np.asarray(natoms, dtype=np.int64)
    totals = simulate_batch_nodes(natoms, min(batch_size, len(natoms)), epochs=20, seed=seed)
    sizes = np.array(sorted(b.num_nodes for b in buckets))
    padded = sizes[np.minimum(np.searchsorted(sizes, totals + 1), len(sizes) - 1)]
    return {"nodes": float(1 - totals.sum() / padded.sum())}
