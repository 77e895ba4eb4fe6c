"""What a run computes with: the model's trained parameters, its loss (one per model family), the optimizer, the
compiled training and evaluation steps (one compilation per bucket shape), and the model's passes over data.

:class:`Engine` owns the device state a checkpoint must hold (weights, optimizer moments, EMA, the
open logging interval's metric sums) and gives it out and takes it back (:meth:`Engine.optimizer_entries`,
:meth:`Engine.load`). :class:`ModelPass` runs the starting model over a data source (labels or descriptors),
for replay and the reference fit. Neither knows about files, epochs or ranks' agreement.
"""

import logging
import time
from contextlib import contextmanager
from typing import Callable, Dict, Iterable, List, Optional, Tuple

import numpy as np

from orb.data.buckets import Bucket
from orb.errors import ConfigError
from orb.graph_cache import compile_cell
from orb.models.adapters import LORA_KEYS
from orb.models.groups import in_group
from orb.training import state as training_state
from orb.training.config import TrainConfig
from orb.training.distributed import DataParallel

log = logging.getLogger("orb")


def _orb_v2_loss(model, cfg: TrainConfig, has_stress: bool, allreduce):
    from orb.training.loss_v2 import OrbLoss

    w = cfg.loss_weights
    return OrbLoss(model, w.energy, w.forces, w.stress, has_stress, allreduce)


def _orb_v3_loss(model, cfg: TrainConfig, has_stress: bool, allreduce):
    from orb.training.loss_v3 import OrbV3Loss

    w = cfg.loss_weights
    return OrbV3Loss(model, w.energy, w.forces, w.stress, has_stress, allreduce, w.confidence, w.equigrad)


LOSSES = {"orb_v2": _orb_v2_loss, "orb_v3": _orb_v3_loss}  # the loss cell of each model family


def make_loss(model, cfg: TrainConfig, has_stress: bool, allreduce=None):
    """The loss cell of the model's family with the config's weights and normalisation."""
    loss = LOSSES[cfg.model.family](model, cfg, has_stress, allreduce)
    loss.online = cfg.online_normalisation
    return loss


def lr_multiplier(name: str, cfg: TrainConfig) -> float:
    """The learning-rate factor of the parameter at path ``name`` (``lr_multipliers``: later entries win)."""
    factor = 1.0
    for group, value in cfg.lr_multipliers.items():
        if in_group(name, group):
            factor = value
    return factor


def is_frozen(name: str, cfg: TrainConfig, adapted_layers: set) -> bool:
    """Kept at the starting weights by ``freeze``, ``freeze_backbone``, a multiplier of 0, or LoRA (the adapted
    layers' own weights, ``adapted_layers`` holding those layers' paths; with ``lora.train_others`` off,
    everything but the adapters)."""
    if any(in_group(name, g) for g in cfg.freeze) or (cfg.freeze_backbone and in_group(name, "backbone")):
        return True
    if lr_multiplier(name, cfg) == 0:
        return True
    if cfg.lora.rank:
        adapter = name.endswith(LORA_KEYS)
        if adapter:  # only the groups' adapters train (other layers carry zero ones: orb.models.adapters)
            return not any(in_group(name, g) for g in cfg.lora.groups)
        return not cfg.lora.train_others or name.rsplit(".", 1)[0] in adapted_layers and name.endswith(".weight")
    return False


def trainable_parameters(model, cfg: TrainConfig) -> list:
    """Parameters the optimizer updates: all but those that cannot change any output (``model.never_trained()``),
    the reference energies unless trained (``reference_energies.trainable``; auto: orb-v2 trains them, orb-v3
    keeps them, as orb-models) and those a fine-tuning strategy keeps (:func:`is_frozen`). Training nothing is
    refused with one line."""
    names = {id(p): name for name, p in model.parameters_and_names()}
    adapted = {name[:-len(".lora_a")] for name in names.values()  # the layers whose adapters train
               if name.endswith(".lora_a") and any(in_group(name, g) for g in cfg.lora.groups)}
    excluded = {id(p) for p in model.never_trained()}
    trainable = cfg.reference_energies.trainable
    if trainable == "false" or (trainable == "auto" and cfg.model.family == "orb_v3"):
        excluded |= {id(w) for w in model.reference_energy_weights()}
    excluded |= {id(p) for p in model.trainable_params() if is_frozen(names[id(p)], cfg, adapted)}
    params = [p for p in model.trainable_params() if id(p) not in excluded]
    for p in model.trainable_params():
        p.requires_grad = id(p) not in excluded
    if not params:
        raise ConfigError(f"{nothing_trains(cfg)}: no parameter of {cfg.model.name} is left to train")
    check_groups_act(cfg, [names[id(p)] for p in params])
    return params


