"""Evaluate an orb checkpoint on a database (any supported format): per-structure CSV, summary, plots.

    orb-evaluate --checkpoint outputs/run/checkpoints/best_weights.ckpt --data data/demo_val.db [--compare START.ckpt]

Writes ``<output_dir>/predictions.csv`` (one row per structure: row id, for data other than one ASE database the
file and the frame or row there, formula, atoms, predicted energy, and where the row has labels its errors),
``<output_dir>/summary.json``, parity plots (``parity_energy_per_atom.png``, ``parity_forces.png``,
``parity_stress.png``) and ``errors_by_element.csv``, and prints the summary and the errors by element.
``--compare`` evaluates a second checkpoint on the same data and shows both side by side (its metrics under
``compare`` in the summary, both series in the plots and the table). The metrics are those of the training log (same
names, units and averaging, ``orb.metrics``), computed over the rows that carry each label; rows without labels are
predicted only. The checkpoint may be PyTorch or MindSpore; its architecture is read from it.
"""

import argparse
import os
import sys
import time
from typing import Dict, List, Optional

import numpy as np

from orb.errors import OrbInputError
from orb.signals import out_of_space
from orb.inference.uncertainty import spearman

COLLECTING = ".uncertain.extxyz.collecting"  # this evaluation's uncertain frames, until it is written
from orb.metrics import (BY_ELEMENT, METRICS, add_sums, element_sums,
                         forces_by_element, metrics_from_sums, structure_sums)

CSV_FIELDS = ("row_id", "source", "frame", "source_row", "formula", "natoms", "energy_pred", "energy_true",
              "energy_abs_error", "energy_per_atom_abs_error", "forces_mae", "forces_cosine", "forces_within_0.03", "stress_mae",
              "predicted_force_error_max", "predicted_force_error_mean")


def structure_record(row_id: int, formula: str, graph, pred: Dict[str, np.ndarray]) -> Dict:
    """One CSV row, its metric sums and its per-element force sums (labels may be missing)."""
    natoms = graph.num_nodes
    record = {"row_id": row_id, "formula": formula, "natoms": natoms, "energy_pred": float(pred["energy"])}
    stress = None if graph.stress is None or "stress" not in pred else graph.stress[0]
    if graph.energy is None and graph.forces is None and stress is None:
        return {"row": record, "sums": None, "elements": None}
    sums = structure_sums(float(pred["energy"]), None if graph.energy is None else float(graph.energy[0]), natoms,
                          pred["forces"] if graph.forces is not None else None, graph.forces,
                          pred.get("stress") if stress is not None else None, stress)
    if graph.energy is not None:
        record.update(energy_true=float(graph.energy[0]), energy_abs_error=sums["energy_mae"],
                      energy_per_atom_abs_error=sums["energy_per_atom_mae"])
    if "forces_mae" in sums:
        record.update(forces_mae=sums["forces_mae"], forces_cosine=sums["forces_cosine"] / natoms,
                      **{"forces_within_0.03": bool(sums["forces_within_0.03"])})
    if "stress_mae" in sums:
        record["stress_mae"] = sums["stress_mae"]
    elements = element_sums(graph.numbers, pred["forces"], graph.forces) if graph.forces is not None else None
    return {"row": record, "sums": sums, "elements": elements}


def summarise(results: List[Dict]) -> Dict:
    """Dataset metrics over the labelled structures (each metric over the rows that have its label)."""
    out = {"structures": len(results), "labelled": sum(r["sums"] is not None for r in results),
           "atoms": int(sum(r["row"]["natoms"] for r in results))}
    for key in METRICS:
        rows = [r["sums"] for r in results if r["sums"] is not None and key in r["sums"]]
        if rows:
            out[key] = metrics_from_sums(add_sums({}, *rows), keys=[key])[key]
    elements = [r["elements"] for r in results if r.get("elements") is not None]
    if elements:
        total = np.sum(elements, axis=0)
        out[BY_ELEMENT] = forces_by_element(total[0], total[1])
    judged = [r["row"] for r in results if "predicted_force_error_mean" in r["row"] and "forces_mae" in r["row"]]
    if len(judged) >= 2:  # the confidence head against the true force errors, structure by structure
        true = np.array([r["forces_mae"] for r in judged])
        out["confidence"] = {
            "structures": len(judged),
            "spearman_mean": spearman(np.array([r["predicted_force_error_mean"] for r in judged]), true),
            "spearman_max": spearman(np.array([r["predicted_force_error_max"] for r in judged]), true),
            "predicted_force_error_mean": float(np.mean([r["predicted_force_error_mean"] for r in judged])),
            "forces_mae": float(true.mean())}
    return out


