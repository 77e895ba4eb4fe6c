"""A run's checkpoints: what they hold (:class:`Progress` and the run's identity, beside the weights and the
optimizer state) and how they are written, kept, found and read (:class:`Checkpointer`), on every rank alike.

As MACE separates ``CheckpointBuilder`` (content) from ``CheckpointIO`` (files), :class:`Progress` is the
run's position as one object with :meth:`Progress.to_meta` / :meth:`Progress.from_meta`, and the
Checkpointer alone knows file names, retention, atomic writes and which rank writes or reads:

* ``last.ckpt``: after every epoch, at step saves inside one (``save_every_n_steps``, ``save_every_minutes``,
  a stop signal), and when a stop interrupts validation; a mid-epoch save holds the epoch's metric sums so
  far and every rank's sums of the open logging interval, a stopped validation its sums so far, so a resume
  continues exactly there.
* ``best.ckpt`` and ``best_weights.ckpt`` (the EMA weights, exported: what the calculator and PyTorch load) when
  the validation loss improves; ``epoch_XXXX.ckpt`` every ``save_every_x_epochs``, the newest
  ``keep_checkpoints`` kept.

Every file is written atomically (``orb.files``) and never holds a NaN or inf: the last good one stays.
In a data-parallel run every rank takes part in gathering sharded state; rank 0 writes, and on resume
rank 0 reads the file and shares it with the others through the collective (one read of a shared file
system, not one per rank).
"""

import json
import logging
import math
import os
import re
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from orb.errors import ConfigError, DivergedError
from orb.files import read_records
from orb.training.distributed import DataParallel
from orb.training.outputs import existing_run_files

log = logging.getLogger("orb")


@dataclass
class Progress:
    """Where a run is: what a resume restores besides weights and optimizer state."""

    epochs_done: int = 0  # complete epochs (trained and validated)
    global_step: int = 0
    best_val: float = math.inf
    best_epoch: int = 0
    step_in_epoch: int = 0  # steps of epoch ``epochs_done + 1`` already trained (a mid-epoch save)
    epoch_sums: Optional[np.ndarray] = None  # that epoch's metric sums so far (reduced over ranks)
    interval_sums: Optional[np.ndarray] = None  # (ranks, sums): each rank's sums of the open logging interval
    skipped: int = 0  # that epoch's steps skipped so far for a non-finite gradient (closed logging intervals)
    nonfinite: Optional[np.ndarray] = None  # open interval: [skipped in a row, longest run, skipped, fp16 overflows]
    initial: Dict = field(default_factory=dict)  # validation of the starting model, by set
    reference_fit: Optional[Dict] = None  # the fit of the reference energies made before the first step
    # a validation a stop interrupted: {"finished": {set: metrics}, "name": the set it stopped in, "batches": done,
    # "of": its batches, "sums": (ranks, sums) each rank's metric sums so far}
    validation: Optional[Dict] = None
    epoch_record: Optional[Dict] = None  # the last epoch's metrics.jsonl line: written again if a kill lost it

    def to_meta(self) -> Dict:
        meta = {"epoch": self.epochs_done, "global_step": self.global_step,
                "best_val_loss": None if math.isinf(self.best_val) else self.best_val, "best_epoch": self.best_epoch,
                "initial": self.initial}
        if self.reference_fit is not None:
            meta["reference_energies_fit"] = self.reference_fit
        if self.epoch_record is not None:
            meta["epoch_record"] = self.epoch_record
        if self.validation is not None:
            meta["validation"] = dict(self.validation, sums=[[float(x) for x in row]
                                                             for row in np.atleast_2d(self.validation["sums"])])
        if self.step_in_epoch:
            meta["step_in_epoch"] = self.step_in_epoch
            meta["epoch_sums"] = [float(x) for x in self.epoch_sums]
            meta["interval_sums"] = [[float(x) for x in row] for row in np.atleast_2d(self.interval_sums)]
            meta["skipped_steps"] = self.skipped
            if self.nonfinite is not None:
                meta["open_nonfinite"] = [int(x) for x in self.nonfinite]
        return meta

    @classmethod
    def from_meta(cls, meta: Dict) -> "Progress":
        best = meta.get("best_val_loss")
        step = int(meta.get("step_in_epoch") or 0)
        return cls(epochs_done=int(meta.get("epoch", 0)), global_step=int(meta.get("global_step", 0)),
                   best_val=math.inf if best is None else float(best), best_epoch=int(meta.get("best_epoch") or 0),
                   step_in_epoch=step,
                   epoch_sums=np.asarray(meta["epoch_sums"], np.float64) if step else None,
                   interval_sums=np.atleast_2d(np.asarray(meta["interval_sums"], np.float64)) if step else None,
                   skipped=int(meta.get("skipped_steps") or 0),
                   nonfinite=np.asarray(meta["open_nonfinite"], np.int64) if step and "open_nonfinite" in meta
                   else None,
                   initial=meta.get("initial") or {}, reference_fit=meta.get("reference_energies_fit"),
                   validation=meta.get("validation"), epoch_record=meta.get("epoch_record"))

    def convert_sums(self, convert: Callable[[np.ndarray], np.ndarray]) -> None:
        """Every metric sum the progress holds passed through ``convert`` (a checkpoint's layout to the loss's)."""
        if self.epoch_sums is not None:
            self.epoch_sums = convert(self.epoch_sums)
        if self.interval_sums is not None:
            self.interval_sums = convert(self.interval_sums)
        if self.validation is not None and self.validation.get("sums") is not None:
            self.validation = dict(self.validation, sums=convert(np.atleast_2d(self.validation["sums"])).tolist())

    def improved(self, val_loss: float, epoch: int) -> bool:
        """Record epoch ``epoch``'s validation loss; whether it is the best so far."""
        if val_loss < self.best_val:
            self.best_val, self.best_epoch = val_loss, epoch
            return True
        return False


