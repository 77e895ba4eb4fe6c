"""The one place that knows the order a run is built in, from its config to a :class:`~orb.training.trainer.Trainer`:

    device and profile -> databases (opened, checked, surveyed) -> model (starting weights)
    -> the checkpoint to resume (read first: it holds the reference fit) -> reference fit
    -> replay choice and pseudo-labels (after the fit: they share its energy zero)
    -> the run's steps and buckets -> engine (parameters, loss, optimizer, compiled steps)
    -> resumed state -> trainer

Each arrow is one call into the piece that owns it; nothing else in the package builds these pieces.
"""

import importlib
import logging
import os
from typing import List, Optional, Sequence, Tuple

import numpy as np

from orb.commands import version_line
from orb.data.formats import describe_path
from orb.data.loader import BatchLoader
from orb.errors import ConfigError, OrbInputError
from orb.metrics import BY_ELEMENT, METRICS, describe
from orb.training import replay as replay_choice
from orb.training import state as training_state
from orb.training import val_split
from orb.training.checkpointing import Checkpointer, Progress, resolve, this_ranks_interval_sums
from orb.training.config import LossWeights, TrainConfig
from orb.training.run_checks import check_training_data
from orb.training.distributed import DataParallel
from orb.training.engine import Compiled, Engine, ModelPass, graph_settings, trainable_parameters
from orb.training.guards import Guards
from orb.training.reference_fit import fit_reference_energies, reference_baseline, table_of_record
from orb.training.reporting import Reporter
from orb.training.run_data import RunData, open_databases, survey, trains_stress
from orb.training.trainer import CALLBACK_HOOKS, Trainer

log = logging.getLogger("orb")
# years of training at a step a second; its schedule takes 1.6 GB on the host and its per-step tables (5 values,
# padded to a power of two of steps) 2.7 GB on the device (5.4 GB in float64)
MAX_TOTAL_STEPS = 10 ** 8


def build_model(cfg: TrainConfig):
    """orb model of the config's architecture with pretrained (or random) weights and reference energies."""
    from orb.io.checkpoint import load_weights_into
    from orb.models import build
    from orb.models.reference_energies import load_reference_file, reference_table

    model = build(cfg.model, seed=cfg.random_seed)
    if cfg.checkpoint_path:
        unlike = load_weights_into(model, cfg.checkpoint_path)
        log.info("loaded weights from %s", cfg.checkpoint_path)
        if unlike:  # a new graph is a choice, but the pretrained weights never saw it: say so, never silently
            log.warning("the 'model:' block differs from the model %s was trained as: %s; its weights start on "
                        "graphs they were not trained on (set these as the checkpoint's unless you mean to change "
                        "them)", cfg.checkpoint_path,
                        ", ".join(f"{key} {ours} (trained: {theirs})" for key, (ours, theirs) in unlike.items()))
    else:
        log.warning("checkpoint_path is empty: starting from RANDOM weights (set it to an orb checkpoint to fine-tune "
                    "the pretrained model)")
    references = cfg.reference_energies
    if references.table or references.file:
        weight = model.reference_energy_weight()
        table = reference_table(references.table) if references.table else weight.asnumpy()
        if references.file:  # a file's entries on top of the table (or of the checkpoint's)
            table = load_reference_file(references.file, table)
        set_reference_table(weight, table)
        log.info("reference energies: %s", " with ".join(
            x for x in (references.table and f"table {references.table}", references.file) if x))
    if cfg.replay.enabled and cfg.replay.head == "separate":
        model.add_replay_heads()  # copies of the starting heads, before any fit of the target's
    if cfg.lora.rank:
        from orb.models.adapters import add_adapters

        adapted = add_adapters(model, cfg.lora.rank, cfg.lora.alpha, cfg.lora.groups, cfg.random_seed)
        if not adapted:
            raise ConfigError(f"config key 'lora.groups' ({cfg.lora.groups}): no MLP layer of {cfg.model.name} is in "
                              "these groups")
        log.info("LoRA: rank-%d adapters (alpha %g) on %d linear layers of %s; %s", cfg.lora.rank, cfg.lora.alpha,
                 len(adapted), ", ".join(cfg.lora.groups), "the other parameters train too" if cfg.lora.train_others
                 else "only the adapters train")
    return model


