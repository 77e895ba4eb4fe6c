"""Surviving a cluster: stop signals, requeue-friendly resume, and the run's record files after a resume.

Schedulers end jobs with a signal (Slurm: SIGTERM at preemption or the time limit, or the one asked
for with ``--signal=USR1@120`` ahead of it; Ctrl-C: SIGINT). :class:`StopSignals` only notes which
arrived; the training loop finishes the step it is in, saves ``last.ckpt`` at that step, logs one
line and raises :class:`Stopped`, which the command line turns into exit status
:data:`STOPPED_STATUS` ("state saved: run again with ``--resume auto``"). In a data-parallel run the
note is summed over ranks in an all-reduce the loop already makes, so every rank stops at the same
step.
"""

import json
import logging
import os
import signal
import time
from typing import List, Optional

from orb.signals import STOP_SIGNALS

log = logging.getLogger("orb")

STOPPED_STATUS = 75  # EX_TEMPFAIL: stopped on request with the state saved; resuming continues the run


class Stopped(Exception):
    """The run stopped on a signal after saving its state."""

    status = STOPPED_STATUS


class StopSignals:
    """While active, the stop signals only set :attr:`received` (the first one's name). A second SIGINT more than
    a second after the first ends the process at once (Ctrl-C twice; a copy of the first, forwarded by the
    launcher, does not)."""

    def __init__(self):
        self.received: Optional[str] = None
        self._when = 0.0
        self._previous = {}

    def _note(self, number, _frame):
        name = signal.Signals(number).name
        if name == "SIGINT" and self.received is not None and time.monotonic() - self._when > 1.0:
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            raise KeyboardInterrupt
        if self.received is None:
            self.received, self._when = name, time.monotonic()

    def __enter__(self):
        import threading

        if threading.current_thread() is threading.main_thread():  # Python handles signals in the main thread only
            for name in STOP_SIGNALS:
                number = getattr(signal, name)
                self._previous[number] = signal.signal(number, self._note)
        return self

    def __exit__(self, *exc):
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous = {}
        return False


def checkpoint_to_resume(output_dir: str, resume: str) -> str:
    """``--resume`` as a path: ``auto`` is ``output_dir``'s last.ckpt when it exists, else "" (a fresh start)."""
    if resume != "auto":
        return resume
    last = os.path.join(output_dir, "checkpoints", "last.ckpt")
    return last if os.path.isfile(last) else ""


def keep_records_up_to(path: str, step: int) -> int:
    """Drop the records of a metrics or batches file written after global ``step`` (a resumed run writes them
    again); the file is rewritten atomically. Returns the number dropped."""
    if not os.path.exists(path):
        return 0
    with open(path) as f:
        lines = f.readlines()
    kept = []
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line cut short by a kill
            continue
        if int(record.get("step", 0)) <= step:
            kept.append(line if line.endswith("\n") else line + "\n")
    if len(kept) == len(lines):
        return 0
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.writelines(kept)
    os.replace(tmp, path)
    return len(lines) - len(kept)


def prune_checkpoints(folder: str, keep: int) -> List[str]:
    """Delete all but the newest ``keep`` periodic ``epoch_XXXX.ckpt`` files (0: keep all)."""
    if keep <= 0 or not os.path.isdir(folder):
        return []
    periodic = sorted(f for f in os.listdir(folder) if f.startswith("epoch_") and f.endswith(".ckpt"))
    removed = periodic[:-keep]
    for name in removed:
        os.remove(os.path.join(folder, name))
    return removed
