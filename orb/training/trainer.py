"""The fine-tuning loop shared by ``finetune.py`` (one device) and ``finetune_parallel.py`` (data parallel)."""

import logging
import math
import os
import sys
import time
from contextlib import contextmanager
from typing import Dict, List, Optional, Tuple

import numpy as np

from orb.data.buckets import Bucket, check_buckets, padding_fraction, parse_buckets, plan_buckets
from orb.data.dataset import AseDbDataset, EpochSampler
from orb.data.graphs import capacity_is_counted
from orb.data.loader import BatchLoader, Step, plan_epoch
from orb.device import compile_cell
from orb.errors import ConfigError
from orb.metrics import METRICS, describe
from orb.training import state as training_state
from orb.training.config import TrainConfig
from orb.training.distributed import DataParallel
from orb.training.outputs import append_jsonl

log = logging.getLogger("orb")


def build_model(cfg: TrainConfig):
    """orb model of the config's architecture with pretrained (or random) weights and reference energies."""
    from orb.io.checkpoint import load_weights_into
    from orb.models import build
    from orb.models.reference_energies import load_reference_file

    model = build(cfg.model, seed=cfg.random_seed)
    if cfg.checkpoint_path:
        load_weights_into(model, cfg.checkpoint_path)
        log.info("loaded weights from %s", cfg.checkpoint_path)
    else:
        log.warning("checkpoint_path is empty: starting from RANDOM weights (set it to an orb-v2 checkpoint "
                    "to fine-tune the pretrained model)")
    if cfg.reference_energies.file:
        import mindspore as ms

        weight = model.graph_head.reference.linear.weight
        table = load_reference_file(cfg.reference_energies.file, weight.asnumpy())
        weight.set_data(ms.Tensor(table.astype(np.float32)))
        log.info("reference energies from %s", cfg.reference_energies.file)
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
        excluded.add(id(model.reference_energy_weight()))
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
    return "{" + ", ".join(f"'{k}': {v:.6g}" for k, v in metrics.items()) + "}"