def print_summary(summary: Dict) -> None:
    """The metrics table; the errors by element follow in :func:`~orb.reports.evaluation.print_element_table` (the
    force MAE of each element was also printed here, a second table of the same numbers)."""
    print(f"{'metric':<32}{'value':>14}  unit   averaging")
    for key, value in summary.items():
        if key in METRICS:
            unit, meaning = METRICS[key]
            print(f"{key:<32}{value:>14.6g}  {unit:<6} {meaning}")
        elif isinstance(value, int):
            print(f"{key:<32}{value:>14d}")
    confidence = summary.get("confidence")
    if confidence:
        print(f"\nconfidence head: predicted force error (mean over atoms) {confidence['predicted_force_error_mean']:.4g}"
              f" eV/Å against a true force MAE of {confidence['forces_mae']:.4g}; rank correlation with the true "
              f"error over {confidence['structures']} structures: {confidence['spearman_mean']:.3f} (mean), "
              f"{confidence['spearman_max']:.3f} (max over atoms)")


def main(argv=None) -> int:
    from orb.signals import run_command

    return run_command(lambda: parse_and_evaluate(argv))  # a stop ends it at once, 75: nothing to continue


def parse_and_evaluate(argv) -> int:
    from orb.device import quiet_mindspore

    quiet_mindspore()  # before anything imports MindSpore
    return evaluate(build_parser().parse_args(argv))


