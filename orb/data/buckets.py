"""Static batch shapes: a few padded bucket sizes chosen from the steps a run will take.

A graph-mode step compiles once per input shape. Batches are padded up to the smallest bucket
that fits, so a run compiles at most ``len(buckets)`` times. The bucket of a step is chosen from
each structure's atom count and edge capacity (an upper bound on its edges under any rotation,
computed once before training), so every data-parallel rank can compute every rank's needs and
all ranks pick the same bucket at every step. Buckets are planned on the run's own steps (the
samplers' plans of its first epochs, tails included); a spare bucket holding the worst possible
batch is compiled only if a later step needs it.
"""

from dataclasses import dataclass, field
from typing import List, Sequence, Tuple

import numpy as np

from orb.data.batching import pad_batch
from orb.data.graphs import AtomGraphs
from orb.errors import ConfigError

MAX_BUCKETS = 16


@dataclass(frozen=True, order=True)
class Bucket:
    """A padded batch shape: nodes, edges and graphs (one more node and graph than a batch may hold,
    for the padding)."""

    num_nodes: int
    num_edges: int
    num_graphs: int
    spare: bool = field(default=False, compare=False)  # the worst case, compiled only if a step needs it

    def holds(self, nodes: int, edges: int, graphs: int) -> bool:
        return nodes < self.num_nodes and edges <= self.num_edges and graphs < self.num_graphs

    def fits(self, batch: AtomGraphs) -> bool:
        return self.holds(batch.num_nodes, batch.num_edges, batch.num_graphs)


def smallest_first(buckets: Sequence[Bucket]) -> List[Bucket]:
    """Buckets in the order a batch tries them: fewest edges (most of a step's work) first."""
    return sorted(buckets, key=lambda b: (b.num_edges, b.num_nodes))


