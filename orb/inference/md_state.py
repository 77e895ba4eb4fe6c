"""orb-md's state of each structure: its integrator, and ``state_k.json``, written atomically with each frame and read
back by ``--resume`` through one validated reader (:mod:`orb.records`).

A resume reads every structure's state, and checks its trajectory and log against it, before anything is cut back
or written: an empty, cut short, partial or hand-edited state (a key missing, a value of another type or shape, an
integrator state ASE cannot take), or a trajectory or log shorter than its state recorded, is one line naming the
file and the cause, exit status 2, every file as it was.
"""

import os
from typing import Dict, Optional

import numpy as np

from orb.errors import OrbInputError
from orb.records import (RecordError, array, integer, mapping, number, optional, read_record, record_of, text)

FILES = {"traj_bytes": integer(0), "log_bytes": integer(0), "uncertain": integer(0),
         "last_total_energy": optional(number)}  # where the files were at a state (and before an off-grid frame)


def integrator(atoms, args, index: int):
    """ASE's integrator of ``args.ensemble`` for one structure (its own random generator: [seed, index])."""
    from ase import units

    dt = args.timestep * units.fs
    rng = np.random.default_rng([args.seed, index])
    if args.ensemble == "nve":
        from ase.md.verlet import VelocityVerlet

        return VelocityVerlet(atoms, timestep=dt)
    if args.ensemble == "nvt" and args.thermostat == "langevin":
        from ase.md.langevin import Langevin

        return Langevin(atoms, timestep=dt, temperature_K=args.temperature, friction=args.friction / units.fs,
                        rng=rng, fixcm=False)  # (ASE 3.28 deprecates fixcm=True: it does not sample NVT exactly)
    if args.ensemble == "nvt":
        from ase.md.nose_hoover_chain import NoseHooverChainNVT

        dynamics = NoseHooverChainNVT(atoms, timestep=dt, temperature_K=args.temperature, tdamp=args.tdamp * units.fs)
        check_chain_state(dynamics)
        return dynamics
    from ase.md.nptberendsen import NPTBerendsen

    return NPTBerendsen(atoms, timestep=dt, temperature_K=args.temperature, pressure_au=args.pressure * units.bar,
                        taut=args.taut * units.fs, taup=args.taup * units.fs,
                        compressibility_au=args.compressibility / units.bar)


def check_chain_state(dynamics) -> None:
    """The Nose-Hoover chain keeps its own positions, momenta and thermostat in attributes of ASE's (3.29: ``_q``,
    ``_p``, ``_thermostat``), which the state saves; an ASE that names them otherwise is refused in one line rather
    than resumed inexactly without a word."""
    from ase import __version__

    chain = getattr(dynamics, "_thermostat", None)
    if not all(isinstance(getattr(dynamics, name, None), np.ndarray) for name in ("_q", "_p")) or chain is None \
            or not any(isinstance(v, np.ndarray) for v in vars(chain).values()):
        raise OrbInputError(f"--thermostat nose-hoover: ASE {__version__} keeps the chain's state where orb-md cannot "
                            "save it, so a --resume would not continue exactly; use --thermostat langevin, or ASE 3.29")


def integrator_state(dynamics) -> Dict:
    """What a resume needs besides positions, momenta and cell: the random generator (Langevin) and the
    thermostat chain (Nose-Hoover), as JSON."""
    state = {}
    for name in ("_q", "_p"):  # Nose-Hoover's own positions and momenta: of fixed atoms, not the atoms' values
        value = getattr(dynamics, name, None)
        if isinstance(value, np.ndarray):
            state[name] = value.tolist()
    rng = getattr(dynamics, "rng", None)
    if rng is not None and hasattr(rng, "bit_generator"):
        state["rng"] = rng.bit_generator.state
    chain = getattr(dynamics, "_thermostat", None)
    if chain is not None:
        state["thermostat"] = {k: np.asarray(v).tolist() for k, v in vars(chain).items()
                               if isinstance(v, (np.ndarray, float)) and k.startswith("_")}
    return state


def size(path: str) -> int:
    return os.path.getsize(path) if os.path.exists(path) else 0


def cut_to(path: str, size: int) -> None:
    """A file cut back to ``size`` bytes (what it held at the state a resume continues from)."""
    if os.path.exists(path) and os.path.getsize(path) > size:
        with open(path, "r+b") as f:
            f.truncate(size)


def restore_integrator(dynamics, state: Dict) -> None:
    """The random generator and thermostat chain of a saved state, set on ``dynamics``; ValueError naming what does
    not fit (a key of another integrator, a value of another shape)."""
    expected = integrator_state(dynamics)
    missing = sorted(set(expected) - set(state))
    if missing:
        raise ValueError(f"lacks {', '.join(missing)}, which {type(dynamics).__name__} needs")
    try:
        for name in ("_q", "_p"):
            if name in state:
                value = np.array(state[name], dtype=np.float64)
                if value.shape != getattr(dynamics, name).shape:
                    raise ValueError(f"{name} of shape {value.shape}, expected {getattr(dynamics, name).shape}")
                setattr(dynamics, name, value)
        if "rng" in state:
            dynamics.rng.bit_generator.state = state["rng"]
        chain = getattr(dynamics, "_thermostat", None)
        for key, value in mapping(state.get("thermostat", {})).items():
            current = getattr(chain, key)
            new = np.array(value, dtype=np.float64) if isinstance(current, np.ndarray) else float(value)
            if np.shape(new) != np.shape(current):
                raise ValueError(f"thermostat {key} of shape {np.shape(new)}, expected {np.shape(current)}")
            setattr(chain, key, new)
    except (AttributeError, KeyError, TypeError, ValueError) as exc:  # numpy's generator state, a chain named
        raise ValueError(f"does not fit {type(dynamics).__name__} ({exc})") from None  # otherwise by ASE


