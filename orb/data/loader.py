"""Training batches: which rows each step takes (same plan on every rank) and their padded arrays,
prepared ahead of the device in background worker processes.

A step's plan is a pure function of (seed, epoch, step): every data-parallel rank computes the
same global batches, the same bucket for each step (from all ranks' atom counts) and its own
shard. Preparing a step (reading rows, rotating, building graphs, padding) is done by up to
``workers`` processes a few steps ahead, in order, so the device does not wait for the host;
with ``workers = 0`` it happens inline. Workers are started with ``spawn`` (they import numpy,
scipy and ase, never MindSpore), with the stop signals blocked until they ignore them
(:class:`HelperContext`), and read the database through their own connections.
"""

import logging
import multiprocessing.context
import time
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Callable, Dict, Iterator, Optional, Sequence, Tuple

import numpy as np

from orb.data.buckets import pad_to_bucket
from orb.data.dataset import AseDbDataset
from orb.data.row_results import Ranks
from orb.data.batching import batch_graphs, empty_batch
from orb.data.neighbours import native_search
from orb.data.plan import Step
from orb.data.tensors import loss_arrays
from orb.errors import DataWorkerError
from orb.host_blas import set_host_blas_threads
from orb.signals import children_start_blocked, die_with_parent, guard_resource_tracker, ignore_stop_signals


def prepare(dataset: AseDbDataset, step: Step, seed: Optional[int], with_stress: bool) -> Tuple[np.ndarray, ...]:
    """The padded loss-input arrays of a step. ``seed`` (None = no augmentation) fixes each row's rotation.

    Each real structure weighs its loss weight (1 unless weighted) / (structures in the global batch):
    summed over ranks, the loss is the mean over the global batch.
    """
    graphs = dataset.get_many(step.indices, [None if seed is None else [seed, step.epoch, i] for i in step.indices])
    batch = batch_graphs(graphs) if graphs else empty_batch(with_stress=dataset.has_stress)
    padded = pad_to_bucket(batch, step.bucket)
    if not with_stress:
        padded.stress = None
    weight = padded.graph_mask.astype(padded.positions.dtype)
    if padded.weight is not None:
        weight = weight * padded.weight
    weight = weight / max(step.global_count, 1)
    return loss_arrays(padded, weight)


log = logging.getLogger("orb")
WORKER_DEATH = "killed by the operating system, often for lack of memory: lower data_workers or batch_size"
_worker_datasets: Dict[str, AseDbDataset] = {}


class _BlockedSpawnProcess(multiprocessing.context.SpawnProcess):
    """A spawned process started with the stop signals blocked (:func:`orb.signals.children_start_blocked`)."""

    def start(self):
        with children_start_blocked():
            super().start()


class HelperContext(multiprocessing.context.SpawnContext):
    """The data workers' multiprocessing context: ``spawn`` (they import numpy, scipy and ase, never MindSpore), each
    worker started with the stop signals blocked until its initializer ignores them, and the resource tracker guarded
    (:func:`orb.signals.guard_resource_tracker`): a job's signal to every process cannot end a worker still starting
    (it did: the pool broke and was started again, twice and the run failed)."""

    Process = _BlockedSpawnProcess

    def __init__(self):
        super().__init__()
        guard_resource_tracker()


def _init_worker(datasets: Dict[str, AseDbDataset]) -> None:
    ignore_stop_signals()  # the training process decides when to stop (and saves first); blocked until now
    die_with_parent()  # ... and a killed training process leaves no worker behind
    set_host_blas_threads(1)  # a worker builds graphs on one thread: a BLAS pool in it would only spin
    _worker_datasets.update(datasets)
    logging.getLogger("orb").setLevel(logging.ERROR)  # e.g. "no C++ compiler": the main process said it once


def _prepare_in_worker(args):
    name, step, seed, with_stress = args
    return prepare(_worker_datasets[name], step, seed, with_stress)


def _rows_in_worker(args):
    """A per-row pass (``count_edge_capacities``, ``check_rows``) over rows ``start:stop`` of dataset ``name``."""
    name, method, start, stop = args
    return getattr(_worker_datasets[name], method)(start, stop)


