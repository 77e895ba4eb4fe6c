"""The run's data: its databases opened, checked and surveyed once; the training stream and evaluation sets; the
bucket shapes and each epoch's steps, the same on every data-parallel rank.

:func:`open_databases` turns the config's data paths into checked databases (indexing other formats
first, on rank 0 while the others wait), reads or computes each one's row census and neighbour counts,
and refuses what cannot train (too few structures for the ranks); :func:`trains_stress` decides the stress loss
and marks the structures without stress.
:class:`RunData` then holds what a run iterates: ``train_set`` (a :class:`~orb.data.mixture.Mixture`
of the target and any replay rows), its sampler and buckets, and ``val_sets`` (named sources: a
validation file, or the training structures ``val_fraction`` holds out), each with an
:class:`EvaluationPlan`. Nothing here runs a model.
"""

import logging
import math
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import numpy as np

from orb.data.buckets import Bucket, check_buckets, largest_batch, parse_buckets, plan_buckets
from orb.data.dataset import AseDbDataset
from orb.data.formats import LabelKeys, describe_path, readable_database
from orb.data.graphs import capacity_is_counted
from orb.data.loader import BatchLoader
from orb.data.mixture import Mixture, Source, replay_per_step
from orb.data.samplers import EpochSampler, MixedSampler, PackedSampler
from orb.data.plan import (EpochSteps, StepTotals, eval_limit, evaluation_plan, padding_ratio,
                           plan_steps, step_totals)
from orb.errors import ConfigError, DatasetError
from orb.precision import is_float64
from orb.training.config import TrainConfig
from orb.training.run_checks import check_job_size
from orb.training.distributed import DataParallel
from orb.training.val_split import ValSplit

log = logging.getLogger("orb")
PLAN_STRUCTURES = 4_000_000  # the training buckets are planned on the first epochs' steps, up to this many rows
PLAN_EPOCHS = 50  # ... and at most this many epochs (however many the run has: a resume that extends it plans alike)


def readable(path, cfg: TrainConfig, dp: DataParallel, progress: bool) -> str:
    """The ASE SQLite database to read for a data path: itself, or its cached index (orb.data.formats), made by
    rank 0 first while the others wait (each node makes its own when the cache folder is node-local). Any
    failure on rank 0 stops every rank at once, each with one line."""
    keys = LabelKeys(cfg.energy_key, cfg.forces_key, cfg.stress_key, cfg.charge_key, cfg.spin_key)
    error: Optional[Exception] = None
    if dp.is_main:
        try:
            found = readable_database(path, keys, progress)
        except Exception as exc:  # reported on every rank below, then re-raised here
            error = exc
    failed = dp.sum(np.array([1.0 if error is not None else 0.0]))[0] > 0  # the others wait for rank 0
    if error is not None:
        raise error
    if failed:
        raise DatasetError(describe_path(path), "rank 0 could not read it (its line names the problem)")
    return found if dp.is_main else readable_database(path, keys, False)


def open_databases(cfg: TrainConfig, dp: DataParallel, progress: bool = False) -> Dict[str, AseDbDataset]:
    """Every database of the run by role (``train``, ``val``, ``replay``, ``replay_val``), checked and surveyed."""
    replay = cfg.replay
    check_job_size(cfg, dp.world_size)
    graphs, charge_spin = cfg.model.graph_settings(), cfg.model.omol

    def open_db(path, **kwargs) -> AseDbDataset:
        dataset = AseDbDataset(readable(path, cfg, dp, progress), settings=graphs, charge_spin=charge_spin,
                               charge_spin_keys=(cfg.charge_key, cfg.spin_key), **kwargs)
        dataset.float64 = is_float64()  # precision float64: graphs (positions, vectors, labels) in float64
        return dataset

    databases = {"train": open_db(cfg.train_data_path, augmentation=cfg.augmentation)}
    if cfg.val_data_path:
        databases["val"] = open_db(cfg.val_data_path)
    if replay.enabled:
        labelled = replay.labels == "data"
        databases["replay"] = open_db(replay.data_path, augmentation=cfg.augmentation, require_labels=labelled)
        if replay.val_data_path:
            databases["replay_val"] = open_db(replay.val_data_path, require_labels=labelled)
    for data in databases.values():  # beyond the embedding table: a C++ stack from MindSpore's Gather, steps later
        data.check_elements_up_to(cfg.model.num_elements, f"is beyond the elements of the model "
                                                          f"(model.num_elements {cfg.model.num_elements})")
    for key, name in (("train_data_path", "train"), ("val_data_path", "val")):
        data = databases.get(name)
        if data is not None and len(data) < dp.world_size:
            raise ConfigError(f"config key '{key}': {data.source} has {len(data)} structure(s), fewer than the "
                              f"{dp.world_size} workers")
    return databases


