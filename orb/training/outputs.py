"""A run's output directory: refusing to mix runs, stale temporary files, the log and metrics.jsonl."""

import logging
import os
import sys
from typing import List

from orb.errors import ConfigError
from orb.files import remove_stale_temporaries

log = logging.getLogger("orb")
RUN_FILES = ("metrics.jsonl", "train.log", "val_split.json")  # (the last: orb.training.val_split.RECORD)


def _completed_steps(metrics_path: str) -> bool:
    """Whether a metrics.jsonl records any training (a step or an epoch), not only the starting validation."""
    try:
        with open(metrics_path) as f:
            return any('"type": "step"' in line or '"type": "epoch"' in line for line in f)
    except OSError:
        return False


def existing_run_files(output_dir: str) -> List[str]:
    """Files of an earlier run in ``output_dir``: its checkpoints, and its metrics and log once it has trained a
    step (a run that failed before its first step left nothing worth keeping)."""
    ckpts = os.path.join(output_dir, "checkpoints")
    found = [os.path.join("checkpoints", f) for f in sorted(os.listdir(ckpts)) if f.endswith(".ckpt")] \
        if os.path.isdir(ckpts) else []
    if found or _completed_steps(os.path.join(output_dir, "metrics.jsonl")):
        found = [f for f in RUN_FILES if os.path.exists(os.path.join(output_dir, f))] + found
    return found


def check_output_dir(output_dir: str, resume: bool, overwrite: bool) -> List[str]:
    """A fresh run never appends to or overwrites an earlier run's files unless told to (``overwrite``)."""
    found = existing_run_files(output_dir)
    if found and not resume and not overwrite:
        listed = ", ".join(found[:4]) + (" ..." if len(found) > 4 else "")
        raise ConfigError(f"output_dir {output_dir} already holds a run ({listed}); continue it with "
                          f"--resume {output_dir}, start over with --overwrite (deletes those files), "
                          "or choose another --output_dir")
    return found


def written_by_training(name: str) -> bool:
    """Whether a run writes, replaces or deletes the file ``name`` (relative to its output_dir)."""
    return (name in RUN_FILES or (name.startswith("batches_rank") and "/" not in name)
            or (name.startswith("checkpoints/") and name.count("/") == 1 and name.endswith(".ckpt")))


def check_outputs_apart(cfg) -> None:
    """A run's output_dir never holds, as files it writes or deletes, its own data or starting checkpoint, and is
    no data folder (``--overwrite`` deleted a checkpoint_path of checkpoints/last.ckpt before loading it)."""
    from orb.files import refuse_overwriting_inputs

    refuse_overwriting_inputs([("output_dir", cfg.output_dir, written_by_training)],
                              [("train_data_path", cfg.train_data_path), ("val_data_path", cfg.val_data_path),
                               ("replay.data_path", cfg.replay.data_path),
                               ("replay.val_data_path", cfg.replay.val_data_path),
                               ("checkpoint_path", cfg.checkpoint_path)])


def _remove_unstarted(output_dir: str) -> None:
    """Delete what a run that never trained a step left (log, metrics, batch records, empty folders)."""
    for name in RUN_FILES:
        path = os.path.join(output_dir, name)
        if os.path.exists(path):
            os.remove(path)
    for name in os.listdir(output_dir):
        if name.startswith("batches_rank") and name.endswith(".jsonl"):
            os.remove(os.path.join(output_dir, name))
    for folder in (os.path.join(output_dir, "checkpoints"), output_dir):
        if os.path.isdir(folder) and not os.listdir(folder):
            os.rmdir(folder)


def discard_unstarted(output_dir: str) -> None:
    """After a failure before the first training step: leave ``output_dir`` as it was (no log, no folders), so
    the corrected command is not refused. A run that trained keeps everything."""
    if output_dir and os.path.isdir(output_dir) and not existing_run_files(output_dir):
        for handler in list(logging.getLogger("orb").handlers):
            if isinstance(handler, logging.FileHandler) and \
                    os.path.dirname(os.path.abspath(handler.baseFilename)) == os.path.abspath(output_dir):
                handler.close()
                logging.getLogger("orb").removeHandler(handler)
        try:
            _remove_unstarted(output_dir)
        except OSError:
            pass


def prepare_output_dir(output_dir: str, resume: bool, overwrite: bool) -> None:
    """Check, then (``overwrite``) delete the earlier run's files, create the folders, remove stale temporaries."""
    found = check_output_dir(output_dir, resume, overwrite)
    if found and not resume:
        for name in found:
            os.remove(os.path.join(output_dir, name))
    if not resume and os.path.isdir(output_dir):
        _remove_unstarted(output_dir)
    try:
        os.makedirs(os.path.join(output_dir, "checkpoints"), exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"config key 'output_dir': cannot create {output_dir} ({exc.strerror})") from None
    for folder in (output_dir, os.path.join(output_dir, "checkpoints")):  # (output_dir: val_split.json's, metrics')
        remove_stale_temporaries(folder)


class RunLogFile(logging.FileHandler):
    """``train.log``: a line that cannot be written (a full disk) is dropped with one warning on the console, not a
    traceback per line (what ``logging`` prints by default)."""

    warned = False

    def handleError(self, record) -> None:
        if not self.warned:
            self.warned = True
            reason = sys.exc_info()[1]
            sys.stderr.write(f"warning: cannot write {self.baseFilename} ({getattr(reason, 'strerror', None) or reason}); "
                             "its lines are dropped, the console has them\n")


def setup_logging(output_dir: str, is_main: bool = True, rank: int = 0) -> None:
    """Console (and for rank 0, ``output_dir/train.log``) logging in a readable format."""
    logger = logging.getLogger("orb")
    logger.setLevel(logging.INFO)
    logger.handlers.clear()
    fmt = logging.Formatter(f"%(asctime)s [%(levelname)s]{f' rank {rank}' if rank else ''} %(message)s",
                            "%Y-%m-%d %H:%M:%S")
    console = logging.StreamHandler(sys.stdout)
    console.setFormatter(fmt)
    logger.addHandler(console)
    if is_main and output_dir:
        os.makedirs(output_dir, exist_ok=True)
        file_handler = RunLogFile(os.path.join(output_dir, "train.log"))
        file_handler.setFormatter(fmt)
        logger.addHandler(file_handler)
    logger.propagate = False

