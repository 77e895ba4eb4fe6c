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
from orb.files import append_record, keep_records_up_to, read_records
from orb.metrics import BY_ELEMENT, format_by_element

log = logging.getLogger("orb")
FORGETTING_KEYS = ("energy_per_atom_mae", "forces_mae", "stress_mae")  # the replay_val line of every epoch
TRADE_OFF_KEYS = ("energy_per_atom_mae", "forces_mae")  # the end-of-run trade-off line
UNITS = {"energy_per_atom_mae": "eV/atom", "forces_mae": "eV/Å"}


def format_metrics(metrics: Dict[str, float]) -> str:
    return "{" + ", ".join(f"'{k}': {v:.6g}" for k, v in metrics.items() if isinstance(v, float)) + "}"


def change(now: float, start: float) -> str:
    return f"{100 * (now - start) / abs(start):+.1f} %" if start else f"{now - start:+.3g}"


def percent(now: float, start: float) -> float:
    return 100.0 * (now - start) / start


def trade_off(records, best_epoch: int, final_epoch: int, pseudo_labels: bool) -> Optional[Dict]:
    """What a run with replay gained on its target and cost its foundation, from ``metrics.jsonl``'s records: for
    ``best_epoch`` (best_weights.ckpt; 0: none was written) and ``final_epoch``, the validation set's and
    ``replay_val``'s MAEs against the starting model's (epoch 0), in %. Against pseudo-labels the starting model's
    replay_val error is 0 by construction, so the foundation is given as the drift itself (MAE against the
    starting model's predictions) instead of a change. None without a replay_val of the start and the final epoch."""
    initial = next((r for r in records if r.get("type") == "initial"), None)
    epochs = {r["epoch"]: r for r in records if r.get("type") == "epoch"}
    if not initial or not initial.get("replay_val") or final_epoch not in epochs:
        return None
    # a starting error of 0 (labels that are the starting model's own predictions) has no % change: the drift itself
    absolute = pseudo_labels or not all(initial["replay_val"].get(k) for k in TRADE_OFF_KEYS)

    def weights(epoch: int) -> Dict:
        now = epochs[epoch]
        out = {"epoch": epoch}
        if initial.get("val") and now.get("val") and all(initial["val"].get(k) for k in TRADE_OFF_KEYS):
            out["target"] = {k: percent(now["val"][k], initial["val"][k]) for k in TRADE_OFF_KEYS}
        replay = now["replay_val"]
        out["foundation_drift" if absolute else "foundation"] = {
            k: replay[k] if absolute else percent(replay[k], initial["replay_val"][k]) for k in TRADE_OFF_KEYS}
        return out

    record = {"type": "trade_off", "epoch": final_epoch, "final": weights(final_epoch)}
    if best_epoch in epochs:
        record["best"] = weights(best_epoch)
    return record


def format_trade_off(record: Dict) -> str:
    """The trade-off record as one log line."""
    def part(weights: Dict, names: bool) -> str:
        target = weights.get("target")
        text = ("target " + ", ".join(f"{k + ' ' if names else ''}{v:+.1f} %" for k, v in target.items())
                if target else "target: no validation set")
        if "foundation" in weights:
            return text + f"; foundation{' (replay_val)' if names else ''} " + ", ".join(
                f"{v:+.1f} %" for v in weights["foundation"].values())
        return text + "; foundation drift" + (" (replay_val against the starting model's predictions) " if names
                                              else " ") + ", ".join(f"{v:.4g} {UNITS[k]}"
                                                                    for k, v in weights["foundation_drift"].items())

    best, final = record.get("best"), record["final"]
    first = f"best_weights.ckpt (epoch {best['epoch']}): {part(best, True)}; " if best else ""
    return f"trade-off of {first}final weights (epoch {final['epoch']}): {part(final, not best)}"


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
            self._append(self.metrics_path, record)

    @staticmethod
    def _append(path: str, record: Dict) -> None:
        try:
            append_record(path, record)
        except OSError as exc:  # a full disk: one line (it was a traceback from record_batches' file)
            raise SaveError(f"could not append to {path} ({exc.strerror or exc}); the checkpoints hold the run: "
                            "free space, then continue with --resume auto") from None

    def has_record(self, kind: str, step: int) -> bool:
        """Whether metrics.jsonl holds a record of type ``kind`` at global step ``step`` (rank 0; False elsewhere)."""
        return self.main and any(r.get("type") == kind and r.get("step") == step
                                 for r in read_records(self.metrics_path))

    def batch(self, epoch: int, global_step: int, row_ids) -> None:
        """With ``record_batches``: the database rows this rank trains on at a step."""
        if self.record_batches:
            self._append(os.path.join(self.output_dir, f"batches_rank{self.rank}.jsonl"),
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

    def trade_off(self, best_epoch: int, final_epoch: int, step: int, pseudo_labels: bool) -> None:
        """At the end of a run with replay: the trade-off line (log) and record (metrics.jsonl), once."""
        if not self.main or self.has_record("trade_off", step):
            return
        record = trade_off(read_records(self.metrics_path), best_epoch, final_epoch, pseudo_labels)
        if record is not None:
            log.info(format_trade_off(record))
            self.record(dict(record, step=step))
