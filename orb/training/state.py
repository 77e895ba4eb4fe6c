"""Training checkpoints: the model, the optimizer state (complete, even when sharded over ranks),
the run's position and the settings a resume must not silently change.

A training checkpoint stores, beside the model's weights, ``optimizer.moment1.<param>``,
``optimizer.moment2.<param>`` (and ``optimizer.ema.<param>`` with an EMA) per trained parameter,
``optimizer.step``, and JSON metadata: epoch, global step, best validation loss, the config and
the training database's row count. Resuming refuses a changed schedule or data order, naming the
keys, unless the user accepts the changes.
"""

import math
from typing import Dict, List, Sequence, Tuple

import numpy as np

from orb.errors import CheckpointError, ConfigError
from orb.training.config import TrainConfig, flatten
from orb.training.distributed import DataParallel
from orb.training.optimizer import FlatAdam

CHECKPOINT_FORMAT = "orb-mindspore-train-2"
OLDER_FORMATS = ("orb-mindspore-train-1",)
# Settings that fix the learning-rate schedule or the order and content of the batches.
# Since they were silently accepted: the loss (its weights), the labels (where non-SQLite data keep them), the model's
# graph and radial basis (no tensor shape shows them), and the patience (where the run ends).
RESUME_KEYS = ("train_data_path", "batch_size", "max_epochs", "lr", "lr_schedule", "warmup_fraction", "random_seed",
               "val_fraction", "augmentation", "ema_decay", "optimizer", "gradient_clip_mode", "gradient_clip_val",
               "replay.data_path", "replay.val_data_path", "replay.val_samples", "replay.labels", "replay.fraction",
               "replay.num_samples", "replay.selection",
               "replay.loss_weight", "replay.head", "freeze", "freeze_backbone", "lr_multipliers", "anchor.weight",
               "anchor.groups", "lora.rank", "lora.alpha", "lora.groups", "lora.train_others",
               "reference_energies.trainable", "reference_energies.fit", "online_normalisation", "replay.in_selection",
               "loss_weights.energy", "loss_weights.forces", "loss_weights.stress", "loss_weights.confidence",
               "loss_weights.equigrad", "energy_key", "forces_key", "stress_key", "charge_key", "spin_key",
               "patience", "model.name", "model.radius", "model.max_neighbors", "model.rbf_radius",
               "model.cutoff_rmax", "model.polynomial_order")
# Settings that change only how each step's arithmetic rounds (kernels, threads, reduction order over ranks, the
# padded batch shapes): a resume may change them, and continues the schedule and data order, but then equals an
# uninterrupted run only to rounding, not bit for bit.
ARITHMETIC_KEYS = ("precision", "deterministic", "num_threads", "ops_profile", "buckets", "num_buckets")


def _full(optimizer: FlatAdam, local: np.ndarray, dp: DataParallel) -> np.ndarray:
    """The full flat vector of a (possibly sharded) optimizer buffer, gathered over ranks."""
    full = dp.gather(local) if optimizer.sharding is not None else local
    return np.asarray(full, optimizer.real)[:optimizer.size]


def optimizer_state(optimizer: FlatAdam, names: Sequence[str], dp: DataParallel) -> List[Tuple[str, np.ndarray]]:
    """(key, array) entries of the optimizer state; every rank must call it (sharded state is gathered)."""
    entries = []
    buffers = [("moment1", optimizer.moment1.asnumpy()), ("moment2", optimizer.moment2.asnumpy())]
    if optimizer.algorithm != "adam":
        buffers = []
    for kind, local in buffers:
        entries += [(f"optimizer.{kind}.{n}", a) for n, a in zip(names, optimizer.split(_full(optimizer, local, dp)))]
    if optimizer.ema_decay > 0:
        ema = optimizer.ema.asnumpy()
        entries += [(f"optimizer.ema.{n}", a) for n, a in zip(names, optimizer.split(ema))]
    entries.append(("optimizer.step", optimizer.step.asnumpy().astype(np.int64)))
    return entries


def ema_weights(optimizer: FlatAdam) -> List[np.ndarray]:
    return optimizer.split(optimizer.ema.asnumpy())