def check_groups_act(cfg: TrainConfig, trained: List[str]) -> None:
    """An ``lr_multipliers`` or ``anchor.groups`` group none of whose parameters trains is refused: a group the model
    lacks (orb-v2's confidence_head, replay_heads without replay) or one frozen acted on nothing, in silence."""
    groups = [(f"lr_multipliers.{g}", g) for g, factor in cfg.lr_multipliers.items() if factor > 0]
    if cfg.anchor.weight > 0:
        groups += [(f"anchor.groups[{i}]", g) for i, g in enumerate(cfg.anchor.groups)]
    for key, group in groups:
        if not any(in_group(name, group) for name in trained):
            raise ConfigError(f"config key '{key}': no parameter of group {group!r} trains in this run ({cfg.model.name}"
                              " has none, or they are frozen or kept: freeze, lora, reference_energies.trainable), so "
                              "it would do nothing: leave it out")


def nothing_trains(cfg: TrainConfig) -> str:
    """The keys that froze every parameter, as an error names them."""
    keys = [f"'freeze' ({cfg.freeze})"] if cfg.freeze else []
    zeros = [g for g, f in cfg.lr_multipliers.items() if f == 0]
    keys += [f"'lr_multipliers' (0 for {zeros})"] if zeros else []
    keys += ["'freeze_backbone'"] if cfg.freeze_backbone else []
    if not keys:
        keys = [f"'reference_energies.trainable' ({cfg.reference_energies.trainable})"]
    return ("config key " if len(keys) == 1 else "config keys ") + " and ".join(keys)


def per_element(params, names: List[str], value) -> Optional[np.ndarray]:
    """A flat vector (the optimizer's layout) holding ``value(name)`` for every element of each parameter."""
    sizes = [int(np.prod(p.shape)) if p.shape else 1 for p in params]
    return np.repeat(np.array([value(n) for n in names], np.float64), sizes)


# config keys that only the host reads (paths, logging, saving, the data pipeline): not part of a graph's identity
HOST_ONLY = ("train_data_path", "val_data_path", "checkpoint_path", "output_dir", "device_id", "save_every_x_epochs",
             "save_every_n_steps", "save_every_minutes", "keep_checkpoints", "log_every_n_steps", "progress_bar",
             "record_batches", "callbacks", "data_workers", "patience", "max_nonfinite_steps", "num_threads",
             "replay.data_path", "replay.val_data_path", "reference_energies.file", "energy_key", "forces_key",
             "stress_key", "charge_key", "spin_key", "val_fraction", "compile_cache")


# config keys that decide the values in the optimizer's schedule tables, parameters of the compiled step (their shape
# is in a graph's identity), and nothing else of a graph (max_epochs also sizes the automatic bucket plan: the shapes,
# in the identity too): a sweep over them computes with the graphs of another run
SCHEDULE_ONLY = ("lr", "lr_schedule", "warmup_fraction", "max_epochs")

# config keys that decide only what the graph's identity already reads from the cells and inputs: parameter values
# (random_seed's initial weights and adapters, the reference energies a fit or table sets), the rows of each batch and
# their per-row weights, inputs (random_seed's sampling and rotations, augmentation, the replay mix and selection)
# and the batch shapes (the bucket plan). A sweep over replay fractions or seeds, or a strategy comparison, loads the
# graphs of its first run; a new input or parameter a key adds (replay.head: separate) is in the identity itself.
VALUES_ONLY = ("random_seed", "augmentation", "num_buckets", "buckets", "reference_energies.fit",
               "reference_energies.table", "replay.fraction", "replay.num_samples", "replay.selection",
               "replay.val_samples", "replay.labels", "replay.loss_weight", "replay.in_selection")


def graph_settings(cfg: TrainConfig, dp: DataParallel) -> Optional[tuple]:
    """What of a run decides its compiled graphs beyond the cells themselves (:func:`orb.graph_cache.graph_identity`):
    every setting but the host's, the schedule's and those that decide only values (VALUES_ONLY), and the
    data-parallel layout; None when the run keeps no compiled graphs. The rank is part of it only with a sharded
    optimizer (each rank's step updates its own slice); otherwise every rank compiles the same graph, so one rank
    compiles it and the others load it (:func:`orb.cache.one_builder`)."""
    from orb.training.config import flatten

    if not getattr(cfg, "compile_cache", True):
        return None
    settings = tuple(sorted((k, repr(v)) for k, v in flatten(cfg.to_dict()).items()
                            if k not in HOST_ONLY + SCHEDULE_ONLY + VALUES_ONLY))
    rank = dp.rank if dp.shard_optimizer else "any"
    return settings + (("data_parallel", dp.world_size, rank, bool(dp.shard_optimizer)),)