def load_callbacks(names: Sequence[str]) -> list:
    """Objects of the ``module:Name`` classes the config lists (``callbacks``), each made without arguments."""
    out = []
    for i, name in enumerate(names):
        module, attribute = name.split(":")
        try:
            out.append(getattr(importlib.import_module(module), attribute)())
        except Exception as exc:  # an import error, a missing name or a failing constructor: one line
            raise ConfigError(f"config key 'callbacks[{i}]': cannot make {name} ({type(exc).__name__}: {exc})") \
                from None
        if not any(callable(getattr(out[-1], hook, None)) for hook in CALLBACK_HOOKS):  # (a typo: never called)
            raise ConfigError(f"config key 'callbacks[{i}]': {name} has none of the hooks a callback may define "
                              f"({', '.join(CALLBACK_HOOKS)}), so it would never be called")
    return out


def fit_reference_energies_to(cfg: TrainConfig, data: RunData, model, outputs: ModelPass):
    """``reference_energies.fit``: the reference energies moved to the user's DFT before the first step."""
    method = cfg.reference_energies.fit
    if method == "least_squares" and cfg.checkpoint_path:
        log.warning("reference_energies.fit: least_squares makes the reference energies explain the whole DFT energy, "
                    "and the pretrained network adds its own per-atom energy on top (measured: 68x the starting "
                    "energy error, docs/benchmarks.md); to fine-tune, use fit: residual")
    train = data.train_source  # (without the structures held out for validation: val_fraction)
    weight = model.reference_energy_weight()
    current = weight.asnumpy().astype(np.float64)
    composition = train.composition()
    baseline = (outputs.labels(train)["energy"] if method == "residual"
                else reference_baseline(composition, len(train), current))
    fit = fit_reference_energies(method, composition, train.energies(), baseline, current, train.weights)
    set_reference_table(weight, fit.table)
    log.info(fit.summary())
    return fit.to_dict()


def set_reference_table(weight, table) -> None:
    """The model's reference-energy table set to ``table``, in the weight's own float type (float64 models)."""
    from mindspore import Tensor

    weight.set_data(Tensor(np.asarray(table).astype(weight.asnumpy().dtype)))


def restore_reference_fit(record, model) -> None:
    """The fitted reference energies a resumed run started from, so its starting model (and pseudo-labels) are the
    ones the run had."""
    weight = model.reference_energy_weight()
    set_reference_table(weight, table_of_record(record, weight.asnumpy()))


def read_resume(path: str, checkpointer: Checkpointer, cfg: TrainConfig, identity: dict,
                accept: bool) -> Tuple[dict, dict, dict, str]:
    """(weights, optimizer state, metadata, path) of the checkpoint to resume, refused if its run's schedule, data
    order or starting weights (``identity``: this run's, as the checkpointer stores it) would change, unless
    accepted."""
    from orb.data.formats import label_keys_apply

    path = resolve(path)
    weights, optimizer_state, meta = checkpointer.read(path)
    paths = (cfg.train_data_path, cfg.val_data_path, cfg.replay.data_path, cfg.replay.val_data_path)
    unused = () if label_keys_apply(paths) else ("energy_key", "forces_key", "stress_key")  # (said at start-up)
    unused += ("val_fraction",) if cfg.val_data_path else ()  # (a validation file is validated instead)
    changes = training_state.check_resume(meta, cfg.to_dict(), identity["train_rows"], path, accept,
                                          identity["train_fingerprint"], identity["starting_weights"], unused,
                                          identity.get("val_split", ""))
    if changes:
        log.warning("resuming with changed settings (accepted): %s", "; ".join(changes))
    rounding = training_state.arithmetic_changes(meta, cfg.to_dict(), identity["world_size"])
    if rounding:
        log.info("resuming with other arithmetic than the checkpoint's run (%s): the schedule and data order continue, "
                 "the numbers follow an uninterrupted run's only to rounding", "; ".join(rounding))
    saved_scale = meta.get("config", {}).get("initial_loss_scale", TrainConfig.initial_loss_scale)  # (older runs:
    # the default)
    if "loss_scale" in optimizer_state and cfg.precision == "fp16-mixed" and saved_scale != cfg.initial_loss_scale:
        log.info("initial_loss_scale %g -> %g not applied: the checkpoint's loss scale (%g) continues", saved_scale,
                 cfg.initial_loss_scale, float(np.asarray(optimizer_state["loss_scale"])))
    return weights, optimizer_state, meta, path


