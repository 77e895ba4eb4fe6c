"""Batched relaxation: every structure of a data set relaxed with FIRE, many per compiled model call.

    orb-relax --checkpoint best_weights.ckpt --data candidates.extxyz --output relaxed.db [--cell]

Each structure keeps its own ASE ``FIRE`` optimizer (on the atoms, or with ``--cell`` on ASE's
``FrechetCellFilter`` of them), so every step is ASE's own arithmetic; only the model is batched:
the structures still relaxing are evaluated together in one padded, compiled call, a structure
leaves the batch when its forces are below ``--fmax`` (or after ``--steps`` steps) and the next
one enters. Each finished structure is written at once to the output ASE database (energy,
forces, stress, ``source_row``, ``relax_steps``, ``converged``), so a killed run continues with
``--resume``, which skips the rows already written; a summary (JSON) lists what did not converge.
"""

import argparse
import logging
import os
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

from orb.errors import OrbInputError, RunError
from orb.records import RUN_RECORD, SUMMARY
from orb.signals import out_of_space

log = logging.getLogger("orb")


@dataclass
class Relaxing:
    """One structure being relaxed: its atoms, their optimizer and the steps taken."""

    source_row: int
    atoms: object
    optimizer: object
    steps: int = 0
    force_error: Optional[np.ndarray] = None  # orb-v3: each atom's predicted force error at the last evaluation
    error: str = ""  # why this structure cannot go on (its graph, the model's or D3's numbers); the others do


def _optimizer(atoms, cell: bool, fmax: float, settings):
    """ASE's FIRE on the atoms, or with ``cell`` on ASE's FrechetCellFilter of them where the model sees a periodic
    structure with pbc set (a molecule stored with pbc and no cell has no stress: the filter failed on it), its
    strain along the periodic axes only (a slab's vacuum is kept)."""
    from ase.filters import FrechetCellFilter
    from ase.optimize import FIRE

    from orb.data.graphs import model_sees_periodic

    target = atoms
    if cell and atoms.pbc.any() and model_sees_periodic(atoms, settings):
        pbc = np.asarray(atoms.pbc, bool)
        target = FrechetCellFilter(atoms, mask=None if pbc.all() else np.outer(pbc, pbc))
    optimizer = FIRE(target, logfile=None)
    optimizer.fmax = fmax  # what Optimizer.run sets
    return optimizer


def read_output(output: str) -> Dict[int, Tuple[int, bool]]:
    """Every structure the output database holds: input row -> (steps, converged), read through one checked reader
    (at a resume's start and for its summary): a file that is no ASE database, or a row without orb-relax's keys
    (one written by hand or by another program; a traceback after the whole run, before), is one line naming it.
    An empty file holds nothing yet (SQLite's own reading of it)."""
    import sqlite3
    from urllib.parse import quote

    from orb.data.formats import SQLITE_MAGIC
    from orb.data.sqlite_rows import roll_back_unfinished_write

    if not os.path.exists(output) or os.path.getsize(output) == 0:
        return {}
    roll_back_unfinished_write(output)  # (a kill while a row was committed)
    advice = "; restore it, or start a new run in another --output"
    with open(output, "rb") as f:
        if f.read(len(SQLITE_MAGIC)) != SQLITE_MAGIC:
            raise OrbInputError(f"--output {output} is not an ASE SQLite database (another file, or one cut short)"
                                f"{advice}")
    try:
        with sqlite3.connect(f"file:{quote(os.path.abspath(output))}?mode=ro", uri=True) as connection:
            tables = {name for (name,) in connection.execute("SELECT name FROM sqlite_master WHERE type='table'")}
            if "systems" not in tables:
                if tables:
                    raise OrbInputError(f"--output {output} is an SQLite file but not an ASE database (no 'systems' "
                                        f"table){advice}")
                return {}
            rows = [row for (row,) in connection.execute("SELECT id FROM systems ORDER BY id")]
            found = connection.execute("SELECT id, key, value FROM number_key_values WHERE key IN "
                                       "('source_row', 'relax_steps', 'converged')").fetchall() if rows else []
    except sqlite3.DatabaseError as exc:
        raise OrbInputError(f"--output {output}: cannot read it as an ASE database ({exc}){advice}") from None
    values: Dict[int, Dict[str, float]] = {}
    for row, key, value in found:
        values.setdefault(row, {})[key] = value
    written = {}
    for row in rows:
        keys = values.get(row, {})
        missing = [k for k in ("source_row", "relax_steps", "converged") if k not in keys]
        if missing:
            raise OrbInputError(f"--output {output}, row {row}: key '{missing[0]}' is missing: a row orb-relax did "
                                f"not write{advice}")
        written[int(keys["source_row"])] = (int(keys["relax_steps"]), bool(keys["converged"]))
    return written


