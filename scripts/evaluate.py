"""Evaluate an orb checkpoint on an ASE database: per-structure CSV, summary table and JSON.

    python scripts/evaluate.py --checkpoint outputs/run/checkpoints/best_weights.ckpt --data data/demo_val.db

Writes ``<output_dir>/predictions.csv`` (row id, formula, atoms, predicted and true energy, energy
error per atom, force MAE and cosine, stress MAE) and ``<output_dir>/summary.json``, and prints the
summary. Rows without labels are predicted only; a database without stress skips stress metrics.
The checkpoint may be PyTorch or MindSpore; its architecture comes from ``--config`` or its metadata.
"""

import argparse
import csv
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FORCE_THRESHOLD = 0.03


def structure_record(row_id, formula, natoms, pred, graph):
    """Metrics of one structure (labels may be missing)."""
    rec = {"row_id": row_id, "formula": formula, "natoms": natoms, "energy_pred": float(pred["energy"])}
    if graph.energy is not None:
        rec["energy_true"] = float(graph.energy[0])
        rec["energy_abs_error"] = abs(rec["energy_pred"] - rec["energy_true"])
        rec["energy_abs_error_per_atom"] = rec["energy_abs_error"] / natoms
    if graph.forces is not None:
        diff = np.abs(pred["forces"] - graph.forces)
        norms = np.linalg.norm(pred["forces"], axis=1) * np.linalg.norm(graph.forces, axis=1)
        rec["force_mae"] = float(diff.mean())
        rec["force_cosine"] = float(((pred["forces"] * graph.forces).sum(1) / np.maximum(norms, 1e-8)).mean())
        rec["forces_within_0.03"] = bool(diff.max() < FORCE_THRESHOLD)
    if graph.stress is not None:
        rec["stress_mae"] = float(np.abs(pred["stress"] - graph.stress[0]).mean())
    return rec


def summarise(records):
    """Dataset-level metrics from per-structure records (every structure weighs the same)."""
    out = {"structures": len(records), "atoms": int(sum(r["natoms"] for r in records))}
    if records and "energy_true" in records[0]:
        out["energy_mae_per_atom"] = float(np.mean([r["energy_abs_error_per_atom"] for r in records]))
        out["energy_mae"] = float(np.mean([r["energy_abs_error"] for r in records]))
    if records and "force_mae" in records[0]:
        atoms = np.array([r["natoms"] for r in records], dtype=float)
        out["force_mae"] = float(np.sum([r["force_mae"] * r["natoms"] for r in records]) / atoms.sum())
        out["force_cosine"] = float(np.sum([r["force_cosine"] * r["natoms"] for r in records]) / atoms.sum())
        out["fwt_0.03"] = float(np.mean([r["forces_within_0.03"] for r in records]))
    if records and "stress_mae" in records[0]:
        out["stress_mae"] = float(np.mean([r["stress_mae"] for r in records]))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="PyTorch or MindSpore orb checkpoint")
    parser.add_argument("--data", required=True, help="ASE SQLite database")
    parser.add_argument("--config", default="", help="YAML config whose 'model:' block gives the architecture")
    parser.add_argument("--output_dir", default="", help="where to write predictions.csv and summary.json "
                        "(default: evaluation/<database name>)")
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--progress_bar", choices=("auto", "true", "false"), default="auto")
    args = parser.parse_args(argv)

    from tqdm import tqdm

    from orb.data.dataset import AseDbDataset
    from orb.errors import OrbInputError
    from orb.data.graphs import batch_graphs

    try:
        import mindspore as ms

        from orb.inference.calculator import model_from_checkpoint
        from orb.inference.predictor import Predictor

        ms.set_context(mode=ms.GRAPH_MODE)
        model = model_from_checkpoint(args.checkpoint, args.config)
        data = AseDbDataset(args.data, model.cfg.radius, model.cfg.max_neighbors, require_labels=False)
    except OrbInputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    predictor = Predictor(model)
    out_dir = args.output_dir or os.path.join("evaluation", os.path.splitext(os.path.basename(args.data))[0])
    os.makedirs(out_dir, exist_ok=True)
    records = []
    show = sys.stderr.isatty() if args.progress_bar == "auto" else args.progress_bar == "true"
    with tqdm(total=len(data), desc="evaluating", disable=not show) as bar:
        for start in range(0, len(data), args.batch_size):
            indices = range(start, min(start + args.batch_size, len(data)))
            try:
                graphs = [data[i] for i in indices]
            except OrbInputError as exc:
                print(f"error: {exc}", file=sys.stderr)
                return 2
            pred = predictor(batch_graphs(graphs))
            offset = 0
            for i, graph in zip(indices, graphs):
                n = graph.num_nodes
                one = {"energy": pred["energy"][i - start], "forces": pred["forces"][offset:offset + n],
                       "stress": pred["stress"][i - start]}
                offset += n
                row = data.row(i)
                records.append(structure_record(int(row.id), row.formula, n, one, graph))
            bar.update(len(graphs))
    summary = summarise(records)
    summary.update({"checkpoint": os.path.abspath(args.checkpoint), "data": os.path.abspath(args.data)})
    with open(os.path.join(out_dir, "predictions.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(records[0].keys()))
        writer.writeheader()
        writer.writerows(records)
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    units = {"energy_mae_per_atom": "eV/atom", "energy_mae": "eV", "force_mae": "eV/Å", "stress_mae": "eV/Å³"}
    print(f"{'metric':<22}{'value':>14}  unit")
    for key, value in summary.items():
        if isinstance(value, float):
            print(f"{key:<22}{value:>14.6g}  {units.get(key, '')}")
        elif isinstance(value, int):
            print(f"{key:<22}{value:>14d}")
    print(f"wrote {os.path.join(out_dir, 'predictions.csv')} and {os.path.join(out_dir, 'summary.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
