"""One definition of every metric the training log, metrics.jsonl and ``evaluate.py`` report.

Names say what is measured; :data:`METRICS` gives each one's unit and how it is averaged, and is
printed at the head of the training log and of the evaluation table. ``loss*`` metrics are in
the normalised units the model is trained in (not eV); every other metric is physical.
"""

from typing import Dict, Iterable, Mapping, Optional, Sequence

import numpy as np
from ase.data import chemical_symbols

FORCE_THRESHOLD = 0.03  # eV/Å, for forces_within_0.03
ELEMENT_BINS = 119  # atomic numbers 0 (padding) to 118
BY_ELEMENT = "forces_mae_by_element"
BY_ELEMENT_MEANING = ("eV/Å", "|F_pred - F| over x, y, z, averaged over all atoms of each element (per element: "
                              "which chemistry got better or worse)")

# name: (unit, averaging and meaning)
METRICS: Dict[str, tuple] = {
    "loss": ("normalised", "weighted sum of the loss_* terms, averaged over structures"),
    "loss_energy": ("normalised", "L1 error of the normalised per-atom energy, averaged over structures "
                                  "(orb-v3: Huber)"),
    "loss_forces": ("normalised", "L1 error of the normalised forces over a structure's atoms and x, y, z, "
                                  "averaged over structures (orb-v3: conditional Huber, averaged over components)"),
    "loss_stress": ("normalised", "L1 error of the normalised stress over 6 components, averaged over structures "
                                  "(orb-v3: Huber; 0 for one without a stress label)"),
    "loss_confidence": ("normalised", "orb-v3: cross-entropy of the force-error classifier, averaged over atoms"),
    "loss_equigrad": ("normalised", "orb-v3 conservative: weight x mean norm of dE/d(rotation), when weighted"),
    "energy_mae": ("eV", "|E_pred - E| per structure, averaged over structures"),
    "energy_per_atom_mae": ("eV/atom", "|E_pred - E| / atoms per structure, averaged over structures"),
    "forces_mae": ("eV/Å", "|F_pred - F| over a structure's atoms and x, y, z, averaged over structures"),
    "forces_cosine": ("", "cosine of predicted and true force vectors, averaged over atoms"),
    "forces_within_0.03": ("", "fraction of structures whose every force component is within 0.03 eV/Å"),
    "stress_mae": ("eV/Å³", "|S_pred - S| over 6 Voigt components, averaged over structures with a stress label"),
    "energy_per_atom_reference_mae": ("eV/atom", "error of the reference energies alone (the baseline the model "
                                                 "improves on), averaged over structures"),
    "confidence_accuracy": ("", "orb-v3: fraction of atoms whose force-error bin the classifier predicts"),
    "rotational_grad_rms": ("eV", "orb-v3 conservative: norm of dE/d(rotation) (0 for a rotation-invariant energy), "
                                  "averaged over structures"),
}
ATOM_AVERAGED = ("forces_cosine", "confidence_accuracy")
STRESS_METRICS = ("loss_stress", "stress_mae")
STRESS_AVERAGED = ("stress_mae",)  # over the structures with a stress label (loss_stress: its share of the loss)


def metrics_from_sums(sums: Mapping[str, float], has_stress: bool = True,
                      keys: Optional[Iterable[str]] = None) -> Dict[str, float]:
    """Averages from sums over structures (over atoms for ``forces_cosine``, over the structures with a stress label
    for ``stress_mae``: none, none reported) and the counts ``num_graphs``, ``num_atoms`` and ``num_stress`` (else
    every structure); none when no structure was scored."""
    if float(sums["num_graphs"]) <= 0:  # (every step skipped, an fp16 overflow: no average, where it read as 0)
        return {}
    graphs, atoms = float(sums["num_graphs"]), max(float(sums["num_atoms"]), 1.0)
    with_stress = float(sums.get("num_stress", graphs))
    out = {}
    for key in keys or METRICS:
        if key not in sums or (not has_stress and key in STRESS_METRICS):
            continue
        if key in STRESS_AVERAGED and not with_stress:  # (an interval of structures without stress: left out, not 0)
            continue
        out[key] = float(sums[key]) / (atoms if key in ATOM_AVERAGED else with_stress if key in STRESS_AVERAGED
                                       else graphs)
    return out


def forces_by_element(error_sums: np.ndarray, atom_counts: np.ndarray) -> Dict[str, float]:
    """Force MAE of each element present, from per-atomic-number sums of the per-atom error (mean over x, y, z)
    and atom counts; keys are element symbols, in atomic-number order."""
    error_sums, atom_counts = np.asarray(error_sums, np.float64), np.asarray(atom_counts, np.float64)
    return {chemical_symbols[z]: float(error_sums[z] / atom_counts[z]) for z in range(1, len(atom_counts))
            if atom_counts[z] > 0}


def element_sums(numbers: np.ndarray, forces_pred: np.ndarray, forces: np.ndarray) -> np.ndarray:
    """(2, ELEMENT_BINS): per atomic number, the sum of |F_pred - F| averaged over x, y, z, and the atom count."""
    error = np.abs(np.asarray(forces_pred, np.float64) - forces).mean(1)
    return np.stack([np.bincount(numbers, error, ELEMENT_BINS), np.bincount(numbers, None, ELEMENT_BINS)])


def format_by_element(values: Mapping[str, float]) -> str:
    return ", ".join(f"{symbol} {value:.4g}" for symbol, value in values.items())


def structure_sums(energy_pred: float, energy: Optional[float], natoms: int, forces_pred: Optional[np.ndarray] = None,
                   forces: Optional[np.ndarray] = None, stress_pred: Optional[np.ndarray] = None,
                   stress: Optional[np.ndarray] = None) -> Dict[str, float]:
    """One structure's contribution to the physical metric sums (host side, float64) of the labels it carries
    (``energy`` None: forces or stress alone)."""
    out = {"num_graphs": 1.0, "num_atoms": float(natoms)}
    if energy is not None:
        out.update(energy_mae=abs(energy_pred - energy), energy_per_atom_mae=abs(energy_pred - energy) / natoms)
    if forces is not None:
        diff = np.abs(np.asarray(forces_pred, np.float64) - forces)
        norms = np.linalg.norm(forces_pred, axis=1) * np.linalg.norm(forces, axis=1)
        out["forces_mae"] = float(diff.mean())
        out["forces_cosine"] = float(((forces_pred * forces).sum(1) / np.maximum(norms, 1e-8)).sum())
        out["forces_within_0.03"] = float(diff.max() < FORCE_THRESHOLD)
    if stress is not None:
        out["stress_mae"] = float(np.abs(np.asarray(stress_pred, np.float64) - stress).mean())
    return out


def add_sums(total: Dict[str, float], *parts: Mapping[str, float]) -> Dict[str, float]:
    for part in parts:
        for key, value in part.items():
            total[key] = total.get(key, 0.0) + float(value)
    return total


def describe(keys: Sequence[str]) -> str:
    """A legend for the metrics in ``keys``: name [unit]: meaning, one per line."""
    known = dict(METRICS, **{BY_ELEMENT: BY_ELEMENT_MEANING})
    return "\n".join(f"  {k} [{known[k][0] or '-'}]: {known[k][1]}" for k in keys if k in known)
