"""Check the physics after fine-tuning: lattice, equation of state, elastic constants and phonons, fine-tuned
model against its foundation.

    orb-properties --checkpoint best_weights.ckpt --reference orb_v3_conservative_inf_omat --output properties

For each structure (``--structures``, or each element's reference crystal: the elements of ``--elements`` or of the
checkpoint's training data), with the fine-tuned model and with ``--reference``: the relaxed cell (FIRE on ASE's
FrechetCellFilter, as orb-relax), the equation of state (Birch-Murnaghan over ±5 % in volume: E0, V0, B), the
elastic tensor (central differences of the stress over ±0.5 % and ±1 % strains), and phonons with phonopy (a
mesh's lowest frequency and imaginary modes, the bands along the standard path), then the differences fine-tuned
minus reference, and against DFT values given with ``--dft``. The many single points (strained, scaled and
displaced cells) are computed in batches through the compiled predictor. Writes ``properties.json``,
``phonons_<structure>.npz``, ``eos_<structure>.png`` and ``bands_<structure>.png`` into ``--output`` and prints
one table per structure. Each structure's report says when a 20-neighbour model's graph of it depends on how tied
neighbours are chosen.
"""

import argparse
import math
import os
import shutil
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Dict, List, Optional

from orb.errors import OrbInputError
from orb.files import owner_gone, owner_tag


@dataclass
class Engine:
    """One model and what computes with it."""

    label: str
    path: str
    model: object
    relaxer: object  # BatchRelaxer, cell relaxed
    points: object  # SinglePoints sharing the relaxer's predictor (its compiled shapes)

    @property
    def settings(self):
        return self.model.cfg.graph_settings()


def load_engine(label: str, path: str, name: Optional[str], args) -> Engine:
    from orb.inference.mechanics import SinglePoints
    from orb.inference.relax import BatchRelaxer
    from orb.io.checkpoint import model_from_checkpoint

    model = model_from_checkpoint(path, name)
    if not model.cfg.has_stress:
        raise OrbInputError(f"{path}: {model.cfg.name} predicts no stress; cells, equations of state and elastic "
                            "constants need it")
    relaxer = BatchRelaxer(model, args.fmax, args.steps, cell=True, batch_size=args.batch_size)
    return Engine(label, path, model, relaxer, SinglePoints(model, args.batch_size, relaxer.predictor))


def stop_now() -> None:
    """Between two batches: a stop signal ends the command (nothing is written before the end)."""
    from orb.signals import STOP, STOPPED_STATUS, Stopped

    if STOP.received is not None:
        raise Stopped(f"stopped by {STOP.received}: nothing written; run the same command again "
                      f"(exit status {STOPPED_STATUS})")


def choose_structures(args, engines: List[Engine]):
    """The structures to check -- the user's (``--structures``), the built-in crystals of ``--elements``, both, or
    without either the built-in crystals of the elements the checkpoint was trained on -- and notes for the
    report."""
    from orb.inference import crystals

    own = crystals.read_structures(args.structures) if args.structures else []
    if own and not args.elements:
        return own, []
    built, notes = built_in_structures(args, engines, args.elements or crystals.trained_elements(args.checkpoint))
    return own + built, notes


def built_in_structures(args, engines: List[Engine], elements: List[str]):
    """Each element's reference crystal, and its tie-free hcp companion where a model's cap ties the crystal's
    neighbours, each repeated so that every model's graph holds its whole neighbourhood."""
    from orb.inference import crystals

    chosen, notes = crystals.element_crystals(elements)
    for structure in list(chosen):
        tied = any(crystals.cap_ties(structure.atoms, e.settings, args.tie_tolerance)["tied"] for e in engines)
        if tied and not structure.name.endswith("_hcp"):
            companion = crystals.close_packed_companion(structure)
            chosen.insert(chosen.index(structure) + 1, companion)
            notes.append(f"{structure.name} ties neighbours at a model's cap: {companion.name} (same volume per atom, "
                         "no ties) added")
    for structure in chosen:
        structure.repeat = crystals.repeat_of(*[crystals.whole_neighbourhood_repeat(structure.atoms, e.settings)
                                                for e in engines])
        structure.atoms = structure.atoms.repeat(structure.repeat)
    if not chosen:
        raise OrbInputError("no built-in crystal for " + ", ".join(elements) + ": give --structures")
    return chosen, notes


