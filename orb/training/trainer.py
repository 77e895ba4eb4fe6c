"""The fine-tuning loop shared by ``finetune.py`` (one device) and ``finetune_parallel.py`` (data parallel):
``fit`` runs epochs, ``train_epoch`` its steps, ``validate`` each validation set.

Everything else has its own home, and :func:`orb.training.setup.build_trainer` builds it in order:
the data (:mod:`~orb.training.run_data`), the compiled steps and device state
(:mod:`~orb.training.engine`), the run's position and its checkpoints (:mod:`~orb.training.checkpointing`),
what the user sees (:mod:`~orb.training.reporting`) and what interrupts a run
(:mod:`~orb.training.guards`).

A stop signal is honoured in every phase: a training step finishes, the state is saved at it and the
run ends with :class:`~orb.signals.Stopped` (exit status 75); in validation (the starting model's or an
epoch's), after the batch in progress, the training so far and the validation's sums so far are saved,
and a resume continues that validation at its next batch (a long validation set is not redone each time
a job is preempted in it); before the first step there is nothing else to save. Callbacks (``callbacks``: objects with any of ``on_train_step(trainer,
epoch, step_in_epoch, global_step)``, ``on_validation_batch(trainer, name, index)``,
``on_epoch_end(trainer, record)``) see the loop without changing it.
"""

import dataclasses
import hashlib
import logging
import math
import os
import time
from typing import Dict, List, Optional, Sequence

import numpy as np

from orb.signals import STOP
from orb.training.checkpointing import Checkpointer, Progress
from orb.training.config import TrainConfig
from orb.training.distributed import DataParallel
from orb.training.engine import Engine
from orb.training.guards import SAVE_FLAG, STOP_FLAG, Guards
from orb.training.reporting import Reporter, format_metrics
from orb.training.run_data import RunData

log = logging.getLogger("orb")
CALLBACK_HOOKS = ("on_train_step", "on_validation_batch", "on_epoch_end")  # what _notify calls (the docstring's)


def selection_loss(results: Dict[str, Dict], train_loss: float, with_replay: bool) -> float:
    """The loss that picks the best epoch (best.ckpt, best_weights.ckpt) and early stopping: the validation set's
    (else the training loss), plus, with ``replay.in_selection``, the held-out replay structures' -- against
    pseudo-labels that is the drift from the foundation itself, so the best epoch is one that kept it."""
    loss = results.get("val", {}).get("loss", train_loss)
    if with_replay and "replay_val" in results:
        loss += results["replay_val"]["loss"]
    return loss


class ValidationStopped(Exception):
    """A stop signal arrived while validating set ``name`` (every rank agreed after the same batch): ``batches`` of
    its ``of`` batches done, this rank's metric sums over them ``sums``."""

    def __init__(self, name: str, batches: int, of: int, sums: np.ndarray):
        super().__init__(name)
        self.name, self.batches, self.of, self.sums = name, batches, of, sums


