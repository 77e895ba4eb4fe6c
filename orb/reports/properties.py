"""orb-properties' report: each structure's numbers as named scalars, the fine-tuned model's against the reference's
and against DFT, the console table, and the equation-of-state and band-structure plots."""

import csv
import json
import math
import os
from typing import Dict, List, Optional

import numpy as np

from orb.errors import OrbInputError
from orb.files import write_atomically

VOIGT = "123456"
PRINCIPAL = ("C11", "C22", "C33", "C12", "C13", "C23", "C44", "C55", "C66")
# every scalar of the report: (name, unit, what it is); the DFT file uses these names
SCALARS = {
    "a": ("Å", "lattice length a (per unit cell of a repeated built-in)"),
    "b": ("Å", "lattice length b"),
    "c": ("Å", "lattice length c"),
    "alpha": ("°", "lattice angle"), "beta": ("°", "lattice angle"), "gamma": ("°", "lattice angle"),
    "volume_per_atom": ("Å³", "relaxed volume per atom"),
    "energy_per_atom": ("eV", "equation of state: minimum energy per atom (E0)"),
    "eos_volume_per_atom": ("Å³", "equation of state: volume per atom at the minimum (V0)"),
    "bulk_modulus": ("GPa", "equation of state: bulk modulus (B)"),
    "bulk_modulus_voigt": ("GPa", "Voigt bulk modulus of the elastic tensor"),
    **{f"C{i}{j}": ("GPa", "elastic constant") for i in VOIGT for j in VOIGT if i <= j},
    "lowest_frequency": ("THz", "lowest phonon frequency on the mesh (Γ's 3 modes nearest 0, the acoustic, left out)"),
    "max_frequency": ("THz", "highest phonon frequency on the mesh"),
    "imaginary_modes": ("", "modes on the mesh below the imaginary threshold"),
}
ALIASES = {"B": "bulk_modulus", "E0": "energy_per_atom", "V0": "eos_volume_per_atom"}
TABLE = ("a", "b", "c", "volume_per_atom", "energy_per_atom", "bulk_modulus", "bulk_modulus_voigt") + PRINCIPAL + (
    "lowest_frequency", "max_frequency", "imaginary_modes")


def scalars(result: Dict) -> Dict[str, float]:
    """A model's numbers for one structure as the named scalars of :data:`SCALARS` (those it computed)."""
    out = dict(result.get("lattice", {}))
    eos = result.get("eos")
    if eos and not eos.get("failed"):
        out.update(energy_per_atom=eos["energy_per_atom"], eos_volume_per_atom=eos["volume_per_atom"],
                   bulk_modulus=eos["bulk_modulus"])
    elastic = result.get("elastic")
    if elastic:
        c = elastic["C"]
        out.update({f"C{i + 1}{j + 1}": c[i][j] for i in range(6) for j in range(i, 6)})
        out["bulk_modulus_voigt"] = elastic["bulk_modulus_voigt"]
    phonons = result.get("phonons")
    if phonons:
        out.update({key: phonons[key] for key in ("lowest_frequency", "max_frequency", "imaginary_modes")})
    return {key: value for key, value in out.items() if key in SCALARS}


def differences(mine: Dict[str, float], theirs: Dict[str, float]) -> Dict[str, float]:
    """``mine - theirs`` for every scalar both have."""
    return {key: mine[key] - theirs[key] for key in mine if key in theirs}


