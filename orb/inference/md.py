"""Batched molecular dynamics: many structures at once, each advanced by ASE's own integrator, all their energies,
forces and stresses from one compiled model call per step.

    orb-md --checkpoint best_weights.ckpt --data start.extxyz --output md/ --ensemble nvt --timestep 1 --steps 10000
           --temperature 300 [--seed 0] [--write_every 10] [--batch_size 32] [--uncertain_above 0.1] [--resume]

Each structure k of the input (counted from 0) runs its own ASE dynamics -- ``VelocityVerlet`` (nve),
``Langevin`` or ``NoseHooverChainNVT`` (nvt, ``--thermostat``), ``NPTBerendsen`` (npt) -- in a thread of its own;
whenever an integrator asks for forces, its request waits until every running structure has asked, and one padded,
compiled model call answers them all (:class:`BatchServer`). So every step is ASE's own arithmetic, and the model is
batched. Initial velocities are the structures' own momenta when the data has them, else Maxwell-Boltzmann at
``--temperature`` drawn with ``--seed`` (structure k: seed [seed, k]).

Per structure: ``traj_k.extxyz`` (a frame every ``--write_every`` steps and the last, with energy, forces, stress
and, for orb-v3, each atom's predicted force error), ``log_k.csv`` (time, temperature, potential, kinetic and
total energy, pressure, volume, predicted error) and its state ``state_k.json`` (step, positions, momenta, cell,
the thermostat's state and random generator, how long the trajectory and log were), written atomically with each
frame: ``--resume`` continues a killed run from there (every state read and checked first:
:mod:`orb.inference.md_state`), cutting the trajectory and log back to it, and ends where an uninterrupted run ends.
``summary.json`` lists every structure's outcome. A stop signal finishes the step in progress, saves every structure
there and exits 75. A structure that cannot be computed (overlapping atoms) stops with one line naming it; the
others go on. The options, output folder and structures are checked in :mod:`orb.inference.md_setup`; the batching
is :mod:`orb.inference.md_batch`.
"""

import argparse
import contextlib
import logging
import os
import sys
import threading
from typing import Dict, List, Optional, Tuple

import numpy as np

from orb.errors import OrbInputError
from orb.signals import out_of_space
from orb.inference.md_batch import BatchServer, StopRun, StructureFailed, make_calculator_class
from orb.inference.md_setup import SETTINGS, Run, check_args, check_output, load_structures, written_by_md
from orb.inference.md_state import check_chain_state  # noqa: F401 (where callers found it before the split)
from orb.inference.md_state import cut_to, integrator, read_state, size, start_at_temperature, state_record, temperature

log = logging.getLogger("orb")
ENSEMBLES = ("nve", "nvt", "npt")
THERMOSTATS = ("langevin", "nose-hoover")


