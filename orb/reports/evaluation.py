"""What ``orb-evaluate`` draws and tabulates beside its CSV and summary: parity plots (energy per atom,
forces, stress; one series per checkpoint) and errors by element (force MAE of each element's atoms,
energy-per-atom MAE of the structures containing it)."""

import os
from typing import Dict, List, Optional

import numpy as np
from ase.data import chemical_symbols

from orb.files import write_atomically, write_csv

MAX_PLOTTED_ATOMS = 200_000  # force components of the first this many labelled atoms are drawn (all are counted)


class ParityPoints:
    """Predicted and true values of one checkpoint, kept for plotting."""

    def __init__(self):
        self.values: Dict[str, List[List[float]]] = {"energy_per_atom": [[], []], "forces": [[], []],
                                                     "stress": [[], []]}
        self.atoms = 0

    def add(self, natoms: int, pred: Dict[str, np.ndarray], graph) -> None:
        if graph.energy is not None:
            self.values["energy_per_atom"][0].append(float(pred["energy"]) / natoms)
            self.values["energy_per_atom"][1].append(float(graph.energy[0]) / natoms)
        if graph.forces is not None and self.atoms < MAX_PLOTTED_ATOMS:
            self.values["forces"][0].extend(np.asarray(pred["forces"]).reshape(-1).tolist())
            self.values["forces"][1].extend(np.asarray(graph.forces).reshape(-1).tolist())
            self.atoms += natoms
        if graph.stress is not None and "stress" in pred:  # (none from a model without a stress head)
            self.values["stress"][0].extend(np.asarray(pred["stress"]).reshape(-1).tolist())
            self.values["stress"][1].extend(np.asarray(graph.stress).reshape(-1).tolist())


UNITS = {"energy_per_atom": "energy per atom (eV/atom)", "forces": "force components (eV/Å)",
         "stress": "stress components (eV/Å³)"}


def write_parity_plots(out_dir: str, series: Dict[str, ParityPoints]) -> List[str]:
    """``parity_<quantity>.png`` for each labelled quantity: prediction against label, the diagonal, each
    series' MAE in its legend. Returns the files written."""
    from orb.reports import figure

    written = []
    for quantity, label in UNITS.items():
        present = {name: points.values[quantity] for name, points in series.items() if points.values[quantity][0]}
        if not present:
            continue
        fig = figure(figsize=(5, 5))
        ax = fig.subplots()
        low, high = np.inf, -np.inf
        for name, (pred, true) in present.items():
            pred, true = np.asarray(pred), np.asarray(true)
            mae = float(np.abs(pred - true).mean())
            ax.scatter(true, pred, s=4, alpha=0.5, label=f"{name}: MAE {mae:.4g} over these points")
            low, high = min(low, true.min(), pred.min()), max(high, true.max(), pred.max())
        ax.plot([low, high], [low, high], color="black", linewidth=0.8)
        ax.set_xlabel(f"DFT {label}")
        ax.set_ylabel(f"predicted {label}")
        ax.legend(loc="upper left", fontsize=8)
        fig.tight_layout()
        path = os.path.join(out_dir, f"parity_{quantity}.png")
        write_atomically(path, lambda tmp: fig.savefig(tmp, dpi=120, format="png"))
        written.append(path)
    return written


def write_confidence_plot(out_dir: str, results: List[Dict], confidence: Dict) -> str:
    """``confidence.png``: each structure's predicted force error (the confidence head's mean over its atoms)
    against its true force MAE, with the diagonal and the rank correlation. Returns the file."""
    from orb.reports import figure

    rows = [r["row"] for r in results if "predicted_force_error_mean" in r["row"] and "forces_mae" in r["row"]]
    true = np.array([r["forces_mae"] for r in rows])
    predicted = np.array([r["predicted_force_error_mean"] for r in rows])
    fig = figure(figsize=(5, 5))
    ax = fig.subplots()
    ax.scatter(true, predicted, s=6, alpha=0.6)
    high = max(float(true.max()), float(predicted.max()))
    ax.plot([0, high], [0, high], color="black", linewidth=0.8)
    ax.set_xlabel("true force MAE of the structure (eV/Å)")
    ax.set_ylabel("predicted force error, mean over atoms (eV/Å)")
    ax.set_title(f"confidence head: rank correlation {confidence['spearman_mean']:.2f} over {len(rows)} structures",
                 fontsize=9)
    fig.tight_layout()
    path = os.path.join(out_dir, "confidence.png")
    write_atomically(path, lambda tmp: fig.savefig(tmp, dpi=120, format="png"))
    return path


