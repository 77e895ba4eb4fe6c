"""``val_fraction``: with no validation file, a seeded share of the training structures held out for validation,
never trained on, and recorded in the run folder (``val_split.json``) so that a resume validates the same ones.

The split is drawn as replay's held-out rows are (:func:`orb.data.selection.hold_out`, by ``random_seed``), over
the positions of the training data (0-based, in the order it is read: an ASE database's rows by id, the frames of
other formats file after file), whatever its format; the run's training source and its ``val`` set are then the
two parts (:class:`orb.data.mixture.Source`), as replay's are.

The record holds the fraction, the seed, the data's identity (row count and the content fingerprint a resume
compares) and the held-out positions. A resume takes the positions from the checkpoint's run folder (so a change
to the code that draws them changes no run); it draws them again only when the record is missing or its settings
or data differ (the resume check then refuses unless changes are accepted), and the checkpoint's digest of the
held-out positions refuses a split drawn again that is not the run's. In a data-parallel run rank 0 reads or
draws the split and every rank receives it through the collective (the run folder need not be visible to every
node); rank 0 alone writes the record, atomically.
"""

import hashlib
import json
import math
import os
from dataclasses import dataclass
from typing import Dict, Optional

import numpy as np

from orb.data.dataset import AseDbDataset
from orb.data.formats import describe_path
from orb.data.selection import hold_out
from orb.errors import ConfigError, OrbInputError
from orb.files import write_json
from orb.training.checkpointing import resolve
from orb.training.config import TrainConfig
from orb.training.distributed import DataParallel

RECORD = "val_split.json"
FORMAT = "orb-mindspore-val-split-1"


@dataclass
class ValSplit:
    """The training data's positions trained on (``kept``) and validated (``held``), both ascending; on rank 0 also
    the ``record`` to keep, how the split was obtained (``origin``) and the record file it was read from."""

    kept: np.ndarray
    held: np.ndarray
    record: Optional[Dict] = None
    origin: str = ""
    read_from: str = ""
    recorded_in: str = ""

    @property
    def digest(self) -> str:
        """The held-out positions, hashed: what a checkpoint keeps of the split."""
        return hashlib.sha256(np.asarray(self.held, np.int64).tobytes()).hexdigest()

    @property
    def redrawn(self) -> bool:
        return self.origin.startswith("drawn again")

    def describe(self, cfg: TrainConfig, source: str) -> str:
        """The start-up log's line: how many held out, the seed, how the split was obtained and where it is kept."""
        same = os.path.abspath(self.read_from or "") == os.path.abspath(self.recorded_in)
        how = (f"read from {self.read_from}" if self.read_from else self.origin) + \
            ("" if same else f"{' and' if self.read_from else ','} recorded in {self.recorded_in}")
        return (f"validation data: {len(self.held)} of the {len(self.held) + len(self.kept)} structures of {source} "
                f"held out, never trained on (val_fraction {cfg.val_fraction:g}, random_seed {cfg.random_seed}); "
                f"{how}")


def check_sizes(fraction: float, held: int, rows: int, world: int, source: str) -> None:
    """Refuse a split that leaves no structure (or fewer than the workers) to validate or to train on."""
    said = f"config key 'val_fraction' ({fraction}) holds out {held} of the {rows} structures of {source}"
    workers = f", fewer than the {world} workers" if world > 1 else ""
    if held < max(world, 1):
        raise ConfigError(f"{said}: {'none' if held == 0 else held} to validate{workers}; raise it or set "
                          "val_data_path")
    if rows - held < max(world, 1):
        raise ConfigError(f"{said}, leaving {rows - held} to train on{workers}; lower it")


def held_out_count(fraction: float, rows: int, world: int, source: str) -> int:
    """How many of ``rows`` structures ``fraction`` holds out (rounded to the nearest), checked."""
    held = int(math.floor(fraction * rows + 0.5))
    check_sizes(fraction, held, rows, world, source)
    return held


def record_of(cfg: TrainConfig, train: AseDbDataset, held: np.ndarray) -> Dict:
    return {"format": FORMAT, "val_fraction": cfg.val_fraction, "random_seed": cfg.random_seed,
            "train_data_path": describe_path(cfg.train_data_path), "train_rows": len(train),
            "train_fingerprint": train.content_fingerprint(), "held_out_count": len(held),
            "held_out": [int(p) for p in held]}


def damaged(path: str, why: str) -> OrbInputError:
    return OrbInputError(f"{path}: the run's record of its validation split is damaged ({why}); delete it to draw "
                         "the split again from random_seed (the resume then checks it against the checkpoint's)")