class Dynamics:
    """The whole run (see the module's docstring)."""

    def __init__(self, model, args, dispersion=None):
        from orb.inference.predictor import Predictor

        self.model, self.args, self.dispersion = model, args, dispersion
        self.predictor = Predictor(model, reuse=False)  # a resumed run computes as an uninterrupted one
        self.stop_requested = False
        self.uncertain = None
        self.integrator_name = {"nve": "VelocityVerlet", "npt": "NPTBerendsen"}.get(
            args.ensemble, "Langevin" if args.thermostat == "langevin" else "NoseHooverChainNVT")

    # ------------------------------------------------------------------ the model, batched
    def evaluate(self, batch: Dict[int, object]) -> Dict[int, object]:
        """Every requesting structure's results from one model call; a structure whose graph cannot be built gets
        its error instead (the others are computed)."""
        from orb.data.batching import batch_graphs
        from orb.data.graphs import atoms_to_graph, model_sees_periodic
        from orb.errors import StructureError
        from orb.inference.predictor import per_structure
        from orb.inference.runs import first_line, made_not_finite
        from orb.inference.uncertainty import per_atom_error

        settings = self.model.cfg.graph_settings()
        graphs, keys, answers = [], [], {}
        for key, atoms in batch.items():
            made = made_not_finite(atoms)
            if made:
                answers[key] = StructureFailed(f"{self.integrator_name} made its {made} NaN or inf (the dynamics' own "
                                               "arithmetic: the input was checked before the first step)")
                continue
            try:
                graph = atoms_to_graph(atoms, settings=settings, float64=self.predictor.float64)
            except StructureError as exc:
                answers[key] = StructureFailed(str(exc))
                continue
            except Exception as exc:  # anything else about this structure: it stops, the others go on
                answers[key] = StructureFailed(f"its graph: {first_line(exc)}")
                continue
            graphs.append(graph)
            keys.append(key)
        if graphs:
            try:
                out = self.predictor(batch_graphs(graphs))
            except Exception as exc:  # every structure of the call is told (one line each), none hangs
                return dict(answers, **{key: StructureFailed(f"the model failed: {first_line(exc)}") for key in keys})
            periodic = [model_sees_periodic(batch[key], settings) for key in keys]  # (a molecule's stress: none)
            for key, results in zip(keys, per_structure(out, [graph.num_nodes for graph in graphs], periodic)):
                confidence = results.pop("confidence", None)
                if self.dispersion is not None:
                    try:
                        d3 = self.dispersion(batch[key])
                    except Exception as exc:  # e.g. an element dftd3 has no parameters for: this structure
                        answers[key] = StructureFailed(f"dispersion: {str(exc).strip()[:200]}")
                        continue
                    results = {name: results[name] + d3[name] for name in results}
                finite = all(np.all(np.isfinite(value)) for value in results.values())
                results["free_energy"] = results["energy"]
                if confidence is not None:
                    results["force_error"] = per_atom_error(confidence)
                answers[key] = results if finite else StructureFailed("the model's energy or forces are not finite")
        return answers

    # ------------------------------------------------------------------ one structure
    def prepare(self, run: Run) -> None:
        """The structure's atoms, velocities and integrator, from its state (read and checked by
        :func:`orb.inference.md_state.read_state`) when resuming."""
        from orb.inference.md_state import as_json, files_of, restore_integrator

        args, atoms, state = self.args, run.atoms, run.state
        if args.resume and state is None:  # killed before its first state: it starts again, so a frame or line
            for kind in ("traj", "log"):   # written before goes
                if os.path.exists(run.path(kind)):
                    os.remove(run.path(kind))
        if state is not None:
            atoms.set_cell(state["cell"], scale_atoms=False)
            # as saved, constraints not applied again: a barostat moves fixed atoms with the cell, and FixAtoms
            # would put them back where the input had them
            atoms.set_positions(state["positions"], apply_constraint=False)
            atoms.set_momenta(state["momenta"], apply_constraint=False)
            files = files_of(state, args)
            run.frames_kept_to = state["step"] - (files is not state)
            cut_to(run.path("traj"), files["traj_bytes"])
            cut_to(run.path("log"), files["log_bytes"])
            if files is not state:  # the state says so before anything is appended (a kill then resumes alike)
                from orb.files import write_json

                write_json(run.path("state"), as_json(dict(state, **files, last_frame_only=None)))
            run.uncertain = int(files.get("uncertain", 0))
            run.energies = [e for e in (state.get("first_total_energy"), files.get("last_total_energy"))
                            if e is not None][:2]
        elif not np.any(atoms.get_momenta()):
            run.at_rest = not start_at_temperature(atoms, args.temperature,
                                                   np.random.default_rng([args.seed, run.index, 1]))
        run.dynamics = integrator(atoms, args, run.index)
        if state is not None:
            run.dynamics.nsteps = run.resumed_from = state["step"]
            restore_integrator(run.dynamics, state["integrator"])
            if state.get("status", "").startswith("stopped: uncertain"):
                run.status = state["status"]  # --stop_uncertain stopped it: it stays stopped
                return
        # a fresh structure runs even for --steps 0: its step-0 frame, log line and state are written
        run.status = "done" if state is not None and run.dynamics.nsteps >= args.steps else "running"

    def run_one(self, run: Run, server: BatchServer) -> None:
        """(In the structure's thread) its dynamics to ``--steps``, writing every ``--write_every`` steps."""
        dynamics, args = run.dynamics, self.args
        run.atoms.calc = self.calculator_class(server, run.index)

        def observe():
            step = dynamics.nsteps
            if step == run.resumed_from:  # ASE observes a run resumed at step 0 again: its state is written
                return
            last = step >= args.steps
            error = run.atoms.calc.results.get("force_error")
            uncertain = args.stop_uncertain and error is not None and error.max() > args.uncertain_above
            frame = step % args.write_every == 0 or last or uncertain  # the frame that stops it is kept too
            if uncertain:
                run.status = "stopped: uncertain"
            if frame or self.stop_requested:  # stopped between frames: the state alone, so that the files hold
                self.write(run, step, frame,  # what an uninterrupted run's hold
                           last_only=frame and step % args.write_every != 0 and not uncertain)
            if uncertain and not last:
                raise StopRun("uncertain")
            if self.stop_requested and not last:
                raise StopRun("stop signal")

        dynamics.attach(observe, interval=1)
        try:
            with np.errstate(divide="ignore") if run.at_rest else contextlib.nullcontext():  # (Berendsen divides
                dynamics.run(args.steps - dynamics.nsteps)  # by the temperature, 0 at rest: ASE clips the scaling)
            run.status = "done"
        except StopRun as reason:
            run.status = "stopped" if str(reason) == "stop signal" else "stopped: uncertain"
        except StructureFailed as exc:
            run.status, run.error = "failed", f"step {dynamics.nsteps}: {exc}"
        except Exception as exc:  # recorded for the summary; the other structures go on
            run.status, run.error = "failed", f"step {dynamics.nsteps}: {type(exc).__name__}: {exc}"
        finally:
            server.leave()

    def write(self, run: Run, step: int, frame: bool = True, last_only: bool = False) -> None:
        """The frame, the log line (unless not ``frame``) and the state at ``step`` (state last: a kill before it
        keeps the previous one, and a resume cuts the frame and line written after it). ``last_only``: a frame off
        the --write_every grid, there because the run ends; the state keeps the files' lengths before it, which a
        resume with more --steps cuts back to (an uninterrupted longer run has no frame there)."""
        from orb.files import write_json

        def files() -> Dict:
            return {"traj_bytes": size(run.path("traj")), "log_bytes": size(run.path("log")),
                    "uncertain": run.uncertain, "last_total_energy": run.energies[-1] if run.energies else None}

        before = files() if last_only else None
        if frame:
            self.write_frame(run, step)
        write_json(run.path("state"), state_record(run, step, files(), before))

    def write_frame(self, run: Run, step: int) -> None:
        """The trajectory frame and log line at ``step``, synced to the disk (and the frame to uncertain.extxyz
        when its predicted error passes --uncertain_above)."""
        import ase.io
        from ase import units

        from orb.data.graphs import model_sees_periodic

        atoms, results = run.atoms, run.atoms.calc.results
        frame = atoms.copy()
        frame.calc = None
        frame.info.update(step=step, time_fs=step * self.args.timestep, energy=results["energy"],
                          source_row=run.row, **run.origin)
        frame.arrays["forces"] = results["forces"]
        if "force_error" in results:
            frame.arrays["predicted_force_error"] = results["force_error"]
        # periodic as the model sees it (orb-v2: any non-zero cell, pbc aside: a boxed crystal with pbc False had its
        # stress and pressure dropped); a model without a stress head predicts none
        periodic = model_sees_periodic(atoms, self.model.cfg.graph_settings())
        if periodic and "stress" in results:
            frame.info["stress"] = results["stress"]
        with open(run.path("traj"), "a") as f:
            ase.io.write(f, frame, format="extxyz")
        kinetic = atoms.get_kinetic_energy()
        volume = atoms.get_volume() if periodic else float("nan")
        pressure = (-np.mean(results["stress"][:3]) / units.GPa + 2 * kinetic / (3 * volume) / units.GPa
                    if periodic and "stress" in results else float("nan"))
        error = float(np.max(results["force_error"])) if "force_error" in results else float("nan")
        new = not os.path.exists(run.path("log"))
        with open(run.path("log"), "a") as f:
            if new:
                f.write("step,time_fs,temperature_K,potential_eV,kinetic_eV,total_eV,pressure_GPa,volume_A3,"
                        "predicted_force_error_max\n")
            f.write(f"{step},{step * self.args.timestep:.6g},{temperature(atoms):.6f},{results['energy']:.10g},"
                    f"{kinetic:.10g},{results['energy'] + kinetic:.10g},{pressure:.8g},{volume:.8g},{error:.6g}\n")
        run.energies.append(results["energy"] + kinetic)
        if self.uncertain is not None and "force_error" in results and error > self.args.uncertain_above:
            self.uncertain.add(atoms, results["force_error"], source_row=run.row, **run.origin, structure=run.index,
                               step=step)
            run.uncertain += 1
        for path in (run.path("traj"), run.path("log")):  # the frame and the line on disk before the state
            with open(path, "rb") as f:
                os.fsync(f.fileno())

    # ------------------------------------------------------------------ all structures
    def run_all(self, runs: List[Run], show: bool) -> None:
        from tqdm import tqdm

        from orb.signals import STOP

        self.calculator_class = make_calculator_class()
        todo = [r for r in runs if r.status == "running"]
        size = self.args.batch_size  # the groups an uninterrupted run forms, by index: a resume keeps them (the
        groups = [[r for r in runs[start:start + size] if r.status == "running"]  # batch shape changes the forces'
                  for start in range(0, len(runs), size)]                         # last bits), finished ones left out
        with STOP.deferred(), tqdm(total=len(todo), desc="dynamics", unit=" structures", disable=not show) as bar:
            for group in (g for g in groups if g):
                if STOP.received is not None:
                    break
                server = BatchServer(self.evaluate)
                threads = []
                for run in group:
                    server.join()
                    threads.append(threading.Thread(target=self.run_one, args=(run, server), daemon=True))
                for thread in threads:
                    thread.start()

                def at_step():  # every structure of the batch stops after the same step: a resume batches them
                    if STOP.received is not None:  # as the uninterrupted run did
                        self.stop_requested = True

                server.serve(lambda: all(not t.is_alive() for t in threads), at_step)
                for thread in threads:
                    thread.join()
                self.calls = getattr(self, "calls", 0) + server.calls
                bar.update(len(group))


