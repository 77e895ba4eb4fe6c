"""The order of a run's structures: each sampler turns an epoch number into that epoch's global batches, split among
the data-parallel ranks (:class:`orb.data.plan.Shards`), the same on every rank and after a resume.

* :class:`EpochSampler`: training on one source, one permutation per epoch;
* :class:`MixedSampler`: training on the target with replay structures in a fixed share of every step;
* :class:`PackedSampler`: evaluation, every structure once, packed by size.
"""

from typing import List

import numpy as np

from orb.data.buckets import Bucket
from orb.data.plan import Shards, even_shards, fixed_batches, pack_by_size


class EpochSampler:
    """Shuffled global batches of dataset positions, one permutation per epoch.

    The permutation is derived from ``(seed, epoch)``, so a resumed run replays the same order and
    every data-parallel rank computes the same global batches (each then takes its part).
    """

    def __init__(self, num_items: int, batch_size: int, seed: int = 0, shuffle: bool = True):
        if num_items < 1:
            raise ValueError("EpochSampler needs at least one item")
        if batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        self.num_items, self.batch_size, self.seed, self.shuffle = num_items, batch_size, seed, shuffle

    def __len__(self) -> int:
        """Steps per epoch."""
        return -(-self.num_items // self.batch_size)

    def order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.num_items)
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_items)

    def shards(self, epoch: int, world: int):
        """The epoch's global batches, each split among ``world`` ranks (:class:`orb.data.plan.Shards`)."""
        return fixed_batches(self.order(epoch), self.batch_size, world)

    def global_batches(self, epoch: int) -> List[np.ndarray]:
        shards = self.shards(epoch, 1)
        return [shards.global_batch(s) for s in range(len(shards))]


class MixedSampler:
    """Global batches of ``target_count`` target positions (mixture positions 0...) and replay positions
    (after them) in a fixed ratio.

    A full step holds ``batch_size - replay_step`` target and ``replay_step`` replay structures; the
    epoch's last step holds fewer target structures and proportionally fewer replay ones (rounded).
    Target structures follow a permutation per epoch, so an epoch is one pass over the target. Replay
    structure ``j`` of the run (counted from its first step) is position ``j % R`` of the permutation
    number ``j // R`` of the ``R`` replay structures. Each global batch is shuffled, so data-parallel
    ranks (which take contiguous parts) each get both kinds.
    """

    def __init__(self, target_count: int, replay_count: int, batch_size: int, replay_step: int, seed: int = 0):
        if target_count < 1 or replay_count < 1:
            raise ValueError("MixedSampler needs target and replay structures")
        if not 1 <= replay_step < batch_size:
            raise ValueError(f"replay structures per step must be in [1, {batch_size}), got {replay_step}")
        self.target_count, self.replay_count = target_count, replay_count
        self.batch_size, self.replay_step, self.seed = batch_size, replay_step, seed
        self.target_step = batch_size - replay_step

    def __len__(self) -> int:
        """Steps per epoch."""
        return -(-self.target_count // self.target_step)

    def _replay_in(self, target: int) -> int:
        """Replay structures in a step holding ``target`` target structures (rounded half up)."""
        return (target * self.replay_step + self.target_step // 2) // self.target_step

    def replay_per_epoch(self) -> int:
        full, last = divmod(self.target_count, self.target_step)
        return full * self.replay_step + (self._replay_in(last) if last else 0)

    def _replay_stream(self, start: int, count: int) -> np.ndarray:
        """Replay positions ``start`` to ``start + count`` of the run's stream."""
        j = np.arange(start, start + count)
        out = np.empty(count, np.int64)
        for cycle in np.unique(j // self.replay_count):
            here = j // self.replay_count == cycle
            order = np.random.default_rng([self.seed, 1, int(cycle)]).permutation(self.replay_count)
            out[here] = order[j[here] % self.replay_count]
        return out

    def global_batches(self, epoch: int) -> List[np.ndarray]:
        targets = np.random.default_rng([self.seed, epoch]).permutation(self.target_count)
        parts = [targets[i:i + self.target_step] for i in range(0, self.target_count, self.target_step)]
        counts = [self._replay_in(len(p)) for p in parts]
        replay = self._replay_stream(epoch * self.replay_per_epoch(), sum(counts)) + self.target_count
        batches, used = [], 0
        for step, (part, count) in enumerate(zip(parts, counts)):
            batch = np.concatenate([part, replay[used:used + count]])
            used += count
            batches.append(np.random.default_rng([self.seed, 2, epoch, step]).permutation(batch))
        return batches

    def shards(self, epoch: int, world: int):
        """The epoch's global batches, each split among ``world`` ranks (:class:`orb.data.plan.Shards`)."""
        batches = self.global_batches(epoch)
        return even_shards(np.concatenate(batches), np.array([len(b) for b in batches]), world)


class PackedSampler:
    """Evaluation steps that pad little: every structure once, packed by size (:func:`pack_by_size`), the same
    plan at every epoch (packed once per number of ranks)."""

    def __init__(self, natoms: np.ndarray, edges: np.ndarray, limit: Bucket):
        self.natoms, self.edges, self.limit = natoms, edges, limit
        self._packed: dict = {}

    def shards(self, epoch: int, world: int) -> Shards:
        if world not in self._packed:
            self._packed[world] = pack_by_size(self.natoms, self.edges, self.limit, world)
        return self._packed[world]