class Compiled:
    """Runs cells, compiling each (kind, bucket shape) once before its first run and logging it; remembers the
    seconds each compilation took with its first run, whether its graph came from the compile cache
    (:mod:`orb.graph_cache`; ``settings``: what of the run decides its graphs, None to compile every graph afresh),
    and each graph's second run, timed once: the step's own work, which tells a restart's overhead from the steps
    it runs anyway (``benchmark.py restart``)."""

    def __init__(self, settings=None):
        self.seconds: Dict[Tuple[str, Bucket], float] = {}
        self.sources: Dict[Tuple[str, Bucket], str] = {}
        self.graph_seconds: Dict[Tuple[str, Bucket], float] = {}  # MindSpore's compilation (or load) alone
        self.second_run_seconds: Dict[Tuple[str, Bucket], float] = {}
        self.settings = settings

    def run(self, kind: str, cell, arrays, bucket: Bucket):
        from orb.data.tensors import to_tensors

        inputs = to_tensors(arrays)
        key = (kind, bucket)
        if key in self.second_run_seconds:
            return cell(*inputs)
        if key in self.seconds:
            start = _after_queued_work()
            out = cell(*inputs)
            _wait_for(out)
            self.second_run_seconds[key] = time.perf_counter() - start
            return out
        log.info("compiling the %s step for batch shape (nodes %d, edges %d, graphs %d), once per shape", kind,
                 bucket.num_nodes, bucket.num_edges, bucket.num_graphs)
        start = _after_queued_work()
        self.sources[key] = compile_cell(cell, *inputs, kind=kind, settings=self.settings)
        self.graph_seconds[key] = time.perf_counter() - start
        out = cell(*inputs)
        _wait_for(out)
        self.seconds[key] = time.perf_counter() - start
        if self.sources[key] == "cache":
            log.info("the %s step's graph came from the compile cache (%.1f s)", kind, self.seconds[key])
        return out

    def total(self) -> float:
        return sum(self.seconds.values())

    def describe(self) -> str:
        """Each graph's first run (compiling or loading it included) and, in parentheses where it ran again, its
        second run."""
        cached = sum(source == "cache" for source in self.sources.values())
        each = ", ".join(self._describe_graph(key, seconds) for key, seconds in self.seconds.items())
        graphs = sum(self.graph_seconds.values())
        return (f"{each}; {cached} of {len(self.seconds)} from the compile cache; {graphs:.1f} s of it MindSpore "
                "compiling or loading graphs, the rest their first runs") if self.seconds else each

    def _describe_graph(self, key, seconds: float) -> str:
        kind, bucket = key
        second = self.second_run_seconds.get(key)
        return (f"{kind} {bucket.num_nodes}x{bucket.num_edges} {seconds:.2f}s"
                + (" cached" if self.sources.get(key) == "cache" else "")
                + (f" (then {second:.2f}s)" if second is not None else ""))


def _after_queued_work() -> float:
    """The clock once the device has finished the steps queued before (their time is not the next graph's). On the CPU
    a step has ended when its call returns: MindSpore's synchronize logs an [ERROR] line there ("CPU device is not
    supported") at every run's end."""
    import mindspore as ms

    if ms.get_context("device_target") != "CPU":
        ms.runtime.synchronize()
    return time.perf_counter()


def _wait_for(out) -> None:
    (out[0] if isinstance(out, tuple) else out).asnumpy()