def read_record(path: str) -> Dict:
    """The record at ``path``, checked; a damaged, empty or truncated one is one line naming it."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise OrbInputError(f"{path}: cannot read the run's record of its validation split ({exc.strerror})") \
            from None
    except UnicodeDecodeError:
        raise damaged(path, "not text") from None
    if not text.strip():
        raise damaged(path, "empty")
    try:
        record = json.loads(text)
    except ValueError as exc:
        raise damaged(path, f"not complete JSON: {exc}") from None
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise damaged(path, f"not a record of format {FORMAT}")
    held, rows = record.get("held_out"), record.get("train_rows")
    if not isinstance(rows, int) or not isinstance(held, list) or not all(type(p) is int for p in held):
        raise damaged(path, "train_rows or held_out is not what it should be")
    positions = np.asarray(held, np.int64)
    if len(held) != record.get("held_out_count") or not (np.diff(positions) > 0).all() or \
            (len(held) and not 0 <= positions[0] <= positions[-1] < rows):
        raise damaged(path, f"held_out is not {record.get('held_out_count')} ascending positions below {rows}")
    return record


def differences(record: Dict, cfg: TrainConfig, train: AseDbDataset) -> str:
    """What differs between a record and this run's settings and training data ("" when nothing does)."""
    changed = [f"{key} {record.get(key)!r}" for key, now in (("val_fraction", cfg.val_fraction),
                                                             ("random_seed", cfg.random_seed))
               if record.get(key) != now]
    if record.get("train_rows") != len(train) or record.get("train_fingerprint") != train.content_fingerprint():
        changed.append("other training data")
    return ", ".join(changed)


def run_folder_of(checkpoint: str) -> str:
    """The run folder a training checkpoint belongs to (the parent of its ``checkpoints`` folder)."""
    folder = os.path.dirname(os.path.abspath(checkpoint))
    return os.path.dirname(folder) if os.path.basename(folder) == "checkpoints" else folder


def _choose_on_main(cfg: TrainConfig, train: AseDbDataset, count: int, world: int, resume: Optional[str]) -> ValSplit:
    """The resumed run's recorded split when it fits this run, else one drawn (again)."""
    rows, origin = len(train), "drawn"
    if resume:
        found = os.path.join(run_folder_of(resolve(resume)), RECORD)
        if os.path.exists(found):
            record = read_record(found)
            changed = differences(record, cfg, train)
            if not changed:
                held = np.asarray(record["held_out"], np.int64)
                check_sizes(cfg.val_fraction, len(held), rows, world, train.source)
                return ValSplit(np.setdiff1d(np.arange(rows), held), held, record, f"read from {found}", found)
            origin = f"drawn again: the run's record {found} has {changed}"
        else:
            origin = f"drawn again: {found} is missing (the checkpoint's digest of the split must agree)"
    kept, held = hold_out(rows, count, cfg.random_seed)
    return ValSplit(kept, held, record_of(cfg, train, held), origin)


def choose(cfg: TrainConfig, train: AseDbDataset, dp: DataParallel, resume: Optional[str]) -> Optional[ValSplit]:
    """The run's split of its training data (None without ``val_fraction``, or with a validation file), the same on
    every rank: rank 0's, received through the collective."""
    if cfg.val_data_path or not cfg.val_fraction:
        return None
    rows = len(train)
    count = held_out_count(cfg.val_fraction, rows, dp.world_size, train.source)
    what = f"read the validation split {os.path.join(run_folder_of(resolve(resume)), RECORD)}" if resume \
        else "draw the validation split"
    split = dp.on_main_for_all(lambda: _choose_on_main(cfg, train, count, dp.world_size, resume), what)
    if not dp.parallel:
        return split
    held = dp.share_from_main({"held": split.held} if dp.is_main else None)["held"].astype(np.int64)
    return split if dp.is_main else ValSplit(np.setdiff1d(np.arange(rows), held), held)


def keep(split: ValSplit, output_dir: str, dp: DataParallel) -> str:
    """``output_dir/val_split.json`` holding the split (rank 0 writes it, atomically, unless it was read from there;
    every rank returns once it is written); its path."""
    path = os.path.join(output_dir, RECORD)

    def write() -> None:
        if not (split.read_from and os.path.abspath(split.read_from) == os.path.abspath(path)):
            write_json(path, split.record)

    dp.on_main_for_all(write, f"write {path}")
    return path
