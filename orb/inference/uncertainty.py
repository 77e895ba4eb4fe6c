"""What the orb-v3 confidence head says about a prediction, and the frames that need new DFT labels.

Every orb-v3 model is trained with a confidence head: per atom, a distribution over 50 bins of its force error
(the mean absolute error of its three force components, 0 to 0.3 eV/Å; orb-models' ``ConfidenceHead``). Its
expectation is the atom's **predicted force error** (eV/Å). A frame's is the largest over its atoms (one badly
described atom is what makes a frame worth labelling) beside the mean. orb-v2 has no confidence head.

:func:`uncertain_frames` collects frames whose predicted error passes a threshold into an extxyz file, ready for
DFT labelling and, labelled, for ``finetune.py`` (the active-learning loop in the README).
"""

import io
import os
from typing import Dict, Optional, Tuple

import numpy as np

from orb.errors import OrbInputError
from orb.files import append_whole

BINS, MAX_ERROR = 50, 0.3  # orb-models' ConfidenceHead: linear bins of 0-0.3 eV/Å
CENTRES = (np.arange(BINS) + 0.5) * MAX_ERROR / BINS
NO_HEAD = "has no confidence head: predicted force errors need an orb-v3 model"


def per_atom_error(confidence: np.ndarray) -> np.ndarray:
    """(N,) predicted force error (eV/Å) of each atom from its (N, 50) bin probabilities."""
    return np.asarray(confidence, np.float64) @ CENTRES


def frame_error(per_atom: np.ndarray) -> Dict[str, float]:
    """A frame's predicted force error: the largest over its atoms (``max``) and their mean (``mean``)."""
    return {"max": float(per_atom.max()), "mean": float(per_atom.mean())} if len(per_atom) else \
        {"max": 0.0, "mean": 0.0}


def check_threshold(model_cfg, threshold: Optional[float], flag: str = "--uncertain_above") -> None:
    """A threshold needs an orb-v3 model and a positive finite number: one line otherwise."""
    if threshold is None:
        return
    if model_cfg.family != "orb_v3":
        raise OrbInputError(f"{flag}: {model_cfg.name} {NO_HEAD}")
    if not np.isfinite(threshold) or threshold <= 0:
        raise OrbInputError(f"{flag} must be a positive number of eV/Å, got {threshold}")


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman's rank correlation (average ranks for ties)."""
    from scipy.stats import spearmanr

    if len(a) < 2:
        return float("nan")
    return float(spearmanr(a, b).correlation)


def whole_frames(text: str) -> str:
    """The complete extxyz frames of ``text`` (a frame cut short by a kill at the end is left out)."""
    lines, kept, i = text.splitlines(keepends=True), 0, 0
    while i < len(lines):
        try:
            count = int(lines[i].strip())
        except ValueError:
            break
        if i + 2 + count > len(lines) or not all(line.endswith("\n") for line in lines[i:i + 2 + count]):
            break
        i += 2 + count
        kept = i
    return "".join(lines[:kept])


class UncertainFrames:
    """``uncertain.extxyz`` in a folder: frames appended as they are found (each append is one write of whole
    frames, flushed: a kill keeps every frame written before it), each with its predicted per-atom errors
    (``arrays['predicted_force_error']``) and its source (``info``)."""

    def __init__(self, folder: str, name: str = "uncertain.extxyz"):
        import threading

        self.path = os.path.join(folder, name)
        self.count = 0
        self.lock = threading.Lock()  # writers in several threads (orb-md) append whole frames, one at a time

    def add(self, atoms, per_atom: np.ndarray, **info) -> None:
        import ase.io

        frame = atoms.copy()
        frame.calc = None
        frame.arrays["predicted_force_error"] = np.asarray(per_atom, np.float64)
        frame.info.update(info, predicted_force_error_max=float(np.max(per_atom)))
        text = io.StringIO()
        ase.io.write(text, frame, format="extxyz")
        with self.lock:  # the whole frame in one write: a kill leaves it whole or absent (or cut short at worst)
            append_whole(self.path, text.getvalue().encode(), fsync=True)
            self.count += 1

    def keep_up_to(self, last_step: Dict[int, int]) -> None:
        """(orb-md's resume) drop the frames of structure k after step ``last_step[k]``: they are computed again."""
        self._keep(lambda info: info.get("step", 0) <= last_step.get(info.get("structure"), -1))

    def keep_rows(self, rows) -> None:
        """(orb-relax's resume) drop the frames of input rows not in ``rows`` (the rows its output holds): a frame
        is written before its row, so a kill between the two leaves a frame whose structure is relaxed again."""
        rows = set(rows)
        self._keep(lambda info: info.get("source_row") in rows)

    def order_by(self, key) -> None:
        """Rewrite the frames sorted by ``key(info)`` (atomically): frames are appended as batches (packed by size)
        or threads (orb-md's structures within a step) deliver them, an order that differed between runs."""
        self._keep(lambda info: True, key)

    def frames(self) -> Tuple[list, str, str]:
        """(the whole frames, their text, the file's text): a frame a kill cut short at the end is left out; a file
        that cannot be read (changed by hand, another file of that name) is one line naming it."""
        import ase.io

        if not os.path.exists(self.path):
            return [], "", ""
        try:
            with open(self.path) as f:
                text = f.read()
            whole = whole_frames(text)  # without a frame a kill cut short, which the next append would follow
            return (ase.io.read(io.StringIO(whole), index=":", format="extxyz") if whole else []), whole, text
        except Exception as exc:  # ase.io's errors vary: one line, the reason
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise OrbInputError(f"{self.path}: cannot read its frames to continue it ({reason}); restore it, or move "
                                "it away to start a new collection") from None

    def _keep(self, wanted, order=None) -> None:
        from orb.files import write_atomically

        frames, whole, text = self.frames()
        if not text:
            return
        kept = [f for f in frames if wanted(f.info)]
        if order is not None:
            kept.sort(key=lambda f: order(f.info))
        if len(kept) < len(frames) or len(whole) < len(text) or order is not None:
            import ase.io

            write_atomically(self.path, lambda tmp: ase.io.write(tmp, kept, format="extxyz"))
        self.count = len(kept)