def read_dft(path: str, names: List[str]) -> Dict[str, Dict[str, float]]:
    """DFT reference values per structure: JSON ``{"Cu_fcc": {"a": 3.63, "B": 140, "C11": 170}}`` or a CSV with a
    ``structure`` column and one column per scalar (an empty cell: no value). Names are those of :data:`SCALARS`
    (``B``, ``E0``, ``V0`` accepted); an unknown name or structure is refused, naming it."""
    try:
        if path.lower().endswith(".csv"):
            with open(path, newline="") as f:
                rows = list(csv.DictReader(f))
            if rows and "structure" not in rows[0]:
                raise OrbInputError(f"--dft {path}: no 'structure' column (its columns: {', '.join(rows[0])})")
            table = {row["structure"]: {k: v for k, v in row.items() if k != "structure" and v not in ("", None)}
                     for row in rows}
        else:
            with open(path) as f:
                table = json.load(f)
    except OSError as exc:
        raise OrbInputError(f"--dft {path}: cannot read it ({exc.strerror or exc})") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise OrbInputError(f"--dft {path}: neither JSON nor CSV ({str(exc).splitlines()[0]})") from None
    if not isinstance(table, dict):
        raise OrbInputError(f"--dft {path}: expected an object of structures, each an object of values")
    found = {}
    for name, values in table.items():
        if name not in names:
            raise OrbInputError(f"--dft {path}: structure {name!r} is not among those computed ({', '.join(names)})")
        if not isinstance(values, dict):
            raise OrbInputError(f"--dft {path}, {name}: expected an object of values, got {type(values).__name__}")
        found[name] = {}
        for given, value in values.items():
            key = ALIASES.get(given, given)
            if key not in SCALARS:
                raise OrbInputError(f"--dft {path}, {name}: unknown value {key!r} (known: "
                                    f"{', '.join(list(SCALARS) + list(ALIASES))})")
            found[name][key] = dft_number(value, f"--dft {path}, {name}, {given}")
    return found


def dft_number(value, where: str) -> float:
    """A reference value as a finite float: nan or inf (which CSV and Python's JSON read) would be compared with and
    printed as if it were a value."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise OrbInputError(f"{where}: not a number ({value!r})") from None
    if not math.isfinite(number):
        raise OrbInputError(f"{where}: not a finite number ({value!r}); for no value, leave it out")
    return number


def _number(value: Optional[float], width: int = 12) -> str:
    if value is None:
        return " " * (width - 1) + "-"
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return f"{value:>{width}d}"
    return f"{value:>{width}.4f}" if abs(value) < 1e5 else f"{value:>{width}.4g}"


def table(entry: Dict) -> str:
    """The console table of one structure: each scalar for each model, their difference and DFT's (with each
    model's error against it)."""
    models = list(entry["models"])
    dft = entry.get("dft") or {}
    header = f"{'quantity':<28}" + "".join(f"{m.replace('_', '-'):>14}" for m in models)
    if len(models) == 2:
        header += f"{'difference':>14}"
    if dft:
        header += f"{'DFT':>12}" + "".join(f"{m.replace('_', '-')[:9] + ' err':>14}" for m in models)
    lines = [header]
    values = {m: entry["models"][m]["scalars"] for m in models}
    for key in TABLE:
        if not any(key in values[m] for m in models):
            continue
        unit = SCALARS[key][0]
        line = f"{key + (f' ({unit})' if unit else ''):<28}" + "".join(
            f"{_number(values[m].get(key), 14)}" for m in models)
        if len(models) == 2:
            line += _number(entry["difference"].get(key), 14)
        if dft:
            line += _number(dft.get(key)) + "".join(
                _number(entry["errors_vs_dft"][m].get(key), 14) for m in models)
        lines.append(line)
    return "\n".join(lines)


def plot_eos(path: str, name: str, curves: Dict[str, Dict]) -> None:
    """Energy per atom against volume per atom: each model's points and its Birch-Murnaghan fit."""
    from ase.eos import birchmurnaghan

    from orb.reports import figure

    fig = figure(figsize=(5.5, 4.0))
    ax = fig.subplots()
    for (label, eos), style in zip(curves.items(), ("o-", "s--")):
        n = eos["natoms"]
        volumes, energies = np.asarray(eos["volumes"]) / n, np.asarray(eos["energies"]) / n
        if eos.get("failed"):  # the points alone
            ax.plot(volumes, energies, style[0], label=f"{label}: no fit")
            continue
        fine = np.linspace(volumes.min(), volumes.max(), 200)
        e0, b0, bp, v0 = eos["fit"]
        line, = ax.plot(fine, birchmurnaghan(fine * n, e0, b0, bp, v0) / n, style[1:])
        ax.plot(volumes, energies, style[0], color=line.get_color(),
                label=f"{label}: B = {eos['bulk_modulus']:.1f} GPa")
    ax.set_xlabel("volume per atom (Å³)")
    ax.set_ylabel("energy per atom (eV)")
    ax.set_title(f"{name}: equation of state")
    ax.legend(fontsize=8)
    fig.tight_layout()
    write_atomically(path, lambda tmp: fig.savefig(tmp, dpi=120, format="png"))


