"""What orb-md checks and sets up before any work: its options, its output folder (a run continued or replaced, never
mixed) and its structures (each a :class:`Run`, checked as the model will read it, named by file, frame and key)."""

import logging
import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import numpy as np

from orb.errors import OrbInputError
from orb.records import RUN_RECORD, SUMMARY

log = logging.getLogger("orb")


@dataclass
class Run:
    """One structure's dynamics and its files."""

    index: int
    row: int
    atoms: object
    dynamics: object = None
    folder: str = ""
    status: str = "pending"
    error: str = ""
    uncertain: int = 0
    energies: List[float] = field(default_factory=list)  # total energy at each frame written (its drift)
    resumed_from: Optional[int] = None  # the step of the state a resume started from (written already)
    state: Optional[Dict] = None  # (resume) its saved state, read and checked before anything is cut or written
    at_rest: bool = False  # no motion but its centre of mass's to draw velocities for (one atom): it starts at rest
    frames_kept_to: int = -1  # (resume) its uncertain frames up to this step stay; later ones are computed again
    where: str = ""  # its input as messages name it: the file and frame (or row), or its row in one ASE database
    origin: Dict = field(default_factory=dict)  # the same as the outputs keep it (orb.inference.runs.origin_keys)

    def path(self, kind: str) -> str:
        ext = {"traj": "extxyz", "log": "csv", "state": "json"}[kind]
        return os.path.join(self.folder, f"{kind}_{self.index}.{ext}")


def check_args(args) -> None:
    for name, value, low in (("--timestep", args.timestep, 0.0), ("--temperature", args.temperature, -1e-300),
                             ("--friction", args.friction, 0.0), ("--tdamp", args.tdamp, 0.0)):
        if not np.isfinite(value) or value <= low:
            bound = ">= 0" if name == "--temperature" else "> 0"
            raise OrbInputError(f"{name} must be a finite number {bound}, got {value}")
    if args.temperature == 0 and (args.ensemble == "npt" or (args.ensemble == "nvt" and args.thermostat != "langevin")):
        # (Nose-Hoover's thermostat masses are proportional to it; Berendsen divides by the temperature, 0 at 0 K:
        # every structure failed with NaN positions, blamed on the structures)
        what = "--ensemble npt (Berendsen)" if args.ensemble == "npt" else f"--thermostat {args.thermostat}"
        raise OrbInputError(f"--temperature must be > 0 for {what}; at 0 K use --thermostat langevin (a quench) or "
                            "orb-relax")
    if args.steps < 0 or args.write_every < 1 or args.batch_size < 1 or not 0 <= args.seed < 2 ** 32:
        raise OrbInputError("--steps must be >= 0, --write_every and --batch_size >= 1, --seed 0 to 2^32 - 1")
    if args.ensemble == "npt" and not all(np.isfinite(v) and v > 0 for v in (args.taut, args.taup,
                                                                             args.compressibility)):
        raise OrbInputError("--taut, --taup and --compressibility must be positive numbers")
    if not np.isfinite(args.pressure):
        raise OrbInputError(f"--pressure must be a finite number (bar), got {args.pressure}")
    check_options_apply(args)
    from orb.inference.runs import check_resume_and_overwrite

    check_resume_and_overwrite(args.resume, args.overwrite)


# each option that only one ensemble or thermostat reads
APPLIES = {"thermostat": "--ensemble nvt", "friction": "--ensemble nvt --thermostat langevin",
           "tdamp": "--ensemble nvt --thermostat nose-hoover", "pressure": "--ensemble npt", "taut": "--ensemble npt",
           "taup": "--ensemble npt", "compressibility": "--ensemble npt"}


def check_options_apply(args) -> None:
    """An option set away from its default that this run's ensemble or thermostat never reads is refused: a
    --pressure without --ensemble npt ran NVE at constant volume, recording the pressure as if it were applied."""
    from orb.inference.md import build_parser

    defaults = build_parser()
    running = f"--ensemble {args.ensemble}" + (f" --thermostat {args.thermostat}" if args.ensemble == "nvt" else "")
    for name, needs in APPLIES.items():
        if getattr(args, name) != defaults.get_default(name) and not running.startswith(needs):
            raise OrbInputError(f"--{name} {getattr(args, name)} applies to {needs}, and this run is {running}: give "
                                f"{needs}, or leave --{name} out")


