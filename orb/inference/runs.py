"""What orb-md and orb-relax share about the structures they start from and the runs they resume."""

import os
from typing import Callable, Dict, Optional, Sequence

import numpy as np

from orb.errors import OrbInputError


def add_charge_spin_keys(parser) -> None:
    """``--charge_key`` and ``--spin_key``: where each structure keeps its total charge and spin (an ``info`` entry,
    or an ASE database row's key-value pair or data), which OMol models read; the same options for every command
    that reads structures (orb-evaluate, orb-relax, orb-md) as ``charge_key``/``spin_key`` for fine-tuning."""
    for name in ("charge", "spin"):
        parser.add_argument(f"--{name}_key", default=name, help=f"where each structure keeps its total {name} (an "
                            "info entry, or an ASE database row's key-value pair or data; OMol models read it)")


def run_settings(args, names: Sequence[str], model, data) -> Dict:
    """What a resume must not change: the settings ``names`` of ``args``; what changes the arithmetic besides them:
    the operator profile and device in force (resolved: ``auto`` is compared as what it chose), the model's
    weights (their digest) and architecture; and the structures of ``data`` (their rows' ids, atom counts and
    elements, as a training resume compares them, and their geometry: positions, cells, momenta). The
    checkpoint's path is recorded, not compared: a copy elsewhere with the same weights continues the run."""
    import hashlib
    import json

    import mindspore as ms

    from orb.models import weights_digest
    from orb.device import ops_profile

    architecture = json.dumps(model.cfg.to_dict(), sort_keys=True, default=str)
    return {**{key: getattr(args, key) for key in names}, "checkpoint": os.path.abspath(args.checkpoint),
            "weights_digest": weights_digest(model), "data_fingerprint": data.content_fingerprint(),
            "structures_fingerprint": data.structures_fingerprint(), "ops_profile": ops_profile(),
            "device_target": ms.get_context("device_target"),
            "architecture": hashlib.sha256(architecture.encode()).hexdigest()[:16]}


def total_charge_and_spin(data, index: int, required: bool) -> Dict[str, float]:
    """The structure's total charge and spin, when its row has them: the input of OMol models (``required``: a
    missing or bad value is refused) and what an output row keeps, so that an OMol model reads the new structure as
    it read the input. A model without them ignores a value it cannot read."""
    try:
        charge, spin = data.charge_and_spin(index)
    except OrbInputError:
        if required:
            raise
        return {}
    return {key: value for key, value in (("charge", charge), ("spin", spin)) if value is not None}


def origin_keys(data) -> Callable[[int], Dict]:
    """row id -> where the user finds that structure, as the key-value pairs the outputs that record it keep beside
    ``source_row``: ``source_file`` and ``source_frame``, or ``source_file_row`` in an ASE database of theirs (the
    dataset's own locator, as orb-evaluate's ``source`` and ``frame``); none for one ASE database, whose row id
    ``source_row`` is."""
    if not data.sources:
        return lambda row: {}
    locate = data.rows.origin_locator()  # (made once: an output row each)

    def keys(row: int) -> Dict:
        path, unit, number = locate(int(row))
        return {"source_file": path, "source_frame" if unit == "frame" else "source_file_row": int(number)}

    return keys


ORIGIN_KEYS = ("source_file", "source_frame", "source_file_row")  # what origin_keys writes


def first_line(exc: BaseException) -> str:
    """An unexpected error as the one line a structure's record or message holds."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def made_not_finite(atoms) -> Optional[str]:
    """Which of a structure's positions, momenta and cell are no longer finite (None: all are). orb-md and orb-relax
    check their input before the first step, so such values are the run's own arithmetic (an integrator, a
    thermostat, FIRE): said so, where they were reported as the structure's "positions contain NaN or inf"."""
    parts = (("positions", atoms.positions), ("momenta", atoms.arrays.get("momenta", np.zeros(1))),
             ("cell", atoms.cell.array))
    bad = [name for name, values in parts if not np.all(np.isfinite(values))]
    return " and ".join(bad) or None


def make_output_folder(folder: str, said: str) -> None:
    """``folder`` made with its parents, or one line beginning with ``said`` (``--output X``) naming what is in its
    way (a file there was "File exists")."""
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as exc:
        path = os.path.abspath(folder)
        while path != os.path.dirname(path) and not os.path.exists(path):
            path = os.path.dirname(path)
        if os.path.exists(path) and not os.path.isdir(path):
            raise OrbInputError(f"{said}: {path} is a file, not a folder") from None
        raise OrbInputError(f"{said}: cannot create {folder} ({exc.strerror or exc})") from None


def check_resume_and_overwrite(resume: bool, overwrite: bool) -> None:
    """--resume continues an earlier run, --overwrite replaces it: both at once were --resume, silently."""
    if resume and overwrite:
        raise OrbInputError("--resume continues the earlier run and --overwrite replaces it: give one of them")