def plot_bands(path: str, name: str, axis, bands: Dict[str, np.ndarray]) -> None:
    """Phonon bands along the standard path, the models overlaid (``axis``: x, special x, labels)."""
    from orb.reports import figure

    x, special, labels = axis
    fig = figure(figsize=(6.5, 4.0))
    ax = fig.subplots()
    for (label, frequencies), (color, style) in zip(bands.items(), (("C0", "-"), ("C3", "--"))):
        lines = ax.plot(x, frequencies, style, color=color, linewidth=1.0)
        lines[0].set_label(label)
    for s in special:
        ax.axvline(s, color="0.7", linewidth=0.6)
    ax.axhline(0.0, color="0.5", linewidth=0.6)
    ax.set_xticks(special)
    ax.set_xticklabels(labels)
    ax.set_xlim(x[0], x[-1])
    ax.set_ylabel("frequency (THz)")
    ax.set_title(f"{name}: phonon bands")
    ax.legend(fontsize=8)
    fig.tight_layout()
    write_atomically(path, lambda tmp: fig.savefig(tmp, dpi=120, format="png"))


def plot_name(kind: str, structure: str, folder: str) -> str:
    """``<folder>/<kind>_<structure>.png`` with the structure's name made a safe file name."""
    safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in structure)
    return os.path.join(folder, f"{kind}_{safe}.png")


def tie_note(entry: Dict) -> str:
    """One line per structure when a model's graph depends on tie-breaking at its cap."""
    parts = []
    for label, result in entry["models"].items():
        ties, counts = result["neighbours"]["ties"], result["neighbours"]["changed"]
        flips = [f"{kind} {count}" for kind, count in counts.items() if count and not count.startswith("0/")]
        if ties["tied"] or flips:
            parts.append(f"{label}: {ties['tied']} of {len(result['relaxed_atoms'])} atoms tie their "
                         f"{ties['cap']}th and {ties['cap'] + 1}st neighbours within {ties['tolerance']:g} Å"
                         + (f"; neighbour sets changed in {', '.join(flips)} cells" if flips else ""))
    return ("depends on tie-breaking at the neighbour cap (" + "; ".join(parts) + ")") if parts else ""


def report(structures, notes: List[str], computed: Dict[str, List[Dict]], dft: Dict) -> List[Dict]:
    """Each structure's entry of properties.json: every model's numbers and scalars, the differences fine-tuned
    minus reference, DFT's values and each model's error against them, and the tie-breaking note."""
    entries = []
    for k, structure in enumerate(structures):
        entry = {"name": structure.name, "source": structure.source, "formula": structure.atoms.get_chemical_formula(),
                 "atoms": len(structure.atoms), "repeat": list(structure.repeat),
                 "models": {label: dict(results[k], scalars=scalars(results[k])) for label, results in computed.items()}}
        if len(computed) == 2:
            entry["difference"] = differences(entry["models"]["fine_tuned"]["scalars"],
                                              entry["models"]["reference"]["scalars"])
        if structure.name in dft:
            entry["dft"] = dft[structure.name]
            entry["errors_vs_dft"] = {label: differences(m["scalars"], entry["dft"])
                                      for label, m in entry["models"].items()}
        entry["tie_breaking"] = tie_note(entry)
        entries.append(entry)
    return entries


def plain(value):
    """``value`` as JSON: arrays as lists, non-finite numbers as null."""
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, np.ndarray):
        return plain(value.tolist())
    if isinstance(value, (np.floating, float)):
        return float(value) if np.isfinite(value) else None
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.bool_):
        return bool(value)
    return value