RUNAWAY = 3.0  # a structure logged above this times its temperature (+500 K) is said to have run away


def logged_temperatures(log: str) -> Tuple[Optional[float], Optional[float]]:
    """A structure's logged temperature at its first frame and the highest (its frames: every --write_every steps),
    None where there are none."""
    try:
        with open(log) as f:
            values = [float(line.split(",")[2]) for line in f.readlines()[1:] if line.count(",") >= 2]
    except (OSError, ValueError):
        return None, None
    finite = [v for v in values if np.isfinite(v)]
    return (values[0] if values and np.isfinite(values[0]) else None), (max(finite) if finite else None)


def ran_away(start: Optional[float], highest: Optional[float], asked: float) -> bool:
    """Whether a structure heated far beyond what it was given (--temperature, or the velocities it came with)."""
    return highest is not None and highest > RUNAWAY * max(asked, start or 0.0) + 500.0


def md(args) -> Dict:
    from orb.files import refuse_overwriting_inputs
    from orb.inference.dispersion import check_dispersion

    check_args(args)  # (the options checked before MindSpore's 1 s import)
    refuse_overwriting_inputs([("--output", args.output, written_by_md)],
                              [("--data", args.data), ("--checkpoint", args.checkpoint)])
    if args.stop_uncertain and args.uncertain_above is None:
        raise OrbInputError("--stop_uncertain needs --uncertain_above")
    check_dispersion(args.dispersion, args.xc)
    from orb.device import import_mindspore

    import_mindspore()  # then what the other imports need, with a stop signal honoured after it
    from orb.device import configure_mindspore, set_ops_profile
    from orb.files import check_run_settings, remove_stale_temporaries, write_json
    from orb.inference.dispersion import D3Dispersion, check_dispersion_for
    from orb.inference.runs import run_settings
    from orb.inference.uncertainty import UncertainFrames, check_threshold
    from orb.io.checkpoint import model_from_checkpoint
    from orb.signals import RESUME_FLAG, STOP, STOPPED_STATUS, Stopped

    configure_mindspore(args.device_target, precision=args.precision)
    set_ops_profile(args.ops_profile)
    model = model_from_checkpoint(args.checkpoint, args.model)
    check_dispersion_for(model.cfg, args.dispersion)
    check_threshold(model.cfg, args.uncertain_above)
    if args.ensemble == "npt" and not model.cfg.has_stress:  # its stress would be zeros: a barostat without pressure
        raise OrbInputError(f"--ensemble npt needs stress, and {model.cfg.name} predicts none (no stress head)")
    runs, data = load_structures(args, model)
    uncertain = UncertainFrames(args.output) if args.uncertain_above is not None else None
    try:
        check_output(args.output, args.resume, args.overwrite)  # after every check: --overwrite deletes the old run
        remove_stale_temporaries(args.output, min_age=600.0)  # a state or summary whose write was killed
        record = os.path.join(args.output, "run.json")
        pending = check_run_settings(record, run_settings(args, SETTINGS, model, data), args.resume, args.output,
                                     informational=("checkpoint",), may_grow=("steps",),
                                     required=args.resume and any(os.path.exists(r.path("state")) for r in runs))
        if args.resume:  # every state and the files it keeps checked before anything is cut back or written
            for run in runs:
                run.state = read_state(run, args)
            if uncertain is not None:
                uncertain.frames()
        if pending is not None:
            write_json(record, pending)
    except OSError as exc:  # a read-only folder (a full disk: the command's own line, status 1)
        if out_of_space(exc):
            raise
        raise OrbInputError(f"--output {args.output}: cannot write there ({exc.strerror or exc})") from None
    d3 = D3Dispersion(args.dispersion, args.xc, model.cfg.graph_settings()) if args.dispersion else None
    dynamics = Dynamics(model, args, d3)
    dynamics.uncertain = uncertain
    for run in runs:
        dynamics.prepare(run)
    still = [r for r in runs if r.at_rest]
    if still:
        first = f"structure {still[0].index}, {still[0].where}" + (" ..." if len(still) > 1 else "")
        print(f"note: {len(still)} structure(s) ({first}) have no motion but their centre of mass's (one atom, or "
              "every atom fixed), which orb-md removes: they start at rest", file=sys.stderr)
    if dynamics.uncertain is not None and args.resume:  # a structure without a state starts again: none kept
        dynamics.uncertain.keep_up_to({r.index: r.frames_kept_to for r in runs})
    show = sys.stderr.isatty() if args.progress_bar == "auto" else args.progress_bar == "true"
    dynamics.run_all(runs, show)
    if dynamics.uncertain is not None and STOP.received is None:  # the run's end: in the order of steps, structures
        dynamics.uncertain.order_by(lambda info: (info.get("step", 0), info.get("structure", 0)))
    logged = {r.index: logged_temperatures(r.path("log")) for r in runs}  # (start, highest): each log read once
    summary = {"checkpoint": args.checkpoint, "data": args.data, "ensemble": args.ensemble,
               "thermostat": args.thermostat if args.ensemble == "nvt" else None, "timestep_fs": args.timestep,
               "steps": args.steps, "temperature_K": args.temperature, "seed": args.seed,
               "precision": args.precision, "model_calls": getattr(dynamics, "calls", 0),
               "compile_seconds": round(sum(dynamics.predictor.compiled.values()), 3), "structures": [
                   {"index": r.index, "source_row": r.row, **r.origin, "status": r.status, "error": r.error,
                    "steps_done": int(r.dynamics.nsteps) if r.dynamics else 0, "uncertain_frames": r.uncertain,
                    "total_energy_drift_eV_per_atom": (float((r.energies[-1] - r.energies[0]) / len(r.atoms))
                                                       if len(r.energies) > 1 and args.ensemble == "nve" else None),
                    "max_temperature_K": logged[r.index][1]}
                   for r in runs]}
    write_json(os.path.join(args.output, "summary.json"), summary)
    hot = [s for s in summary["structures"] if ran_away(*logged[s["index"]], args.temperature)]
    if hot:  # (a model unfit for a structure heats it without bound: 63,316 K at step 10, and "ran 40 steps")
        worst = max(hot, key=lambda s: s["max_temperature_K"])
        print(f"warning: {len(hot)} structure(s) ran far hotter than they started (structure {worst['index']}, "
              f"{runs[worst['index']].where}: {worst['max_temperature_K']:,.0f} K in its log): the model "
              "is likely unfit for them (see max_temperature_K in summary.json, and the predicted force errors)",
              file=sys.stderr)
    failed = [r for r in runs if r.status == "failed"]
    for r in failed:
        print(f"structure {r.index} ({r.where}) stopped: {r.error}", file=sys.stderr)
    if STOP.received is not None:
        raise Stopped(f"stopped by {STOP.received}; every structure's state is saved in {args.output}: "
                      f"{RESUME_FLAG} (exit status {STOPPED_STATUS})")
    return summary