def prune_checkpoints(folder: str, keep: int) -> List[str]:
    """Delete all but the newest ``keep`` periodic ``epoch_XXXX.ckpt`` files (0: keep all)."""
    if keep <= 0 or not os.path.isdir(folder):
        return []
    periodic = sorted((f for f in os.listdir(folder) if re.fullmatch(r"epoch_\d+\.ckpt", f)),
                      key=lambda f: int(f[len("epoch_"):-len(".ckpt")]))  # by number: epoch_10000 after epoch_9999
    removed = periodic[:-keep]
    for name in removed:
        os.remove(os.path.join(folder, name))
    return removed


def checkpoint_to_resume(output_dir: str, resume: str, overwrite: bool = False, config: Optional[Dict] = None
                         ) -> str:
    """``--resume`` as a path: ``auto`` is ``output_dir``'s last.ckpt when it exists, else "" (a fresh start) when
    the folder holds no checkpoint (a first attempt killed before its first save: nothing to lose), only what this
    run's first save wrote before it was cut short (:func:`first_save_cut_short`; ``config``: the run's
    ``cfg.to_dict()``) or with ``overwrite``; a folder with an earlier run's checkpoints but no last.ckpt is refused,
    never overwritten."""
    if resume != "auto":
        return resume
    last = os.path.join(output_dir, "checkpoints", "last.ckpt")
    if os.path.isfile(last):
        return last
    found = [f for f in existing_run_files(output_dir) if f.endswith(".ckpt")] if os.path.isdir(output_dir) else []
    if found and not overwrite and config is not None and first_save_cut_short(output_dir, found, config):
        log.warning("--resume auto: %s holds only what the first epoch's save of this run wrote before it was cut "
                    "short (%s; no last.ckpt): starting the run again", output_dir, ", ".join(found))
        return ""
    if found and not overwrite:
        raise ConfigError(f"--resume auto: {output_dir} has no checkpoints/last.ckpt but holds an earlier run "
                          f"({', '.join(found[:4])}{' ...' if len(found) > 4 else ''}); continue from one of its "
                          "checkpoints with --resume PATH, start over with --overwrite (deletes those files), or "
                          "choose another --output_dir")
    return ""


def first_save_cut_short(output_dir: str, found: List[str], config: Dict) -> bool:
    """Whether the checkpoints ``found`` in ``output_dir`` (no last.ckpt) are what the first epoch's save of a run of
    this ``config`` wrote before a kill (best.ckpt and best_weights.ckpt come before last.ckpt): best.ckpt there,
    every training checkpoint of epoch 1 and of this config, nothing but those and best_weights.ckpt (written with
    best.ckpt). A requeued job then starts again, where it was refused."""
    from orb.io.checkpoint import load_checkpoint

    names = {os.path.basename(f) for f in found}
    if "best.ckpt" not in names or not names <= {"best.ckpt", "best_weights.ckpt", "epoch_0001.ckpt"}:
        return False
    try:  # the epoch's record comes after last.ckpt: a finished run whose last.ckpt was deleted later has it
        records = read_records(os.path.join(output_dir, "metrics.jsonl"))  # (a line the kill cut short: skipped)
        if any(isinstance(r, dict) and r.get("type") == "epoch" for r in records):
            return False
    except (OSError, ValueError):  # (unreadable: not shown to be a first save cut short)
        return False
    for name in names - {"best_weights.ckpt"}:
        try:
            _, _, meta = load_checkpoint(os.path.join(output_dir, "checkpoints", name))
        except Exception:  # noqa: BLE001 (unreadable: not shown to be this run's)
            return False
        if meta.get("epoch") != 1 or meta.get("config") != json.loads(json.dumps(config)):
            return False
    return True


def resolve(path: str) -> str:
    """A training checkpoint given as itself or as an output folder (its checkpoints/last.ckpt)."""
    if os.path.isdir(path):
        folder = os.path.join(path, "checkpoints")
        return os.path.join(folder if os.path.isdir(folder) else path, "last.ckpt")
    return path


