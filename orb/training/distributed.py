"""What a data-parallel run hands to the shared training loop (``finetune_parallel.py`` builds it).

:class:`DataParallel` with its defaults is one device. In an ``msrun`` job it carries the rank,
the number of ranks and what the compiled step uses to combine ranks: ``grad_reducer`` makes the
gradient reducer (``nn.DistributedGradReducer``) for the trained parameters, ``all_reduce`` sums
the normalisers' batch statistics, ``reduce_scatter`` and ``all_gather`` serve the sharded
optimizer. Host-side helpers sum metrics over ranks and check that all ranks start from the same
weights.
"""

import logging
from dataclasses import dataclass
from typing import Callable, Dict, Optional

import numpy as np

from orb.errors import ClusterError, ConfigError

log = logging.getLogger("orb")


@dataclass
class DataParallel:
    rank: int = 0
    world_size: int = 1
    grad_reducer: Optional[Callable] = None  # trained parameters -> a cell summing their gradients over ranks
    all_reduce: Optional[Callable] = None  # in-graph sum over ranks
    reduce_scatter: Optional[Callable] = None  # in-graph sum over ranks, rank r keeping the r-th slice (axis 0)
    all_gather: Optional[Callable] = None  # in-graph concatenation over ranks (along axis 0)
    shard_optimizer: bool = False

    @property
    def is_main(self) -> bool:
        """Rank 0 writes the log file, metrics.jsonl and checkpoints."""
        return self.rank == 0

    @property
    def parallel(self) -> bool:
        return self.world_size > 1

    def sum(self, values: np.ndarray) -> np.ndarray:
        """Element-wise sum of a small host array over all ranks (metrics, flags, checksums; float64 in and out), the
        same bits on every rank whatever the number of ranks and however the collective adds: each rank's values
        travel in a row of their own (:meth:`sum_shares`, exact) and the rows are added here in float64, in rank
        order. (A float32 all-reduce adds the ranks' values in float32: 8 equal sums of row positions near 7.5e9
        came back 4,096 off, and the replay check refused identical choices.) Its message is ``world_size`` times
        the array: for an array each of whose elements one rank fills, :meth:`sum_shares`."""
        values = np.asarray(values, dtype=np.float64)
        if not self.parallel:
            return values
        rows = np.zeros((self.world_size,) + values.shape, np.float64)
        rows[self.rank] = values
        total = np.zeros(values.shape, np.float64)
        for row in self.sum_shares(rows):
            total += row
        return total

    def sum_shares(self, values: np.ndarray, chunk: int = 1 << 24) -> np.ndarray:
        """Element-wise sum over all ranks of a host array each of whose elements at most one rank makes non-zero (a
        rank's share of the rows, rank 0's arrays, small whole numbers), exact (float64 in and out), a value plus
        zeros being exact: each value travels as one float32 part, or as two or three (24 bits each, float64 has 53)
        where some rank's values need them (a float64 model's outputs), in all-reduces of at most ``chunk`` values
        (a replay's 1.5 M descriptors of 256 values were one 4.6 GB message per rank)."""
        values = np.asarray(values, dtype=np.float64)
        if not self.parallel:
            return values
        flat, total = values.reshape(-1), np.zeros(values.size, np.float64)
        rest = flat
        for _ in range(self._float32_parts(flat)):
            part = rest.astype(np.float32)
            total += self._all_reduce_chunks(part, chunk)  # (high + middle) + low: each sum exact
            rest = rest - part.astype(np.float64)  # (exact in float64)
        return total.reshape(values.shape)

    def _float32_parts(self, values: np.ndarray) -> int:
        """How many float32 parts the values of every rank need to travel exactly (1-3), the same on every rank."""
        from mindspore import Tensor

        rest, needed = values, 1
        for parts in (1, 2):
            rest = rest - rest.astype(np.float32).astype(np.float64)
            if np.any(rest != 0):
                needed = parts + 1
        votes = np.zeros(3, np.float32)
        votes[needed - 1] = 1.0
        counted = self.all_reduce(Tensor(votes)).asnumpy()  # (small counts: exact)
        return int(np.flatnonzero(counted > 0.5).max()) + 1

    def _all_reduce_chunks(self, values: np.ndarray, chunk: int) -> np.ndarray:
        from mindspore import Tensor

        return np.concatenate([self.all_reduce(Tensor(np.ascontiguousarray(values[i:i + chunk]))).asnumpy()
                               for i in range(0, len(values), chunk)] or [np.zeros(0, np.float32)]).astype(np.float64)

    def on_main_for_all(self, action: Callable[[], object], what: str):
        """``action()`` on rank 0 (a save, a read of the run folder), and its result there, returned on every rank only
        once rank 0 has finished it. msrun SIGKILLs the other workers as soon as one exits non-zero, so a rank that
        left a save at once and exited on a stop (75) killed rank 0 in the middle of writing that stop's checkpoint.
        A failure on rank 0 is raised there, and on the others as a :class:`ClusterError` naming ``what`` (rank 0's
        log says why)."""
        result, failure = None, None
        if self.is_main:
            try:
                result = action()
            except BaseException as exc:  # raised below, after every rank has heard of it (a stop, a Ctrl-C too:
                failure = exc              # the others would wait in the all-reduce)
        failed = self.sum(np.array([failure is not None], np.float64))[0] if self.parallel else failure
        if failure is not None:
            raise failure
        if failed:
            raise ClusterError(f"rank 0 could not {what} (its log says why)")
        return result

    def share_from_main(self, arrays: Optional[Dict[str, np.ndarray]], chunk: int = 1 << 24) -> Dict[str, np.ndarray]:
        """Rank 0's named arrays on every rank (``arrays`` is read on rank 0 only): what rank 0 read from a shared
        file system reaches the others through the collective, not N more reads of the file.

        The names, shapes and types travel first (as JSON bytes), then the float32 values in float32 sums
        of ``chunk`` elements (a value plus zeros is exact), the rest through :meth:`sum_shares` (exact).
        """
        import json

        if not self.parallel:
            return dict(arrays)
        layout = json.dumps([[k, list(v.shape), str(v.dtype)] for k, v in arrays.items()]).encode() \
            if self.is_main else b""
        size = int(self.sum_shares(np.array([len(layout)], np.float64))[0])
        raw = np.frombuffer(layout, np.uint8).astype(np.float64) if self.is_main else np.zeros(size)
        entries = json.loads(bytes(np.rint(self.sum_shares(raw)).astype(np.uint8)).decode())
        out = {}
        floats = [e for e in entries if e[2] == "float32"]
        flat = (np.concatenate([arrays[k].reshape(-1) for k, _, _ in floats]) if self.is_main and floats
                else np.zeros(sum(int(np.prod(shape)) for _, shape, _ in floats), np.float32))
        summed = self._all_reduce_chunks(flat, chunk).astype(np.float32)  # (float32 values: one part, exact)
        offset = 0
        for name, shape, _ in floats:
            n = int(np.prod(shape))
            out[name] = summed[offset:offset + n].reshape(shape)
            offset += n
        for name, shape, dtype in entries:
            if dtype != "float32":
                values = arrays[name].astype(np.float64) if self.is_main else np.zeros(shape)
                out[name] = np.rint(self.sum_shares(values)).astype(dtype) \
                    if np.issubdtype(np.dtype(dtype), np.integer) else self.sum_shares(values).astype(dtype)
        return out

    def gather(self, values: np.ndarray) -> np.ndarray:
        """Concatenation over ranks of equally sized float32 host arrays (rank order)."""
        if not self.parallel:
            return np.asarray(values)
        from mindspore import Tensor

        return self.all_gather(Tensor(np.ascontiguousarray(values, dtype=np.float32))).asnumpy()

    def gather_float64(self, values: np.ndarray) -> np.ndarray:
        """Concatenation over ranks of equally sized float64 host arrays, bit for bit: each value travels as its 8
        bytes (small integers, exact in float32), so a resume continues from exactly the sums a rank held."""
        values = np.ascontiguousarray(values, dtype=np.float64)
        if not self.parallel:
            return values.copy()
        raw = self.gather(values.view(np.uint8).astype(np.float32))
        return np.ascontiguousarray(np.rint(raw).astype(np.uint8)).view(np.float64)

    def check_same_parameters(self, model) -> None:
        """All ranks must start from identical weights: compare cheap checksums across ranks."""
        if not self.parallel:
            return
        sums = [(float(p.asnumpy().astype(np.float64).sum()), float(np.abs(p.asnumpy()).astype(np.float64).sum()))
                for _, p in model.parameters_and_names()]
        checksum = np.array(sums).sum(axis=0)
        mean = self.sum(checksum) / self.world_size
        spread = np.sqrt(self.sum((checksum - mean) ** 2) / self.world_size)
        if np.any(spread > 1e-6 * np.maximum(np.abs(checksum), 1.0)):
            raise ConfigError(f"rank {self.rank}: model parameters differ between ranks (checksum spread {spread}); "
                               "all ranks must load the same checkpoint and use the same random_seed")
        log.info("parameters identical on all %d ranks (checksum %.6e)", self.world_size, checksum[1])


# MindSpore's collectives, as a failed one names itself ("Launch kernel failed, name:Default/AllReduce-op0")
COLLECTIVES = ("AllReduce", "AllGather", "ReduceScatter", "Broadcast", "Barrier", "AllToAll", "Send", "Receive")


def lost_peer(exc: RuntimeError) -> Optional[ClusterError]:
    """The one line for MindSpore's error of a collective whose peer is gone (msrun's scheduler or another worker
    killed: a traceback on every rank), or None for any other error (a fault whose traceback must show)."""
    text = str(exc).strip()
    first = text.splitlines()[0] if text else ""
    if not any(word in first for word in COLLECTIVES):
        return None
    return ClusterError(f"the job's communication failed ({first}): msrun's scheduler or another worker ended; the "
                        "last checkpoint is kept (--resume auto continues from it)")