def survey(loader: BatchLoader, name: str, dp: DataParallel) -> None:
    """Every row of database ``name`` checked (once per database: a bad row stops the run now, not hours into it)
    and, where the batch shapes need it, its neighbours counted; both kept in the cache for later starts."""
    dataset = loader.datasets[name]
    shared = f" (shared by {dp.world_size} ranks)" if dp.parallel else ""
    start = time.perf_counter()
    loader.census(name, dp)
    if dataset.census_pass.read_from is not None:
        log.info("%s data: %d rows (structures and labels) checked before, read from %s", name, len(dataset),
                 dataset.census_pass.read_from)
    else:
        log.info("%s data: %d rows (structures and labels) checked in %.1f s%s", name, len(dataset),
                 time.perf_counter() - start, shared)
    start = time.perf_counter()
    loader.edge_capacities(name, dp)
    if dataset.capacities_read_from is not None:
        log.info("%s data: neighbour counts of %d structures for the batch shapes read from %s", name, len(dataset),
                 dataset.capacities_read_from)
    elif capacity_is_counted(dataset.settings):
        log.info("%s data: neighbours of %d structures counted for the batch shapes in %.1f s%s%s", name,
                 len(dataset), time.perf_counter() - start, shared,
                 f", kept in {dataset.capacities_kept_in}" if dataset.capacities_kept_in else "")


def trains_stress(cfg: TrainConfig, databases: Dict[str, AseDbDataset]) -> bool:
    """Whether the stress loss is trained: some structure trained on has a stress label (the target's, or a replay
    set's read with its own labels), and the loss weight and the model have stress. Every set of the run then gives a
    structure without one MISSING_STRESS, weighed at 0: a validation set of molecules as much as a molecule among
    crystals (a structure given none would be scored against zeros)."""
    labelled = [databases["train"]]
    if "replay" in databases and cfg.replay.labels != "model":
        labelled.append(databases["replay"])
    some = any(data.has_stress for data in labelled)
    wanted = cfg.loss_weights.stress > 0 and cfg.model.has_stress
    if wanted and not some and not cfg.model.omol:
        weights = cfg.loss_weights
        if weights.energy == weights.forces == 0 and not (cfg.model.family == "orb_v3" and weights.confidence > 0):
            raise ConfigError(f"config key 'loss_weights.stress' is the only loss weight above 0, but "
                              f"{describe_path(cfg.train_data_path)} has no stress labels: nothing to train")
        log.warning("%s has no stress labels: training without the stress loss", describe_path(cfg.train_data_path))
    if not (wanted and some):
        return False
    for data in databases.values():
        data.mark_missing_stress()
    return True


@dataclass
class EvaluationPlan:
    """Steps that evaluate every structure of a source once, packed by size, and their buckets (planned on exactly
    those steps, or the configured ones) with the padded / real atoms and edges."""

    sampler: PackedSampler
    buckets: List[Bucket]
    padding: Tuple[float, float]


def plan_evaluation(data, cfg: TrainConfig, world: int, local_batch: int) -> EvaluationPlan:
    edges = data.edge_capacities()
    explicit = parse_buckets(cfg.buckets, local_batch) if cfg.buckets else []
    limit = max(explicit, key=lambda b: b.num_edges) if explicit else eval_limit(data.natoms, edges, cfg.batch_size)
    _, buckets, steps = evaluation_plan(data.natoms, edges, limit, world, cfg.num_buckets, cfg.max_epochs)
    if explicit:
        check_buckets(data.natoms, edges, 1, explicit, "evaluated")
        buckets = explicit
    return EvaluationPlan(PackedSampler(data.natoms, edges, limit), buckets, padding_ratio(steps, buckets, world))