class Checkpointer:
    """Writes, keeps and reads a run's checkpoints (see the module's docstring). ``identity`` is the part of the
    metadata that names the run (format, config, model, training data); ``model`` the cell whose weights
    are saved."""

    def __init__(self, folder: str, dp: DataParallel, model, identity: Dict, save_every_x_epochs: int,
                 max_epochs: int, keep: int):
        self.folder, self.dp, self.model, self.identity = folder, dp, model, identity
        self.save_every_x_epochs, self.max_epochs, self.keep = save_every_x_epochs, max_epochs, keep
        self.last_save = time.monotonic()

    @property
    def last(self) -> str:
        return os.path.join(self.folder, "last.ckpt")

    def meta(self, progress: Progress) -> Dict:
        return dict(self.identity, **progress.to_meta())

    def _refuse_nonfinite(self, state: Sequence[Tuple[str, np.ndarray]], global_step: int) -> None:
        for name, value in list(self.model.parameters_and_names()) + list(state):
            array = value.asnumpy() if hasattr(value, "asnumpy") else np.asarray(value)
            if np.issubdtype(array.dtype, np.floating) and not np.isfinite(array).all():
                raise DivergedError(f"{name} holds NaN or inf after global step {global_step}: not saved; "
                                    f"{self.last} holds the last finite state")

    def save_last(self, progress: Progress, state: Sequence[Tuple[str, np.ndarray]]) -> None:
        """``last.ckpt`` at ``progress`` (all ranks call it; rank 0 writes; every rank returns once it is written)."""
        self.last_save = time.monotonic()
        self.dp.on_main_for_all(lambda: self._write_last(progress, state), f"write {self.last}")

    def _write_last(self, progress: Progress, state: Sequence[Tuple[str, np.ndarray]]) -> None:
        from orb.io.checkpoint import save_checkpoint

        self._refuse_nonfinite(state, progress.global_step)
        started = time.perf_counter()
        save_checkpoint(self.last, self.model, self.meta(progress), state)
        if progress.step_in_epoch:
            log.info("saved last.ckpt at epoch %d, step %d (global step %d) in %.1f s", progress.epochs_done + 1,
                     progress.step_in_epoch, progress.global_step, time.perf_counter() - started)

    def save_epoch(self, progress: Progress, state: Sequence[Tuple[str, np.ndarray]], improved: bool,
                   best_weights: Optional[Dict], evaluation_weights) -> None:
        """After epoch ``progress.epochs_done``: best.ckpt and best_weights.ckpt when ``improved`` (the latter
        written inside ``evaluation_weights()``, with ``best_weights`` as its metadata), the periodic epoch file
        and its retention, and ``last.ckpt`` last: until it is written a resume redoes the epoch and writes the
        others again, so a kill or a full disk between two files never leaves a best file older than the best
        epoch ``last.ckpt`` records."""
        self.last_save = time.monotonic()

        def write() -> None:
            from orb.io.checkpoint import save_checkpoint

            self._refuse_nonfinite(state, progress.global_step)
            epoch = progress.epochs_done
            if improved:
                save_checkpoint(os.path.join(self.folder, "best.ckpt"), self.model, self.meta(progress), state)
                with evaluation_weights():
                    save_checkpoint(os.path.join(self.folder, "best_weights.ckpt"), self.model, best_weights,
                                    exported=True)
            if epoch % self.save_every_x_epochs == 0 or epoch == self.max_epochs:
                save_checkpoint(os.path.join(self.folder, f"epoch_{epoch:04d}.ckpt"), self.model,
                                self.meta(progress), state)
                prune_checkpoints(self.folder, self.keep)
            self._write_last(progress, state)

        self.dp.on_main_for_all(write, f"write the checkpoints of epoch {progress.epochs_done}")

    def read(self, path: str) -> Tuple[Dict[str, np.ndarray], Dict[str, np.ndarray], Dict]:
        """(weights, optimizer state, metadata) of a training checkpoint. In a data-parallel run rank 0 reads the
        file and the others receive it through the collective; if rank 0 cannot read it, every rank stops."""
        from orb.io.checkpoint import load_checkpoint

        if not self.dp.parallel:
            return load_checkpoint(path)
        loaded = self.dp.on_main_for_all(lambda: load_checkpoint(path), f"read {path}")
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


def this_ranks_interval_sums(progress: Progress, dp: DataParallel) -> Optional[np.ndarray]:
    """What this rank's open logging interval held at a mid-epoch save: its own row when the run had as many ranks
    (every metric then continues bit for bit), else rank 0 takes the interval's total (equal to rounding)."""
    if progress.interval_sums is None:
        return None
    sums = progress.interval_sums
    if len(sums) == dp.world_size:
        return sums[dp.rank]
    return sums.sum(axis=0) if dp.is_main else np.zeros(sums.shape[1])