def companion(output: str, kind: str) -> str:
    """The file beside the output database that holds its run's ``kind`` (``relaxed.db`` -> ``relaxed.run.json``,
    ``relaxed.summary.json``, ``relaxed.uncertain.extxyz``)."""
    return os.path.splitext(os.path.abspath(output))[0] + "." + kind


COMPANIONS = (RUN_RECORD, SUMMARY, "uncertain.extxyz")
# what orb-relax adds (with orb.inference.runs.ORIGIN_KEYS: for data other than one ASE database, the file and its frame
# or row each structure came from)
OUTPUT_KEYS = ("source_row", "relax_steps", "converged", "predicted_force_error_max")


def check_output_name(output: str, resume: bool, overwrite: bool) -> None:
    """What the options say of the output, checked before MindSpore's import."""
    from orb.inference.runs import check_resume_and_overwrite

    check_resume_and_overwrite(resume, overwrite)
    if os.path.isdir(output):  # (with --resume it left its run.json beside the folder, then failed reading it)
        raise OrbInputError(f"--output {output} is a folder: name an ASE database file (relaxed.db)")
    if not output.endswith(".db"):  # (an .extxyz or .json name got an SQLite file, which ase.io could not read)
        raise OrbInputError(f"--output {output}: orb-relax writes an ASE SQLite database: name it with .db")


def check_output(output: str, resume: bool, overwrite: bool) -> None:
    """An existing output is continued (``--resume``) or replaced (``--overwrite``: with its run's settings,
    summary and uncertain frames), never silently mixed; a fresh output never meets an earlier run's frames. (Its
    name and options: :func:`check_output_name`, before MindSpore's import.)"""
    if os.path.exists(output) and not resume and not overwrite:
        raise OrbInputError(f"--output {output} exists: pass --resume to continue it or --overwrite to replace it")
    if resume and not os.path.exists(output):
        log.warning("--resume: %s holds no earlier run to continue: starting it", output)
    if os.path.exists(output + ".lock"):  # ASE's lock file of an earlier version's run killed mid-write: no one's
        os.remove(output + ".lock")
    if resume:
        return
    for path in [output] + [companion(output, kind) for kind in COMPANIONS]:
        if os.path.exists(path):
            os.remove(path)


# what a resume must not change (--steps may grow, not shrink, as orb-md's); what it may change, said (a resumed run
# relaxes the unfinished structures from their start, in other batches whatever the size: these only round them
# otherwise than an uninterrupted run would)
SETTINGS = ("steps", "fmax", "cell", "uncertain_above", "precision", "dispersion", "xc", "model", "batch_size")
SAID = ("batch_size", "ops_profile", "device_target")