class Trainer:
    """Fits an orb model to an ASE database: compiled steps, validation, logging, checkpoints, resume."""

    def __init__(self, cfg: TrainConfig, data_parallel: Optional[DataParallel] = None, resume: Optional[str] = None,
                 accept_config_changes: bool = False):
        self.cfg, self.dp = cfg, data_parallel or DataParallel()
        self._log_device()
        self.output_dir = cfg.output_dir
        self.checkpoint_dir = os.path.join(self.output_dir, "checkpoints")
        self._load_data()
        self.model = build_model(cfg)
        self.params = trainable_parameters(self.model, cfg)
        self.param_names = self._names(self.params)
        self.steps_per_epoch = len(self.sampler)
        self.total_steps = cfg.max_epochs * self.steps_per_epoch
        self._build_steps()
        self.compiled: Dict[Tuple[str, Bucket], float] = {}
        self.compile_time = 0.0  # seconds spent compiling during the current epoch
        self.start_epoch, self.global_step, self.best_val = 0, 0, math.inf
        if resume:
            self._resume(resume, accept_config_changes)
        self.dp.check_same_parameters(self.model)
        self._log_start()

    # ----------------------------------------------------------------- setup
    def _log_device(self) -> None:
        import mindspore as ms

        from orb.models.kernels import set_kernel_mode, uses_custom_kernels

        set_kernel_mode(self.cfg.kernels)
        kernels = "accurate custom CPU kernels" if uses_custom_kernels() else "MindSpore's built-in kernels"
        log.info("device: %s (%s)", ms.get_context("device_target"), kernels)
        if self.dp.parallel:
            log.info("data parallel: rank %d of %d (pid %d)", self.dp.rank, self.dp.world_size, os.getpid())

    def _load_data(self) -> None:
        cfg, world = self.cfg, self.dp.world_size
        if cfg.optimizer_shard and world < 2:
            raise ConfigError("config key 'optimizer_shard': sharding the optimizer state needs a data-parallel run "
                              "with at least 2 workers (run_parallel.sh)")
        if cfg.batch_size < world:
            raise ConfigError(f"config key 'batch_size' ({cfg.batch_size}) is the global batch and must be at least "
                              f"the number of workers ({world})")
        graphs, charge_spin = cfg.model.graph_settings(), cfg.model.omol
        self.train_set = AseDbDataset(cfg.train_data_path, augmentation=cfg.augmentation, settings=graphs,
                                      charge_spin=charge_spin)
        self.val_set = (AseDbDataset(cfg.val_data_path, settings=graphs, charge_spin=charge_spin)
                        if cfg.val_data_path else None)
        for key, data in (("train_data_path", self.train_set), ("val_data_path", self.val_set)):
            if data is not None and len(data) < world:
                raise ConfigError(f"config key '{key}': {data.path} has {len(data)} structure(s), fewer than the "
                                  f"{world} workers")
        self.has_stress = self.train_set.has_stress and cfg.loss_weights.stress > 0 and cfg.model.has_stress
        if cfg.loss_weights.stress > 0 and cfg.model.has_stress and not self.train_set.has_stress:
            log.warning("%s has no stress labels: training without the stress loss", cfg.train_data_path)
        if self.val_set is not None and self.has_stress and not self.val_set.has_stress:
            raise ConfigError(f"val_data_path {cfg.val_data_path} has no stress while the training data has; "
                              "set loss_weights.stress: 0 or add stress labels")
        self.local_batch = math.ceil(cfg.batch_size / world)
        self.sampler = EpochSampler(len(self.train_set), cfg.batch_size, cfg.random_seed, True)
        self.val_sampler = EpochSampler(len(self.val_set), cfg.batch_size, 0, False) if self.val_set else None
        datasets = {"train": self.train_set, **({"val": self.val_set} if self.val_set is not None else {})}
        self.loader = BatchLoader(datasets, cfg.data_workers)
        self.train_buckets = self._buckets("train", "training")
        self.val_buckets = self._buckets("val", "validation") if self.val_set is not None else []

    def _buckets(self, name: str, what: str) -> List[Bucket]:
        dataset = self.loader.datasets[name]
        start = time.perf_counter()
        edges = self.loader.edge_capacities(name, self.dp)
        if dataset.capacities_read_from is not None:
            log.info("%s data: neighbour counts of %d structures for the batch shapes read from %s", what, len(dataset),
                     dataset.capacities_read_from)
        elif capacity_is_counted(dataset.settings):
            log.info("%s data: neighbours of %d structures counted for the batch shapes in %.1f s%s%s", what,
                     len(dataset), time.perf_counter() - start,
                     f" (shared by {self.dp.world_size} ranks)" if self.dp.parallel else "",
                     f", kept in {dataset.capacities_kept_in}" if dataset.capacities_kept_in else "")
        if self.cfg.buckets:
            buckets = parse_buckets(self.cfg.buckets, self.local_batch)
            check_buckets(dataset.natoms, edges, self.local_batch, buckets, what)
            return buckets
        return plan_buckets(dataset.natoms, edges, self.local_batch, self.cfg.num_buckets, seed=self.cfg.random_seed)

    def _names(self, params) -> List[str]:
        names = {id(p): name for name, p in self.model.parameters_and_names()}
        return [names[id(p)] for p in params]

    def _build_steps(self) -> None:
        from orb.training.optimizer import FlatAdam, Sharding
        from orb.training.schedule import make_schedule
        from orb.training.steps import EvalStep, TrainStep

        cfg, dp = self.cfg, self.dp
        self.schedule = make_schedule(cfg.lr_schedule, cfg.lr, self.total_steps, cfg.warmup_fraction)
        sharding = Sharding(dp.rank, dp.world_size, dp.all_gather) if dp.shard_optimizer else None
        self.optimizer = FlatAdam(self.params, self.schedule, clip_mode=cfg.gradient_clip_mode,
                                  clip_value=cfg.gradient_clip_val, all_reduce=dp.all_reduce, sharding=sharding,
                                  ema_decay=cfg.ema_decay, algorithm=cfg.optimizer)
        self.loss_cell = make_loss(self.model, cfg, self.has_stress, dp.all_reduce)
        self.train_step = TrainStep(self.loss_cell, self.optimizer)
        self.eval_step = EvalStep(self.loss_cell)

    def _log_start(self) -> None:
        cfg = self.cfg
        n_params = self.model.num_parameters()
        n_train = int(sum(np.prod(p.shape) for p in self.params))
        log.info("model: %s, %s parameters (%s trained), %d message-passing layers, latent %d; graphs: %d neighbours "
                 "within %g Å", cfg.model.name, f"{n_params:,}", f"{n_train:,}", cfg.model.num_message_passing_steps,
                 cfg.model.latent_dim, cfg.model.max_neighbors, cfg.model.radius)
        log.info("train data: %s (%d structures, %d atoms)%s", cfg.train_data_path, len(self.train_set),
                 int(self.train_set.natoms.sum()), "" if self.train_set.has_stress else ", no stress")
        if self.val_set is not None:
            log.info("validation data: %s (%d structures)", cfg.val_data_path, len(self.val_set))
        log.info("batch size: %d global, %d per worker x %d worker(s); %d steps per epoch, %d epochs",
                 cfg.batch_size, self.local_batch, self.dp.world_size, self.steps_per_epoch, cfg.max_epochs)
        log.info("optimizer: %s, %s schedule, peak lr %.3g%s, clipping %s %g%s", cfg.optimizer, cfg.lr_schedule,
                 float(self.schedule.lr.max()), f", EMA of weights {cfg.ema_decay}" if cfg.ema_decay else "",
                 cfg.gradient_clip_mode, cfg.gradient_clip_val,
                 ", state sharded over ranks" if self.dp.shard_optimizer else "")
        pad = padding_fraction(self.train_set.natoms, self.train_set.edge_capacities(), self.local_batch,
                               self.train_buckets)
        log.info("train buckets (nodes, edges, graphs): %s; expected padding %.0f%% of nodes, %.0f%% of edges",
                 [(b.num_nodes, b.num_edges, b.num_graphs) for b in self.train_buckets], 100 * pad["nodes"],
                 100 * pad["edges"])
        keys = [k for k in self.loss_cell.sum_keys if k in METRICS and (self.has_stress or "stress" not in k)]
        log.info("metrics (per epoch, train and validation):\n%s", describe(keys))

    # ----------------------------------------------------------------- steps
    def _plan(self, sampler: EpochSampler, dataset: AseDbDataset, buckets, epoch: int) -> List[Step]:
        return plan_epoch(sampler, dataset.natoms, dataset.edge_capacities(), self.dp.shards, self.dp.rank, buckets,
                          epoch)

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
        out.asnumpy()
        self.compiled[key] = time.perf_counter() - start
        self.compile_time += self.compiled[key]
        return out

    def _sums_to_metrics(self, sums: np.ndarray) -> Dict[str, float]:
        return self.loss_cell.metrics(sums)

    # ----------------------------------------------------------------- epochs
    def train_epoch(self, epoch: int, progress) -> Dict[str, float]:
        from orb.training.steps import read_and_reset

        steps = self._plan(self.sampler, self.train_set, self.train_buckets, epoch)
        seed = self.cfg.random_seed if self.cfg.augmentation else None
        totals = np.zeros(len(self.loss_cell.sum_keys))
        self.compile_time, wait_before = 0.0, self.loader.wait_time
        start = time.perf_counter()
        bar = progress(total=len(steps), desc=f"epoch {epoch + 1}", leave=False)
        for i, (step, arrays) in enumerate(self.loader.iterate("train", steps, seed, self.has_stress)):
            self._record(step)
            self._run("train", self.train_step, arrays, step.bucket)
            self.global_step += 1
            bar.update(1)
            if (i + 1) % self.cfg.log_every_n_steps == 0 or i + 1 == len(steps):
                part = self.dp.sum(read_and_reset(self.train_step.metric_sums))  # one host sync per interval
                totals += part
                interval = self._sums_to_metrics(part)
                bar.set_postfix(loss=f"{interval['loss']:.4f}")
                self._write_jsonl({"type": "step", "epoch": epoch + 1, "step": self.global_step,
                                   "lr": float(self.schedule.lr[min(self.global_step, self.total_steps) - 1]),
                                   **interval})
        bar.close()
        metrics = self._sums_to_metrics(totals)
        elapsed = time.perf_counter() - start - self.compile_time
        metrics["data_wait"] = (self.loader.wait_time - wait_before) / max(elapsed, 1e-9)
        metrics["train_time"] = elapsed
        if self.compile_time:
            metrics["compile_time"] = self.compile_time
        return metrics

    def validate(self, progress) -> Dict[str, float]:
        if self.val_set is None:
            return {}
        start = time.perf_counter()
        steps = self._plan(self.val_sampler, self.val_set, self.val_buckets, 0)
        total = np.zeros(0)
        bar = progress(total=len(steps), desc="validation", leave=False)
        with self._evaluation_weights():
            for step, arrays in self.loader.iterate("val", steps, None, self.has_stress):
                sums = self._run("eval", self.eval_step, arrays, step.bucket).asnumpy().astype(np.float64)
                total = sums if total.size == 0 else total + sums  # float64 on the host, batch by batch
                bar.update(1)
        bar.close()
        metrics = self._sums_to_metrics(self.dp.sum(total))
        metrics["val_time"] = time.perf_counter() - start
        return metrics

    @contextmanager
    def _evaluation_weights(self):
        """Validation sees the EMA of the weights when ``ema_decay`` is set (as the saved best weights)."""
        if not self.cfg.ema_decay:
            yield
            return
        from mindspore import Tensor

        current = [p.asnumpy() for p in self.params]
        for p, value in zip(self.params, training_state.ema_weights(self.optimizer)):
            p.set_data(Tensor(value))
        try:
            yield
        finally:
            for p, value in zip(self.params, current):
                p.set_data(Tensor(value))

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
        history = []
        try:
            if self.start_epoch == 0 and self.val_set is not None:
                initial = self.validate(progress)  # the starting checkpoint, to compare fine-tuning against
                if self.dp.is_main:
                    log.info("Before fine-tuning: val_metrics: %s", _fmt(initial))
                self._write_jsonl({"type": "initial", "epoch": 0, "step": 0, "val": initial})
            epochs = progress(total=cfg.max_epochs, initial=self.start_epoch, desc="fine-tuning")
            for epoch in range(self.start_epoch, last_epoch):
                train_metrics = self.train_epoch(epoch, progress)
                val_metrics = self.validate(progress)
                epochs.update(1)
                if self.dp.is_main:
                    log.info(f"Epoch: {epoch + 1}/{cfg.max_epochs}, train_metrics: {_fmt(train_metrics)}, "
                             f"val_metrics: {_fmt(val_metrics)}")
                record = {"type": "epoch", "epoch": epoch + 1, "step": self.global_step, "train": train_metrics,
                          "val": val_metrics, "lr": float(self.schedule.lr[max(self.global_step, 1) - 1])}
                self._write_jsonl(record)
                history.append(record)
                self._save_epoch(epoch + 1, val_metrics.get("loss", train_metrics["loss"]))
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

    # ----------------------------------------------------------------- outputs
    def _record(self, step: Step) -> None:
        """With ``record_batches``: the database row ids this rank trains on, one line per step."""
        if self.cfg.record_batches:
            ids = [int(self.train_set.ids[i]) for i in step.indices]
            append_jsonl(os.path.join(self.output_dir, f"batches_rank{self.dp.rank}.jsonl"),
                         {"epoch": step.epoch + 1, "step": self.global_step + 1, "row_ids": ids})

    def _write_jsonl(self, record: Dict) -> None:
        if self.dp.is_main:
            append_jsonl(os.path.join(self.output_dir, "metrics.jsonl"), record)

    def _meta(self, epoch: int) -> Dict:
        return {"format": training_state.CHECKPOINT_FORMAT, "epoch": epoch, "global_step": self.global_step,
                "best_val_loss": None if math.isinf(self.best_val) else self.best_val,
                "random_seed": self.cfg.random_seed, "config": self.cfg.to_dict(), "model": self.cfg.model.to_dict(),
                "train_rows": len(self.train_set), "world_size": self.dp.world_size}

    def _save_epoch(self, epoch: int, val_loss: float) -> None:
        from orb.io.checkpoint import save_checkpoint

        improved = val_loss < self.best_val
        if improved:
            self.best_val = val_loss
        state = training_state.optimizer_state(self.optimizer, self.param_names, self.dp)  # collective when sharded
        if not self.dp.is_main:
            return
        meta = self._meta(epoch)
        save_checkpoint(os.path.join(self.checkpoint_dir, "last.ckpt"), self.model, meta, state)
        if improved:
            save_checkpoint(os.path.join(self.checkpoint_dir, "best.ckpt"), self.model, meta, state)
            with self._evaluation_weights():
                save_checkpoint(os.path.join(self.checkpoint_dir, "best_weights.ckpt"), self.model,
                                {"epoch": epoch, "val_loss": val_loss, "ema": bool(self.cfg.ema_decay),
                                 "config": self.cfg.to_dict(), "model": self.cfg.model.to_dict()})
        if epoch % self.cfg.save_every_x_epochs == 0 or epoch == self.cfg.max_epochs:
            save_checkpoint(os.path.join(self.checkpoint_dir, f"epoch_{epoch:04d}.ckpt"), self.model, meta, state)

    def _resume(self, path: str, accept_changes: bool) -> None:
        from orb.io.checkpoint import load_checkpoint, load_torch_state_dict

        if os.path.isdir(path):
            folder = os.path.join(path, "checkpoints")
            path = os.path.join(folder if os.path.isdir(folder) else path, "last.ckpt")
        weights, opt_state, meta = load_checkpoint(path)
        changes = training_state.check_resume(meta, self.cfg.to_dict(), len(self.train_set), path, accept_changes)
        load_torch_state_dict(self.model, weights, source=path)
        training_state.restore_optimizer(self.optimizer, self.param_names, opt_state, path)
        self.start_epoch = int(meta["epoch"])
        self.global_step = int(meta["global_step"])
        self.best_val = training_state.best_loss(meta)
        if changes:
            log.warning("resuming with changed settings (accepted): %s", "; ".join(changes))
        log.info("resumed from %s: %d epochs done, global step %d", path, self.start_epoch, self.global_step)
