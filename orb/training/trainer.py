"""The fine-tuning loop shared by ``finetune.py`` (one device) and ``finetune_parallel.py`` (data parallel)."""

import logging
import math
import os
import sys
import time
from collections import deque
from contextlib import contextmanager
from typing import Dict, List, Optional, Tuple

import numpy as np

from orb.data.buckets import Bucket, check_buckets, largest_batch, parse_buckets, plan_buckets
from orb.data.dataset import AseDbDataset, EpochSampler
from orb.data.formats import describe_path
from orb.data.graphs import capacity_is_counted
from orb.data.loader import BatchLoader
from orb.data.plan import (EpochSteps, PackedSampler, Step, StepTotals, eval_limit, evaluation_plan, padding_ratio,
                           plan_steps, step_totals)
from orb.data.mixture import MixedSampler, Mixture, Source, replay_per_step
from orb.device import compile_cell
from orb.errors import ClusterError, ConfigError, DatasetError, DivergedError
from orb.metrics import BY_ELEMENT, METRICS, describe, format_by_element
from orb.training import replay as replay_data
from orb.training import state as training_state
from orb.training.config import TrainConfig
from orb.training.distributed import DataParallel
from orb.io.files import append_record as append_jsonl, keep_records_up_to
from orb.signals import RESUME_HINT, STOP, STOPPED_STATUS, Stopped
from orb.training.preemption import prune_checkpoints
from orb.training.reference_fit import fit_reference_energies, reference_baseline

log = logging.getLogger("orb")
PLAN_STRUCTURES = 4_000_000  # the training buckets are planned on the first epochs' steps, up to this many rows
PLAN_EPOCHS = 50  # ... and at most this many epochs (however many the run has: a resume that extends it plans alike)


def describe_buckets(buckets: List[Bucket]) -> str:
    planned = ", ".join(f"({b.num_nodes}, {b.num_edges}, {b.num_graphs})" for b in buckets if not b.spare)
    spare = [b for b in buckets if b.spare]
    return planned + "".join(f" + spare ({b.num_nodes}, {b.num_edges}, {b.num_graphs}) for the worst possible batch, "
                             "compiled only if a step needs it" for b in spare)


def build_model(cfg: TrainConfig):
    """orb model of the config's architecture with pretrained (or random) weights and reference energies."""
    from orb.io.checkpoint import load_weights_into
    from orb.models import build
    from orb.models.reference_energies import load_reference_file, reference_table

    model = build(cfg.model, seed=cfg.random_seed)
    if cfg.checkpoint_path:
        load_weights_into(model, cfg.checkpoint_path)
        log.info("loaded weights from %s", cfg.checkpoint_path)
    else:
        log.warning("checkpoint_path is empty: starting from RANDOM weights (set it to an orb-v2 checkpoint "
                    "to fine-tune the pretrained model)")
    references = cfg.reference_energies
    if references.table or references.file:
        import mindspore as ms

        weight = model.reference_energy_weight()
        table = reference_table(references.table) if references.table else weight.asnumpy()
        if references.file:  # a file's entries on top of the table (or of the checkpoint's)
            table = load_reference_file(references.file, table)
        weight.set_data(ms.Tensor(table.astype(np.float32)))
        log.info("reference energies: %s", " with ".join(
            x for x in (references.table and f"table {references.table}", references.file) if x))
    return model


def trainable_parameters(model, cfg: TrainConfig) -> list:
    """Parameters the optimizer updates: all but those that cannot change any output
    (``model.never_trained()``), the backbone if frozen, and the reference energies unless trained
    (``reference_energies.trainable``; auto: orb-v2 trains them, orb-v3 keeps them, as orb-models)."""
    excluded = {id(p) for p in model.never_trained()}
    if cfg.freeze_backbone:
        excluded |= {id(p) for p in model.backbone_parameters()}
    trainable = cfg.reference_energies.trainable
    if trainable == "false" or (trainable == "auto" and cfg.model.family == "orb_v3"):
        excluded |= {id(w) for w in model.reference_energy_weights()}
    params = [p for p in model.trainable_params() if id(p) not in excluded]
    for p in model.trainable_params():
        p.requires_grad = id(p) not in excluded
    return params


def make_loss(model, cfg: TrainConfig, has_stress: bool, allreduce=None):
    """The loss cell of the model's family with the config's weights."""
    w = cfg.loss_weights
    if cfg.model.family == "orb_v3":
        from orb.training.loss_v3 import OrbV3Loss

        return OrbV3Loss(model, w.energy, w.forces, w.stress, has_stress, allreduce, w.confidence, w.equigrad)
    from orb.training.loss import OrbLoss

    return OrbLoss(model, w.energy, w.forces, w.stress, has_stress, allreduce)


def _tqdm_enabled(setting: str, is_main: bool) -> bool:
    if not is_main:
        return False
    if setting == "auto":
        return sys.stderr.isatty()
    return setting == "true"


def _fmt(metrics: Dict[str, float]) -> str:
    return "{" + ", ".join(f"'{k}': {v:.6g}" for k, v in metrics.items() if isinstance(v, float)) + "}"


def _change(now: float, start: float) -> str:
    return f"{100 * (now - start) / abs(start):+.1f} %" if start else f"{now - start:+.3g}"


FORGETTING_KEYS = ("energy_per_atom_mae", "forces_mae", "stress_mae")  # the replay_val line of every epoch


