"""What ends or interrupts a training run besides its last epoch: stop signals, timed saves, non-finite steps.

:class:`Guards` reads the process's stop-signal listener (``orb.signals.STOP``) and the save timer
as flags every rank contributes to (summed over ranks in an all-reduce the loop already makes, so all
ranks stop or save at the same step), and turns the training step's non-finite counter into a
warning naming the rows, or into :class:`~orb.errors.DivergedError` when too many come in a row.
"""

import logging
import time
from collections import deque
from typing import Callable, Optional

import numpy as np

from orb.errors import DivergedError
from orb.signals import RESUME_HINT, STOP, STOPPED_STATUS, Stopped, StopSignals

log = logging.getLogger("orb")
STOP_FLAG, SAVE_FLAG = 0, 1


class Guards:
    """Stop and save flags, and the non-finite-step check of a run (see the module's docstring)."""

    def __init__(self, save_every_minutes: float, max_nonfinite_steps: int, log_every_n_steps: int, is_main: bool,
                 signals: StopSignals = STOP):
        self.save_every_minutes, self.max_nonfinite_steps = save_every_minutes, max_nonfinite_steps
        self.is_main, self.signals = is_main, signals
        self.last_save = time.monotonic()
        self.steps_run = 0  # training steps run by this process (the device counts them alike)
        self.recent: deque = deque(maxlen=log_every_n_steps + 1)  # (number, epoch, step in epoch, global, rows)

    def flags(self) -> np.ndarray:
        """[a stop signal arrived, a timed save is due (decided by rank 0)] on this rank."""
        minutes = self.save_every_minutes
        due = self.is_main and minutes > 0 and time.monotonic() - self.last_save >= 60.0 * minutes
        return np.array([self.signals.received is not None, due], np.float64)

    def saved(self) -> None:
        self.last_save = time.monotonic()

    def stepped(self, epoch: int, step_in_epoch: int, global_step: int, rows) -> None:
        self.steps_run += 1
        self.recent.append((self.steps_run, epoch, step_in_epoch, global_step, rows))

    def check_finite(self, nonfinite: np.ndarray, row_ids: Callable[[list], list], saved: str = "") -> int:
        """Steps skipped for a non-finite gradient since the last check; too many in a row end the run, naming the
        latest one's epoch, step and rows (this rank's), and ``saved``: the checkpoint holding the last finite state
        ("" when nothing was saved yet)."""
        in_a_row, longest, latest, count = (int(v) for v in nonfinite)
        if not count:
            return 0
        where = next((r for r in self.recent if r[0] == latest), None)
        place = (f"epoch {where[1] + 1}, step {where[2]} (global step {where[3]}), rows {row_ids(where[4])}" if where
                 else f"step {latest} of this process")
        limit = max(self.max_nonfinite_steps, 1)
        if longest >= limit:
            raise DivergedError(f"{longest} training steps in a row had a non-finite loss or gradient (the latest: "
                                f"{place}); the run stops (max_nonfinite_steps: {self.max_nonfinite_steps}); "
                                + (f"{saved} holds the last finite state: lower lr, check those rows, or resume"
                                   if saved else "nothing was saved yet: lower lr or check those rows, and start "
                                   "again"))
        log.warning("%d training step(s) skipped for a non-finite loss or gradient (latest: %s)", count, place)
        return count

    def stop(self, where: str, global_step: int, saved_in: Optional[str]) -> Stopped:
        """The exception that ends a run after a stop signal (``where``: the phase), its line logged once."""
        kept = (f"state saved in {saved_in}" if saved_in else "nothing trained yet, nothing to save")
        message = (f"stopped by {self.signals.received or 'a signal on another rank'} at {where} (global step "
                   f"{global_step}); {kept}: {RESUME_HINT} (exit status {STOPPED_STATUS})")
        if self.is_main:
            log.info(message)
        return Stopped(message)