class BatchRelaxer:
    """Relaxes structures with per-structure FIRE steps and one batched model call per step."""

    def __init__(self, model, fmax: float = 0.05, steps: int = 500, cell: bool = False, batch_size: int = 32,
                 dispersion=None):
        from orb.inference.predictor import Predictor

        self.model, self.fmax, self.max_steps, self.cell = model, fmax, steps, cell
        self.batch_size, self.dispersion = batch_size, dispersion
        self.predictor = Predictor(model)
        self.calls = 0

    def _evaluate(self, active: List[Relaxing]) -> None:
        """The model (and dispersion) on every active structure at once; the results attached to each."""
        from ase.calculators.singlepoint import SinglePointCalculator

        from orb.data.batching import batch_graphs
        from orb.data.graphs import atoms_to_graph, model_sees_periodic
        from orb.inference.predictor import per_structure
        from orb.inference.runs import first_line, made_not_finite
        from orb.inference.uncertainty import per_atom_error

        settings = self.model.cfg.graph_settings()
        graphs = []
        for r in active:
            made = made_not_finite(r.atoms)
            if made:  # (the input was checked before the first step: FIRE's own arithmetic)
                r.error = f"step {r.steps}: FIRE made its {made} NaN or inf"
                continue
            try:
                graph = atoms_to_graph(r.atoms, settings=settings, float64=self.predictor.float64)
            except OrbInputError as exc:  # positions or cell no longer finite, atoms on top of each other
                r.error = f"step {r.steps}: {exc}"
                continue
            except Exception as exc:  # anything else about this structure: it stops, the others go on
                r.error = f"step {r.steps}: its graph: {first_line(exc)}"
                continue
            graphs.append(graph)
        evaluated = [r for r in active if not r.error]
        if not evaluated:
            return
        try:
            out = self.predictor(batch_graphs(graphs))
        except Exception as exc:  # every structure of the call is told (one line each); none is written
            for r in evaluated:
                r.error = f"step {r.steps}: the model failed: {first_line(exc)}"
            return
        self.calls += 1
        periodic = [model_sees_periodic(r.atoms, settings) for r in evaluated]  # (a molecule's stress is none)
        for r, results in zip(evaluated, per_structure(out, [len(r.atoms) for r in evaluated], periodic)):
            confidence = results.pop("confidence", None)
            if confidence is not None:
                r.force_error = per_atom_error(confidence)
            if self.dispersion is not None:
                try:
                    d3 = self.dispersion(r.atoms)
                except OrbInputError as exc:
                    r.error = f"step {r.steps}: {exc}"
                    continue
                except Exception as exc:  # e.g. an element dftd3 has no parameters for: this structure
                    r.error = f"step {r.steps}: dispersion: {first_line(exc)}"
                    continue
                results = {key: results[key] + d3[key] for key in results}
            if not all(np.all(np.isfinite(results[key])) for key in results):
                r.error = f"step {r.steps}: the model's energy, forces or stress are not finite"
                continue
            r.atoms.calc = SinglePointCalculator(r.atoms, free_energy=results["energy"], **results)

    def run(self, structures, on_done, stop: Callable[[], bool] = lambda: False,
            on_failed: Optional[Callable] = None) -> None:
        """Relax ``structures`` (an iterable of ``(source_row, atoms)``); ``on_done(relaxing, converged)`` is
        called for each as it finishes, ``on_failed(relaxing)`` for one that cannot go on (``relaxing.error``
        says why; without ``on_failed`` that ends the run). Returns early, between two steps, once ``stop()`` is
        true (a stop signal): the structures still relaxing are left for a resumed run."""
        with warnings.catch_warnings():  # (scipy's logm in FrechetCellFilter, at every step of a cell relaxation:
            warnings.filterwarnings("ignore", message="logm result may be inaccurate")  # hundreds of lines, 1e-13)
            self._run(iter(structures), on_done, stop, on_failed)

    def _run(self, queue, on_done, stop, on_failed) -> None:
        active: List[Relaxing] = []
        while not stop():
            while len(active) < self.batch_size:
                item = next(queue, None)
                if item is None:
                    break
                row, atoms = item
                active.append(Relaxing(row, atoms, _optimizer(atoms, self.cell, self.fmax,
                                                              self.model.cfg.graph_settings())))
            if not active:
                return
            self._evaluate(active)
            still = []
            for r in active:
                if r.error:
                    if on_failed is None:
                        raise RunError(f"structure {r.source_row}: {r.error}")
                    on_failed(r)
                    continue
                gradient = r.optimizer.optimizable.get_gradient()
                if r.optimizer.gradient_converged(gradient):
                    on_done(r, True)
                elif r.steps >= self.max_steps:
                    on_done(r, False)
                else:
                    r.optimizer.step()
                    r.steps += 1
                    still.append(r)
            active = still


