"""The fine-tuning loop shared by ``finetune.py`` (one device) and ``finetune_parallel.py`` (data parallel)."""

import json
import logging
import math
import os
import sys
import time
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from orb.data.buckets import Bucket, pad_to_bucket, padding_fraction, parse_buckets, plan_buckets
from orb.training.config import TrainConfig
from orb.data.dataset import AseDbDataset, EpochSampler
from orb.training.distributed import Distributed
from orb.errors import CheckpointError, ConfigError
from orb.data.graphs import AtomGraphs, batch_graphs, empty_batch

log = logging.getLogger("orb")
CHECKPOINT_FORMAT = "orb-mindspore-train-1"


def select_device(requested: str) -> str:
    """``auto`` picks Ascend, then GPU, then CPU (whichever MindSpore can use here)."""
    if requested != "auto":
        return requested
    import mindspore as ms

    for target in ("Ascend", "GPU"):
        try:
            if ms.hal.is_available(target):
                return target
        except Exception:  # a backend plug-in that fails to load counts as unavailable
            pass
    return "CPU"


def configure_mindspore(cfg: TrainConfig, parallel: bool = False) -> str:
    """Graph mode on the configured device (in an msrun job each worker gets its local device)."""
    import mindspore as ms

    target = select_device(cfg.device_target)
    ms.set_context(mode=ms.GRAPH_MODE)
    threads = cfg.num_threads or int(os.environ.get("OMP_NUM_THREADS", "0") or 0)
    if target == "CPU" and threads:
        # MindSpore's CPU kernels use their own pool (25 threads by default), not only OpenMP's
        ms.device_context.cpu.op_tuning.threads_num(threads)
    try:
        if parallel:
            ms.set_device(target)
        else:
            ms.set_device(target, cfg.device_id)
    except RuntimeError:  # already running (a second run in the same process) on the same device is fine
        if ms.get_context("device_target") != target:
            raise
    return target


def build_model(cfg: TrainConfig):
    """orb model of the config's architecture with pretrained (or random) weights and reference energies."""
    from orb.io.checkpoint import load_weights_into
    from orb.models.orb_v2 import GraphRegressor
    from orb.models.reference_energies import load_reference_file

    model = GraphRegressor(cfg.model, seed=cfg.random_seed)
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
    """Parameters the optimizer updates: all but those that cannot change any output, the backbone if
    frozen, and the reference energies if fixed.

    Never updated: the decoder (no head reads it) and the force head's last bias (the per-structure
    mean removal cancels it exactly; its gradient is rounding noise, which Adam would amplify into
    a random walk).
    """
    excluded = {id(p) for p in model.decoder_parameters()}
    excluded.add(id(model.node_head.mlp.layer(len(model.node_head.mlp.layer_names) - 1).bias))
    if cfg.freeze_backbone:
        excluded |= {id(p) for p in model.backbone_parameters()}
    if not cfg.reference_energies.trainable:
        excluded.add(id(model.graph_head.reference.linear.weight))
    params = [p for p in model.trainable_params() if id(p) not in excluded]
    for p in model.trainable_params():
        p.requires_grad = id(p) not in excluded
    return params


def _tqdm_enabled(setting: str, is_main: bool) -> bool:
    if not is_main:
        return False
    if setting == "auto":
        return sys.stderr.isatty()
    return setting == "true"