class Engine:
    """The trained parameters, loss, optimizer and compiled steps of a run (see the module's docstring)."""

    def __init__(self, model, cfg: TrainConfig, dp: DataParallel, has_stress: bool, total_steps: int,
                 compiled: Optional[Compiled] = None):
        from orb.training.optimizer import FlatAdam, Sharding
        from orb.training.schedule import make_schedule
        from orb.precision import precision
        from orb.training.steps import EvalStep, LossScale, TrainStep

        self.model, self.cfg, self.dp, self.has_stress = model, cfg, dp, has_stress
        self.compiled = compiled or Compiled()
        self.params = trainable_parameters(model, cfg)
        names = {id(p): name for name, p in model.parameters_and_names()}
        self.param_names = [names[id(p)] for p in self.params]
        self.schedule = make_schedule(cfg.lr_schedule, cfg.lr, total_steps, cfg.warmup_fraction)
        sharding = (Sharding(dp.rank, dp.world_size, dp.reduce_scatter, dp.all_gather, dp.all_reduce)
                    if dp.shard_optimizer else None)
        anchor = cfg.anchor
        anchored = per_element(self.params, self.param_names, lambda n: anchor.weight if not anchor.groups or any(
            in_group(n, g) for g in anchor.groups) else 0.0) if anchor.weight else None
        self.optimizer = FlatAdam(self.params, self.schedule, clip_mode=cfg.gradient_clip_mode,
                                  clip_value=cfg.gradient_clip_val, sharding=sharding, ema_decay=cfg.ema_decay,
                                  algorithm=cfg.optimizer, anchor=anchored,
                                  lr_scale=per_element(self.params, self.param_names,
                                                       lambda n: lr_multiplier(n, cfg)) if cfg.lr_multipliers else None)
        self.loss_cell = make_loss(model, cfg, has_stress, dp.all_reduce)
        reducer = self.optimizer.gradient_reducer()  # a sharded optimizer reduce-scatters its own slices
        if reducer is None and dp.grad_reducer is not None:
            reducer = dp.grad_reducer(self.optimizer.gradients_to_reduce())
        self.loss_scale = (LossScale(cfg.initial_loss_scale) if precision() == "fp16-mixed"  # float16's narrow range
                           else None)
        self.train_step = TrainStep(self.loss_cell, self.optimizer, reducer, self.loss_scale)
        self.eval_step = EvalStep(self.loss_cell)

    # ------------------------------------------------------------------ steps
    def train(self, arrays, bucket: Bucket) -> None:
        """One optimisation step (its metric sums accumulate on the device)."""
        self.compiled.run("train", self.train_step, arrays, bucket)

    def evaluate(self, arrays, bucket: Bucket) -> np.ndarray:
        """This rank's metric sums of one evaluation batch (float64)."""
        return self.compiled.run("eval", self.eval_step, arrays, bucket).asnumpy().astype(np.float64)

    @property
    def num_sums(self) -> int:
        return self.loss_cell.num_sums

    def metrics(self, sums: np.ndarray, by_element: bool = False) -> Dict:
        return self.loss_cell.metrics(sums, by_element)

    def take_interval_sums(self) -> np.ndarray:
        """This rank's metric sums since the last call (one host synchronisation), then zero on the device."""
        from orb.training.steps import read_and_reset

        return read_and_reset(self.train_step.metric_sums)

    def interval_sums(self) -> np.ndarray:
        """This rank's metric sums of the open logging interval, left in place (for a checkpoint)."""
        return self.train_step.metric_sums.asnumpy().astype(np.float64)

    def restore_interval_sums(self, values: np.ndarray) -> None:
        from orb.training.steps import write_parameter

        write_parameter(self.train_step.metric_sums, np.asarray(values))

    def take_nonfinite(self) -> np.ndarray:
        from orb.training.steps import read_nonfinite

        return read_nonfinite(self.train_step)

    def take_overflows(self) -> int:
        """Steps skipped since the last call for an fp16 loss-scale overflow (each halved the scale)."""
        from orb.training.steps import read_overflows

        return read_overflows(self.train_step)

    def open_nonfinite(self) -> np.ndarray:
        """The open logging interval's [skipped steps in a row, longest run, skipped, fp16 overflows], left in place
        (for a checkpoint: equal on every rank, the gradient being the reduced one)."""
        values = self.train_step.nonfinite.asnumpy().astype(np.int64)
        overflows = 0 if self.loss_scale is None else int(self.loss_scale.overflows.asnumpy())
        return np.concatenate([values[[0, 1, 3]], [overflows]])

    def restore_nonfinite(self, values: np.ndarray) -> None:
        """What :meth:`open_nonfinite` gave at a mid-epoch save (the latest step's number is of the process that
        ran it: not kept)."""
        from orb.training.steps import write_parameter

        row, longest, count = (int(v) for v in values[:3])
        write_parameter(self.train_step.nonfinite, np.array([row, longest, 0, count]))
        if self.loss_scale is not None and len(values) > 3:
            write_parameter(self.loss_scale.overflows, np.array(int(values[3])))

    def loss_scale_value(self) -> Optional[float]:
        return None if self.loss_scale is None else float(self.loss_scale.scale.asnumpy())

    def lr(self, step: int) -> float:
        """The learning rate of the ``step``-th applied update (1-based, clamped to the schedule)."""
        return float(self.schedule.lr[min(max(step, 1), len(self.schedule.lr)) - 1])

    def applied_lr(self) -> float:
        """The learning rate of the latest update applied: the schedule advances with the optimizer's updates, and a
        step skipped for a non-finite gradient (or an fp16 overflow) applies none, so after skipped steps it trails
        the global step (records gave the global step's rate, not the one used)."""
        return self.lr(int(self.optimizer.step.asnumpy()))

    @contextmanager
    def evaluation_weights(self):
        """Inside: the model holds the EMA of the weights when ``ema_decay`` is set (what validation and the saved
        best weights use); the training weights come back after."""
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

    # ------------------------------------------------------------------ state
    def optimizer_entries(self) -> List[Tuple[str, np.ndarray]]:
        """The optimizer's state (and an fp16 run's loss scale) as checkpoint entries; every rank must call it
        (sharded state is gathered)."""
        entries = training_state.optimizer_state(self.optimizer, self.param_names, self.dp)
        if self.loss_scale is not None:
            entries += [("optimizer.loss_scale", self.loss_scale.scale.asnumpy()),
                        ("optimizer.loss_scale_good_steps", self.loss_scale.good_steps.asnumpy())]
        return entries

    def load(self, weights: Dict[str, np.ndarray], optimizer_state: Dict[str, np.ndarray], source: str) -> None:
        """The model's weights and the optimizer's state from a training checkpoint (this rank's slice); an fp16
        run's loss scale where the checkpoint has one (a run resumed in fp16-mixed from another precision starts
        from the initial scale)."""
        from orb.io.checkpoint import load_torch_state_dict
        from orb.training.steps import write_parameter

        load_torch_state_dict(self.model, weights, source=source)
        training_state.restore_optimizer(self.optimizer, self.param_names, optimizer_state, source)
        if self.loss_scale is not None and "loss_scale" in optimizer_state:
            write_parameter(self.loss_scale.scale, optimizer_state["loss_scale"])
            write_parameter(self.loss_scale.good_steps, optimizer_state["loss_scale_good_steps"])

    def num_trained(self) -> int:
        return int(sum(np.prod(p.shape) for p in self.params))