def relax(args) -> Dict:
    from orb.files import refuse_overwriting_inputs
    from orb.inference.dispersion import check_dispersion

    for flag, wrong, rule in (("--fmax", not (np.isfinite(args.fmax) and args.fmax > 0), "a finite number > 0"),
                              ("--steps", args.steps < 0, ">= 0"), ("--batch_size", args.batch_size < 1, ">= 1")):
        if wrong:  # (the options checked before MindSpore's 1 s import)
            raise OrbInputError(f"{flag} must be {rule}, got {getattr(args, flag[2:])}")
    refuse_overwriting_inputs([("--output", args.output, None)] +
                              [("--output's record", companion(args.output, kind), None) for kind in COMPANIONS],
                              [("--data", args.data), ("--checkpoint", args.checkpoint)])
    check_dispersion(args.dispersion, args.xc)
    check_output_name(args.output, args.resume, args.overwrite)
    from orb.device import import_mindspore

    import_mindspore()  # then what the other imports need, with a stop signal honoured after it
    import sqlite3

    import ase.db
    from tqdm import tqdm

    from orb.data.dataset import AseDbDataset
    from orb.data.formats import LabelKeys, readable_database, storable_pairs, without_labels
    from orb.device import configure_mindspore, set_ops_profile
    from orb.files import check_run_settings, remove_stale_temporaries, write_json
    from orb.inference.runs import ORIGIN_KEYS, origin_keys, run_settings, total_charge_and_spin
    from orb.inference.dispersion import D3Dispersion, check_dispersion_elements, check_dispersion_for
    from orb.inference.uncertainty import UncertainFrames, check_threshold
    from orb.io.checkpoint import model_from_checkpoint
    from orb.signals import RESUME_FLAG, STOP, STOPPED_STATUS, Stopped

    configure_mindspore(args.device_target, precision=args.precision)
    set_ops_profile(args.ops_profile)
    model = model_from_checkpoint(args.checkpoint, args.model)
    if args.cell and not model.cfg.has_stress:  # its stress would be zeros: the cell would never move
        raise OrbInputError(f"--cell needs stress, and {model.cfg.name} predicts none (no stress head)")
    keys = LabelKeys(charge=args.charge_key, spin=args.spin_key, labels=False)
    data = AseDbDataset(readable_database(args.data, keys), require_labels=False, labels=False,
                        settings=model.cfg.graph_settings(), charge_spin=model.cfg.omol,
                        charge_spin_keys=(keys.charge, keys.spin))
    data.census()  # every row checked before the first step (OMol models: each row's charge and spin), named if bad
    check_dispersion_for(model.cfg, args.dispersion)
    check_dispersion_elements(data, args.dispersion)
    check_threshold(model.cfg, args.uncertain_above)
    try:
        check_output(args.output, args.resume, args.overwrite)  # after every check: --overwrite deletes the old one
        remove_stale_temporaries(os.path.dirname(os.path.abspath(args.output)), min_age=600.0)  # a killed summary's
        record = companion(args.output, "run.json")
        earlier = read_output(args.output) if args.resume else {}
        pending = check_run_settings(record, run_settings(args, SETTINGS, model, data), args.resume, args.output,
                                     informational=("checkpoint",), may_grow=("steps",), said=SAID,
                                     required=bool(earlier))
    except OSError as exc:  # a read-only folder (a full disk: the command's own line, status 1)
        if out_of_space(exc):
            raise
        raise OrbInputError(f"--output {args.output}: cannot write there ({exc.strerror or exc})") from None
    done = set(earlier)
    todo = [i for i in range(len(data)) if int(data.ids[i]) not in done]
    uncertain = (UncertainFrames(os.path.dirname(os.path.abspath(args.output)),
                                 os.path.basename(companion(args.output, "uncertain.extxyz")))
                 if args.uncertain_above is not None else None)
    if uncertain is not None and args.resume:
        uncertain.keep_rows(done)  # (read, and refused if it cannot be, before anything is written)
    if pending is not None:
        write_json(record, pending)
    dispersion = D3Dispersion(args.dispersion, args.xc, model.cfg.graph_settings()) if args.dispersion else None
    relaxer = BatchRelaxer(model, args.fmax, args.steps, args.cell, args.batch_size, dispersion)
    show = sys.stderr.isatty() if args.progress_bar == "auto" else args.progress_bar == "true"

    def structures():
        for i in todo:
            atoms = data.get_atoms(i, say_dropped=True)
            atoms.calc = None
            atoms.info = without_labels(atoms.info)  # the input's labels are not the relaxed structure's
            atoms.info.update(total_charge_and_spin(data, i, model.cfg.omol))
            yield int(data.ids[i]), atoms

    start = time.perf_counter()
    # outside a `with` block every write is its own transaction; SQLite's own locking only (ASE's lock file, left by a
    # kill mid-write, made every later start wait for it forever, a stop signal deferred meanwhile)
    db = ase.db.connect(args.output, type="db", use_lock_file=False)
    written, failures, origin = [], {}, origin_keys(data)
    with STOP.deferred(), tqdm(total=len(todo), desc="relaxing", disable=not show) as bar:
        def finish(r: Relaxing, converged: bool) -> None:
            extra = {} if r.force_error is None else {"predicted_force_error_max": float(r.force_error.max())}
            mine = dict(source_row=r.source_row, **origin(r.source_row), relax_steps=r.steps, converged=converged,
                        **extra)
            # the input's own attributes (total charge and spin, which an OMol model reads next; config_type ...)
            pairs = dict(storable_pairs(r.atoms.info, skip=OUTPUT_KEYS + ORIGIN_KEYS), **mine)
            if uncertain is not None and extra and extra["predicted_force_error_max"] > args.uncertain_above:
                uncertain.add(r.atoms, r.force_error, source=str(args.data), source_row=r.source_row,
                              **origin(r.source_row),
                              relax_steps=r.steps)  # before its row: a resume drops it unless the row was written
            try:
                db.write(r.atoms, key_value_pairs=pairs)  # committed now
            except (OSError, sqlite3.Error) as exc:  # a full disk: the rows written before stay
                raise RunError(f"could not write to {args.output} ({exc}); its {len(done) + len(written)} structures "
                               "written before are kept: free space, then run again with --resume") from None
            written.append(r.source_row)
            bar.update(1)

        def failed(r: Relaxing) -> None:  # not written: a resume tries it again; the summary names it
            failures[r.source_row] = r.error
            print(f"{data.where(r.source_row)} stopped: {r.error}", file=sys.stderr)  # its file and frame, or row
            bar.update(1)

        relaxer.run(structures(), finish, stop=lambda: STOP.received is not None, on_failed=failed)
    seconds = time.perf_counter() - start
    results = read_output(args.output)
    not_converged = sorted(row for row, (_, converged) in results.items() if not converged)
    summary = {"input": args.data, "output": os.path.abspath(args.output), "checkpoint": args.checkpoint,
               "fmax": args.fmax, "max_steps": args.steps, "cell": args.cell, "dispersion": args.dispersion or None,
               "precision": args.precision, "uncertain": 0 if uncertain is None else uncertain.count,
               "structures": len(results), "relaxed_now": len(written), "already_done": len(done),
               "remaining": len(todo) - len(written), "converged": len(results) - len(not_converged),
               "failed_rows": {str(row): error for row, error in sorted(failures.items())},
               **({"failed_sources": {str(row): data.where(row) for row in sorted(failures)}} if data.sources else {}),
               "not_converged_rows": not_converged,
               "mean_steps": float(np.mean([s for s, _ in results.values()])) if results else 0.0,
               "model_calls": relaxer.calls, "seconds": seconds,
               "structures_per_second": len(written) / seconds if seconds > 0 else 0.0}
    summary_path = companion(args.output, "summary.json")
    try:
        write_json(summary_path, summary)
    except OSError as exc:
        raise RunError(f"could not write {summary_path} ({exc.strerror or exc}); the {len(results)} relaxed "
                       f"structures are kept in {args.output}") from None
    if STOP.received is not None:
        raise Stopped(f"stopped by {STOP.received} after {len(written)} of {len(todo)} structures; the "
                      f"{len(results)} finished ones are kept in {args.output}: {RESUME_FLAG} "
                      f"(exit status {STOPPED_STATUS})")
    return summary