class Trainer:
    """Fits an orb model to an ASE database: compiled steps, validation, logging, checkpoints, resume."""

    def __init__(self, cfg: TrainConfig, dist: Optional[Distributed] = None, resume: Optional[str] = None):
        from orb.training.loss import OrbLoss
        from orb.training.steps import EvalStep, TrainStep

        import mindspore as ms
        from mindspore import Tensor, nn

        from orb.training.schedule import learning_rates

        self.cfg, self.dist = cfg, dist or Distributed()
        self.output_dir = cfg.output_dir
        self.checkpoint_dir = os.path.join(self.output_dir, "checkpoints")
        if self.dist.is_main:
            os.makedirs(self.checkpoint_dir, exist_ok=True)
        self.train_set = AseDbDataset(cfg.train_data_path, cfg.model.radius, cfg.model.max_neighbors,
                                      augmentation=cfg.augmentation)
        self.val_set = (AseDbDataset(cfg.val_data_path, cfg.model.radius, cfg.model.max_neighbors)
                        if cfg.val_data_path else None)
        self.has_stress = self.train_set.has_stress and cfg.loss_weights.stress > 0
        if cfg.loss_weights.stress > 0 and not self.train_set.has_stress:
            log.warning("%s has no stress labels: training without the stress loss", cfg.train_data_path)
        if self.val_set is not None and self.has_stress and not self.val_set.has_stress:
            raise ConfigError(f"val_data_path {cfg.val_data_path} has no stress while the training data has; "
                              "set loss_weights.stress: 0 or add stress labels")

        world = self.dist.world_size
        self.local_batch = math.ceil(cfg.batch_size / world)
        self.sampler = EpochSampler(len(self.train_set), cfg.batch_size, cfg.random_seed, True, self.dist.rank, world)
        self.val_sampler = (EpochSampler(len(self.val_set), cfg.batch_size, cfg.random_seed, False, self.dist.rank,
                                         world) if self.val_set is not None else None)
        self.train_buckets = self._buckets(self.train_set)
        self.val_buckets = self._buckets(self.val_set) if self.val_set is not None else []

        self.model = build_model(cfg)
        self.params = trainable_parameters(self.model, cfg)
        self.steps_per_epoch = len(self.sampler)
        self.total_steps = cfg.max_epochs * self.steps_per_epoch
        self.lrs = learning_rates(cfg.lr_schedule, cfg.lr, self.total_steps, cfg.warmup_fraction)
        self.optimizer = nn.Adam(self.params, learning_rate=Tensor(self.lrs))
        self._check_optimizer_shard()
        w = cfg.loss_weights
        self.loss_cell = OrbLoss(self.model, w.energy, w.forces, w.stress, self.has_stress,
                                 self.dist.graph_allreduce())
        self.train_step = TrainStep(self.loss_cell, self.optimizer, cfg.gradient_clip_mode, cfg.gradient_clip_val,
                                    self.dist.grad_reducer(self.params))
        self.eval_step = EvalStep(self.loss_cell)
        self.compiled: Dict[Tuple[str, Bucket], float] = {}
        self.compile_time = 0.0  # seconds spent compiling during the current epoch
        self.start_epoch, self.global_step, self.best_val = 0, 0, math.inf
        if resume:
            self._resume(resume)
        self.dist.check_same_parameters(self.model)
        self._ms = ms
        self._log_start()

    # ----------------------------------------------------------------- setup
    def _buckets(self, dataset: AseDbDataset) -> List[Bucket]:
        if self.cfg.buckets:
            return parse_buckets(self.cfg.buckets, self.local_batch)
        return plan_buckets(dataset.natoms, self.local_batch, self.cfg.model.max_neighbors, self.cfg.num_buckets,
                            seed=self.cfg.random_seed)

    def _check_optimizer_shard(self) -> None:
        if not self.cfg.optimizer_shard:
            return
        if not self.dist.parallel:
            raise ConfigError("optimizer_shard: true needs data-parallel training (finetune_parallel.py / "
                              "run_parallel.sh)")
        target = self._device_target()
        if target == "CPU":
            raise ConfigError("optimizer_shard: true is not available on CPU: MindSpore's optimizer parallel "
                              "(ZeRO-style sharding) supports only Ascend and GPU; set optimizer_shard: false")

    @staticmethod
    def _device_target() -> str:
        import mindspore as ms

        return ms.get_context("device_target")

    def _log_start(self) -> None:
        cfg = self.cfg
        n_params = self.model.num_parameters()
        n_train = int(sum(np.prod(p.shape) for p in self.params))
        log.info("model: %s parameters (%s trained), %d message-passing layers, latent %d",
                 f"{n_params:,}", f"{n_train:,}", cfg.model.num_message_passing_steps, cfg.model.latent_dim)
        log.info("train data: %s (%d structures, %d atoms)%s", cfg.train_data_path, len(self.train_set),
                 int(self.train_set.natoms.sum()), "" if self.train_set.has_stress else ", no stress")
        if self.val_set is not None:
            log.info("validation data: %s (%d structures)", cfg.val_data_path, len(self.val_set))
        log.info("batch size: %d global, %d per worker x %d worker(s); %d steps per epoch, %d epochs",
                 cfg.batch_size, self.local_batch, self.dist.world_size, self.steps_per_epoch, cfg.max_epochs)
        pad = padding_fraction(self.train_set.natoms, self.local_batch, self.train_buckets, cfg.model.max_neighbors)
        log.info("train buckets (nodes, edges, graphs): %s; expected padding %.0f%% of nodes, %.0f%% of edges",
                 [(b.num_nodes, b.num_edges, b.num_graphs) for b in self.train_buckets], 100 * pad["nodes"],
                 100 * pad["edges"])

    # ----------------------------------------------------------------- batches
    def _batch(self, dataset: AseDbDataset, indices: np.ndarray, epoch: int, augment: bool) -> AtomGraphs:
        seed = self.cfg.random_seed
        graphs = [dataset.get(int(i), rotation_seed=[seed, epoch, int(i)] if augment else None) for i in indices]
        if not graphs:
            return empty_batch(with_stress=dataset.has_stress)
        return batch_graphs(graphs)

    def _inputs(self, batch: AtomGraphs, buckets: Sequence[Bucket], global_count: int):
        from orb.data.tensors import loss_inputs

        padded = pad_to_bucket(batch, buckets)
        weight = padded.graph_mask.astype(np.float32) * (self.dist.world_size / max(global_count, 1))
        if not self.has_stress:
            padded.stress = None
        bucket = Bucket(padded.num_nodes, padded.num_edges, padded.num_graphs)
        return loss_inputs(padded, weight), bucket

    def _run(self, kind: str, cell, inputs, bucket: Bucket):
        key = (kind, bucket)
        if key in self.compiled:
            return cell(*inputs)
        log.info("compiling the %s step for batch shape (nodes %d, edges %d, graphs %d) ...", kind,
                 bucket.num_nodes, bucket.num_edges, bucket.num_graphs)
        start = time.perf_counter()
        out = cell(*inputs)
        out.asnumpy()
        self.compiled[key] = time.perf_counter() - start
        self.compile_time += self.compiled[key]
        log.info("compiled %s step in %.1f s (%d compilations so far)", kind, self.compiled[key], len(self.compiled))
        return out

    # ----------------------------------------------------------------- epochs
    def train_epoch(self, epoch: int, progress) -> Dict[str, float]:
        from orb.training.loss import SUM_KEYS, metrics_from_sums
        from orb.training.steps import read_and_reset

        global_batches = self.sampler.global_batches(epoch)
        totals = np.zeros(len(SUM_KEYS))
        data_time = 0.0
        self.compile_time = 0.0
        start = time.perf_counter()
        bar = progress(total=len(global_batches), desc=f"epoch {epoch + 1}", leave=False)
        for step, global_batch in enumerate(global_batches):
            t0 = time.perf_counter()
            batch = self._batch(self.train_set, self.sampler.shard(global_batch), epoch, self.cfg.augmentation)
            self._record(epoch, batch)
            inputs, bucket = self._inputs(batch, self.train_buckets, len(global_batch))
            data_time += time.perf_counter() - t0
            self._run("train", self.train_step, inputs, bucket)
            self.global_step += 1
            bar.update(1)
            if (step + 1) % self.cfg.log_every_n_steps == 0 or step + 1 == len(global_batches):
                part = self.dist.sum(read_and_reset(self.train_step.metric_sums))  # one host sync per interval
                totals += part
                interval = metrics_from_sums(part, self.has_stress)
                bar.set_postfix(loss=f"{interval['loss']:.4f}")
                self._write_jsonl({"type": "step", "epoch": epoch + 1, "step": self.global_step,
                                   "lr": float(self.lrs[min(self.global_step - 1, len(self.lrs) - 1)]), **interval})
        bar.close()
        metrics = metrics_from_sums(totals, self.has_stress)
        metrics["data_time"] = data_time
        metrics["train_time"] = time.perf_counter() - start - data_time - self.compile_time
        if self.compile_time:
            metrics["compile_time"] = self.compile_time
        return metrics

    def validate(self, progress) -> Dict[str, float]:
        from orb.training.loss import metrics_from_sums
        from orb.training.steps import read_and_reset

        if self.val_set is None:
            return {}
        start = time.perf_counter()
        batches = self.val_sampler.global_batches(0)
        bar = progress(total=len(batches), desc="validation", leave=False)
        for global_batch in batches:
            batch = self._batch(self.val_set, self.val_sampler.shard(global_batch), 0, False)
            inputs, bucket = self._inputs(batch, self.val_buckets, len(global_batch))
            self._run("eval", self.eval_step, inputs, bucket)
            bar.update(1)
        bar.close()
        sums = self.dist.sum(read_and_reset(self.eval_step.metric_sums))
        metrics = metrics_from_sums(sums, self.has_stress)
        metrics["val_time"] = time.perf_counter() - start
        return metrics

    def fit(self, until_epoch: Optional[int] = None) -> Dict:
        """Train from the current epoch to ``until_epoch`` (default: the config's ``max_epochs``)."""
        from tqdm import tqdm

        cfg = self.cfg
        last_epoch = cfg.max_epochs if until_epoch is None else min(until_epoch, cfg.max_epochs)
        show = _tqdm_enabled(cfg.progress_bar, self.dist.is_main)

        def progress(**kwargs):
            return tqdm(disable=not show, dynamic_ncols=True, **kwargs)

        self.model.set_train(True)
        run_start = time.perf_counter()
        history = []
        if self.start_epoch == 0 and self.val_set is not None:
            initial = self.validate(progress)  # the starting checkpoint, to compare fine-tuning against
            if self.dist.is_main:
                log.info("Before fine-tuning: val_metrics: %s", _fmt(initial))
            self._write_jsonl({"type": "initial", "epoch": 0, "step": 0, "val": initial})
        epochs = progress(total=cfg.max_epochs, initial=self.start_epoch, desc="fine-tuning")
        for epoch in range(self.start_epoch, last_epoch):
            train_metrics = self.train_epoch(epoch, progress)
            val_metrics = self.validate(progress)
            epochs.update(1)
            line = (f"Epoch: {epoch + 1}/{cfg.max_epochs}, train_metrics: {_fmt(train_metrics)}, "
                    f"val_metrics: {_fmt(val_metrics)}")
            if self.dist.is_main:
                log.info(line)
            record = {"type": "epoch", "epoch": epoch + 1, "step": self.global_step, "train": train_metrics,
                      "val": val_metrics, "lr": float(self.lrs[min(self.global_step, len(self.lrs)) - 1])}
            self._write_jsonl(record)
            history.append(record)
            self._save_epoch(epoch + 1, val_metrics.get("loss", train_metrics["loss"]))
        epochs.close()
        total = time.perf_counter() - run_start
        if self.dist.is_main:
            log.info("training finished in %.1f s (%d compilations: %s)", total, len(self.compiled),
                     ", ".join(f"{k[0]} {k[1].num_nodes}x{k[1].num_edges} {v:.0f}s" for k, v in self.compiled.items()))
            log.info("checkpoints: %s (last.ckpt, best.ckpt, best_weights.ckpt); metrics: %s", self.checkpoint_dir,
                     os.path.join(self.output_dir, "metrics.jsonl"))
        return {"history": history, "total_time": total, "compilations": len(self.compiled)}

    # ----------------------------------------------------------------- outputs
    def _record(self, epoch: int, batch: AtomGraphs) -> None:
        """With ``record_batches``: the database row ids this rank trains on, one line per step."""
        if not self.cfg.record_batches:
            return
        os.makedirs(self.output_dir, exist_ok=True)
        ids = [] if batch.system_id is None else batch.system_id.tolist()
        with open(os.path.join(self.output_dir, f"batches_rank{self.dist.rank}.jsonl"), "a") as f:
            f.write(json.dumps({"epoch": epoch + 1, "step": self.global_step + 1, "row_ids": ids}) + "\n")

    def _write_jsonl(self, record: Dict) -> None:
        if not self.dist.is_main:
            return
        with open(os.path.join(self.output_dir, "metrics.jsonl"), "a") as f:
            f.write(json.dumps(record) + "\n")

    def _optimizer_entries(self) -> List[Tuple[str, object]]:
        """(checkpoint key without the ``optimizer.`` prefix, parameter) of the Adam state."""
        names = {id(p): name for name, p in self.model.parameters_and_names()}
        opt = self.optimizer
        entries = []
        for param, m1, m2 in zip(opt.parameters, opt.moment1, opt.moment2):
            key = names[id(param)]
            entries += [(f"moment1.{key}", m1), (f"moment2.{key}", m2)]
        return entries + [("beta1_power", opt.beta1_power), ("beta2_power", opt.beta2_power),
                          ("global_step", opt.global_step)]

    def _optimizer_state(self):
        return [(f"optimizer.{key}", param) for key, param in self._optimizer_entries()]

    def _meta(self, epoch: int) -> Dict:
        return {"format": CHECKPOINT_FORMAT, "epoch": epoch, "global_step": self.global_step,
                "best_val_loss": None if math.isinf(self.best_val) else self.best_val,
                "random_seed": self.cfg.random_seed, "config": self.cfg.to_dict()}

    def _save_epoch(self, epoch: int, val_loss: float) -> None:
        from orb.io.checkpoint import save_checkpoint

        improved = val_loss < self.best_val
        if improved:
            self.best_val = val_loss
        if not self.dist.is_main:
            return
        state = self._optimizer_state()
        meta = self._meta(epoch)
        save_checkpoint(os.path.join(self.checkpoint_dir, "last.ckpt"), self.model, meta, state)
        if improved:
            save_checkpoint(os.path.join(self.checkpoint_dir, "best.ckpt"), self.model, meta, state)
            save_checkpoint(os.path.join(self.checkpoint_dir, "best_weights.ckpt"), self.model,
                            {"epoch": epoch, "val_loss": val_loss, "config": self.cfg.to_dict()})
        if epoch % self.cfg.save_every_x_epochs == 0 or epoch == self.cfg.max_epochs:
            save_checkpoint(os.path.join(self.checkpoint_dir, f"epoch_{epoch:04d}.ckpt"), self.model, meta, state)

    def _resume(self, path: str) -> None:
        from mindspore import Tensor

        from orb.io.checkpoint import load_checkpoint, load_torch_state_dict

        if os.path.isdir(path):
            path = os.path.join(path, "checkpoints", "last.ckpt") if os.path.isdir(
                os.path.join(path, "checkpoints")) else os.path.join(path, "last.ckpt")
        weights, opt_state, meta = load_checkpoint(path)
        if meta.get("format") != CHECKPOINT_FORMAT:
            raise CheckpointError(f"{path}: not a training checkpoint of this program (use checkpoint_path to start "
                                  "from plain weights)")
        load_torch_state_dict(self.model, weights, source=path)
        targets = self._optimizer_entries()
        missing = [k for k, _ in targets if k not in opt_state]
        if missing:
            raise CheckpointError(f"{path}: optimizer state does not match the trained parameters "
                                  f"(missing {missing[:3]}...); was freeze_backbone or the model changed?")
        for key, param in targets:
            param.set_data(Tensor(opt_state[key].astype(param.asnumpy().dtype).reshape(param.shape)))
        self.start_epoch = int(meta["epoch"])
        self.global_step = int(meta["global_step"])
        self.best_val = math.inf if meta.get("best_val_loss") is None else float(meta["best_val_loss"])
        log.info("resumed from %s: %d epochs done, global step %d", path, self.start_epoch, self.global_step)


def _fmt(metrics: Dict[str, float]) -> str:
    return "{" + ", ".join(f"'{k}': {v:.6g}" for k, v in metrics.items()) + "}"


def setup_logging(output_dir: str, is_main: bool = True, rank: int = 0) -> None:
    """Console (and for the main process, ``output_dir/train.log``) logging in a readable format."""
    logger = logging.getLogger("orb")
    logger.setLevel(logging.INFO)
    logger.handlers.clear()
    fmt = logging.Formatter(f"%(asctime)s [%(levelname)s]{f' rank {rank}' if rank else ''} %(message)s",
                            "%Y-%m-%d %H:%M:%S")
    console = logging.StreamHandler(sys.stdout)
    console.setFormatter(fmt)
    logger.addHandler(console)
    if is_main:
        os.makedirs(output_dir, exist_ok=True)
        file_handler = logging.FileHandler(os.path.join(output_dir, "train.log"))
        file_handler.setFormatter(fmt)
        logger.addHandler(file_handler)
    logger.propagate = False