def build_parser(prog: Optional[str] = None) -> argparse.ArgumentParser:
    """orb-md's options."""
    from orb.bundled import command_path
    from orb.commands import HelpFormatter, Parser
    from orb.device import add_device_argument, add_ops_profile_argument
    from orb.inference.runs import add_charge_spin_keys
    from orb.precision import PRECISIONS

    parser = Parser(prog=prog, allow_abbrev=False, description=__doc__.split("\n\n")[0],
                                     formatter_class=HelpFormatter)
    parser.add_argument("--checkpoint", required=True, type=command_path, help="PyTorch or MindSpore orb checkpoint")
    parser.add_argument("--data", required=True, nargs="+", help="starting structures (any format orb-evaluate "
                        "reads; their momenta, when stored, are the initial velocities)", type=command_path)
    add_charge_spin_keys(parser)
    parser.add_argument("--output", required=True, help="folder for traj_k.extxyz, log_k.csv, state_k.json, "
                        "summary.json")
    parser.add_argument("--ensemble", choices=ENSEMBLES, default="nve", help="nve: constant energy, no thermostat "
                        "(VelocityVerlet) | nvt: --thermostat at --temperature | npt: NPTBerendsen at --temperature "
                        "and --pressure")
    parser.add_argument("--thermostat", choices=THERMOSTATS, default="langevin", help="nvt's: ASE's Langevin or "
                        "NoseHooverChainNVT")
    parser.add_argument("--timestep", type=float, required=True, help="fs")
    parser.add_argument("--steps", type=int, required=True, help="MD steps per structure")
    parser.add_argument("--temperature", type=float, default=300.0, help="K: initial velocities (when the data has "
                        "none) and the thermostat's")
    parser.add_argument("--friction", type=float, default=0.01, help="Langevin friction, 1/fs")
    parser.add_argument("--tdamp", type=float, default=100.0, help="Nose-Hoover damping time, fs")
    parser.add_argument("--pressure", type=float, default=1.0, help="npt: bar")
    parser.add_argument("--taut", type=float, default=100.0, help="npt: Berendsen temperature time constant, fs")
    parser.add_argument("--taup", type=float, default=1000.0, help="npt: Berendsen pressure time constant, fs")
    parser.add_argument("--compressibility", type=float, default=4.57e-5, help="npt: 1/bar (water's)")
    parser.add_argument("--seed", type=int, default=0, help="random seed of the initial velocities (when the data "
                        "has none) and Langevin's noise; structure k uses [seed, k]")
    parser.add_argument("--write_every", type=int, default=10, help="steps between frames (and saved states)")
    parser.add_argument("--batch_size", type=int, default=32, help="structures run together")
    parser.add_argument("--uncertain_above", type=float, default=None, help="orb-v3: frames whose predicted force "
                        "error (largest over the atoms) passes this many eV/Å go to OUTPUT/uncertain.extxyz")
    parser.add_argument("--stop_uncertain", action="store_true", help="stop a structure at its first such frame")
    parser.add_argument("--resume", action="store_true", help="continue a killed or stopped run in OUTPUT")
    parser.add_argument("--overwrite", action="store_true", help="replace an earlier run in OUTPUT")
    parser.add_argument("--model", default=None, help="model name, when the checkpoint cannot tell "
                        "(default: the checkpoint's)")
    parser.add_argument("--dispersion", default="", help="add DFT-D3: d3bj or d3zero (pip install .[d3])")
    parser.add_argument("--xc", default="pbe", help="the functional of the training data, for --dispersion")
    parser.add_argument("--precision", default="float32-high", choices=PRECISIONS,
                        help="what the model computes in (orb.precision)")
    add_device_argument(parser)
    add_ops_profile_argument(parser)
    parser.add_argument("--progress_bar", choices=("auto", "true", "false"), default="auto",
                        help="auto: when the output is a terminal")
    return parser


def parse_arguments(argv: Optional[List[str]] = None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    args.data = args.data[0] if len(args.data) == 1 else args.data
    return args


def main(argv: Optional[List[str]] = None) -> int:
    from orb.signals import RESUME_FLAG, run_command

    def body() -> int:
        from orb.device import quiet_mindspore

        from orb.files import sole_writer

        quiet_mindspore()
        args = parse_arguments(argv)
        with sole_writer(args.output, "--output"):  # (another orb-md into it at the same time: refused)
            summary = md(args)
        done = sum(s["status"] == "done" for s in summary["structures"])
        print(f"{done} of {len(summary['structures'])} structures ran {args.steps} steps ({summary['model_calls']} "
              f"model calls); {os.path.join(args.output, 'summary.json')}")
        return 0 if done + sum(s["status"].startswith("stopped") for s in summary["structures"]) == \
            len(summary["structures"]) else 1

    return run_command(body, RESUME_FLAG)


if __name__ == "__main__":
    from orb.signals import run_program

    run_program(main)