def main(argv: Optional[List[str]] = None) -> int:
    from orb.signals import RESUME_FLAG, run_command

    return run_command(lambda: parse_and_relax(argv), RESUME_FLAG)


def parse_and_relax(argv: Optional[List[str]]) -> int:
    args = build_parser().parse_args(argv)
    from orb.files import sole_writer

    args.data = args.data[0] if len(args.data) == 1 else args.data
    with sole_writer(args.output, "--output"):  # (another orb-relax into it at the same time: refused)
        summary = relax(args)
    print(f"relaxed {summary['relaxed_now']} structures in {summary['seconds']:.1f} s "
          f"({summary['structures_per_second']:.2f}/s, {summary['model_calls']} model calls); {args.output} holds "
          f"{summary['structures']}: {summary['converged']} converged, {len(summary['not_converged_rows'])} not "
          f"within {args.steps} steps" + (f"; {len(summary['failed_rows'])} stopped by an error (see above; not "
                                           "written)" if summary["failed_rows"] else ""))
    if args.uncertain_above is not None:
        print(uncertain_line(summary["uncertain"], args.uncertain_above, companion(args.output, "uncertain.extxyz")))
    return 1 if summary["failed_rows"] else 0


def uncertain_line(count: int, threshold: float, path: str) -> str:
    """What --uncertain_above collected (the file was written in silence, its count only in the summary)."""
    past = f"past --uncertain_above {threshold:g} eV/Å (the predicted force error, largest over the atoms)"
    if not count:
        return f"no relaxed structure {past}: {path} holds none"
    return f"{path} holds {count} relaxed structure{'s' if count > 1 else ''} {past}"