def build_trainer(cfg: TrainConfig, data_parallel: Optional[DataParallel] = None, resume: Optional[str] = None,
                  accept_config_changes: bool = False, callbacks: Sequence = ()) -> Trainer:
    """A trainer for ``cfg`` (resumed from ``resume``: a training checkpoint or an output folder), built in the
    order of the module's docstring. ``callbacks`` are added to those the config names."""
    import mindspore as ms

    from orb.models import model_identity, weights_digest
    from orb.models.ops_profile import describe_profile
    from orb.device import set_ops_profile
    from orb.precision import check_device, describe as describe_precision, set_precision

    check_training_data(cfg)
    dp = data_parallel or DataParallel()
    if cfg.optimizer_shard and dp.world_size < 2:
        raise ConfigError("config key 'optimizer_shard': sharding the optimizer state needs a data-parallel run with "
                          "at least 2 workers (run_parallel.sh)")
    callbacks = load_callbacks(cfg.callbacks) + list(callbacks)
    set_ops_profile(cfg.ops_profile)
    check_device(cfg.precision, ms.get_context("device_target"))
    if cfg.precision == "float64" and dp.parallel:
        raise ConfigError("config key 'precision': float64 trains on one process (finetune.py): the collectives of a "
                          "data-parallel run (MindSpore's CPU AllReduce and AllGather) sum in float32; use "
                          "float32-highest in parallel")
    set_precision(cfg.precision)
    log.info("%s; device: %s, %s, %s%s", version_line(), ms.get_context("device_target"), describe_profile(),
             describe_precision(cfg.precision, ms.get_context("device_target")),
             ", deterministic" if cfg.deterministic else "")
    if dp.parallel:
        log.info("data parallel: rank %d of %d (pid %d)", dp.rank, dp.world_size, os.getpid())
    reporter = Reporter(cfg.output_dir, dp.rank, cfg.progress_bar, cfg.record_batches)
    model = build_model(cfg)
    trainable_parameters(model, cfg)  # a strategy that trains nothing is refused before any data is read
    starting_weights = weights_digest(model)
    databases = open_databases(cfg, dp, reporter.show_bars)
    loader = BatchLoader(databases, cfg.data_workers)
    try:
        for name in databases:
            survey(loader, name, dp)
        split = val_split.choose(cfg, databases["train"], dp, resume)
        data = RunData(cfg, dp, databases, loader, trains_stress(cfg, databases), split)
        compiled = Compiled(graph_settings(cfg, dp))

        def one_pass(source):
            name = f"{source.name} pass"
            loader.add(name, source)
            yield from loader.iterate(name, data.pass_steps(source, data.evaluation_plan(source)), None, False)
            loader.close()

        outputs = ModelPass(model, one_pass, dp, compiled)
        train = databases["train"]
        identity = {"format": training_state.CHECKPOINT_FORMAT, "random_seed": cfg.random_seed,
                    "config": cfg.to_dict(), "model": cfg.model.to_dict(), "train_rows": len(train),
                    "train_fingerprint": train.content_fingerprint(), "world_size": dp.world_size,
                    "starting_weights": starting_weights, **({"val_split": split.digest} if split else {})}
        checkpointer = Checkpointer(os.path.join(cfg.output_dir, "checkpoints"), dp, model, identity,
                                    cfg.save_every_x_epochs, cfg.max_epochs, cfg.keep_checkpoints)
        resumed = read_resume(resume, checkpointer, cfg, identity, accept_config_changes) if resume else None
        if split is not None:  # (after the resume check: a refused resume leaves the run's record as it was)
            split.recorded_in = val_split.keep(split, cfg.output_dir, dp)
        progress = Progress.from_meta(resumed[2]) if resumed else Progress()
        if progress.reference_fit is not None:
            restore_reference_fit(progress.reference_fit, model)
        elif cfg.reference_energies.fit != "none" and not resumed:  # (a resume never fits: the checkpoint's weights
            progress.reference_fit = fit_reference_energies_to(cfg, data, model, outputs)  # hold the run's references)
        elif cfg.reference_energies.fit != "none":
            log.info("reference_energies.fit %s is not applied: the resumed run made no fit, and its checkpoint's weights "
                     "hold its reference energies", cfg.reference_energies.fit)
        starting_key = []  # the starting model's identity, computed once when a cache needs it

        def model_key() -> tuple:
            if not starting_key:
                starting_key.append(model_identity(model))
            return starting_key[0]

        data.plan(*replay_choice.choose(cfg, databases, outputs, model_key, data.has_stress, dp))
        total_steps = cfg.max_epochs * data.steps_per_epoch
        if total_steps > MAX_TOTAL_STEPS:  # the schedule's per-step tables would not fit
            raise ConfigError(f"config key 'max_epochs' ({cfg.max_epochs}) x {data.steps_per_epoch} steps per epoch is "
                              f"{total_steps} steps, more than {MAX_TOTAL_STEPS}")
        engine = Engine(model, cfg, dp, data.has_stress, total_steps, compiled)
        if resumed:
            weights, optimizer_state, _, path = resumed
            engine.load(weights, optimizer_state, path)
            progress.convert_sums(engine.loss_cell.sums_from)
            if progress.step_in_epoch:  # inside an epoch: this rank's sums of the open logging interval
                engine.restore_interval_sums(this_ranks_interval_sums(progress, dp))
                if progress.nonfinite is not None:
                    engine.restore_nonfinite(progress.nonfinite)
            reporter.forget_after(progress.global_step, progress.epoch_record)
            log.info("resumed from %s: %d epochs%s done, global step %d", path, progress.epochs_done,
                     f" and {progress.step_in_epoch} of {data.steps_per_epoch} steps" if progress.step_in_epoch
                     else "", progress.global_step)
        dp.check_same_parameters(model)
        guards = Guards(cfg.save_every_minutes, cfg.max_nonfinite_steps, cfg.log_every_n_steps, dp.is_main)
        trainer = Trainer(cfg, dp, data, engine, checkpointer, reporter, guards, progress, callbacks)
    except BaseException:
        loader.close()
        raise
    if dp.is_main:
        log_start(cfg, dp, data, engine)
    return trainer