class Trainer:
    """Fits an orb model to the user's data (and replay data): compiled steps, validation, logging, checkpoints,
    resume.

    The data it sees: ``train_set``, one :class:`~orb.data.mixture.Mixture` of the target and (with
    ``replay.fraction > 0``) replay structures, and ``val_sets``, named validation sets (``val``: the
    target's; ``replay_val``: held-out replay structures, what fine-tuning costs the foundation).
    """

    def __init__(self, cfg: TrainConfig, data_parallel: Optional[DataParallel] = None, resume: Optional[str] = None,
                 accept_config_changes: bool = False):
        self.cfg, self.dp = cfg, data_parallel or DataParallel()
        self._log_device()
        self.output_dir = cfg.output_dir
        self.checkpoint_dir = os.path.join(self.output_dir, "checkpoints")
        self.compiled: Dict[Tuple[str, Bucket], float] = {}
        self.compile_time = 0.0  # seconds spent compiling during the current epoch
        self._open_data()
        self.model = build_model(cfg)
        if cfg.replay.enabled and cfg.replay.head == "separate":
            self.model.add_replay_heads()  # copies of the starting heads, before any fit of the target's
        self._starting_digest: Optional[str] = None
        self._choose_replay()
        self._plan_data()
        self.reference_fit = None
        if not resume and cfg.reference_energies.fit != "none":
            self._fit_reference_energies()
        self.params = trainable_parameters(self.model, cfg)
        self.param_names = self._names(self.params)
        self.steps_per_epoch = len(self.sampler)
        self.total_steps = cfg.max_epochs * self.steps_per_epoch
        self._build_steps()
        self.start_epoch, self.global_step, self.best_val = 0, 0, math.inf
        self.epochs_done, self.best_epoch = 0, 0
        self.initial: Dict[str, Dict] = {}  # validation of the starting model (epoch 0), by set
        self.resume_step, self.resume_totals = 0, None  # a mid-epoch resume: steps of start_epoch done, their sums
        self.signals = STOP
        self.last_save = time.monotonic()
        self.steps_run = 0  # training steps run by this process (the device counts them alike)
        self.recent_steps: deque = deque(maxlen=cfg.log_every_n_steps + 1)  # (number, epoch, step, global, rows)
        if resume:
            self._resume(resume, accept_config_changes)
        self.dp.check_same_parameters(self.model)
        self._log_start()

    # ----------------------------------------------------------------- setup
    def _log_device(self) -> None:
        import mindspore as ms

        from orb.models.kernels import describe_profile
        from orb.models.ops_profile import set_ops_profile

        set_ops_profile(self.cfg.ops_profile)
        log.info("device: %s, %s", ms.get_context("device_target"), describe_profile())
        if self.dp.parallel:
            log.info("data parallel: rank %d of %d (pid %d)", self.dp.rank, self.dp.world_size, os.getpid())

    def _open_data(self) -> None:
        """Open and check every database, and count their neighbours (batch shapes), before the model is built."""
        cfg, world, replay = self.cfg, self.dp.world_size, self.cfg.replay
        if cfg.optimizer_shard and world < 2:
            raise ConfigError("config key 'optimizer_shard': sharding the optimizer state needs a data-parallel run "
                              "with at least 2 workers (run_parallel.sh)")
        if cfg.batch_size < world:
            raise ConfigError(f"config key 'batch_size' ({cfg.batch_size}) is the global batch and must be at least "
                              f"the number of workers ({world})")
        if cfg.patience and not cfg.val_data_path:
            raise ConfigError("config key 'patience' stops on the validation loss and needs val_data_path")
        if replay.enabled and replay.labels == "model" and not cfg.checkpoint_path:
            raise ConfigError("config key 'replay.labels': model labels replay data with the starting checkpoint's "
                              "predictions and needs checkpoint_path")
        if cfg.reference_energies.fit == "residual" and not cfg.checkpoint_path:
            raise ConfigError("config key 'reference_energies.fit': residual fits to the starting checkpoint's "
                              "errors and needs checkpoint_path (least_squares needs none)")
        if cfg.reference_energies.fit == "least_squares" and cfg.checkpoint_path:
            log.warning("reference_energies.fit: least_squares makes the reference energies explain the whole DFT "
                        "energy, and the pretrained network adds its own per-atom energy on top (measured: 68x the "
                        "starting energy error, docs/benchmarks.md); to fine-tune, use fit: residual")
        graphs, charge_spin = cfg.model.graph_settings(), cfg.model.omol

        def open_db(path, **kwargs):
            return AseDbDataset(self._readable(path), settings=graphs, charge_spin=charge_spin, **kwargs)

        self.databases: Dict[str, AseDbDataset] = {"train": open_db(cfg.train_data_path,
                                                                    augmentation=cfg.augmentation)}
        if cfg.val_data_path:
            self.databases["val"] = open_db(cfg.val_data_path)
        if replay.enabled:
            labelled = replay.labels == "data"
            self.databases["replay"] = open_db(replay.data_path, augmentation=cfg.augmentation,
                                               require_labels=labelled)
            if replay.val_data_path:
                self.databases["replay_val"] = open_db(replay.val_data_path, require_labels=labelled)
        for key, name in (("train_data_path", "train"), ("val_data_path", "val")):
            data = self.databases.get(name)
            if data is not None and len(data) < world:
                raise ConfigError(f"config key '{key}': {data.path} has {len(data)} structure(s), fewer than the "
                                  f"{world} workers")
        self.local_batch = math.ceil(cfg.batch_size / world)
        self.loader = BatchLoader(self.databases, cfg.data_workers)
        for name, data in self.databases.items():
            self._survey(name, data)
        train = self.databases["train"]
        self.has_stress = train.has_stress and cfg.loss_weights.stress > 0 and cfg.model.has_stress
        if cfg.loss_weights.stress > 0 and cfg.model.has_stress and not train.has_stress and not cfg.model.omol:
            log.warning("%s has no stress labels: training without the stress loss",
                        describe_path(cfg.train_data_path))
        self._check_stress()

    def _readable(self, path: str) -> str:
        """The ASE SQLite database to read for a data path: itself, or its cached index (orb.data.formats), made by
        rank 0 first while the others wait (each node makes its own when the cache folder is node-local)."""
        from orb.data.formats import LabelKeys, readable_database

        cfg = self.cfg
        keys = LabelKeys(cfg.energy_key, cfg.forces_key, cfg.stress_key, cfg.charge_key, cfg.spin_key)
        error = None
        if self.dp.is_main:
            try:
                readable = readable_database(path, keys, _tqdm_enabled(cfg.progress_bar, True))
            except DatasetError as exc:
                error = exc
        failed = self.dp.sum(np.array([1.0 if error is not None else 0.0]))[0] > 0  # the others wait for rank 0
        if error is not None:
            raise error
        if failed:
            raise DatasetError(describe_path(path), "rank 0 could not read it (its line names the problem)")
        return readable if self.dp.is_main else readable_database(path, keys, False)

    def _check_stress(self) -> None:
        """Every set a training batch or a validation mixes with the target must carry stress when it is trained."""
        if not self.has_stress:
            return
        replay_by_model = self.cfg.replay.labels == "model" and self.cfg.model.has_stress
        for name, key in (("val", "val_data_path"), ("replay", "replay.data_path"),
                          ("replay_val", "replay.val_data_path")):
            data = self.databases.get(name)
            if data is not None and not data.has_stress and not (name.startswith("replay") and replay_by_model):
                raise ConfigError(f"{key} {data.path} has no stress while the training data has; set "
                                  "loss_weights.stress: 0 or add stress labels" +
                                  (" (or replay.labels: model)" if name.startswith("replay") else ""))

    def _survey(self, name: str, dataset: AseDbDataset) -> None:
        """Every row's labels checked (once per database: a bad row stops the run now, not hours into it) and, where
        the batch shapes need it, its neighbours counted; both kept in the cache for later starts."""
        start = time.perf_counter()
        self.loader.census(name, self.dp)
        if dataset.census_pass.read_from is not None:
            log.info("%s data: %d rows (structures and labels) checked before, read from %s", name, len(dataset),
                     dataset.census_pass.read_from)
        else:
            log.info("%s data: %d rows (structures and labels) checked in %.1f s%s", name, len(dataset),
                     time.perf_counter() - start, f" (shared by {self.dp.world_size} ranks)" if self.dp.parallel
                     else "")
        start = time.perf_counter()
        self.loader.edge_capacities(name, self.dp)
        if dataset.capacities_read_from is not None:
            log.info("%s data: neighbour counts of %d structures for the batch shapes read from %s", name, len(dataset),
                     dataset.capacities_read_from)
        elif capacity_is_counted(dataset.settings):
            log.info("%s data: neighbours of %d structures counted for the batch shapes in %.1f s%s%s", name,
                     len(dataset), time.perf_counter() - start,
                     f" (shared by {self.dp.world_size} ranks)" if self.dp.parallel else "",
                     f", kept in {dataset.capacities_kept_in}" if dataset.capacities_kept_in else "")

    def starting_digest(self) -> tuple:
        """The starting model's identity, computed once (the key of cached descriptors and pseudo-labels)."""
        from orb.models import model_identity

        if self._starting_digest is None:
            self._starting_digest = model_identity(self.model)
        return self._starting_digest

    def _choose_replay(self) -> None:
        """Which replay rows are trained on and validated, and their labels (model labels: the starting model's)."""
        cfg, replay = self.cfg, self.cfg.replay
        self.replay_train: Optional[Source] = None
        self.replay_val: Optional[Source] = None
        if not replay.enabled:
            return
        data = self.databases["replay"]
        candidates, val = replay_data.split(data, self.databases.get("replay_val"), replay.fraction,
                                            replay.val_samples, cfg.random_seed)
        chosen = replay_data.select(data, candidates, replay.num_samples, replay.selection, cfg.random_seed,
                                    self.forward, self.starting_digest, self.dp) if len(candidates) else candidates
        if replay.labels == "model":
            with_stress = self.has_stress
            needed = {}  # database -> positions that need labels
            if len(chosen):
                needed[id(data)] = (data, chosen)
            if val is not None:
                db, positions = val
                previous = needed.get(id(db), (db, np.zeros(0, np.int64)))[1]
                needed[id(db)] = (db, np.union1d(previous, positions))
            for db, positions in needed.values():
                db.set_labels(replay_data.pseudo_labels(db, positions, self.forward, self.starting_digest,
                                                        with_stress, self.dp))
        head = 1 if replay.head == "separate" else 0  # replay structures are predicted by the replay heads
        if len(chosen):
            self.replay_train = Source("replay", data, chosen, replay.loss_weight, head)
        if val is not None:
            self.replay_val = Source("replay_val", *val, head=head)

    def _plan_data(self) -> None:
        """The training stream, validation sets, samplers and bucket shapes."""
        cfg, replay = self.cfg, self.cfg.replay
        self.train_source = Source("train", self.databases["train"])
        sources = [self.train_source] + ([self.replay_train] if self.replay_train is not None else [])
        self.train_set = Mixture(sources)
        self.val_sets: Dict[str, Source] = {}
        if "val" in self.databases:
            self.val_sets["val"] = Source("val", self.databases["val"])
        if self.replay_val is not None:
            self.val_sets["replay_val"] = self.replay_val
        if self.replay_train is not None:
            self.sampler = MixedSampler(len(self.train_source), len(self.replay_train), cfg.batch_size,
                                        replay_per_step(cfg.batch_size, replay.fraction), cfg.random_seed)
        else:
            self.sampler = EpochSampler(len(self.train_set), cfg.batch_size, cfg.random_seed, True)
        self.loader.add("train", self.train_set)
        self.train_buckets, self.train_padding = self._train_buckets()
        self.val_samplers: Dict[str, PackedSampler] = {}
        self.val_buckets: Dict[str, List[Bucket]] = {}
        self.val_padding: Dict[str, Tuple[float, float]] = {}
        for name, data in self.val_sets.items():
            self.loader.add(name, data)
            self.val_samplers[name], self.val_buckets[name], self.val_padding[name] = self._evaluation_plan(data)

    def _train_buckets(self) -> Tuple[List[Bucket], Tuple[float, float]]:
        """The training buckets, planned on the steps of the sampler's first epochs (as many as ~4 M structures, at
        most 50 epochs: every epoch of a small dataset's run, tails included; not depending on ``max_epochs``, so a
        run stopped early and extended on resume pads its steps as an uninterrupted one), and their padded / real
        atoms and edges over those steps."""
        cfg, data = self.cfg, self.train_set
        edges = data.edge_capacities()
        epochs = max(1, min(PLAN_EPOCHS, PLAN_STRUCTURES // len(data)))
        sample = StepTotals.concatenate([step_totals(self.sampler.shards(epoch, self.dp.world_size), data.natoms,
                                                     edges) for epoch in range(epochs)])
        if cfg.buckets:
            buckets = parse_buckets(cfg.buckets, self.local_batch)
            check_buckets(data.natoms, edges, self.local_batch, buckets, "training")
        else:
            buckets = plan_buckets(sample.nodes, sample.edges, self.local_batch + 1,
                                   largest_batch(data.natoms, edges, min(self.local_batch, len(data))),
                                   cfg.num_buckets, len(self.sampler) * cfg.max_epochs)
        return buckets, padding_ratio(sample, buckets, self.dp.world_size)

    def _evaluation_plan(self, data) -> Tuple[PackedSampler, List[Bucket], Tuple[float, float]]:
        """Steps that evaluate every structure of ``data`` once, packed by size, their buckets (planned on exactly
        those steps; the configured ones when given) and padded / real atoms and edges."""
        edges = data.edge_capacities()
        explicit = parse_buckets(self.cfg.buckets, self.local_batch) if self.cfg.buckets else []
        limit = max(explicit, key=lambda b: b.num_edges) if explicit else eval_limit(data.natoms, edges,
                                                                                      self.cfg.batch_size)
        _, buckets, steps = evaluation_plan(data.natoms, edges, limit, self.dp.world_size, self.cfg.num_buckets,
                                            self.cfg.max_epochs)
        if explicit:
            check_buckets(data.natoms, edges, 1, explicit, "evaluated")
            buckets = explicit
        return PackedSampler(data.natoms, edges, limit), buckets, padding_ratio(steps, buckets, self.dp.world_size)

    def _names(self, params) -> List[str]:
        names = {id(p): name for name, p in self.model.parameters_and_names()}
        return [names[id(p)] for p in params]

    def _build_steps(self) -> None:
        from orb.training.optimizer import FlatAdam, Sharding
        from orb.training.schedule import make_schedule
        from orb.training.steps import EvalStep, TrainStep

        cfg, dp = self.cfg, self.dp
        self.schedule = make_schedule(cfg.lr_schedule, cfg.lr, self.total_steps, cfg.warmup_fraction)
        sharding = (Sharding(dp.rank, dp.world_size, dp.reduce_scatter, dp.all_gather, dp.all_reduce)
                    if dp.shard_optimizer else None)
        self.optimizer = FlatAdam(self.params, self.schedule, clip_mode=cfg.gradient_clip_mode,
                                  clip_value=cfg.gradient_clip_val, sharding=sharding, ema_decay=cfg.ema_decay,
                                  algorithm=cfg.optimizer)
        self.loss_cell = make_loss(self.model, cfg, self.has_stress, dp.all_reduce)
        grad_reducer = self.optimizer.gradient_reducer()  # a sharded optimizer reduce-scatters its own slices
        if grad_reducer is None and dp.grad_reducer is not None:
            grad_reducer = dp.grad_reducer(self.optimizer.gradients_to_reduce())
        self.train_step = TrainStep(self.loss_cell, self.optimizer, grad_reducer)
        self.eval_step = EvalStep(self.loss_cell)

    def _log_start(self) -> None:
        cfg = self.cfg
        n_params = self.model.num_parameters()
        n_train = int(sum(np.prod(p.shape) for p in self.params))
        log.info("model: %s, %s parameters (%s trained), %d message-passing layers, latent %d; graphs: %d neighbours "
                 "within %g Å", cfg.model.name, f"{n_params:,}", f"{n_train:,}", cfg.model.num_message_passing_steps,
                 cfg.model.latent_dim, cfg.model.max_neighbors, cfg.model.radius)
        train = self.train_source
        log.info("train data: %s (%d structures, %d atoms)%s%s", describe_path(cfg.train_data_path), len(train),
                 int(train.natoms.sum()), "" if train.has_stress else ", no stress", self._weights_note(train))
        for name, data in self.val_sets.items():
            log.info("%s data: %s (%d structures)%s", "validation" if name == "val" else name, data.path, len(data),
                     self._weights_note(data))
        if self.replay_train is not None:
            r = self.replay_train
            log.info("replay: %d structures of %s (%s labels, loss weight %g, %s heads); each step: %d target + %d "
                     "replay structures", len(r), r.path, cfg.replay.labels, cfg.replay.loss_weight, cfg.replay.head,
                     self.sampler.target_step, self.sampler.replay_step)
        elif self.replay_val is not None:
            log.info("replay: validated only (replay.fraction 0): forgetting is measured every epoch, not prevented")
        log.info("batch size: %d global, %d per worker x %d worker(s); %d steps per epoch, %d epochs%s",
                 cfg.batch_size, self.local_batch, self.dp.world_size, self.steps_per_epoch, cfg.max_epochs,
                 f"; early stopping after {cfg.patience} epochs without a lower validation loss" if cfg.patience
                 else "")
        log.info("optimizer: %s, %s schedule, peak lr %.3g%s, clipping %s %g%s", cfg.optimizer, cfg.lr_schedule,
                 float(self.schedule.lr.max()), f", EMA of weights {cfg.ema_decay}" if cfg.ema_decay else "",
                 cfg.gradient_clip_mode, cfg.gradient_clip_val,
                 ", state sharded over ranks" if self.dp.shard_optimizer else "")
        log.info("train buckets (nodes, edges, graphs): %s; padded / real: atoms %.2fx, edges %.2fx",
                 describe_buckets(self.train_buckets), *self.train_padding)
        for name, buckets in self.val_buckets.items():
            log.info("%s buckets (structures packed by size): %s; padded / real: atoms %.2fx, edges %.2fx", name,
                     describe_buckets(buckets), *self.val_padding[name])
        keys = [k for k in self.loss_cell.sum_keys if k in METRICS and (self.has_stress or "stress" not in k)]
        log.info("metrics (per epoch, train and validation):\n%s", describe(keys + [BY_ELEMENT]))

    @staticmethod
    def _weights_note(data: Source) -> str:
        weights = data.dataset.weights[data.positions]
        if np.all(weights == 1):
            return ""
        return (f", per-structure loss weights from the rows' 'weight' (mean {weights.mean():.3g}, "
                f"{int((weights == 0).sum())} zero)")

    # ----------------------------------------------------------------- reference energies
    def _fit_reference_energies(self) -> None:
        """Move the reference energies to the user's DFT (``reference_energies.fit``), before the first step."""
        from mindspore import Tensor

        method = self.cfg.reference_energies.fit
        data = self.databases["train"]
        weight = self.model.reference_energy_weight()
        current = weight.asnumpy().astype(np.float64)
        composition = data.composition()
        if method == "residual":
            baseline = self.forward("train_energies", self.train_source, "labels")["energy"]
        else:
            baseline = reference_baseline(composition, len(data), current)
        fit = fit_reference_energies(method, composition, data.energies(), baseline, current)
        weight.set_data(Tensor(fit.table.astype(np.float32)))
        self.reference_fit = fit
        log.info(fit.summary())

    # ----------------------------------------------------------------- steps
    def _plan(self, sampler, dataset, buckets, epoch: int) -> EpochSteps:
        return plan_steps(sampler.shards(epoch, self.dp.world_size), dataset.natoms, dataset.edge_capacities(),
                          buckets, self.dp.rank, epoch)

    def _run(self, kind: str, cell, arrays, bucket: Bucket):
        from orb.data.tensors import to_tensors

        inputs = to_tensors(arrays)
        key = (kind, bucket)
        if key in self.compiled:
            return cell(*inputs)
        log.info("compiling the %s step for batch shape (nodes %d, edges %d, graphs %d), once per shape", kind,
                 bucket.num_nodes, bucket.num_edges, bucket.num_graphs)
        start = time.perf_counter()
        compile_cell(cell, *inputs)
        out = cell(*inputs)
        (out[0] if isinstance(out, tuple) else out).asnumpy()
        self.compiled[key] = time.perf_counter() - start
        self.compile_time += self.compiled[key]
        return out

    def forward(self, name: str, source: Source, kind: str) -> Dict[str, np.ndarray]:
        """The model's outputs over every structure of ``source``, in its order: ``kind`` "labels" gives energy (eV),
        forces and stress; "descriptors" the per-structure descriptors. Each data-parallel rank computes its part
        of every batch; the parts are summed over ranks, so every rank returns the whole."""
        from orb.inference.predictor import DescriptorCell, PredictCell
        from orb.data.tensors import MODEL_INPUTS

        cell = DescriptorCell(self.model) if kind == "descriptors" else PredictCell(self.model)
        sampler, buckets, _ = self._evaluation_plan(source)
        self.loader.add(name, source)
        offsets = np.concatenate([[0], np.cumsum(source.natoms)]).astype(np.int64)
        if kind == "descriptors":
            out = {"descriptors": np.zeros((len(source), self.cfg.model.latent_dim))}
        else:
            out = {"energy": np.zeros(len(source)), "forces": np.zeros((int(offsets[-1]), 3)),
                   "stress": np.zeros((len(source), 6))}
        start = time.perf_counter()
        for step, arrays in self.loader.iterate(name, self._plan(sampler, source, buckets, 0), None, False):
            result = self._run(f"{kind} pass", cell, arrays[:len(MODEL_INPUTS)], step.bucket)
            index = np.asarray(step.indices, np.int64)
            if kind == "descriptors":
                out["descriptors"][index] = result.asnumpy()[:len(index)]
                continue
            energy, forces, stress = (t.asnumpy() for t in result[:3])
            out["energy"][index], out["stress"][index] = energy[:len(index)], stress[:len(index)]
            node = 0
            for i in index:  # a step's structures' atoms are consecutive, in its order
                n = int(offsets[i + 1] - offsets[i])
                out["forces"][offsets[i]:offsets[i + 1]] = forces[node:node + n]
                node += n
        self.loader.close()
        log.info("%s: %s of %d structures in %.1f s", name, kind, len(source), time.perf_counter() - start)
        return {key: self.dp.sum(value) for key, value in out.items()}  # each rank filled its own structures

    def _sums_to_metrics(self, sums: np.ndarray, by_element: bool = False) -> Dict:
        return self.loss_cell.metrics(sums, by_element)

    # ----------------------------------------------------------------- epochs
    def train_epoch(self, epoch: int, progress) -> Dict[str, float]:
        """Train one epoch (from step ``resume_step`` of it after a mid-epoch resume), saving ``last.ckpt`` inside it
        when a step save is due; a stop signal ends it with the state saved (:class:`Stopped`)."""
        from orb.training.steps import read_and_reset, read_nonfinite

        steps = self._plan(self.sampler, self.train_set, self.train_buckets, epoch)
        first, self.resume_step = self.resume_step, 0
        totals = self.resume_totals if first else np.zeros(self.loss_cell.num_sums)
        seed = self.cfg.random_seed if self.cfg.augmentation else None
        self.compile_time, wait_before = 0.0, self.loader.wait_time
        start = time.perf_counter()
        bar = progress(total=len(steps), initial=first, desc=f"epoch {epoch + 1}", leave=False)
        skipped = 0
        for i, (step, arrays) in enumerate(self.loader.iterate("train", steps[first:], seed, self.has_stress), first):
            self._record(step)
            self._run("train", self.train_step, arrays, step.bucket)
            self.global_step += 1
            self.steps_run += 1
            self.recent_steps.append((self.steps_run, epoch, i + 1, self.global_step, step.indices))
            bar.update(1)
            boundary = (i + 1) % self.cfg.log_every_n_steps == 0 or i + 1 == len(steps)
            flags = self._stop_and_save_flags()
            if boundary:  # one host synchronisation per interval; the ranks' flags travel with the sums
                part = self.dp.sum(np.concatenate([read_and_reset(self.train_step.metric_sums), flags]))
                part, flags = part[:-len(flags)], part[-len(flags):]
                skipped += self._check_finite(read_nonfinite(self.train_step))
                totals += part
                interval = self._sums_to_metrics(part)
                bar.set_postfix(loss=f"{interval['loss']:.4f}")
                self._write_jsonl({"type": "step", "epoch": epoch + 1, "step": self.global_step,
                                   "lr": float(self.schedule.lr[min(self.global_step, self.total_steps) - 1]),
                                   **interval})
            elif self.dp.parallel:
                flags = np.zeros_like(flags)  # ranks agree only at interval boundaries
            every = self.cfg.save_every_n_steps
            if i + 1 < len(steps) and (flags.any() or (every and self.global_step % every == 0)):
                self._save_step(epoch, i + 1, totals)
                if flags[0]:
                    bar.close()
                    self._stop(epoch, i + 1)
        bar.close()
        metrics = self._sums_to_metrics(totals, by_element=True)
        if skipped:
            metrics["nonfinite_steps"] = float(skipped)
        elapsed = time.perf_counter() - start - self.compile_time
        metrics["data_wait"] = (self.loader.wait_time - wait_before) / max(elapsed, 1e-9)
        metrics["train_time"] = elapsed
        if self.compile_time:
            metrics["compile_time"] = self.compile_time
        return metrics

    def _check_finite(self, nonfinite: np.ndarray) -> int:
        """Steps skipped for a non-finite gradient since the last check; too many in a row end the run, naming the
        latest one's epoch, step and rows (this rank's)."""
        in_a_row, longest, latest, count = (int(v) for v in nonfinite)
        if count:
            where = next((r for r in self.recent_steps if r[0] == latest), None)
            rows = [self.train_set.row_id(j) for j in where[4]] if where else []
            place = (f"epoch {where[1] + 1}, step {where[2]} (global step {where[3]}), rows {rows}" if where else
                     f"step {latest} of this process")
            limit = max(self.cfg.max_nonfinite_steps, 1)
            if longest >= limit:
                raise DivergedError(f"{longest} training steps in a row had a non-finite loss or gradient (the "
                                    f"latest: {place}); the run stops (max_nonfinite_steps: "
                                    f"{self.cfg.max_nonfinite_steps}); last.ckpt holds the last finite state: "
                                    "lower lr, check those rows, or resume")
            log.warning("%d training step(s) skipped for a non-finite loss or gradient (latest: %s)", count, place)
        return count

    def _stop_and_save_flags(self) -> np.ndarray:
        """[a stop signal arrived, a timed save is due (decided by rank 0)] on this rank."""
        minutes = self.cfg.save_every_minutes
        due = self.dp.is_main and minutes > 0 and time.monotonic() - self.last_save >= 60.0 * minutes
        return np.array([self.signals.received is not None, due], np.float64)

    def _stop(self, epoch: int, steps_done: int) -> None:
        """End the run after a stop signal: the state is saved at this step."""
        where = (f"epoch {epoch + 1}, step {steps_done} of {self.steps_per_epoch}" if steps_done < self.steps_per_epoch
                 else f"the end of epoch {epoch + 1}")
        message = (f"stopped by {self.signals.received or 'a signal on another rank'} at {where} (global step "
                   f"{self.global_step}); state saved in {os.path.join(self.checkpoint_dir, 'last.ckpt')}: {RESUME_HINT} "
                   f"(exit status {STOPPED_STATUS})")
        if self.dp.is_main:
            log.info(message)
        raise Stopped(message)

    def validate(self, progress, name: str = "val") -> Dict[str, float]:
        """Metrics of validation set ``name`` (with the EMA weights when ``ema_decay`` is set)."""
        if name not in self.val_sets:
            return {}
        start = time.perf_counter()
        steps = self._plan(self.val_samplers[name], self.val_sets[name], self.val_buckets[name], 0)
        total = np.zeros(self.loss_cell.num_sums)
        bar = progress(total=len(steps), desc=name, leave=False)
        with self._evaluation_weights():
            for step, arrays in self.loader.iterate(name, steps, None, self.has_stress):
                total += self._run("eval", self.eval_step, arrays, step.bucket).asnumpy().astype(np.float64)
                bar.update(1)
        bar.close()
        metrics = self._sums_to_metrics(self.dp.sum(total), by_element=True)
        metrics["val_time"] = time.perf_counter() - start
        return metrics

    def validate_all(self, progress) -> Dict[str, Dict]:
        return {name: self.validate(progress, name) for name in self.val_sets}

    @contextmanager
    def _evaluation_weights(self):
        """Validation sees the EMA of the weights when ``ema_decay`` is set (as the saved best weights)."""
        if not self.cfg.ema_decay:
            yield
            return
        from orb.training.steps import write_parameter

        current = [p.asnumpy().copy() for p in self.params]  # a copy: on CPU asnumpy may share the buffer
        for p, value in zip(self.params, training_state.ema_weights(self.optimizer)):
            write_parameter(p, value)
        try:
            yield
        finally:
            for p, value in zip(self.params, current):
                write_parameter(p, value)

    def _log_validation(self, prefix: str, results: Dict[str, Dict]) -> None:
        if not self.dp.is_main:
            return
        log.info(prefix + ", ".join(f"{name}_metrics: {_fmt(metrics)}" for name, metrics in results.items()))
        for name, metrics in results.items():
            if metrics.get(BY_ELEMENT):
                log.info("%s forces MAE by element (eV/Å): %s", name, format_by_element(metrics[BY_ELEMENT]))
        start, now = self.initial.get("replay_val"), results.get("replay_val")
        if start and now and now is not start:
            changes = [f"{k} {now[k]:.4g} ({_change(now[k], start[k])})" for k in FORGETTING_KEYS
                       if k in now and k in start]
            log.info("replay_val against the starting model: %s", ", ".join(changes))

    def fit(self, until_epoch: Optional[int] = None) -> Dict:
        """Train from the current epoch to ``until_epoch`` (default: the config's ``max_epochs``)."""
        from tqdm import tqdm

        cfg = self.cfg
        last_epoch = cfg.max_epochs if until_epoch is None else min(until_epoch, cfg.max_epochs)
        show = _tqdm_enabled(cfg.progress_bar, self.dp.is_main)

        def progress(**kwargs):
            return tqdm(disable=not show, dynamic_ncols=True, **kwargs)

        self.model.set_train(True)
        run_start = time.perf_counter()
        self.last_save = time.monotonic()
        history = []
        try:
            with self.signals.deferred():
                if self.start_epoch == 0 and self.global_step == 0 and self.val_sets:
                    self.initial = self.validate_all(progress)  # the starting checkpoint, to compare fine-tuning
                    self._log_validation("Before fine-tuning: ", self.initial)
                    self._write_jsonl({"type": "initial", "epoch": 0, "step": 0, **self.initial})
                epochs = progress(total=cfg.max_epochs, initial=self.start_epoch, desc="fine-tuning")
                for epoch in range(self.start_epoch, last_epoch):
                    if self._stopped_early():
                        break
                    train_metrics = self.train_epoch(epoch, progress)
                    results = self.validate_all(progress)
                    epochs.update(1)
                    self._log_validation(f"Epoch: {epoch + 1}/{cfg.max_epochs}, train_metrics: "
                                         f"{_fmt(train_metrics)}, ", results)
                    record = {"type": "epoch", "epoch": epoch + 1, "step": self.global_step, "train": train_metrics,
                              **results, "lr": float(self.schedule.lr[max(self.global_step, 1) - 1])}
                    self._save_epoch(epoch + 1, results.get("val", {}).get("loss", train_metrics["loss"]))
                    self._write_jsonl(record)  # after the save: no line claims an epoch the checkpoint lacks
                    history.append(record)
                    self.start_epoch = epoch + 1  # where a later fit() call continues
                    if epoch + 1 < last_epoch and self.dp.sum(self._stop_and_save_flags()[:1])[0]:
                        self._stop(epoch, self.steps_per_epoch)
                epochs.close()
        finally:
            self.loader.close()
        total = time.perf_counter() - run_start
        if self.dp.is_main:
            log.info("training finished in %.1f s (%d compilations: %s)", total, len(self.compiled),
                     ", ".join(f"{k[0]} {k[1].num_nodes}x{k[1].num_edges} {v:.0f}s" for k, v in self.compiled.items()))
            log.info("checkpoints: %s (last.ckpt, best.ckpt, best_weights.ckpt); metrics: %s", self.checkpoint_dir,
                     os.path.join(self.output_dir, "metrics.jsonl"))
        return {"history": history, "total_time": total, "compilations": len(self.compiled)}

    def _stopped_early(self) -> bool:
        """Early stopping: ``patience`` epochs in a row without a lower validation loss end the run."""
        waited = self.epochs_done - self.best_epoch
        if not self.cfg.patience or waited < self.cfg.patience or math.isinf(self.best_val):
            return False
        if self.dp.is_main:
            log.info("early stopping: the validation loss has not improved for %d epochs (best %.6g after epoch %d; "
                     "best.ckpt and best_weights.ckpt hold it)", waited, self.best_val, self.best_epoch)
        self._write_jsonl({"type": "stopped", "epoch": self.epochs_done, "step": self.global_step,
                           "best_epoch": self.best_epoch, "best_val_loss": self.best_val})
        return True

    # ----------------------------------------------------------------- outputs
    def _record(self, step: Step) -> None:
        """With ``record_batches``: the database row ids this rank trains on, one line per step."""
        if self.cfg.record_batches:
            ids = [self.train_set.row_id(i) for i in step.indices]
            append_jsonl(os.path.join(self.output_dir, f"batches_rank{self.dp.rank}.jsonl"),
                         {"epoch": step.epoch + 1, "step": self.global_step + 1, "row_ids": ids})

    def _write_jsonl(self, record: Dict) -> None:
        if self.dp.is_main:
            append_jsonl(os.path.join(self.output_dir, "metrics.jsonl"), record)

    def _meta(self, epoch: int) -> Dict:
        meta = {"format": training_state.CHECKPOINT_FORMAT, "epoch": epoch, "global_step": self.global_step,
                "best_val_loss": None if math.isinf(self.best_val) else self.best_val, "best_epoch": self.best_epoch,
                "initial": self.initial, "random_seed": self.cfg.random_seed, "config": self.cfg.to_dict(),
                "model": self.cfg.model.to_dict(), "train_rows": len(self.train_source),
                "train_fingerprint": self.databases["train"].content_fingerprint(),
                "world_size": self.dp.world_size}
        if self.reference_fit is not None:
            meta["reference_energies_fit"] = self.reference_fit.to_dict()
        return meta

    def _refuse_nonfinite(self, state) -> None:
        """No checkpoint ever holds a NaN or inf: the last good one stays."""
        for name, value in list(self.model.parameters_and_names()) + list(state):
            array = value.asnumpy() if hasattr(value, "asnumpy") else np.asarray(value)
            if np.issubdtype(array.dtype, np.floating) and not np.isfinite(array).all():
                raise DivergedError(f"{name} holds NaN or inf after global step {self.global_step}: not saved; "
                                    f"{os.path.join(self.checkpoint_dir, 'last.ckpt')} holds the last finite state")

    def _save_step(self, epoch: int, steps_done: int, totals: np.ndarray) -> None:
        """``last.ckpt`` inside epoch ``epoch`` after ``steps_done`` of its steps: with the epoch's metric sums so
        far and the current logging interval's, a resume continues exactly here."""
        from orb.io.checkpoint import save_checkpoint

        state = training_state.optimizer_state(self.optimizer, self.param_names, self.dp)  # collective when sharded
        self.last_save = time.monotonic()
        if not self.dp.is_main:
            return
        self._refuse_nonfinite(state)
        meta = dict(self._meta(epoch), step_in_epoch=steps_done, epoch_sums=[float(x) for x in totals],
                    interval_sums=[float(x) for x in self.train_step.metric_sums.asnumpy()])
        started = time.perf_counter()
        save_checkpoint(os.path.join(self.checkpoint_dir, "last.ckpt"), self.model, meta, state)
        log.info("saved last.ckpt at epoch %d, step %d of %d (global step %d) in %.1f s", epoch + 1, steps_done,
                 self.steps_per_epoch, self.global_step, time.perf_counter() - started)

    def _save_epoch(self, epoch: int, val_loss: float) -> None:
        from orb.io.checkpoint import save_checkpoint

        improved = val_loss < self.best_val
        if improved:
            self.best_val, self.best_epoch = val_loss, epoch
        self.epochs_done = epoch
        state = training_state.optimizer_state(self.optimizer, self.param_names, self.dp)  # collective when sharded
        self.last_save = time.monotonic()
        if not self.dp.is_main:
            return
        self._refuse_nonfinite(state)
        meta = self._meta(epoch)
        save_checkpoint(os.path.join(self.checkpoint_dir, "last.ckpt"), self.model, meta, state)
        if improved:
            save_checkpoint(os.path.join(self.checkpoint_dir, "best.ckpt"), self.model, meta, state)
            with self._evaluation_weights():
                weights_meta = {"epoch": epoch, "val_loss": val_loss, "ema": bool(self.cfg.ema_decay),
                                "config": self.cfg.to_dict(), "model": self.cfg.model.to_dict()}
                if self.reference_fit is not None:
                    weights_meta["reference_energies_fit"] = self.reference_fit.to_dict()
                save_checkpoint(os.path.join(self.checkpoint_dir, "best_weights.ckpt"), self.model, weights_meta,
                                exported=True)
        if epoch % self.cfg.save_every_x_epochs == 0 or epoch == self.cfg.max_epochs:
            save_checkpoint(os.path.join(self.checkpoint_dir, f"epoch_{epoch:04d}.ckpt"), self.model, meta, state)
            prune_checkpoints(self.checkpoint_dir, self.cfg.keep_checkpoints)

    def _read_checkpoint(self, path: str, load_checkpoint):
        """(weights, optimizer state, metadata) of a training checkpoint. In a data-parallel run rank 0 reads the
        file and the others receive it through the collective (one read of the shared file system, not one per
        rank); if rank 0 cannot read it, every rank stops."""
        if not self.dp.parallel:
            return load_checkpoint(path)
        import json

        loaded, failure = None, None
        if self.dp.is_main:
            try:
                loaded = load_checkpoint(path)
            except Exception as exc:  # reported below, after every rank has heard of it
                failure = exc
        if self.dp.sum(np.array([failure is not None], np.float64))[0]:
            if failure is not None:
                raise failure
            raise ClusterError(f"rank 0 could not read {path} (its log says why)")
        arrays = None
        if self.dp.is_main:
            weights, opt_state, meta = loaded
            arrays = {**{"w/" + k: np.asarray(v) for k, v in weights.items()},
                      **{"o/" + k: np.asarray(v) for k, v in opt_state.items()},
                      "meta": np.frombuffer(json.dumps(meta).encode(), np.uint8)}
        started = time.perf_counter()
        shared = self.dp.share_from_main(arrays)
        log.info("%s %s %s in %.1f s", "read" if self.dp.is_main else "received", path,
                 f"and shared it with the other {self.dp.world_size - 1} ranks" if self.dp.is_main else "from rank 0",
                 time.perf_counter() - started)
        weights = {k[2:]: v for k, v in shared.items() if k.startswith("w/")}
        opt_state = {k[2:]: v for k, v in shared.items() if k.startswith("o/")}
        return weights, opt_state, json.loads(bytes(shared["meta"]).decode())

    def _resume(self, path: str, accept_changes: bool) -> None:
        from orb.io.checkpoint import load_checkpoint, load_torch_state_dict

        if os.path.isdir(path):
            folder = os.path.join(path, "checkpoints")
            path = os.path.join(folder if os.path.isdir(folder) else path, "last.ckpt")
        weights, opt_state, meta = self._read_checkpoint(path, load_checkpoint)
        changes = training_state.check_resume(meta, self.cfg.to_dict(), len(self.train_source), path, accept_changes,
                                              self.databases["train"].content_fingerprint())
        load_torch_state_dict(self.model, weights, source=path)
        training_state.restore_optimizer(self.optimizer, self.param_names, opt_state, path)
        self.start_epoch = self.epochs_done = int(meta["epoch"])
        self.global_step = int(meta["global_step"])
        self.best_val = training_state.best_loss(meta)
        self.best_epoch = int(meta.get("best_epoch") or 0)
        self.initial = meta.get("initial") or {}
        self.resume_step = int(meta.get("step_in_epoch") or 0)
        if self.resume_step:  # inside an epoch: its sums so far, and the open logging interval's on the device
            from orb.training.steps import write_parameter

            self.resume_totals = np.asarray(meta["epoch_sums"], np.float64)
            write_parameter(self.train_step.metric_sums, np.asarray(meta["interval_sums"]))
        if self.dp.is_main:
            dropped = keep_records_up_to(os.path.join(self.output_dir, "metrics.jsonl"), self.global_step)
            if dropped:
                log.info("metrics.jsonl: %d record(s) written after the checkpoint dropped (the steps run again)",
                         dropped)
        keep_records_up_to(os.path.join(self.output_dir, f"batches_rank{self.dp.rank}.jsonl"), self.global_step)
        if changes:
            log.warning("resuming with changed settings (accepted): %s", "; ".join(changes))
        log.info("resumed from %s: %d epochs%s done, global step %d", path, self.start_epoch,
                 f" and {self.resume_step} of {self.steps_per_epoch} steps" if self.resume_step else "",
                 self.global_step)
