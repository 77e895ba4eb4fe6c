"""What a run tells its user: the console and ``train.log`` (rank 0), ``metrics.jsonl`` (rank 0), each rank's
``batches_rank<r>.jsonl`` (``record_batches``) and progress bars (rank 0, on a terminal).

One :class:`Reporter` per process decides once whether it speaks for the run; every other piece
calls it without asking which rank it is on.
"""

import logging
import os
import sys
from typing import Dict, Optional

from orb.errors import SaveError
from orb.io.files import append_record, keep_records_up_to, read_records
from orb.metrics import BY_ELEMENT, format_by_element

log = logging.getLogger("orb")
FORGETTING_KEYS = ("energy_per_atom_mae", "forces_mae", "stress_mae")  # the replay_val line of every epoch


def format_metrics(metrics: Dict[str, float]) -> str:
    return "{" + ", ".join(f"'{k}': {v:.6g}" for k, v in metrics.items() if isinstance(v, float)) + "}"


def change(now: float, start: float) -> str:
    return f"{100 * (now - start) / abs(start):+.1f} %" if start else f"{now - start:+.3g}"


def progress_bars_shown(setting: str, is_main: bool) -> bool:
    if not is_main:
        return False
    return sys.stderr.isatty() if setting == "auto" else setting == "true"


class Reporter:
    """The run's voice (see the module's docstring)."""

    def __init__(self, output_dir: str, rank: int, progress_bar: str = "auto", record_batches: bool = False):
        self.output_dir, self.rank = output_dir, rank
        self.main = rank == 0
        self.show_bars = progress_bars_shown(progress_bar, self.main)
        self.record_batches = record_batches

    @property
    def metrics_path(self) -> str:
        return os.path.join(self.output_dir, "metrics.jsonl")

    def info(self, message: str, *args) -> None:
        if self.main:
            log.info(message, *args)

    def warning(self, message: str, *args) -> None:
        if self.main:
            log.warning(message, *args)

    def progress(self, **kwargs):
        from tqdm import tqdm

        return tqdm(disable=not self.show_bars, dynamic_ncols=True, **kwargs)

    def record(self, record: Dict) -> None:
        """One line of ``metrics.jsonl`` (written after the checkpoint it describes: a full disk here loses nothing
        a resume cannot redo)."""
        if self.main:
            try:
                append_record(self.metrics_path, record)
            except OSError as exc:
                raise SaveError(f"could not append to {self.metrics_path} ({exc.strerror or exc}); the checkpoints "
                                "hold the run: free space, then continue with --resume auto") from None

    def has_record(self, kind: str, step: int) -> bool:
        """Whether metrics.jsonl holds a record of type ``kind`` at global step ``step`` (rank 0; False elsewhere)."""
        return self.main and any(r.get("type") == kind and r.get("step") == step
                                 for r in read_records(self.metrics_path))

    def batch(self, epoch: int, global_step: int, row_ids) -> None:
        """With ``record_batches``: the database rows this rank trains on at a step."""
        if self.record_batches:
            append_record(os.path.join(self.output_dir, f"batches_rank{self.rank}.jsonl"),
                          {"epoch": epoch, "step": global_step, "row_ids": row_ids})

    def forget_after(self, global_step: int, epoch_record: Optional[Dict] = None) -> None:
        """A resume drops the records written after its checkpoint (those steps run again), and writes the
        checkpoint's last epoch line again when a kill (or a full disk) came between its save and its line."""
        if self.main:
            dropped = keep_records_up_to(self.metrics_path, global_step)
            if dropped:
                log.info("metrics.jsonl: %d record(s) written after the checkpoint dropped (the steps run again)",
                         dropped)
            if epoch_record is not None and not any(
                    r.get("type") == "epoch" and r.get("epoch") == epoch_record["epoch"]
                    for r in read_records(self.metrics_path)):
                self.record(epoch_record)
                log.info("metrics.jsonl: epoch %d's line, lost after its checkpoint was saved, written again",
                         epoch_record["epoch"])
        keep_records_up_to(os.path.join(self.output_dir, f"batches_rank{self.rank}.jsonl"), global_step)

    def validation(self, prefix: str, results: Dict[str, Dict], initial: Optional[Dict[str, Dict]] = None) -> None:
        """An epoch's (or the starting model's) validation, and what fine-tuning cost the foundation so far."""
        if not self.main:
            return
        log.info(prefix + ", ".join(f"{name}_metrics: {format_metrics(m)}" for name, m in results.items()))
        for name, metrics in results.items():
            if metrics.get(BY_ELEMENT):
                log.info("%s forces MAE by element (eV/Å): %s", name, format_by_element(metrics[BY_ELEMENT]))
        start, now = (initial or {}).get("replay_val"), results.get("replay_val")
        if start and now and now is not start:
            changes = [f"{k} {now[k]:.4g} ({change(now[k], start[k])})" for k in FORGETTING_KEYS
                       if k in now and k in start]
            log.info("replay_val against the starting model: %s", ", ".join(changes))