def start_at_temperature(atoms, temperature: float, rng) -> bool:
    """Maxwell-Boltzmann momenta at ``temperature`` without centre-of-mass motion (ASE's MaxwellBoltzmannDistribution
    and Stationary); False, and the structure at rest, when it has no motion but its centre of mass's (one atom, as
    Materials Project stores elemental metals; every atom fixed): ASE's Stationary rescales a kinetic energy of 0
    by 0 there, NaN momenta that were blamed on the structure's positions a step later."""
    from ase.md.velocitydistribution import MaxwellBoltzmannDistribution, Stationary

    MaxwellBoltzmannDistribution(atoms, temperature_K=temperature, rng=rng)
    momenta, masses = atoms.get_momenta(), atoms.get_masses()[:, None]
    internal = momenta - masses * (momenta.sum(axis=0) / masses.sum())
    if np.sum(internal ** 2 / masses) <= 1e-12 * np.sum(momenta ** 2 / masses) or not np.any(momenta):
        atoms.set_momenta(np.zeros_like(momenta), apply_constraint=False)
        return False
    Stationary(atoms)
    return True


def temperature(atoms) -> float:
    """ASE's temperature, and 0 K for a structure with no degree of freedom left (every atom fixed), where ASE
    divides a kinetic energy of 0 by 0 degrees of freedom (a NaN in every line of its log)."""
    free = 3 * len(atoms) - sum(c.get_removed_dof(atoms) for c in atoms.constraints)
    return atoms.get_temperature() if free > 0 else 0.0


def state_fields(atoms: int) -> Dict:
    """What ``state_k.json`` holds, each field's check (a structure of ``atoms`` atoms)."""
    return {"step": integer(0), "positions": array((atoms, 3)), "momenta": array((atoms, 3)), "cell": array((3, 3)),
            "integrator": mapping, **FILES, "first_total_energy": optional(number),
            "last_frame_only": optional(record_of(FILES, ("uncertain", "last_total_energy"))), "status": text}


# what earlier versions did not write (last_frame_only: see files_of)
OPTIONAL = ("uncertain", "last_total_energy", "first_total_energy", "last_frame_only", "status")


def read_state(run, args) -> Optional[Dict]:
    """(--resume) structure ``run``'s saved state, checked, with the files a resume keeps checked against it (see the
    module's docstring); None when it has none (killed before its first state: it starts again)."""
    path = run.path("state")
    if not os.path.exists(path):
        return None
    index = run.index
    advice = (f"; restore it, or remove state_{index}.json, traj_{index}.extxyz and log_{index}.csv from "
              f"{run.folder} to run structure {index} again")
    state = read_record(path, state_fields(len(run.atoms)), OPTIONAL, advice)
    files = files_of(state, args)
    if files is None:
        raise OrbInputError(f"--resume {run.folder}: structure {index}'s run, written by an earlier version, ended at "
                            f"step {state['step']}, off the --write_every grid, and its state does not say where "
                            "its files were before that frame: extend it with the version that wrote it, or start it "
                            "again")
    for kind, key in (("traj", "traj_bytes"), ("log", "log_bytes")):
        check_kept_part(run.path(kind), files[key], state["step"], advice)
    probe = run.atoms.copy()
    probe.set_positions(state["positions"], apply_constraint=False)
    probe.set_momenta(state["momenta"], apply_constraint=False)
    probe.set_cell(state["cell"], scale_atoms=False)
    try:
        restore_integrator(integrator(probe, args, index), state["integrator"])
    except ValueError as exc:
        raise RecordError(f"{path}: key 'integrator' {exc}{advice}") from None
    return state


def files_of(state: Dict, args) -> Optional[Dict]:
    """Where the trajectory and log a resume keeps end: at the state, or, when a longer run now extends one whose
    last frame was off the --write_every grid (there because it ended), before that frame (an uninterrupted longer
    run has none there); None when an earlier version wrote such a state without saying where that was."""
    if args.steps <= state["step"]:
        return state
    if state.get("last_frame_only"):
        return state["last_frame_only"]
    if "last_frame_only" not in state and state["step"] % args.write_every:
        return None
    return state


def check_kept_part(path: str, length: int, step: int, advice: str) -> None:
    """The first ``length`` bytes of ``path`` (what a resume keeps) are there and end a line: a trajectory or log cut
    short, replaced or removed since its state was written is named, never continued with a gap."""
    have = size(path)
    if have < length:
        raise RecordError(f"{path} holds {have} bytes, fewer than the {length} its state at step {step} recorded (it "
                          f"was cut short or replaced){advice}")
    if length:
        with open(path, "rb") as f:
            f.seek(length - 1)
            if f.read(1) != b"\n":
                raise RecordError(f"{path} does not end a line where its state at step {step} says it did (byte "
                                  f"{length}): it was changed since{advice}")


def state_record(run, step: int, files: Dict, before: Optional[Dict]) -> Dict:
    """``state_k.json``'s content at ``step`` (``files``: where the files are now; ``before``: where they were before
    an off-grid last frame)."""
    atoms = run.atoms
    return {"step": step, "positions": atoms.get_positions().tolist(), "momenta": atoms.get_momenta().tolist(),
            "cell": atoms.cell.array.tolist(), "integrator": integrator_state(run.dynamics), **files,
            "first_total_energy": run.energies[0] if run.energies else None, "last_frame_only": before,
            "status": run.status}


def as_json(state: Dict) -> Dict:
    """A state read by :func:`read_state` as JSON again (its arrays as lists)."""
    return {key: value.tolist() if isinstance(value, np.ndarray) else value for key, value in state.items()}