def round_up(x: int, multiple: int) -> int:
    return int(-(-x // multiple) * multiple)


def largest_batch(natoms: np.ndarray, edges: np.ndarray, batch_size: int) -> Tuple[int, int]:
    """Node and edge totals no batch of ``batch_size`` structures can exceed."""
    return int(np.sort(natoms)[-batch_size:].sum()), int(np.sort(edges)[-batch_size:].sum())


COMPILE_COST_STEPS = 500  # one more compiled shape is worth it if it saves this many steps' padded work (auto)
AUTO_MAX_BUCKETS = 8


def candidate_caps(totals: np.ndarray, multiple: int) -> np.ndarray:
    """Edge capacities a bucket may take: fine quantiles of the steps' edge totals, the tail resolved to its
    largest step (a top bucket far above every step actually seen is padding paid on every step it takes)."""
    levels = np.unique(np.concatenate([np.linspace(0, 1, 257), 1 - np.logspace(-7, -1, 13)]))
    caps = np.unique([round_up(int(q), multiple) for q in np.quantile(totals, levels)])
    return caps[caps > 0] if (caps > 0).any() else np.array([multiple])


def _best_caps(totals: np.ndarray, caps: np.ndarray, max_buckets: int) -> List[Tuple[float, List[int]]]:
    """For k = 1..max_buckets buckets: the least padded edges of the steps (sorted ``totals``) over subsets of
    ``caps`` that include the largest, and that subset (exact dynamic programme, vectorised over caps)."""
    n = len(caps)
    held = np.searchsorted(totals, caps, side="right").astype(np.float64)  # steps with total <= cap
    cost = caps * held  # one bucket per cap, holding every step below it
    back: List[np.ndarray] = []
    results = [(float(cost[-1]), [n - 1])]
    lower = np.tril(np.ones((n, n), bool), -1)  # [j, i]: i < j
    for _ in range(2, max_buckets + 1):
        # with cap j last: min over a previous last cap i < j of cost[i] + caps[j] * (held[j] - held[i])
        options = np.where(lower, cost[None, :] - caps[:, None] * held[None, :], np.inf)
        previous = options.argmin(1)
        extended = options[np.arange(n), previous] + caps * held
        better = extended < cost
        back.append(np.where(better, previous, -1))
        cost = np.where(better, extended, cost)
        chosen, j = [n - 1], n - 1
        for links in reversed(back):
            if links[j] < 0:
                continue
            j = int(links[j])
            chosen.append(j)
        results.append((float(cost[-1]), sorted(chosen)))
    return results


def plan_buckets(nodes: np.ndarray, edges: np.ndarray, graphs: int, worst: Tuple[int, int], max_buckets: int = 0,
                 run_steps: int = 0, multiple: int = 8) -> List[Bucket]:
    """Bucket shapes for steps like the sample (``nodes``/``edges``: per sample step, what its bucket must hold;
    e.g. the run's first epochs, as the samplers plan them), least padded edges first.

    The edge capacities are chosen among fine quantiles of the sample's edge totals, its largest step
    included, by an exact dynamic programme; each bucket's node capacity is the largest of the steps
    it holds. ``max_buckets`` 0 chooses the count: the fewest whose padded work over ``run_steps``
    steps plus one compilation per bucket (as :data:`COMPILE_COST_STEPS` steps) is least. When a step
    could exceed every planned bucket (``worst``: the atoms and edges no step exceeds), a spare
    bucket of the worst case is added: it compiles only if a step needs it.
    """
    nodes, edges = np.asarray(nodes, np.int64), np.asarray(edges, np.int64)
    order = np.argsort(edges, kind="stable")
    nodes, edges = nodes[order], edges[order]
    caps = candidate_caps(edges, multiple)
    options = _best_caps(edges, caps, max_buckets or AUTO_MAX_BUCKETS)
    if max_buckets:
        _, chosen = options[-1]
    else:
        steps = max(run_steps, len(edges))

        def total_work(option):
            padded, picked = option
            mean = padded / len(edges)
            return mean * steps + len(picked) * COMPILE_COST_STEPS * mean

        _, chosen = min(options, key=total_work)
    held = np.searchsorted(edges, caps[chosen], side="right")
    buckets, low = [], 0
    for j, high in zip(chosen, held):
        node_cap = round_up(int(nodes[low:high].max(initial=0)) + 1, multiple)
        buckets.append(Bucket(node_cap, int(caps[j]), graphs))
        low = high
    # a bucket's node capacity holds at least every smaller bucket's steps
    buckets = [Bucket(max(b.num_nodes for b in buckets[:k + 1]), b.num_edges, graphs) for k, b in enumerate(buckets)]
    top = buckets[-1]
    spare_nodes, spare_edges = round_up(worst[0] + 1, multiple), round_up(max(worst[1], 1), multiple)
    if spare_nodes > top.num_nodes or spare_edges > top.num_edges:
        buckets.append(Bucket(max(spare_nodes, top.num_nodes), max(spare_edges, top.num_edges), graphs, spare=True))
    return buckets


def parse_buckets(spec: Sequence[Sequence[int]], batch_size: int) -> List[Bucket]:
    """Buckets given explicitly as ``[[num_nodes, num_edges], ...]``."""
    return sorted(Bucket(int(n), int(e), batch_size + 1) for n, e in spec)


def assign_buckets(nodes: np.ndarray, edges: np.ndarray, graphs: np.ndarray, buckets: Sequence[Bucket]) -> np.ndarray:
    """Per step (its largest rank part's atoms, edge capacity and structures), the index in ``buckets`` of the
    smallest one that holds it: every rank computes the same from every rank's structures."""
    nodes, edges, graphs = (np.asarray(a, np.int64) for a in (nodes, edges, graphs))
    chosen = np.full(len(nodes), -1, np.int64)
    for bucket in smallest_first(buckets):
        fits = (chosen < 0) & (nodes < bucket.num_nodes) & (edges <= bucket.num_edges) & (graphs < bucket.num_graphs)
        chosen[fits] = buckets.index(bucket)
    if (chosen < 0).any():
        k = int(np.argmax(chosen < 0))
        raise ConfigError(
            f"a batch of {graphs[k]} structures with {nodes[k]} atoms (up to {edges[k]} edges) fits no bucket "
            f"{[(b.num_nodes, b.num_edges) for b in buckets]}; enlarge 'buckets' in the config or leave it empty")
    return chosen


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