def relaxed_structures(engine: Engine, structures, bar) -> List[Dict]:
    """Every structure relaxed together, cell and atoms (orb-relax's BatchRelaxer): atoms, converged, steps."""
    from orb.inference.mechanics import relax_all
    from orb.signals import STOP

    found = relax_all(engine.relaxer, [s.atoms for s in structures], stop=lambda: STOP.received is not None)
    stop_now()
    bar.update(len(structures))
    for item in found:
        item["atoms"].calc = None
    return found


def equations_of_state(engine: Engine, relaxed: List[Dict], args, bar) -> List[Dict]:
    """Each relaxed structure's equation of state (its volumes of every structure in the same batches), with the
    relaxed structure's own single point (``base``: its neighbour fingerprint, which the strained cells compare
    with)."""
    from orb.inference.mechanics import fit_eos, scaled_cells

    groups = [[r["atoms"]] + scaled_cells(r["atoms"], args.eos_span, args.eos_points) for r in relaxed]
    results = engine.points([c for g in groups for c in g], keys=True, stop=stop_now, progress=bar.update)
    out, start = [], 0
    for group in groups:
        mine, start = results[start:start + len(group)], start + len(group)
        eos = fit_eos([c.get_volume() for c in group[1:]], [m["energy"] for m in mine[1:]], len(group[0]))
        eos["neighbour_sets_changed"] = [m["neighbours"] != mine[0]["neighbours"] for m in mine[1:]]
        out.append(dict(eos, base=mine[0]))
    return out


def elastic_tensors(engine: Engine, relaxed: List[Dict], bases: List[Dict], args, bar) -> List[Dict]:
    """Each relaxed structure's elastic tensor: the strained cells of every structure batched (with
    ``--relax_ions`` relaxed together first)."""
    from orb.inference.mechanics import (bulk_modulus_voigt, elastic_tensor, relax_all, smallest_stiffness,
                                         strained_cells)
    from orb.inference.relax import BatchRelaxer
    from orb.signals import STOP

    groups = [strained_cells(r["atoms"], args.strains) for r in relaxed]
    cells = [c for g in groups for c in g]
    if args.relax_ions:  # (their own step limit: --steps 0 takes the structures as given, not the strained cells)
        ions = BatchRelaxer(engine.model, args.fmax, args.ion_steps, cell=False, batch_size=args.batch_size)
        ions.predictor = engine.points.predictor
        done = relax_all(ions, cells, stop=lambda: STOP.received is not None)
        engine.relaxer.calls += ions.calls  # counted with the relaxations
        stop_now()
        bar.update(len(cells))
        results = [{"stress": d["stress"], "neighbours": None, "converged": d["converged"], "steps": d["steps"]}
                   for d in done]
    else:
        results = engine.points(cells, keys=True, stop=stop_now, progress=bar.update)
    out, start = [], 0
    for group, base in zip(groups, bases):
        mine, start = results[start:start + len(group)], start + len(group)
        c = elastic_tensor([m["stress"] for m in mine], args.strains)
        out.append({"C": c.tolist(), "bulk_modulus_voigt": bulk_modulus_voigt(c),
                    "smallest_stiffness": smallest_stiffness(c), "strains": list(args.strains),
                    "relax_ions": bool(args.relax_ions),
                    "ion_relaxation": ion_relaxation(mine, args) if args.relax_ions else None,
                    "neighbour_sets_changed": None if args.relax_ions else
                    [m["neighbours"] != base["neighbours"] for m in mine]})
    return out


