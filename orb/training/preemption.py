"""Surviving a cluster: stop signals, requeue-friendly resume, and the run's record files after a resume.

Schedulers end jobs with a signal (Slurm: SIGTERM at preemption or the time limit, or the one asked
for with ``--signal=USR1@120`` ahead of it; Ctrl-C: SIGINT). :class:`StopSignals` only notes which
arrived; the training loop finishes the step it is in, saves ``last.ckpt`` at that step, logs one
line and raises :class:`Stopped`, which the command line turns into exit status
:data:`STOPPED_STATUS` ("state saved: run again with ``--resume auto``"). In a data-parallel run the
note is summed over ranks in an all-reduce the loop already makes, so every rank stops at the same
step.
"""

import logging
import os
from typing import List

from orb.errors import ConfigError
from orb.training.outputs import existing_run_files

log = logging.getLogger("orb")


def checkpoint_to_resume(output_dir: str, resume: str, overwrite: bool = False) -> str:
    """``--resume`` as a path: ``auto`` is ``output_dir``'s last.ckpt when it exists, else "" (a fresh start) when
    the folder holds no checkpoint (a first attempt killed before its first save: nothing to lose) or with
    ``overwrite``; a folder with an earlier run's checkpoints but no last.ckpt is refused, never overwritten."""
    if resume != "auto":
        return resume
    last = os.path.join(output_dir, "checkpoints", "last.ckpt")
    if os.path.isfile(last):
        return last
    found = [f for f in existing_run_files(output_dir) if f.endswith(".ckpt")] if os.path.isdir(output_dir) else []
    if found and not overwrite:
        raise ConfigError(f"--resume auto: {output_dir} has no checkpoints/last.ckpt but holds an earlier run "
                          f"({', '.join(found[:4])}{' ...' if len(found) > 4 else ''}); continue from one of its "
                          "checkpoints with --resume PATH, start over with --overwrite (deletes those files), or "
                          "choose another --output_dir")
    return ""


def prune_checkpoints(folder: str, keep: int) -> List[str]:
    """Delete all but the newest ``keep`` periodic ``epoch_XXXX.ckpt`` files (0: keep all)."""
    if keep <= 0 or not os.path.isdir(folder):
        return []
    periodic = sorted(f for f in os.listdir(folder) if f.startswith("epoch_") and f.endswith(".ckpt"))
    removed = periodic[:-keep]
    for name in removed:
        os.remove(os.path.join(folder, name))
    return removed