def build_parser(prog: Optional[str] = None) -> argparse.ArgumentParser:
    """orb-relax's options."""
    from orb.bundled import command_path
    from orb.commands import HelpFormatter, Parser
    from orb.device import add_device_argument, add_ops_profile_argument
    from orb.inference.runs import add_charge_spin_keys
    from orb.precision import PRECISIONS

    parser = Parser(prog=prog, allow_abbrev=False, description=__doc__.split("\n\n")[0],
                                     formatter_class=HelpFormatter)
    parser.add_argument("--checkpoint", required=True, type=command_path, help="PyTorch or MindSpore orb checkpoint")
    parser.add_argument("--data", required=True, nargs="+", help="structures to relax: ASE SQLite, extxyz or any "
                        "ase.io file, .aselmdb, a folder, or several of these", type=command_path)
    add_charge_spin_keys(parser)
    parser.add_argument("--output", required=True, help="ASE SQLite database of the relaxed structures")
    parser.add_argument("--fmax", type=float, default=0.05, help="converged when every force (and with --cell "
                        "every cell force) is below this, eV/Å")
    parser.add_argument("--steps", type=int, default=500, help="FIRE steps at most per structure")
    parser.add_argument("--cell", action="store_true", help="relax the cell too, along its periodic axes (ASE's "
                        "FrechetCellFilter)")
    parser.add_argument("--batch_size", type=int, default=32, help="structures relaxing together")
    parser.add_argument("--resume", action="store_true", help="continue an existing output (skip its rows)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output")
    parser.add_argument("--model", default=None, help="model name, when the checkpoint cannot tell "
                        "(default: the checkpoint's)")
    parser.add_argument("--dispersion", default="", help="add DFT-D3 dispersion: d3bj or d3zero (pip install .[d3])")
    parser.add_argument("--xc", default="pbe", help="the functional of the training data, for --dispersion")
    add_device_argument(parser)
    add_ops_profile_argument(parser)
    parser.add_argument("--precision", default="float32-high", choices=PRECISIONS,
                        help="what the model computes in (orb.precision; float64 for tight relaxations, CPU)")
    parser.add_argument("--uncertain_above", type=float, default=None,
                        help="orb-v3: relaxed structures whose predicted force error (the confidence head's, largest "
                        "over the atoms) passes this many eV/Å also go to OUTPUT.uncertain.extxyz")
    parser.add_argument("--progress_bar", choices=("auto", "true", "false"), default="auto",
                        help="auto: when the output is a terminal")
    return parser


if __name__ == "__main__":
    from orb.signals import run_program

    run_program(main)