def ion_relaxation(results: List[Dict], args) -> Dict:
    """How the ions of one structure's strained cells relaxed: the step limit, the most steps taken and the strains
    (``strain_labels``) whose relaxation did not converge, which the report names."""
    from orb.inference.mechanics import strain_labels

    labels = strain_labels(args.strains)
    return {"fmax": args.fmax, "step_limit": args.ion_steps, "most_steps": max(r["steps"] for r in results),
            "unconverged": [label for label, r in zip(labels, results) if not r["converged"]]}


def phonon_spectra(engine: Engine, structures, relaxed: List[Dict], args, bar) -> List[Dict]:
    """Each relaxed structure's phonons: phonopy's supercells of every structure batched."""
    from orb.inference.crystals import unit_of
    from orb.inference.phonons import PhononJob, automatic_supercell, band_axis

    jobs = []
    for structure, r in zip(structures, relaxed):
        unit = unit_of(r["atoms"], structure.repeat)
        size = args.supercell * 3 if len(args.supercell) == 1 else args.supercell
        with warnings.catch_warnings():  # phonopy's note that primitive_matrix "auto" is its new default
            warnings.simplefilter("ignore")
            jobs.append(PhononJob(unit, size or automatic_supercell(unit), args.displacement, args.symprec))
    groups = [job.cells() for job in jobs]
    bar.total += sum(len(g) for g in groups)
    bar.refresh()
    results = engine.points([c for g in groups for c in g], keys=True, stop=stop_now, progress=bar.update)
    out, start = [], 0
    for job, group in zip(jobs, groups):
        mine, start = results[start:start + len(group)], start + len(group)
        job.force_constants([m["forces"] for m in mine])
        found = job.mesh(args.mesh, args.imaginary_below)
        path = job.band_path(args.band_points)
        found.update(supercell=job.supercell, displacements=len(group) - 1, supercell_atoms=len(group[0]),
                     neighbour_sets_changed=[m["neighbours"] != mine[0]["neighbours"] for m in mine[1:]],
                     bands=job.bands(path), band_path=None if path is None else path.path,
                     band_axis=None if path is None else band_axis(path))
        out.append(found)
    return out


def compute(engine: Engine, structures, args, show: bool) -> List[Dict]:
    """Every property of every structure with one model: each kind of cell batched over all the structures."""
    from tqdm import tqdm

    from orb.inference.crystals import cap_ties
    from orb.inference.mechanics import lattice

    n = len(structures)
    total = n + n * (1 + args.eos_points) + n * 12 * len(args.strains)
    label = engine.label.replace("_", "-")
    said = (lambda what: None) if show else (lambda what: print(f"{label}: {what}", file=sys.stderr, flush=True))
    with tqdm(total=total, desc=label, disable=not show) as bar:  # (without the bar, a line per phase: a job log
        said(f"relaxing {n} structure(s)")  # shows where a long run is)
        relaxed = relaxed_structures(engine, structures, bar)
        said("equations of state")
        eos = equations_of_state(engine, relaxed, args, bar)
        said("elastic tensors")
        elastic = elastic_tensors(engine, relaxed, [e.pop("base") for e in eos], args, bar)
        if not args.no_phonons:
            said("phonons")
        phonons = phonon_spectra(engine, structures, relaxed, args, bar) if not args.no_phonons else [None] * n
    out = []
    for structure, r, e, c, p in zip(structures, relaxed, eos, elastic, phonons):
        ties = cap_ties(r["atoms"], engine.settings, args.tie_tolerance)
        capped = ties["at_cap"] > 0
        counts = {kind: (None if found is None or found["neighbour_sets_changed"] is None or not capped else
                         f"{sum(found['neighbour_sets_changed'])}/{len(found['neighbour_sets_changed'])}")
                  for kind, found in (("eos", e), ("elastic", c), ("phonons", p))}
        out.append({"relaxation": {"converged": r["converged"], "steps": r["steps"]},
                    "lattice": lattice(r["atoms"], structure.repeat), "eos": e, "elastic": c, "phonons": p,
                    "neighbours": {"ties": ties, "changed": counts}, "relaxed_atoms": r["atoms"]})
    return out