def write_outputs(folder: str, entries: List[Dict], run: Dict) -> None:
    """properties.json, each structure's phonon arrays and its plots, every file written atomically."""
    from orb.files import write_json

    for entry in entries:
        models = entry["models"]
        plot_eos(plot_name("eos", entry["name"], folder), entry["name"],
                 {label.replace("_", "-"): m["eos"] for label, m in models.items()})
        arrays = {}
        for label, m in models.items():
            phonons = m.get("phonons")
            if phonons:
                for key in ("qpoints", "weights", "frequencies", "bands"):
                    if phonons.get(key) is not None:
                        arrays[f"{label}/{key}"] = np.asarray(phonons.pop(key))
                m["phonons"]["arrays"] = os.path.basename(plot_name("phonons", entry["name"], folder))[:-4] + ".npz"
        if arrays:
            write_atomically(plot_name("phonons", entry["name"], folder)[:-4] + ".npz",
                             lambda tmp: np.savez(tmp, **arrays), suffix=".npz")
        axis = next((m["phonons"]["band_axis"] for m in models.values() if m.get("phonons")), None)
        if axis is not None:
            plot_bands(plot_name("bands", entry["name"], folder), entry["name"], axis,
                       {label.replace("_", "-"): arrays[f"{label}/bands"] for label in models
                        if f"{label}/bands" in arrays})
        for m in models.values():
            atoms = m.pop("relaxed_atoms")
            m["relaxed_cell"] = {"cell": atoms.cell.array, "numbers": atoms.numbers,
                                 "scaled_positions": atoms.get_scaled_positions()}
            if m.get("phonons"):
                m["phonons"].pop("band_axis", None)
    write_json(os.path.join(folder, "properties.json"), plain(dict(run, structures=entries)))


def said(relaxation: Dict) -> str:
    if relaxation["steps"] == 0 and not relaxation["converged"]:  # --steps 0: the structure as given, by choice
        return "not relaxed (--steps 0)"
    return f"{'converged' if relaxation['converged'] else 'NOT converged'} in {relaxation['steps']} steps"


def print_report(summary: Dict, output: str) -> None:
    for note in summary["notes"]:
        print(f"note: {note}")
    for entry in summary["structures"]:
        models = entry["models"]
        relaxation = ", ".join(f"{label.replace('_', '-')} {said(m['relaxation'])}" for label, m in models.items())
        print(f"\n{entry['name']} ({entry['formula']}, {entry['source']}; relaxation: {relaxation})")
        print(table(entry))
        for label, m in models.items():
            phonons = m.get("phonons")
            eos = m.get("eos") or {}
            if eos.get("failed"):
                print(f"  {label.replace('_', '-')}: {eos['failed']} (widen --eos_span, or relax: --steps)")
            elif eos and not eos["minimum_inside"]:
                print(f"  {label.replace('_', '-')}: the equation of state's minimum is outside the volumes computed "
                      "(widen --eos_span, or relax: --steps)")
            if phonons and phonons["imaginary_modes"]:
                print(f"  {label.replace('_', '-')}: {phonons['imaginary_modes']} imaginary modes on the mesh "
                      f"(below {phonons['imaginary_below']} THz)")
            elastic = m.get("elastic") or {}
            ions = elastic.get("ion_relaxation") or {}
            if ions.get("unconverged"):
                print(f"  {label.replace('_', '-')}: {entry['name']}'s ions NOT converged (--fmax {ions['fmax']:g} "
                      f"eV/Å) within --ion_steps {ions['step_limit']} in {len(ions['unconverged'])} strained cells "
                      f"({', '.join(ions['unconverged'])}): its elastic constants are not the relaxed-ion ones")
            if elastic and elastic["smallest_stiffness"] <= 0:
                print(f"  {label.replace('_', '-')}: mechanically unstable: the elastic tensor is not positive "
                      f"definite (smallest eigenvalue {elastic['smallest_stiffness']:.3g} GPa; Born's criterion)")
        if entry["tie_breaking"]:
            print(f"  note: {entry['tie_breaking']}")
    print(f"\nwrote {os.path.join(output, 'properties.json')} and the plots in {summary['seconds']:.1f} s")