Batches = Iterable[Tuple[object, tuple]]  # (step, its padded arrays), in the order of a plan


class ModelPass:
    """The model's outputs over every structure of a source, in its order: labels (energy eV, forces eV/Å, stress)
    or descriptors. ``batches(source)`` yields this rank's planned steps of one pass; each rank fills its own
    structures and the parts are summed over ranks, so every rank returns the whole."""

    def __init__(self, model, batches: Callable[[object], Batches], dp: DataParallel, compiled: Compiled):
        self.model, self.batches, self.dp, self.compiled = model, batches, dp, compiled

    def labels(self, source) -> Dict[str, np.ndarray]:
        from orb.models.cells import PredictCell

        offsets = np.concatenate([[0], np.cumsum(source.natoms)]).astype(np.int64)
        out = {"energy": np.zeros(len(source)), "forces": np.zeros((int(offsets[-1]), 3)),
               "stress": np.zeros((len(source), 6))}

        def fill(index, result):
            energy, forces, stress = (t.asnumpy() for t in result[:3])
            out["energy"][index], out["stress"][index] = energy[:len(index)], stress[:len(index)]
            node = 0
            for i in index:  # a step's structures' atoms are consecutive, in its order
                n = int(offsets[i + 1] - offsets[i])
                out["forces"][offsets[i]:offsets[i + 1]] = forces[node:node + n]
                node += n

        return self._run("labels", PredictCell(self.model), source, fill, out)

    def descriptors(self, source) -> Dict[str, np.ndarray]:
        from orb.models.cells import DescriptorCell

        out = {"descriptors": np.zeros((len(source), self.model.cfg.latent_dim))}

        def fill(index, result):
            out["descriptors"][index] = result.asnumpy()[:len(index)]

        return self._run("descriptors", DescriptorCell(self.model), source, fill, out)

    def _run(self, kind: str, cell, source, fill, out: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
        from orb.data.tensors import MODEL_INPUTS

        start = time.perf_counter()
        for step, arrays in self.batches(source):
            result = self.compiled.run(f"{kind} pass", cell, arrays[:len(MODEL_INPUTS)], step.bucket)
            fill(np.asarray(step.indices, np.int64), result)
        log.info("%s: %s of %d structures in %.1f s", source.name, kind, len(source), time.perf_counter() - start)
        return {key: self.dp.sum_shares(value) for key, value in out.items()}  # (each structure on one rank)