def build_parser(prog: Optional[str] = None) -> argparse.ArgumentParser:
    """orb-evaluate's options."""
    from orb.bundled import command_path
    from orb.commands import HelpFormatter, Parser
    from orb.device import add_device_argument, add_ops_profile_argument
    from orb.inference.runs import add_charge_spin_keys
    from orb.precision import PRECISIONS

    parser = Parser(prog=prog, allow_abbrev=False, description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--checkpoint", required=True, type=command_path, help="PyTorch or MindSpore orb checkpoint")
    parser.add_argument("--compare", default="", help="a second checkpoint evaluated on the same data and shown "
                        "beside the first (e.g. the starting model and the fine-tuned one)", type=command_path)
    parser.add_argument("--data", required=True, nargs="+", help="ASE SQLite database, extxyz or any ase.io file, "
                        ".aselmdb, a folder of them, or several of these (read as one data set)", type=command_path)
    for name in ("energy", "forces", "stress"):
        parser.add_argument(f"--{name}_key", default="", help=f"where other formats keep the {name} (orb.data.formats)"
                            f" (default: REF_{name}, then the stored results, then {name}"
                            + (", then a virial; none: no stress)" if name == "stress" else ")"))
    add_charge_spin_keys(parser)
    parser.add_argument("--held_out", default="", type=command_path, help="a fine-tuning run's folder or its "
                        "val_split.json: evaluate only the structures of --data (that run's training data) it held out "
                        "for validation (val_fraction), as its validation did (default: every structure of --data)")
    parser.add_argument("--output_dir", default="", help="where to write predictions.csv and summary.json "
                        "(default: evaluation/<database name>)")
    parser.add_argument("--model", default=None, help="model name, when the checkpoint cannot tell (a published "
                        "orb-v3 file: orb_v3_conservative_20_omat or ..._inf_omat) (default: the checkpoint's)")
    parser.add_argument("--batch_size", type=int, default=8, help="structures of an average batch: each step "
                        "packs structures of similar size up to twice such a batch's atoms and edges")
    parser.add_argument("--dispersion", default="", help="add DFT-D3 dispersion to the predictions: d3bj or d3zero "
                        "(needs pip install .[d3])")
    parser.add_argument("--xc", default="pbe", help="the functional of the training data, for --dispersion")
    add_device_argument(parser)
    add_ops_profile_argument(parser)
    parser.add_argument("--precision", default="float32-high", choices=PRECISIONS,
                        help="what the model computes in (orb.precision): float32-high (HF32/TF32 products on "
                        "Ascend/GPU, orb-models' default), float32-highest, bf16-mixed, fp16-mixed, float64 (CPU)")
    parser.add_argument("--matmul_precision", default="", choices=("", "highest", "high"),
                        help=argparse.SUPPRESS)  # the old spelling of --precision float32-high | float32-highest
    parser.add_argument("--uncertain_above", type=float, default=None,
                        help="orb-v3: write the structures whose predicted force error (the confidence head's, "
                        "largest over the atoms) passes this many eV/Å to OUTPUT_DIR/uncertain.extxyz")
    parser.add_argument("--progress_bar", choices=("auto", "true", "false"), default="auto",
                        help="auto: when the output is a terminal")
    return parser


def predict_dataset(checkpoint: str, args, keys, show: bool, out_dir: str = ""):
    """Every structure's record (``structure_record`` plus its atomic numbers; with an orb-v3 model its predicted
    force error) and the parity points of one checkpoint on ``args.data``; with ``--uncertain_above``, the frames
    whose predicted error passes it go to ``out_dir/uncertain.extxyz``."""
    from tqdm import tqdm

    from orb.data.batching import batch_graphs
    from orb.data.dataset import AseDbDataset
    from orb.data.formats import readable_database
    from orb.inference.dispersion import D3Dispersion, check_dispersion_elements, check_dispersion_for
    from orb.inference.predictor import Predictor, per_structure
    from orb.inference.runs import origin_keys
    from orb.inference.uncertainty import UncertainFrames, check_threshold, frame_error, per_atom_error
    from orb.reports.evaluation import ParityPoints
    from orb.io.checkpoint import model_from_checkpoint
    from orb.models import is_float64_model

    model = model_from_checkpoint(checkpoint, args.model)
    data = AseDbDataset(readable_database(args.data, keys), require_labels=False, settings=model.cfg.graph_settings(),
                        charge_spin=model.cfg.omol, charge_spin_keys=(keys.charge, keys.spin))
    data.census()  # every row's labels, charge and spin checked before anything is written or removed
    data.float64 = is_float64_model(model)
    positions = held_out_positions(args.held_out, data) if args.held_out else np.arange(len(data))
    batches, buckets = packed_batches(data, args.batch_size, positions=positions)
    check_dispersion_for(model.cfg, args.dispersion)
    check_dispersion_elements(data, args.dispersion)
    dispersion = D3Dispersion(args.dispersion, args.xc, model.cfg.graph_settings()) if args.dispersion else None
    predictor = Predictor(model, buckets)
    if out_dir:  # the evaluated checkpoint (a --compare one collects nothing)
        check_threshold(model.cfg, args.uncertain_above)
    uncertain = UncertainFrames(out_dir, COLLECTING) if args.uncertain_above is not None and out_dir else None
    if uncertain is not None:  # a fresh collection, beside an earlier evaluation's uncertain.extxyz, which it replaces
        try:                   # only once this evaluation is written (a stopped one keeps the earlier frames)
            os.makedirs(out_dir, exist_ok=True)
            if os.path.exists(uncertain.path):
                os.remove(uncertain.path)
        except OSError as exc:  # (a full disk: the command's own line, status 1)
            if out_of_space(exc):
                raise
            raise OrbInputError(f"--output_dir {out_dir}: cannot write there ({exc.strerror or exc})") from None
    results, points, locate = [None] * len(data), ParityPoints(), data.rows.origin_locator()
    origin = origin_keys(data)  # (an uncertain frame's file and frame, as orb-relax's and orb-md's record it)
    with tqdm(total=len(positions), desc=f"evaluating {os.path.basename(checkpoint)}", disable=not show) as bar:
        for indices in batches:
            graphs = [data[int(i)] for i in indices]
            pred = per_structure(predictor(batch_graphs(graphs)), [graph.num_nodes for graph in graphs])
            for i, graph, one in zip(indices, graphs, pred):
                n = graph.num_nodes
                confidence = one.pop("confidence", None)
                per_atom = per_atom_error(confidence) if confidence is not None else None
                if dispersion is not None:
                    d3 = dispersion(data.get_atoms(int(i)))
                    one = {key: one[key] + d3[key] for key in one}
                row = data.row(int(i))
                record = structure_record(int(row.id), row.formula, graph, one)
                if data.sources:  # structures indexed from other files: the file, and the frame or row, each came from
                    path, unit, number = locate(int(row.id))
                    record["row"].update(source=path, **{"frame" if unit == "frame" else "source_row": number})
                record["numbers"] = np.asarray(graph.numbers)
                if per_atom is not None:  # the confidence head's (orb-v3): max over atoms and mean, eV/Å
                    predicted = frame_error(per_atom)
                    record["row"].update(predicted_force_error_max=predicted["max"],
                                         predicted_force_error_mean=predicted["mean"])
                    if uncertain is not None and predicted["max"] > args.uncertain_above:
                        atoms = data.get_atoms(int(i))
                        uncertain.add(atoms, per_atom, source=str(args.data), source_row=int(row.id),
                                      **origin(int(row.id)),
                                      predicted_energy=float(one["energy"]))
                results[int(i)] = record
                points.add(n, one, graph)
            bar.update(len(graphs))
    return [results[int(p)] for p in positions], points


def held_out_record(held_out: str) -> str:
    """The ``val_split.json`` that ``--held_out`` names (a run folder or the file), checked to exist."""
    from orb.training.val_split import RECORD

    path = os.path.join(held_out, RECORD) if os.path.isdir(held_out) else held_out
    if not os.path.isfile(path):
        raise OrbInputError(f"--held_out {held_out}: no {RECORD} there (a run with val_fraction and no val_data_path "
                            "writes it in its output_dir)")
    return path


def held_out_positions(held_out: str, data) -> np.ndarray:
    """The positions of ``data`` a run's record of its validation split holds out; refused when ``data`` is not the
    data the split was drawn from (its row count or content fingerprint differs)."""
    from orb.training.val_split import read_record

    record = read_record(held_out_record(held_out))
    if record["train_rows"] != len(data) or record.get("train_fingerprint") != data.content_fingerprint():
        raise OrbInputError(f"--held_out {held_out}: the split was drawn from {record.get('train_data_path')} "
                            f"({record['train_rows']} structures), not from --data {data.source} ({len(data)} "
                            "structures, or other ones): give that run's training data")
    return np.asarray(record["held_out"], np.int64)


def packed_batches(data, batch_size: int, fill_graphs: bool = True, positions: Optional[np.ndarray] = None):
    """Batches of structures of similar size (:func:`orb.data.plan.pack_by_size`: little padding whatever the
    rows' order) of ``data``'s ``positions`` (default: all), and the few bucket shapes planned on exactly them
    (``fill_graphs``: see :func:`orb.data.plan.evaluation_plan`)."""
    from orb.data.plan import eval_limit, evaluation_plan

    positions = np.arange(len(data)) if positions is None else positions
    natoms, edges = data.natoms[positions], data.edge_capacities()[positions]
    shards, buckets, _ = evaluation_plan(natoms, edges, eval_limit(natoms, edges, batch_size), 1,
                                         fill_graphs=fill_graphs)
    return [positions[shards.part(s, 0)] for s in range(len(shards))], buckets


def evaluate(args) -> int:
    from orb.inference.dispersion import check_dispersion

    if args.batch_size < 1:  # (the options checked before MindSpore's 1 s import)
        raise OrbInputError(f"--batch_size must be at least 1, got {args.batch_size}")
    check_dispersion(args.dispersion, args.xc)
    if args.held_out:
        held_out_record(args.held_out)
    from orb.device import import_mindspore

    import_mindspore()  # then what the other imports need, with a stop signal honoured after it
    from orb.data.formats import LabelKeys
    from orb.device import configure_mindspore, set_ops_profile
    from orb.files import refuse_overwriting_inputs, sole_writer
    from orb.io.checkpoint import check_checkpoint_file
    from orb.reports.evaluation import errors_by_element, print_element_table
    from orb.models.ops_profile import describe_profile
    from orb.precision import describe as describe_precision
    from orb.signals import STOP

    if args.matmul_precision:
        print(f"warning: --matmul_precision is deprecated: use --precision float32-{args.matmul_precision}",
              file=sys.stderr)
        args.precision = f"float32-{args.matmul_precision}"
    target = configure_mindspore(args.device_target, precision=args.precision)
    set_ops_profile(args.ops_profile)
    print(f"device: {target}, {describe_profile()}, {describe_precision(args.precision, target)}")
    keys = LabelKeys(args.energy_key, args.forces_key, args.stress_key, args.charge_key, args.spin_key)
    show = sys.stderr.isatty() if args.progress_bar == "auto" else args.progress_bar == "true"
    args.data = args.data[0] if len(args.data) == 1 else args.data
    first = args.data if isinstance(args.data, str) else args.data[0]
    out_dir = args.output_dir or os.path.join("evaluation", os.path.splitext(os.path.basename(first.rstrip("/")))[0])
    checkpoints = [args.checkpoint] + ([args.compare] if args.compare else [])
    for flag, path in zip(("--checkpoint", "--compare"), checkpoints):  # before the first one's hour of work
        check_checkpoint_file(path, flag)
    names = [os.path.basename(c) for c in checkpoints]
    if len(set(names)) < len(names):
        names = ["checkpoint", "compare"]
    writable_folder(out_dir)  # before the hour of predictions, not after them
    replaced = set(evaluation_files() + ["uncertain.extxyz", COLLECTING])
    refuse_overwriting_inputs([("--output_dir", out_dir, replaced.__contains__)],
                              [("--data", args.data), ("--checkpoint", args.checkpoint), ("--compare", args.compare)])
    with sole_writer(out_dir, "--output_dir"):  # (another evaluation into it at the same time: refused)
        try:
            runs = {name: predict_dataset(path, args, keys, show, out_dir if name == names[0] else "")
                    for name, path in zip(names, checkpoints)}
            with STOP.deferred():  # every file, then the stop (a stop between two files left two evaluations')
                summary, written = summarise_and_write(args, names, runs, out_dir, target)
            if STOP.received is not None:
                print(f"{STOP.received} received while the results were written: the evaluation is complete",
                      file=sys.stderr)
        except BaseException:  # a stop, a failure, bad input: this evaluation's collection goes (the earlier stays)
            if os.path.exists(os.path.join(out_dir, COLLECTING)):
                os.remove(os.path.join(out_dir, COLLECTING))
            raise
    tables = {name: errors_by_element(run[0]) for name, run in runs.items()}
    if args.compare:
        print_comparison(summary, summary["compare"], names)
    else:
        print_summary(summary)
    if any(tables.values()):
        print_element_table(tables)
    print(f"wrote {', '.join(written)}")
    if not any(r["sums"] is not None for r in runs[names[0]][0]):  # ("labelled 0" alone left a user wondering)
        print("note: no structure has energy and forces labels, so no errors were measured; outside an ASE database "
              "they are read from info['REF_energy'], the calculator's results or info['energy'] and "
              "arrays['REF_forces'], the calculator's or arrays['forces']: name others with --energy_key and "
              "--forces_key (an ASE database's are its rows' calculator results)",
              file=sys.stderr)
    return 0


def writable_folder(out_dir: str) -> None:
    """One line, before any prediction, when ``out_dir`` cannot hold the results: a file there, or a folder (or the
    nearest existing folder above it, where it would be made) this process cannot write."""
    existing = os.path.abspath(out_dir)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise OrbInputError(f"--output_dir {out_dir}: cannot write there ({existing} is a file)")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise OrbInputError(f"--output_dir {out_dir}: cannot write there ({existing}: permission denied)")


def summarise_and_write(args, names, runs, out_dir: str, target: str):
    """(the summary, the files written) of an evaluation's ``runs``."""
    from orb.device import ops_profile

    results = runs[names[0]][0]
    summary = summarise(results)
    data = os.path.abspath(args.data) if isinstance(args.data, str) else [os.path.abspath(d) for d in args.data]
    if args.held_out:
        summary["held_out"] = os.path.abspath(held_out_record(args.held_out))
    summary.update({"checkpoint": os.path.abspath(args.checkpoint), "data": data,
                    "device_target": target, "ops_profile": ops_profile(), "precision": args.precision})
    if args.compare:
        other = summarise(runs[names[1]][0])
        other["checkpoint"] = os.path.abspath(args.compare)
        summary["compare"] = other
    try:
        written = write_outputs(out_dir, results, summary, runs, collected=args.uncertain_above is not None)
    except OSError as exc:  # a read-only folder: every file is whole or absent (a full disk: status 1, its own line)
        if out_of_space(exc):
            raise
        raise OrbInputError(f"--output_dir {out_dir}: cannot write the results there "
                            f"({exc.strerror or exc})") from None
    return summary, written


STAGING = ".staging-"  # an evaluation's files before they replace the earlier ones: .staging-<pid>@<host>


def write_outputs(out_dir: str, results: List[Dict], summary: Dict, runs: Dict, collected: bool = False) -> List[str]:
    """predictions.csv, summary.json, the parity plots and errors_by_element.csv, and (``collected``) the uncertain
    frames (:func:`publish_uncertain`), written together: each into a staging folder first, then renamed into place
    one after another, so that a kill or a full disk while they are written leaves the earlier evaluation's files as
    they were (a new predictions.csv was left beside the earlier summary.json and plots); the files written."""
    import shutil

    from orb.reports.evaluation import (errors_by_element, write_confidence_plot, write_element_table,
                                        write_parity_plots)
    from orb.files import fsync_directory, owner_gone, owner_tag, remove_stale_temporaries, write_csv, write_json

    os.makedirs(out_dir, exist_ok=True)
    remove_stale_temporaries(out_dir, min_age=600.0)  # those of an evaluation killed while it wrote
    here = owner_tag().partition("@")[2]
    for name in os.listdir(out_dir):  # the staging folders of killed evaluations: this host's, others' after an hour
        tag, path = name[len(STAGING):], os.path.join(out_dir, name)
        if name.startswith(STAGING) and (owner_gone(tag) or (tag.partition("@")[2] != here and
                                                              time.time() - os.path.getmtime(path) > 3600)):
            shutil.rmtree(path, ignore_errors=True)
    stage = os.path.join(out_dir, STAGING + owner_tag())
    shutil.rmtree(stage, ignore_errors=True)
    os.makedirs(stage)
    try:
        fields = [f for f in CSV_FIELDS if any(f in r["row"] for r in results)]
        staged = [os.path.join(stage, "predictions.csv"), os.path.join(stage, "summary.json")]
        write_csv(staged[0], fields, (r["row"] for r in results))
        write_json(staged[1], summary)
        staged += write_parity_plots(stage, {name: run[1] for name, run in runs.items()})
        if summary.get("confidence"):
            staged.append(write_confidence_plot(stage, results, summary["confidence"]))
        tables = {name: errors_by_element(run[0]) for name, run in runs.items()}
        if any(tables.values()):
            write_element_table(os.path.join(stage, "errors_by_element.csv"), tables)
            staged.append(os.path.join(stage, "errors_by_element.csv"))
        written = [os.path.join(out_dir, os.path.basename(path)) for path in staged]
        if collected:
            staged.append(publish_uncertain(out_dir, stage))
            written.append(os.path.join(out_dir, "uncertain.extxyz"))
        for path, final in zip(staged, written):
            if path is not None:
                os.replace(path, final)
            elif os.path.exists(final):  # none found this time: none kept (it would describe another evaluation)
                os.remove(final)
        remove_earlier_outputs(out_dir, written)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    fsync_directory(out_dir)
    return [path for path in written if os.path.exists(path)]


def publish_uncertain(out_dir: str, stage: str) -> Optional[str]:
    """This evaluation's uncertain frames (collected in COLLECTING), in the input's order, moved into ``stage`` to
    become ``uncertain.extxyz`` with the other files: until then the earlier collection stays, so a stopped or killed
    evaluation loses no frames gathered for labelling. None when none were found."""
    from orb.inference.uncertainty import UncertainFrames

    collected = os.path.join(out_dir, COLLECTING)
    if not os.path.exists(collected):
        return None
    UncertainFrames(out_dir, COLLECTING).order_by(lambda info: info.get("source_row", 0))
    staged = os.path.join(stage, "uncertain.extxyz")
    os.replace(collected, staged)
    return staged


def evaluation_files() -> List[str]:
    """Every file an evaluation may write in its folder."""
    from orb.reports.evaluation import UNITS

    return (["predictions.csv", "summary.json"] + [f"parity_{quantity}.png" for quantity in UNITS]
            + ["confidence.png", "errors_by_element.csv"])


def remove_earlier_outputs(out_dir: str, written: List[str]) -> None:
    """The files of an earlier evaluation in the same folder that this one did not write (an orb-v3 model's
    confidence plot beside a later orb-v2 evaluation; a stress plot beside molecules): removed once this one's are
    written, so that the folder holds one evaluation. Not ``uncertain.extxyz``, data collected for labelling: only
    a new collection (``--uncertain_above``) replaces it."""
    keep = {os.path.abspath(p) for p in written}
    for name in evaluation_files():
        path = os.path.abspath(os.path.join(out_dir, name))
        if path not in keep and os.path.exists(path):
            os.remove(path)


def print_comparison(first: Dict, second: Dict, names: List[str]) -> None:
    """The metrics of two checkpoints side by side (the starting model and the fine-tuned one, say)."""
    from orb.reports.evaluation import column_headings

    headings = column_headings(names, 25)
    print(f"{'metric':<32}{headings[0]:>26}{headings[1]:>26}  unit")
    for key in METRICS:
        if key in first or key in second:
            a, b = first.get(key, float("nan")), second.get(key, float("nan"))
            print(f"{key:<32}{a:>26.6g}{b:>26.6g}  {METRICS[key][0]}")


if __name__ == "__main__":
    from orb.signals import run_program

    run_program(main)