def describe_groups(cfg: TrainConfig, engine: Engine) -> str:
    """Each parameter group's size, how much of it trains, and with which lr factor and anchor."""
    from orb.models.groups import group_of, in_group
    from orb.training.engine import lr_multiplier

    trained = set(engine.param_names)
    sizes = {}
    for name, p in engine.model.parameters_and_names():
        if not p.requires_grad and name not in trained and ("normalizer" in name or "rbf_transform" in name or
                                                            "bin_edges" in name):
            continue  # buffers
        group = group_of(name)
        total, used, factors, anchors = sizes.setdefault(group, [0, 0, set(), set()])
        size = int(np.prod(p.shape)) if p.shape else 1
        sizes[group][0] += size
        if name in trained:
            sizes[group][1] += size
            factors.add(lr_multiplier(name, cfg))
            anchored = cfg.anchor.weight and (not cfg.anchor.groups or any(in_group(name, g) for g in cfg.anchor.groups))
            anchors.add(cfg.anchor.weight if anchored else 0.0)
    parts = []
    for group, (total, used, factors, anchors) in sizes.items():
        extra = "".join([f", lr x{'/'.join(f'{f:g}' for f in sorted(factors))}" if factors != {1.0} and factors
                         else "", f", anchor {'/'.join(f'{a:g}' for a in sorted(anchors))}" if any(anchors) else ""])
        parts.append(f"{group} {used:,}/{total:,}{extra}")
    return "; ".join(parts)


def counted(number: int, noun: str) -> str:
    """``1 epoch``, ``3 epochs``: a count and its noun, singular for one (the log said "1 steps per epoch, 1 epochs")."""
    return f"{number} {noun}{'' if number == 1 else 's'}"


def describe_buckets(buckets) -> str:
    planned = ", ".join(f"({b.num_nodes}, {b.num_edges}, {b.num_graphs})" for b in buckets if not b.spare)
    spare = [b for b in buckets if b.spare]
    return planned + "".join(f" + spare ({b.num_nodes}, {b.num_edges}, {b.num_graphs}) for the worst possible batch, "
                             "compiled only if a step needs it" for b in spare)


def stress_note(trained: bool, source) -> str:
    """What the start-up log says of a set's stress labels: none, or how many structures have one when some have
    none and the run trains stress."""
    if not source.has_stress:
        return ", no stress"
    count = source.stress_rows if trained else len(source)
    return "" if count == len(source) else f", {count} of them with a stress label (the others' stress weighed at 0)"