class RunData:
    """What a run iterates (see the module's docstring). Build with :func:`open_databases`, :func:`survey` and
    :meth:`plan`; then :meth:`train_steps` and :meth:`eval_steps` give this rank's steps."""

    def __init__(self, cfg: TrainConfig, dp: DataParallel, databases: Dict[str, AseDbDataset], loader: BatchLoader,
                 has_stress: bool, split: Optional[ValSplit] = None):
        self.cfg, self.dp, self.databases, self.loader, self.has_stress = cfg, dp, databases, loader, has_stress
        self.local_batch = math.ceil(cfg.batch_size / dp.world_size)
        self.split = split  # val_fraction: the training structures held out are the validation set, never trained on
        self.train_source = Source("train", databases["train"], None if split is None else split.kept)
        replayed = cfg.replay.enabled and cfg.replay.fraction > 0
        if not replayed and not np.any(self.train_source.dataset.weights[self.train_source.positions] > 0):
            raise DatasetError(self.train_source.source, "every structure trained on has weight 0: nothing to train",
                               key="weight")  # (it trained in silence, the loss 0 throughout; before any fit)
        self.replay_train: Optional[Source] = None
        self.replay_val: Optional[Source] = None

    def plan(self, replay_train: Optional[Source], replay_val: Optional[Source]) -> None:
        """The training stream (target plus any replay rows), its sampler and buckets; the evaluation sets and
        their plans."""
        cfg = self.cfg
        self.replay_train, self.replay_val = replay_train, replay_val
        sources = [self.train_source] + ([replay_train] if replay_train is not None else [])
        self.train_set = Mixture(sources)
        if replay_train is not None:
            self.sampler = MixedSampler(len(self.train_source), len(replay_train), cfg.batch_size,
                                        replay_per_step(cfg.batch_size, cfg.replay.fraction), cfg.random_seed)
        else:
            self.sampler = EpochSampler(len(self.train_set), cfg.batch_size, cfg.random_seed, True)
        self.loader.add("train", self.train_set)
        self.train_buckets, self.train_padding = self._train_buckets()
        self.val_sets: Dict[str, Source] = {}
        if "val" in self.databases:
            self.val_sets["val"] = Source("val", self.databases["val"])
        elif self.split is not None:
            self.val_sets["val"] = Source("val", self.databases["train"], self.split.held)
        if replay_val is not None:
            self.val_sets["replay_val"] = replay_val
        self.val_plans = {}
        for name, data in self.val_sets.items():
            self.loader.add(name, data)
            self.val_plans[name] = self.evaluation_plan(data)

    @property
    def steps_per_epoch(self) -> int:
        return len(self.sampler)

    def _train_buckets(self) -> Tuple[List[Bucket], Tuple[float, float]]:
        """The training buckets, planned on the steps of the sampler's first epochs (as many as ~4 M structures, at
        most 50 epochs: every epoch of a small dataset's run, tails included; not depending on ``max_epochs``, so a
        run stopped early and extended on resume pads its steps as an uninterrupted one), and their padded / real
        atoms and edges over those steps."""
        cfg, data, world = self.cfg, self.train_set, self.dp.world_size
        edges = data.edge_capacities()
        epochs = max(1, min(PLAN_EPOCHS, PLAN_STRUCTURES // len(data)))
        sample = StepTotals.concatenate([step_totals(self.sampler.shards(epoch, world), data.natoms, edges)
                                         for epoch in range(epochs)])
        if cfg.buckets:
            buckets = parse_buckets(cfg.buckets, self.local_batch)
            check_buckets(data.natoms, edges, self.local_batch, buckets, "training")
        else:
            buckets = plan_buckets(sample.nodes, sample.edges, self.local_batch + 1,
                                   largest_batch(data.natoms, edges, min(self.local_batch, len(data))),
                                   cfg.num_buckets, len(self.sampler) * cfg.max_epochs)
        return buckets, padding_ratio(sample, buckets, world)

    def evaluation_plan(self, data) -> EvaluationPlan:
        return plan_evaluation(data, self.cfg, self.dp.world_size, self.local_batch)

    def train_steps(self, epoch: int) -> EpochSteps:
        """This rank's training steps of ``epoch``."""
        return self._steps(self.sampler, self.train_set, self.train_buckets, epoch)

    def eval_steps(self, name: str) -> EpochSteps:
        """This rank's steps over evaluation set ``name``."""
        plan = self.val_plans[name]
        return self._steps(plan.sampler, self.val_sets[name], plan.buckets, 0)

    def pass_steps(self, source, plan: EvaluationPlan) -> EpochSteps:
        """This rank's steps of one pass over any source (e.g. the starting model's pass over replay rows)."""
        return self._steps(plan.sampler, source, plan.buckets, 0)

    def _steps(self, sampler, data, buckets: List[Bucket], epoch: int) -> EpochSteps:
        return plan_steps(sampler.shards(epoch, self.dp.world_size), data.natoms, data.edge_capacities(), buckets,
                          self.dp.rank, epoch)

    def weights_note(self, data: Source) -> str:
        """For the start-up log: the per-structure loss weights of a source, when any differs from 1."""
        weights = data.dataset.weights[data.positions]
        if np.all(weights == 1):
            return ""
        return (f", per-structure loss weights from the rows' 'weight' (mean {weights.mean():.3g}, "
                f"{int((weights == 0).sum())} zero)")