def restore_optimizer(optimizer: FlatAdam, names: Sequence[str], state: Dict[str, np.ndarray], path: str) -> None:
    """Load the optimizer state of a training checkpoint (this rank's slice when sharded)."""
    from mindspore import Tensor

    missing = [n for n in names if f"moment1.{n}" not in state] if optimizer.algorithm == "adam" else []
    if missing:
        raise CheckpointError(f"{path}: the optimizer state does not match the trained parameters (missing {missing[:3]}"
                              f"{' ...' if len(missing) > 3 else ''}); was freeze_backbone, "
                              "reference_energies.trainable or the model changed?")

    def flat(kind: str) -> np.ndarray:
        full = np.concatenate([np.asarray(state[f"{kind}.{n}"], optimizer.real).reshape(-1) for n in names])
        padded = np.concatenate([full, np.zeros(optimizer.padding, optimizer.real)])
        return padded[optimizer.offset:optimizer.offset + optimizer.local_size]

    if optimizer.algorithm == "adam":
        optimizer.moment1.set_data(Tensor(flat("moment1")))
        optimizer.moment2.set_data(Tensor(flat("moment2")))
    step = state.get("step", state.get("global_step"))
    optimizer.step.set_data(Tensor(np.array(int(np.asarray(step).reshape(-1)[0]), np.int32)))
    optimizer.sync_from_model()
    if optimizer.ema_decay > 0:
        if f"ema.{names[0]}" in state:
            optimizer.ema.set_data(Tensor(np.concatenate([np.asarray(state[f"ema.{n}"], optimizer.real).reshape(-1)
                                                          for n in names])))


def config_changes(saved: Dict, current: Dict, keys: Sequence[str] = RESUME_KEYS) -> List[str]:
    """``key: saved -> current`` for each resume-relevant setting that differs (a key the saved run did not have
    yet counts as its default)."""
    old, new = dict(flatten(TrainConfig().to_dict()), **flatten(saved)), flatten(current)
    if old.get("lora.rank") == 0:  # "off" was spelt 0 before it was null
        old["lora.rank"] = None
    return [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in keys if _in_order(old.get(k)) != _in_order(new.get(k))]


def _in_order(value):
    """A mapping's entries in order (``lr_multipliers``: later entries win, so a reordering changes the rates;
    dicts compare equal in any order), anything else as it is."""
    return list(value.items()) if isinstance(value, dict) else value


def arithmetic_changes(meta: Dict, current_config: Dict, world_size: int) -> List[str]:
    """``key: saved -> current`` for each setting that changes how the resumed steps round (ARITHMETIC_KEYS and the
    number of workers): allowed, but worth a line, since the result then differs from the uninterrupted run's in
    the last bits (several in mixed precision)."""
    changes = config_changes(meta.get("config", {}), current_config, ARITHMETIC_KEYS)
    saved = meta.get("world_size")
    if saved is not None and saved != world_size:
        changes.append(f"workers: {saved} -> {world_size}")
    return changes


def check_resume(meta: Dict, current_config: Dict, train_rows: int, path: str, accept_changes: bool,
                 train_fingerprint: str = "", starting_weights: str = "", unused: Sequence[str] = (),
                 val_split: str = "") -> List[str]:
    """Refuse to resume with a changed schedule, data order or starting model unless ``accept_changes``; returns
    the changes.

    The training data is compared by content (its rows' ids, atom counts and elements) when the checkpoint
    recorded it, so a copy elsewhere (node-local scratch, another mount) resumes; else by its path. The
    starting weights (``checkpoint_path``, any reference table, replay heads, initial adapters) are compared by
    their digest: the anchor pulls toward them, pseudo-labels and the reference fit come from them. ``unused``:
    settings that read nothing in this run (label keys when all its data are ASE databases), not compared.
    ``val_split``: the digest of the training structures held out for validation (``val_fraction``; "" for none),
    compared with the checkpoint's: a split drawn again (its record lost) must be the run's, and a run that held
    structures out does not train on them after a resume that validates a file instead.
    """
    fmt = meta.get("format")
    if fmt != CHECKPOINT_FORMAT and fmt not in OLDER_FORMATS:
        raise CheckpointError(f"{path}: not a training checkpoint of this program (use checkpoint_path to start "
                              "from plain weights)")
    by_content = bool(meta.get("train_fingerprint")) and bool(train_fingerprint)
    keys = [k for k in RESUME_KEYS if not (by_content and k == "train_data_path") and k not in unused]
    changes = config_changes(meta.get("config", {}), current_config, keys)
    rows = meta.get("train_rows")
    if rows is not None and rows != train_rows:
        changes.append(f"rows in train_data_path: {rows} -> {train_rows}")
    elif by_content and meta["train_fingerprint"] != train_fingerprint:
        changes.append("train_data_path: the rows' ids, atom counts or elements differ from the checkpoint's data")
    if meta.get("starting_weights") and starting_weights and meta["starting_weights"] != starting_weights:
        changes.append("checkpoint_path: its weights (with any reference_energies table or file) differ from those "
                       "the run started from")
    if (meta.get("val_split") or "") != (val_split or ""):  # (a split now and none before, or the reverse, too)
        changes.append("val_fraction: the training structures held out for validation differ from the checkpoint's "
                       "run's")
    if changes and not accept_changes:
        raise ConfigError(f"--resume {path}: these settings differ from the checkpoint's run and would change its "
                          f"schedule or data order: {'; '.join(changes)}. Restore them, or pass "
                          "--accept_config_changes to continue with the new settings")
    return changes


def best_loss(meta: Dict) -> float:
    value = meta.get("best_val_loss")
    return math.inf if value is None else float(value)