RUN_RECORDS = (SUMMARY, "uncertain.extxyz", RUN_RECORD)  # beside each structure's traj_, state_ and log_


def written_by_md(name: str) -> bool:
    """Whether orb-md writes, cuts or removes the file ``name`` of its output folder."""
    return "/" not in name and (name.startswith(("traj_", "state_", "log_")) or name in RUN_RECORDS)


def check_output(folder: str, resume: bool, overwrite: bool) -> None:
    """A folder holding an earlier run is continued (--resume) or replaced (--overwrite), never mixed; --resume of
    none starts the run, said (a requeue script passes it from the first start; a mistyped folder is seen). (Both
    flags at once: refused by :func:`check_args`, before MindSpore's import.)"""
    from orb.inference.runs import make_output_folder

    found = [f for f in os.listdir(folder) if f.startswith(("traj_", "state_", "log_"))] if os.path.isdir(folder) \
        else []
    if resume and not found:
        log.warning("--resume: %s holds no earlier run to continue: starting it", folder)
    if found and not resume and not overwrite:
        raise OrbInputError(f"--output {folder} holds an earlier run ({', '.join(sorted(found)[:3])} ...): pass "
                            "--resume to continue it or --overwrite to replace it")
    if found and overwrite and not resume:  # the states first: a kill meanwhile leaves no structure that a resume
        found.sort(key=lambda name: not name.startswith("state_"))  # would continue beside a deleted trajectory
        for name in found + [n for n in RUN_RECORDS if os.path.exists(os.path.join(folder, n))]:
            os.remove(os.path.join(folder, name))
    make_output_folder(folder, f"--output {folder}")


def load_structures(args, model) -> Tuple[List[Run], object]:
    from orb.data.dataset import AseDbDataset
    from orb.data.formats import LabelKeys, readable_database, without_labels
    from orb.inference.dispersion import check_dispersion_elements
    from orb.inference.runs import ORIGIN_KEYS, origin_keys, total_charge_and_spin

    keys = LabelKeys(charge=args.charge_key, spin=args.spin_key, labels=False)
    data = AseDbDataset(readable_database(args.data, keys), require_labels=False, labels=False,
                        settings=model.cfg.graph_settings(), charge_spin=model.cfg.omol,
                        charge_spin_keys=(keys.charge, keys.spin))
    data.check_structures()  # before the first step, named by file, row or frame, and key (labels: discarded)
    check_dispersion_elements(data, args.dispersion)
    runs, origin = [], origin_keys(data)
    for i in range(len(data)):
        atoms = data.get_atoms(i, say_dropped=True)
        atoms.calc = None
        atoms.info = {key: value for key, value in without_labels(atoms.info).items()  # the starting structure's
                      if key not in ORIGIN_KEYS}  # labels are not the frames', nor where an earlier run's input was
        if model.cfg.omol:
            atoms.info.update(total_charge_and_spin(data, i, required=True))
        row = int(data.ids[i])
        if args.ensemble == "npt" and not (atoms.cell.any() and atoms.pbc.all()):
            raise data.error_at("npt needs a periodic structure (a cell and pbc)", row, "cell")
        if not np.all(np.isfinite(atoms.get_momenta())):  # (a NaN velocity was blamed on the positions, mid-run)
            raise data.error_at("momenta contain NaN or inf", row, "momenta")
        if not (np.all(np.isfinite(atoms.get_masses())) and np.all(atoms.get_masses() > 0)):
            raise data.error_at("masses must be finite and > 0", row, "masses")
        runs.append(Run(i, row, atoms, folder=args.output, where=data.where(row), origin=origin(row)))
    return runs, data


# what a resume must not change (--steps may grow, not shrink); the batch size too: a structure's float32 forces
# depend, in their last bits, on the batch shape it was computed in
SETTINGS = ("steps", "ensemble", "thermostat", "timestep", "temperature", "friction", "tdamp", "pressure", "taut",
            "taup", "compressibility", "seed", "write_every", "batch_size", "uncertain_above", "stop_uncertain",
            "precision", "dispersion", "xc", "model")