class BatchLoader:
    """Prepared steps of named datasets in order, ``depth`` steps ahead, from ``workers`` processes (0: inline).

    ``wait_time`` accumulates the seconds the consumer waited for a batch that was not ready.
    """

    def __init__(self, datasets: Dict[str, AseDbDataset], workers: int = 0, depth: int = 4):
        self.datasets, self.workers, self.depth = dict(datasets), int(workers), max(int(depth), 1)
        self.wait_time = 0.0
        self._pool = None

    def add(self, name: str, dataset) -> None:
        """Make ``dataset`` (anything with ``get`` and ``has_stress``) iterable as ``name``; running workers are
        stopped, so the next :meth:`iterate` starts workers that hold it."""
        self.datasets[name] = dataset
        self.close()

    def _new_pool(self) -> ProcessPoolExecutor:
        native_search()  # build the neighbour search once, here, before the workers load it
        return ProcessPoolExecutor(self.workers, mp_context=HelperContext(), initializer=_init_worker,
                                   initargs=(self.datasets,))

    def _ensure_pool(self):
        if self._pool is None and self.workers > 0:
            self._pool = self._new_pool()
        return self._pool

    def _pass(self, name: str, method: str, what: str, chunk: int = 256) -> Optional[Callable[[int, int], np.ndarray]]:
        """Dataset ``name``'s per-row ``method`` over a range of rows, by the workers (None without workers).

        Their own short-lived pool: set-up that fails after this (a bad checkpoint, a refused resume)
        leaves no worker processes behind; the training pool starts with the first epoch."""
        if self.workers == 0:
            return None
        dataset = self.datasets[name]

        def run(start: int, stop: int) -> np.ndarray:
            ranges = [(name, method, a, min(a + chunk, stop)) for a in range(start, stop, chunk)]
            if not ranges:
                return np.zeros(0, np.int64)
            with self._new_pool() as pool:
                try:
                    return np.concatenate(list(pool.map(_rows_in_worker, ranges)))
                except BrokenProcessPool:
                    raise DataWorkerError(f"a data worker died while {what} of {dataset.source} "
                                          f"({WORKER_DEATH})") from None

        return run

    def edge_capacities(self, name: str, ranks: Optional[Ranks] = None, chunk: int = 256) -> np.ndarray:
        """Dataset ``name``'s edge capacities (:meth:`AseDbDataset.edge_capacities`), counted by the workers
        when not cached (in a data-parallel run, this rank's share of the rows)."""
        return self.datasets[name].edge_capacities(self._pass(name, "count_edge_capacities", "counting the "
                                                              "neighbours", chunk), ranks)

    def census(self, name: str, ranks: Optional[Ranks] = None, chunk: int = 256) -> np.ndarray:
        """Dataset ``name``'s census of its labels (:meth:`AseDbDataset.census`), every row read and checked by
        the workers when not cached (in a data-parallel run, this rank's share of the rows)."""
        return self.datasets[name].census(self._pass(name, "check_rows", "checking the rows", chunk), ranks)

    def iterate(self, name: str, steps: Sequence[Step], seed: Optional[int],
                with_stress: bool) -> Iterator[Tuple[Step, tuple]]:
        pool = self._ensure_pool()
        if pool is None:
            for step in steps:
                start = time.perf_counter()
                arrays = prepare(self.datasets[name], step, seed, with_stress)
                self.wait_time += time.perf_counter() - start
                yield step, arrays
            return
        pending: deque = deque()  # [step, its future (None: not submitted to the current workers)]
        todo = iter(steps)
        replaced = None  # the step at which the workers were last replaced

        def refill() -> None:
            while len(pending) < self.depth:
                following = next(todo, None)
                if following is None:
                    break
                pending.append([following, None])
            for item in pending:
                if item[1] is None:
                    item[1] = self._pool.submit(_prepare_in_worker, (name, item[0], seed, with_stress))

        while True:
            start = time.perf_counter()
            try:
                refill()
                if not pending:
                    return
                arrays = pending[0][1].result()
            except BrokenProcessPool:  # a worker died (e.g. the out-of-memory killer): new workers, same steps
                step = pending[0][0]
                if replaced == step:
                    raise DataWorkerError(f"data workers died twice while preparing epoch {step.epoch + 1}'s steps "
                                          f"({WORKER_DEATH})") from None
                replaced = step
                # (not a stop signal: workers start with them blocked and ignore them)
                log.warning("a data worker died while preparing epoch %d's steps (%s); starting new workers and "
                            "preparing those steps again", step.epoch + 1, WORKER_DEATH)
                self.close()
                self._pool = self._new_pool()
                for item in pending:
                    item[1] = None
                continue
            self.wait_time += time.perf_counter() - start
            yield pending.popleft()[0], arrays

    def close(self) -> None:
        """Stop the workers now (they ignore stop signals, so they are killed, not asked). A worker killed while it
        sent a batch leaves part of one in the results' pipe, and the pool's thread reading it waited for the rest for
        ever, and the interpreter's exit for that thread (a failed run never ended): this process's end of the pipe is
        closed once the workers are gone, so that the read ends and the thread with it.

        That thread is joined before this returns: left running, it closed its wake-up pipe while the interpreter's
        exit wrote to it (``concurrent.futures``' unlocked ``_python_exit``), and a stopped rank printed a traceback
        (CI, 2026-12-01)."""
        if self._pool is not None:
            processes = list((getattr(self._pool, "_processes", None) or {}).values())
            results = getattr(self._pool, "_result_queue", None)  # (the pool lets go of it at its shutdown)
            thread = getattr(self._pool, "_executor_manager_thread", None)
            for process in processes:
                process.kill()
            for process in processes:
                process.join()
            if results is not None:
                results._writer.close()
            self._pool.shutdown(wait=False, cancel_futures=True)
            if thread is not None:
                thread.join(timeout=60)  # it ends at once: its workers are gone and its results' pipe is closed
            self._pool = None