def remove_stale_staging(output: str) -> None:
    """The staging and replaced folders of runs killed on this host (their process gone): a kill left them for good. A
    replaced output whose replacement never arrived (killed between :func:`publish`'s two renames) is put back."""
    folder, prefix = os.path.dirname(output), f".{os.path.basename(output)}."
    for name in os.listdir(folder) if os.path.isdir(folder) else []:
        kind, _, owner = name[len(prefix):].partition("-")
        if not name.startswith(prefix) or kind not in ("partial", "old") or not owner_gone(owner):
            continue
        if kind == "old" and not os.path.exists(output):
            os.rename(os.path.join(folder, name), output)
        else:
            shutil.rmtree(os.path.join(folder, name), ignore_errors=True)


def prepare_output(args) -> str:
    """A fresh staging folder beside ``--output`` (renamed into place when everything is written, so that an output
    is whole or absent); an existing output is refused unless ``--overwrite``, and never one holding an input."""
    output = os.path.abspath(args.output)
    if os.path.exists(output) and not os.path.isdir(output):
        raise OrbInputError(f"--output {args.output} is a file: name a folder")
    if os.path.exists(output) and not args.overwrite:
        raise OrbInputError(f"--output {args.output} exists: pass --overwrite to replace it")
    inputs = [args.checkpoint, args.reference, args.dft] + list(args.structures or [])
    for path in filter(None, inputs):
        if os.path.exists(path) and os.path.commonpath([output, os.path.abspath(path)]) == output:
            raise OrbInputError(f"--output {args.output} holds the input {path}: choose another folder")
    staging = os.path.join(os.path.dirname(output), f".{os.path.basename(output)}.partial-{owner_tag()}")
    remove_stale_staging(output)
    try:
        shutil.rmtree(staging, ignore_errors=True)
        os.makedirs(staging)
    except OSError as exc:
        raise OrbInputError(f"--output {args.output}: cannot write there ({exc.strerror or exc})") from None
    return staging


def publish(staging: str, output: str) -> None:
    """The staging folder becomes ``output``; an earlier output (``--overwrite``) is replaced whole."""
    output = os.path.abspath(output)
    old = None
    if os.path.exists(output):
        old = os.path.join(os.path.dirname(output), f".{os.path.basename(output)}.old-{owner_tag()}")
        os.rename(output, old)
    os.rename(staging, output)
    if old:
        shutil.rmtree(old, ignore_errors=True)


def check_arguments(args) -> None:
    """Bad numbers, a missing phonopy (before any work) and files that are not there: one line each."""
    from orb.inference.phonons import require_phonopy
    from orb.io.checkpoint import check_checkpoint_file

    if not args.no_phonons:
        require_phonopy()
    if args.eos_points < 5 or not 0 < args.eos_span < 0.5:
        raise OrbInputError("--eos_points must be at least 5 and --eos_span within (0, 0.5)")
    if not args.strains or any(not 0 < s < 0.1 for s in args.strains) or len(set(args.strains)) < len(args.strains):
        raise OrbInputError("--strains must be distinct amplitudes within (0, 0.1)")
    if args.supercell and (len(args.supercell) not in (1, 3) or min(args.supercell) < 1 or max(args.supercell) > 16):
        raise OrbInputError("--supercell takes one or three integers from 1 to 16")
    if not 1 <= args.mesh <= 100 or not 2 <= args.band_points <= 10 ** 4:  # (N^3 q-points: bounded memory)
        raise OrbInputError("--mesh must be from 1 to 100 and --band_points from 2 to 10000")
    if args.ion_steps < 1:  # (0 would take every strained cell as given: clamped ions, recorded as relaxed)
        raise OrbInputError(f"--ion_steps must be at least 1, got {args.ion_steps}")
    if not 0 < args.displacement < 0.5 or args.batch_size < 1 or args.steps < 0 \
            or not 0 < args.fmax < math.inf:
        raise OrbInputError("--displacement within (0, 0.5) Å, --batch_size at least 1, --steps >= 0 and --fmax a "
                            "finite number > 0")
    if not 0 < args.symprec < 1:  # (phonopy crashed the process on a negative one, after every relaxation)
        raise OrbInputError(f"--symprec must be within (0, 1) Å, got {args.symprec}")
    if not 0 <= args.imaginary_below < math.inf:  # (a negative one flagged real modes; nan flagged none)
        raise OrbInputError(f"--imaginary_below must be a finite number >= 0 THz, got {args.imaginary_below}")
    if not 0 <= args.tie_tolerance < math.inf:  # (nan or a negative one found no ties, where there were)
        raise OrbInputError(f"--tie_tolerance must be a finite number >= 0 Å, got {args.tie_tolerance}")
    check_checkpoint_file(args.checkpoint, "--checkpoint")
    if args.reference:
        check_checkpoint_file(args.reference, "--reference")
    for path in list(args.structures or []) + ([args.dft] if args.dft else []):
        if not os.path.exists(path):
            raise OrbInputError(f"{path}: no such file")