def log_start(cfg: TrainConfig, dp: DataParallel, data: RunData, engine: Engine) -> None:
    """What the run is about to do, in the start-up log."""
    model = engine.model
    log.info("model: %s, %s parameters (%s trained), %d message-passing layers, latent %d; graphs: %d neighbours "
             "within %g Å", cfg.model.name, f"{model.num_parameters():,}", f"{engine.num_trained():,}",
             cfg.model.num_message_passing_steps, cfg.model.latent_dim, cfg.model.max_neighbors, cfg.model.radius)
    train = data.train_source
    log.info("train data: %s (%d structures, %d atoms)%s%s", describe_path(cfg.train_data_path), len(train),
             int(train.natoms.sum()), stress_note(data.has_stress, train), data.weights_note(train))
    for name, source in data.val_sets.items():
        if name == "val" and data.split is not None:  # the training structures held out (val_fraction)
            (log.warning if data.split.redrawn else log.info)("%s%s%s", data.split.describe(cfg, source.source),
                                                              stress_note(data.has_stress, source),
                                                              data.weights_note(source))
            continue
        log.info("%s data: %s (%d structures)%s%s", "validation" if name == "val" else name, source.source,
                 len(source), stress_note(data.has_stress, source), data.weights_note(source))
    if data.replay_train is not None:
        r = data.replay_train
        log.info("replay: %d structures of %s (%s labels, loss weight %g, %s heads); each step: %d target + %d "
                 "replay structures", len(r), r.source, cfg.replay.labels, cfg.replay.loss_weight, cfg.replay.head,
                 data.sampler.target_step, data.sampler.replay_step)
    elif data.replay_val is not None:
        log.info("replay: validated only (replay.fraction 0): forgetting is measured every epoch, not prevented")
    log.info("batch size: %d global, %d per worker x %s; %s per epoch, %s%s", cfg.batch_size, data.local_batch,
             counted(dp.world_size, "worker"), counted(data.steps_per_epoch, "step"), counted(cfg.max_epochs, "epoch"),
             f"; early stopping after {counted(cfg.patience, 'epoch')} without a lower validation loss"
             if cfg.patience else "")
    for note in settings_that_do_nothing(cfg, len(train)):
        log.warning("%s", note)
    log.info("optimizer: %s, %s schedule, peak lr %.3g%s, clipping %s %g%s", cfg.optimizer, cfg.lr_schedule,
             float(engine.schedule.lr.max()), f", EMA of weights {cfg.ema_decay}" if cfg.ema_decay else "",
             cfg.gradient_clip_mode, cfg.gradient_clip_val, ", state sharded over ranks" if dp.shard_optimizer else "")
    log.info("train buckets (nodes, edges, graphs): %s; padded / real: atoms %.2fx, edges %.2fx",
             describe_buckets(data.train_buckets), *data.train_padding)
    for name, plan in data.val_plans.items():
        log.info("%s buckets (structures packed by size): %s; padded / real: atoms %.2fx, edges %.2fx", name,
                 describe_buckets(plan.buckets), *plan.padding)
    log.info("parameter groups (trained / all; lr factor, anchor weight): %s", describe_groups(cfg, engine))
    keys = [k for k in engine.loss_cell.sum_keys if k in METRICS and (data.has_stress or "stress" not in k)]
    log.info("metrics (per epoch, train and validation):\n%s", describe(keys + [BY_ELEMENT]))


def files_read(paths: List[str]) -> List[str]:
    """The absolute paths of the files data paths name (a folder's files; a path not there: itself)."""
    from orb.data.formats import source_files

    files = []
    for path in paths:
        try:
            files += [os.path.realpath(f) for f in source_files(path)]
        except OrbInputError:
            files.append(os.path.realpath(path))
    return files


def settings_that_do_nothing(cfg: TrainConfig, train_rows: int) -> List[str]:
    """Lines for settings this run accepts but cannot act on as written, said once at the start (each was silent:
    a batch larger than the data, loss weights of terms the model has no head for, the training data validated)."""
    notes = []
    if cfg.batch_size > train_rows and not cfg.replay.enabled:
        notes.append(f"batch_size {cfg.batch_size} is more than the {train_rows} training structures: each epoch is "
                     f"one step of all {train_rows}")
    model = cfg.model
    unused = {"equigrad": model.family != "orb_v3" or not model.conservative,
              "confidence": model.family != "orb_v3"}
    default = LossWeights()
    for term, absent in unused.items():
        weight = getattr(cfg.loss_weights, term)
        if absent and weight > 0 and weight != getattr(default, term):  # (not the default every config carries)
            notes.append(f"loss_weights.{term} {weight:g} is not used: {model.name} has no {term} term")
    train = cfg.train_data_path if isinstance(cfg.train_data_path, list) else [cfg.train_data_path]
    val = cfg.val_data_path if isinstance(cfg.val_data_path, list) else [cfg.val_data_path]
    shared = sorted(set(files_read(train)) & set(files_read([p for p in val if p])))
    if shared:  # (by file: a validation file inside a training folder was trained on without a word)
        notes.append(f"validation data {', '.join(shared)} is also training data: its metrics do not measure "
                     "generalisation")
    if cfg.val_data_path and cfg.val_fraction:
        notes.append(f"val_fraction {cfg.val_fraction:g} is not used: val_data_path is validated (a template's split "
                     "applies only when no validation data is given)")
    if len({os.path.abspath(p) for p in train}) < len(train):
        notes.append("train_data_path lists a file twice: its structures count twice per epoch")
    return notes