def errors_by_element(results: List[Dict]) -> List[Dict]:
    """Per element present in the labelled structures: atoms, force MAE of its atoms (eV/Å), structures containing
    it and their energy-per-atom MAE (eV/atom)."""
    force_error, atoms = np.zeros(len(chemical_symbols)), np.zeros(len(chemical_symbols))
    energy_error, structures = np.zeros(len(chemical_symbols)), np.zeros(len(chemical_symbols))
    for result in results:
        if result["sums"] is None:
            continue
        if result.get("elements") is not None:
            force_error += result["elements"][0][:len(chemical_symbols)]
            atoms += result["elements"][1][:len(chemical_symbols)]
        present = np.unique(result["numbers"])
        error = result["row"].get("energy_per_atom_abs_error")
        if error is not None:
            energy_error[present] += error
            structures[present] += 1
    rows = []
    for z in range(1, len(chemical_symbols)):
        if atoms[z] or structures[z]:
            rows.append({"element": chemical_symbols[z], "atoms": int(atoms[z]),
                         "forces_mae": float(force_error[z] / atoms[z]) if atoms[z] else None,
                         "structures": int(structures[z]),
                         "energy_per_atom_mae": float(energy_error[z] / structures[z]) if structures[z] else None})
    return rows


def write_element_table(path: str, tables: Dict[str, List[Dict]]) -> None:
    """``errors_by_element.csv``: one row per element, the columns of each checkpoint side by side."""
    elements = sorted({row["element"] for rows in tables.values() for row in rows},
                      key=chemical_symbols.index)
    fields = ["element"]
    for name in tables:
        fields += [f"{name}_atoms", f"{name}_forces_mae", f"{name}_structures", f"{name}_energy_per_atom_mae"]
    lines = []
    for element in elements:
        line = {"element": element}
        for name, rows in tables.items():
            row = next((r for r in rows if r["element"] == element), None)
            if row is not None:
                for key in ("atoms", "forces_mae", "structures", "energy_per_atom_mae"):
                    if row[key] is not None:
                        line[f"{name}_{key}"] = row[key]
        lines.append(line)
    write_csv(path, fields, lines)


def column_headings(names: List[str], width: int) -> List[str]:
    """Headings for columns of at most ``width`` characters: the names themselves when each fits, else A, B, ...,
    each printed in full above the table first (names cut to the width were alike: a fine-tuned checkpoint and its
    starting model's file often differ only at the end)."""
    if all(len(name) <= width for name in names):
        return list(names)
    headings = [chr(ord("A") + k) if k < 26 else f"#{k + 1}" for k in range(len(names))]
    for heading, name in zip(headings, names):
        print(f"{heading}: {name}")
    return headings


def print_element_table(tables: Dict[str, List[Dict]]) -> None:
    names = list(tables)
    print("\nerrors by element (eV/Å for forces, eV/atom for the energy of the structures containing it)")
    headings = column_headings(names, 23)
    header = f"{'element':<9}" + "".join(f"{h + ' F-MAE':>30}{'E/atom MAE':>13}" for h in headings)
    print(header)
    elements = sorted({row["element"] for rows in tables.values() for row in rows}, key=chemical_symbols.index)
    for element in elements:
        line = f"{element:<9}"
        for name in names:
            row: Optional[Dict] = next((r for r in tables[name] if r["element"] == element), None)
            f_mae = row and row["forces_mae"]
            e_mae = row and row["energy_per_atom_mae"]
            line += f"{f_mae if f_mae is not None else float('nan'):>30.5g}{e_mae if e_mae is not None else float('nan'):>13.5g}"
        print(line)