def run(args) -> Dict:
    from orb.device import configure_mindspore, import_mindspore, set_ops_profile

    import_mindspore()  # first, a stop signal held: the checks import the checkpoint reader, which imports MindSpore
    check_arguments(args)  # phonopy before any work
    staging = prepare_output(args)
    from orb.reports.properties import read_dft, report, write_outputs
    from orb.signals import STOP

    try:
        target = configure_mindspore(args.device_target, precision=args.precision)
        set_ops_profile(args.ops_profile)
        engines = [load_engine("fine_tuned", args.checkpoint, args.model, args)]
        if args.reference:
            engines.append(load_engine("reference", args.reference, args.reference_model, args))
        structures, notes = choose_structures(args, engines)
        dft = read_dft(args.dft, [s.name for s in structures]) if args.dft else {}
        show = sys.stderr.isatty() if args.progress_bar == "auto" else args.progress_bar == "true"
        start, computed, speed = time.perf_counter(), {}, {}
        with STOP.deferred():
            for engine in engines:
                computed[engine.label] = compute(engine, structures, args, show)
                speed[engine.label] = {"single_points": engine.points.structures, "model_calls": engine.points.calls,
                                       "relaxation_calls": engine.relaxer.calls}
        entries = report(structures, notes, computed, dft)
        run_info = {"checkpoint": args.checkpoint, "reference": args.reference or None, "precision": args.precision,
                    "device_target": target, "notes": notes, "seconds": time.perf_counter() - start,
                    "calls": speed, "settings": {key: getattr(args, key) for key in SETTINGS}}
        write_outputs(staging, entries, run_info)
        publish(staging, args.output)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return {"structures": entries, "notes": notes, "seconds": run_info["seconds"]}


SETTINGS = ("fmax", "steps", "eos_points", "eos_span", "strains", "relax_ions", "ion_steps", "displacement",
            "supercell", "mesh", "imaginary_below", "symprec", "tie_tolerance", "no_phonons", "batch_size")


def main(argv: Optional[List[str]] = None) -> int:
    from orb.signals import run_command

    return run_command(lambda: parse_and_run(argv))  # a stop ends it, 75: nothing to continue


def parse_and_run(argv: Optional[List[str]]) -> int:
    from orb.device import quiet_mindspore

    quiet_mindspore()
    from orb.reports.properties import print_report

    args = build_parser().parse_args(argv)
    print_report(run(args), args.output)
    return 0


