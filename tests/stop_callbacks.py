"""Callbacks (config key ``callbacks``) that interrupt a run at an exact place, as a scheduler or a crash would:
the tests name them as ``stop_callbacks:Name`` with this folder on PYTHONPATH, so that every data-parallel
worker interrupts itself at the same step or batch."""

import os
import signal

KILL_AT_STEP = 7  # after a step save at 6 (save_every_n_steps 3) and between log boundaries (every 4 steps)


class KillAtStep7:
    """SIGKILL (no save, no clean-up: a node failure or the out-of-memory killer) after global step 7."""

    def on_train_step(self, trainer, epoch, step_in_epoch, global_step):
        if global_step == KILL_AT_STEP:
            os.kill(os.getpid(), signal.SIGKILL)


class TermInFirstValidation:
    """SIGTERM (a scheduler's preemption) during the validation after the first epoch, at its first batch."""

    def on_validation_batch(self, trainer, name, index):
        if trainer.progress.global_step > 0 and trainer.progress.epochs_done == 0 and index == 0:
            os.kill(os.getpid(), signal.SIGTERM)


class TermAtLastStepOfFirstEpoch:
    """SIGTERM at the last training step of the first epoch (its last logging interval)."""

    def on_train_step(self, trainer, epoch, step_in_epoch, global_step):
        if epoch == 0 and step_in_epoch == trainer.data.steps_per_epoch:
            os.kill(os.getpid(), signal.SIGTERM)


class TermInStartingValidation:
    """SIGTERM during the starting model's validation, after its third batch (neither its first nor its last)."""

    def on_validation_batch(self, trainer, name, index):
        if trainer.progress.global_step == 0 and index == 2:
            os.kill(os.getpid(), signal.SIGTERM)


class RecordValidationBatches:
    """Appends ``global_step name index`` of every validation batch to the file $ORB_VALIDATION_BATCHES."""

    def on_validation_batch(self, trainer, name, index):
        with open(os.environ["ORB_VALIDATION_BATCHES"], "a") as f:
            f.write(f"{trainer.progress.global_step} {name} {index}\n")