class Trainer:
    """Fits an orb model to the run's data (see the module's docstring)."""

    def __init__(self, cfg: TrainConfig, dp: DataParallel, data: RunData, engine: Engine, checkpointer: Checkpointer,
                 reporter: Reporter, guards: Guards, progress: Progress, callbacks: Sequence = ()):
        self.cfg, self.dp, self.data, self.engine = cfg, dp, data, engine
        self.checkpointer, self.reporter, self.guards, self.progress = checkpointer, reporter, guards, progress
        self.callbacks = list(callbacks)

    @property
    def model(self):
        return self.engine.model

    def _notify(self, hook: str, *args) -> None:
        for callback in self.callbacks:
            method = getattr(callback, hook, None)
            if method is not None:
                method(self, *args)

    # ----------------------------------------------------------------- the run
    def fit(self, until_epoch: Optional[int] = None) -> Dict:
        """Train from the current epoch to ``until_epoch`` (default: the config's ``max_epochs``)."""
        cfg, progress = self.cfg, self.progress
        last_epoch = cfg.max_epochs if until_epoch is None else min(until_epoch, cfg.max_epochs)
        self.model.set_train(True)
        run_start = time.perf_counter()
        self.guards.saved()
        history = []
        STOP.reset()
        if not self.data.val_sets:  # a stopped validation of sets this run does not have: nothing to continue
            progress.validation = None
        try:
            with STOP.deferred():
                if progress.global_step == 0 and progress.epochs_done == 0 and self.data.val_sets:
                    self._validate_starting_model()
                epochs = self.reporter.progress(total=cfg.max_epochs, initial=progress.epochs_done,
                                                desc="fine-tuning")
                stopped = False
                for epoch in range(progress.epochs_done, last_epoch):
                    stopped = self._stopped_early()
                    if stopped:
                        break
                    history.append(self._epoch(epoch))
                    epochs.update(1)
                    if epoch + 1 < last_epoch and self.dp.sum(self.guards.flags()[:1])[0]:
                        raise self.guards.stop(f"the end of epoch {epoch + 1}", progress.global_step,
                                               self.checkpointer.last)
                epochs.close()
                if stopped or progress.epochs_done >= cfg.max_epochs:
                    STOP.finish()  # all saved: a signal from now on (the job's end) ends nothing (exit 0, no traceback)
        finally:
            self.data.loader.close()
        total = time.perf_counter() - run_start
        compiled = self.engine.compiled
        self.reporter.info("training finished in %.1f s (%d compilations: %s)", total, len(compiled.seconds),
                           compiled.describe())
        self.reporter.info("checkpoints: %s (last.ckpt, best.ckpt, best_weights.ckpt); metrics: %s",
                           self.checkpointer.folder, self.reporter.metrics_path)
        if cfg.replay.enabled and (stopped or progress.epochs_done >= cfg.max_epochs):
            self.reporter.trade_off(progress.best_epoch, progress.epochs_done, progress.global_step,
                                    cfg.replay.labels == "model")
        return {"history": history, "total_time": total, "compilations": len(compiled.seconds)}

    def _validate_starting_model(self) -> None:
        try:
            initial = self.validate_all()
        except ValidationStopped:  # its sums so far are kept: a resume continues it
            self.checkpointer.save_last(self.progress, self.engine.optimizer_entries())
            raise self.guards.stop("the validation of the starting model", 0, self.checkpointer.last) from None
        self.progress.initial = initial
        self.reporter.validation("Before fine-tuning: ", initial)
        if not self.reporter.has_record("initial", 0):  # (a run resumed from a save at step 0 wrote it already)
            self.reporter.record({"type": "initial", "epoch": 0, "step": 0, **initial})

    def _epoch(self, epoch: int) -> Dict:
        """Train and validate epoch ``epoch`` (0-based), save it, record it."""
        progress = self.progress
        train_metrics, sums, skipped = self.train_epoch(epoch)
        try:
            results = self.validate_all()
        except ValidationStopped:  # the epoch's training and the validation's sums so far are kept
            self._save_inside_epoch(epoch, self.data.steps_per_epoch, sums, skipped)
            raise self.guards.stop(f"the validation of epoch {epoch + 1}", progress.global_step,
                                   self.checkpointer.last) from None
        self.reporter.validation(f"Epoch: {epoch + 1}/{self.cfg.max_epochs}, train_metrics: "
                                 f"{format_metrics(train_metrics)}, ", results, progress.initial)
        record = {"type": "epoch", "epoch": epoch + 1, "step": progress.global_step, "train": train_metrics,
                  **results, "lr": self.engine.applied_lr()}
        progress.epoch_record = record  # in the checkpoint too: a kill between the save and the line loses neither
        self._save_epoch(epoch + 1, selection_loss(results, train_metrics.get("loss", math.nan),  # (all skipped:
                                                   self.cfg.replay.in_selection),  # never the best epoch, not loss 0)
                         "" if "loss" in train_metrics else "no training step applied: every one was skipped")
        self.reporter.record(record)  # after the save: no line claims an epoch the checkpoint lacks
        self._notify("on_epoch_end", record)
        return record

    def _stopped_early(self) -> bool:
        """Early stopping: ``patience`` epochs in a row without a lower validation loss end the run."""
        progress = self.progress
        waited = progress.epochs_done - progress.best_epoch
        if not self.cfg.patience or waited < self.cfg.patience or math.isinf(progress.best_val):
            return False
        self.reporter.info("early stopping: the validation loss has not improved for %d epochs (best %.6g after "
                           "epoch %d; best.ckpt and best_weights.ckpt hold it)", waited, progress.best_val,
                           progress.best_epoch)
        if not self.reporter.has_record("stopped", progress.global_step):  # (a resume of the stopped run: once)
            self.reporter.record({"type": "stopped", "epoch": progress.epochs_done, "step": progress.global_step,
                                  "best_epoch": progress.best_epoch, "best_val_loss": progress.best_val})
        return True

    # ----------------------------------------------------------------- training
    def train_epoch(self, epoch: int):
        """Train epoch ``epoch`` (from the step a mid-epoch resume saved), saving ``last.ckpt`` inside it when a
        step save is due or a stop signal arrived (then :class:`~orb.signals.Stopped`). Returns (metrics, the
        metric sums over ranks, non-finite steps skipped)."""
        cfg, engine, progress, guards = self.cfg, self.engine, self.progress, self.guards
        steps = self.data.train_steps(epoch)
        first = progress.step_in_epoch
        totals = progress.epoch_sums.copy() if first else np.zeros(engine.num_sums)
        skipped = progress.skipped if first else 0
        progress.step_in_epoch, progress.epoch_sums, progress.interval_sums, progress.skipped = 0, None, None, 0
        progress.nonfinite = None
        seed = cfg.random_seed if cfg.augmentation else None
        compile_before, wait_before = engine.compiled.total(), self.data.loader.wait_time
        start = time.perf_counter()
        bar = self.reporter.progress(total=len(steps), initial=first, desc=f"epoch {epoch + 1}", leave=False)
        row_ids = self._row_ids
        for done, (step, arrays) in enumerate(self.data.loader.iterate("train", steps[first:], seed,
                                                                       self.data.has_stress), first + 1):
            self.reporter.batch(epoch + 1, progress.global_step + 1, row_ids(step.indices))
            engine.train(arrays, step.bucket)
            progress.global_step += 1
            guards.stepped(epoch, done, progress.global_step, step.indices)
            self._notify("on_train_step", epoch, done, progress.global_step)
            bar.update(1)
            last = done == len(steps)
            flags = guards.flags()
            if done % cfg.log_every_n_steps == 0 or last:  # one host synchronisation per interval; flags travel too
                part = self.dp.sum(np.concatenate([engine.take_interval_sums(), flags]))
                part, flags = part[:-len(flags)], part[-len(flags):]
                saved = self.checkpointer.last if os.path.exists(self.checkpointer.last) else ""
                skipped_now = guards.check_finite(engine.take_nonfinite(), row_ids, saved) + engine.take_overflows()
                skipped += skipped_now
                totals += part
                interval = engine.metrics(part)
                interval.update(skip_metrics(skipped_now, engine))  # which interval skipped, at which fp16 scale
                if "loss" in interval:  # (an interval whose every step was skipped has none)
                    bar.set_postfix(loss=f"{interval['loss']:.4f}")
                self.reporter.record({"type": "step", "epoch": epoch + 1, "step": progress.global_step,
                                      "lr": engine.applied_lr(), **interval})
            elif self.dp.parallel:
                flags = np.zeros_like(flags)  # ranks agree only at interval boundaries
            every = cfg.save_every_n_steps
            periodic = bool(every) and progress.global_step % every == 0
            if flags[STOP_FLAG] or (not last and (flags[SAVE_FLAG] or periodic)):
                self._save_inside_epoch(epoch, done, totals, skipped)
                if flags[STOP_FLAG]:
                    bar.close()
                    raise guards.stop(f"epoch {epoch + 1}, step {done} of {len(steps)}", progress.global_step,
                                      self.checkpointer.last)
        bar.close()
        metrics = engine.metrics(totals, by_element=True)
        metrics.update(skip_metrics(skipped, engine))
        compile_time = engine.compiled.total() - compile_before
        elapsed = time.perf_counter() - start - compile_time
        metrics["data_wait"] = (self.data.loader.wait_time - wait_before) / max(elapsed, 1e-9)
        metrics["train_time"] = elapsed
        if compile_time:
            metrics["compile_time"] = compile_time
        return metrics, totals, skipped

    def _row_ids(self, indices) -> list:
        return [self.data.train_set.row_id(i) for i in indices]

    # ----------------------------------------------------------------- validation
    def validate(self, name: str = "val", resume_at: int = 0, sums: Optional[np.ndarray] = None) -> Dict[str, float]:
        """Metrics of validation set ``name`` (with the EMA weights when ``ema_decay`` is set), from batch
        ``resume_at`` on with this rank's ``sums`` of the batches before it. A stop signal ends it after the batch in
        progress, all ranks alike (:class:`ValidationStopped`, with the sums so far)."""
        if name not in self.data.val_sets:
            return {}
        start = time.perf_counter()
        steps = self.data.eval_steps(name)
        total = np.zeros(self.engine.num_sums) if sums is None else np.array(sums, np.float64)
        bar = self.reporter.progress(total=len(steps), initial=resume_at, desc=name, leave=False)
        with self.engine.evaluation_weights():
            batches = self.data.loader.iterate(name, steps[resume_at:], None, self.data.has_stress)
            for index, (step, arrays) in enumerate(batches, start=resume_at):
                total += self.engine.evaluate(arrays, step.bucket)
                bar.update(1)
                self._notify("on_validation_batch", name, index)
                if self.dp.sum(self.guards.flags()[:1])[0]:
                    bar.close()
                    raise ValidationStopped(name, index + 1, len(steps), total)
        bar.close()
        metrics = self.engine.metrics(self.dp.sum(total), by_element=True)
        metrics["val_time"] = time.perf_counter() - start
        return metrics

    def validate_all(self) -> Dict[str, Dict]:
        """Every validation set's metrics, continuing a validation a stop interrupted (``progress.validation``:
        the sets it finished, and where it stopped in the next). A stop records where in ``progress.validation``
        (collective: every rank's sums are gathered) and raises :class:`ValidationStopped`."""
        partial, self.progress.validation = self._continued_validation(), None
        results = dict(partial["finished"]) if partial else {}
        for name in self.data.val_sets:
            if name in results:
                continue
            at, sums = (partial["batches"], partial["sums"]) if partial and partial["name"] == name else (0, None)
            try:
                results[name] = self.validate(name, at, sums)
            except ValidationStopped as stopped:
                gathered = self.dp.gather_float64(stopped.sums).reshape(self.dp.world_size, -1)
                self.progress.validation = {"finished": results, "name": name, "batches": stopped.batches,
                                            "of": stopped.of, "sums": gathered, "step": self.progress.global_step,
                                            "sets": self._validation_keys()}
                raise
        return results

    def _continued_validation(self) -> Optional[Dict]:
        """``progress.validation`` with this rank's sums, when the run stopped in the validation it is about to do:
        at the same step (the same weights), on as many ranks, over the same sets, rows and batches on every rank
        (a resume may change the validation data, its batching or the ranks); else None, said once. Collective."""
        partial = self.progress.validation
        if not partial:
            return None
        sums = np.atleast_2d(partial["sums"])
        same = (partial.get("step") == self.progress.global_step and len(sums) == self.dp.world_size
                and partial.get("sets") == self._validation_keys())
        if self.dp.sum(np.array([same], np.float64))[0] < self.dp.world_size:  # every rank continues, or none
            self.reporter.info("the stopped validation of %s is done again: this run validates other data, batches or "
                               "weights, or on another number of ranks", partial["name"])
            return None
        self.reporter.info("continuing the stopped validation of %s after batch %d of %d", partial["name"],
                           partial["batches"], partial["of"])
        return dict(partial, sums=sums[self.dp.rank])

    def _validation_keys(self) -> Dict[str, List[str]]:
        """Each validation set's identity, every rank's: its rows (and where their charge and spin are read), the
        structures validated and each rank's batches of them (collective)."""
        keys = {}
        for name, source in self.data.val_sets.items():
            digest = hashlib.sha256(repr(source.dataset.inputs_identity()).encode())
            digest.update(np.asarray(source.positions, np.int64).tobytes())
            for step in self.data.eval_steps(name):
                bucket = step.bucket
                digest.update(repr((tuple(int(i) for i in step.indices), bucket.num_nodes, bucket.num_edges,
                                    bucket.num_graphs)).encode())
            ranks = self.dp.gather_float64(np.frombuffer(digest.digest(), np.float64)).reshape(self.dp.world_size, -1)
            keys[name] = [row.tobytes().hex() for row in ranks]
        return keys

    # ----------------------------------------------------------------- saving
    def _save_inside_epoch(self, epoch: int, done: int, totals: np.ndarray, skipped: int) -> None:
        """``last.ckpt`` after ``done`` steps of epoch ``epoch``, with the epoch's metric sums so far and every rank's
        sums of the open logging interval (all ranks call it: the gathers are collective)."""
        state = self.engine.optimizer_entries()
        # bit for bit: the sums accumulate in float64 (orb.training.steps.metric_sum_type)
        interval = self.dp.gather_float64(self.engine.interval_sums()).reshape(self.dp.world_size, -1)
        snapshot = dataclasses.replace(self.progress, step_in_epoch=done, epoch_sums=totals.copy(),
                                       interval_sums=interval, skipped=skipped,
                                       nonfinite=self.engine.open_nonfinite())
        self.checkpointer.save_last(snapshot, state)
        self.guards.saved()

    def _save_epoch(self, epoch: int, val_loss: float, why: str = "") -> None:
        progress = self.progress
        improved = progress.improved(val_loss, epoch)
        if not math.isfinite(val_loss):  # never the best epoch: said, where it was silent (no best.ckpt at all)
            self.reporter.warning("epoch %d: the loss that picks the best epoch is %s (%s): not a best epoch "
                                  "(best.ckpt and best_weights.ckpt %s)", epoch, val_loss,
                                  why or "orb-evaluate on the validation data names each structure's error",
                                  f"keep epoch {progress.best_epoch}" if progress.best_epoch else "are not written")
        progress.epochs_done = epoch
        state = self.engine.optimizer_entries()
        best_weights = {"epoch": epoch, "val_loss": val_loss, "ema": bool(self.cfg.ema_decay),
                        "config": self.cfg.to_dict(), "model": self.cfg.model.to_dict()}
        if progress.reference_fit is not None:
            best_weights["reference_energies_fit"] = progress.reference_fit
        self.checkpointer.save_epoch(progress, state, improved, best_weights, self.engine.evaluation_weights)
        self.guards.saved()


def skip_metrics(skipped: int, engine) -> Dict[str, float]:
    """``nonfinite_steps`` when steps were skipped, and fp16's ``loss_scale`` now: for a step or an epoch record."""
    out = {"nonfinite_steps": float(skipped)} if skipped else {}
    if engine.loss_scale is not None:
        out["loss_scale"] = engine.loss_scale_value()
    return out