def build_parser(prog: Optional[str] = None) -> argparse.ArgumentParser:
    """orb-properties' options."""
    from orb.bundled import command_path
    from orb.commands import HelpFormatter, Parser
    from orb.device import add_device_argument, add_ops_profile_argument
    from orb.precision import PRECISIONS

    parser = Parser(prog=prog, allow_abbrev=False, description=__doc__.split("\n\n")[0],
                                     formatter_class=HelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="the fine-tuned model: a checkpoint file or published "
                        "weights by name", type=command_path)
    parser.add_argument("--reference", default="", help="the model to compare with, usually the foundation: a "
                        "published name (orb_v3_conservative_inf_omat) or any checkpoint", type=command_path)
    parser.add_argument("--structures", nargs="+", default=None, help="crystals to check, in any format orb-relax "
                        "reads (default: each element's reference crystal, see --elements)", type=command_path)
    parser.add_argument("--elements", nargs="+", default=None, help="elements whose reference crystals (fcc, bcc, "
                        "hcp, diamond; ASE's lattice constants) are checked too (default: without --structures, the "
                        "elements of the checkpoint's training data)")
    parser.add_argument("--output", required=True, help="folder for properties.json, the arrays and the plots")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --output folder whole")
    parser.add_argument("--dft", default="", help="DFT values per structure to compare with: JSON or CSV (names: "
                        "a, b, c, volume_per_atom, B, C11 ... C66, lowest_frequency, max_frequency)")
    parser.add_argument("--model", default=None, help="model name of --checkpoint when the file cannot tell "
                        "(default: the checkpoint's)")
    parser.add_argument("--reference_model", default=None, help="model name of --reference when the file cannot "
                        "tell (default: the reference checkpoint's)")
    parser.add_argument("--fmax", type=float, default=0.001, help="relaxations converge below this force (and cell "
                        "force), eV/Å")
    parser.add_argument("--steps", type=int, default=500, help="FIRE steps at most per relaxation; 0: the "
                        "structures as given")
    parser.add_argument("--eos_points", type=int, default=7, help="volumes of the equation of state")
    parser.add_argument("--eos_span", type=float, default=0.05, help="the equation of state's volumes span ± this "
                        "fraction of the relaxed volume")
    parser.add_argument("--strains", type=float, nargs="+", default=[0.005, 0.01], help="strain amplitudes of the "
                        "elastic tensor (each ±; two are Richardson-extrapolated)")
    parser.add_argument("--relax_ions", action="store_true", help="relax the atoms in each strained cell (needed "
                        "for crystals with internal degrees of freedom: hcp, diamond, most compounds)")
    parser.add_argument("--ion_steps", type=int, default=500, help="with --relax_ions: FIRE steps at most per "
                        "strained cell, to --fmax (not --steps: --steps 0 takes only the structures as given); the "
                        "report names a strained cell not converged")
    parser.add_argument("--no_phonons", "--no-phonons", action="store_true", help="skip the phonons (no phonopy "
                        "needed)")
    parser.add_argument("--supercell", type=int, nargs="+", default=[], help="phonon supercell of the relaxed unit "
                        "cell: N or NX NY NZ (default: the smallest at least 10 Å wide)")
    parser.add_argument("--displacement", type=float, default=0.01, help="phonopy's displacement amplitude, Å")
    parser.add_argument("--mesh", type=int, default=20, help="Γ-centred phonon mesh: N x N x N q-points")
    parser.add_argument("--band_points", type=int, default=200, help="q-points along the band path")
    parser.add_argument("--imaginary_below", type=float, default=0.1, help="THz: frequencies below minus this are "
                        "flagged imaginary")
    parser.add_argument("--symprec", type=float, default=1e-5, help="phonopy's symmetry tolerance, Å")
    parser.add_argument("--tie_tolerance", type=float, default=1e-3, help="Å: an atom whose 20th and 21st "
                        "neighbours (the cap's) are closer than this is reported as tied")
    parser.add_argument("--batch_size", type=int, default=16, help="cells per compiled model call")
    add_device_argument(parser)
    add_ops_profile_argument(parser)
    parser.add_argument("--precision", default="float32-high", choices=PRECISIONS,
                        help="what the models compute in (orb.precision; float64 on the CPU for phonons)")
    parser.add_argument("--progress_bar", choices=("auto", "true", "false"), default="auto",
                        help="auto: when the output is a terminal")
    return parser


if __name__ == "__main__":
    from orb.signals import run_program

    run_program(main)
