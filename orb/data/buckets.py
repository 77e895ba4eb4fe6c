"""Static batch shapes: a few padded bucket sizes chosen from the dataset's size distribution.

A graph-mode step compiles once per input shape. Batches are padded up to the smallest bucket
that fits, so a run compiles at most ``len(buckets)`` times. The largest bucket fits the
``batch_size`` largest structures, so every possible batch has a bucket.
"""

from dataclasses import dataclass
from itertools import combinations
from typing import List, Optional, Sequence

import numpy as np

from orb.data.graphs import AtomGraphs, pad_batch


@dataclass(frozen=True, order=True)
class Bucket:
    """A padded batch shape: nodes, edges and graphs (one more graph than structures, for the padding)."""

    num_nodes: int
    num_edges: int
    num_graphs: int

    def fits(self, batch: AtomGraphs) -> bool:
        return (batch.num_nodes < self.num_nodes and batch.num_edges <= self.num_edges
                and batch.num_graphs < self.num_graphs)


def round_up(x: int, multiple: int) -> int:
    return int(-(-x // multiple) * multiple)


def edges_per_atom_bound(natoms: np.ndarray, max_neighbors: int) -> np.ndarray:
    """Upper bound on a structure's edges: each atom has at most min(k, 27 n - 1) neighbours."""
    return natoms * np.minimum(max_neighbors, 27 * natoms - 1)


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
    """Choose at most ``max_buckets`` bucket shapes minimising the expected padded size.

    The largest bucket holds the ``batch_size`` largest structures; the smaller ones are picked
    among quantiles of simulated batch node totals. Edge capacity is ``max_neighbors`` per node,
    an upper bound for any batch that fits the node capacity.
    """
    natoms = np.asarray(natoms, dtype=np.int64)
    batch_size = min(batch_size, len(natoms))
    largest = int(np.sort(natoms)[-batch_size:].sum())
    totals = simulate_batch_nodes(natoms, batch_size, seed=seed)
    caps = sorted({round_up(int(q) + 1, multiple) for q in np.quantile(totals, np.linspace(0.05, 0.95, 19))})
    top = round_up(largest + 1, multiple)
    caps = [c for c in caps if c < top]
    best, best_cost = (top,), None
    for k in range(0, max_buckets):
        for chosen in combinations(caps, k):
            sizes = np.array(sorted(chosen) + [top])
            cost = sizes[np.searchsorted(sizes, totals + 1)].sum()
            if best_cost is None or cost < best_cost:
                best, best_cost = tuple(sizes.tolist()), cost
    return [Bucket(n, n * max_neighbors, batch_size + 1) for n in best]


def parse_buckets(spec: Sequence[Sequence[int]], batch_size: int) -> List[Bucket]:
    """Buckets given explicitly as ``[[num_nodes, num_edges], ...]``."""
    return sorted(Bucket(int(n), int(e), batch_size + 1) for n, e in spec)


def select_bucket(batch: AtomGraphs, buckets: Sequence[Bucket]) -> Bucket:
    """The smallest bucket that fits ``batch``; a clear error if none does."""
    for bucket in sorted(buckets):
        if bucket.fits(batch):
            return bucket
    raise ValueError(
        f"a batch of {batch.num_graphs} structures, {batch.num_nodes} atoms and {batch.num_edges} edges fits no "
        f"bucket {[(b.num_nodes, b.num_edges) for b in buckets]}; enlarge 'buckets' in the config or leave it empty"
    )


def pad_to_bucket(batch: AtomGraphs, buckets: Sequence[Bucket]) -> AtomGraphs:
    b = select_bucket(batch, buckets)
    return pad_batch(batch, b.num_nodes, b.num_edges, b.num_graphs)


def padding_fraction(natoms: Sequence[int], batch_size: int, buckets: Sequence[Bucket],
                     max_neighbors: int = 20, seed: int = 0) -> Optional[dict]:
    """Expected fraction of padded nodes and edges (edges estimated from the per-atom bound)."""
    natoms = np.asarray(natoms, dtype=np.int64)
    totals = simulate_batch_nodes(natoms, min(batch_size, len(natoms)), epochs=20, seed=seed)
    sizes = np.array(sorted(b.num_nodes for b in buckets))
    padded = sizes[np.minimum(np.searchsorted(sizes, totals + 1), len(sizes) - 1)]
    mean_edges_per_atom = edges_per_atom_bound(natoms, max_neighbors).sum() / natoms.sum()
    real_edges = totals * mean_edges_per_atom
    return {
        "nodes": float(1 - totals.sum() / padded.sum()),
        "edges": float(1 - real_edges.sum() / (padded * max_neighbors).sum()),
    }
