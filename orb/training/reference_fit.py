"""Per-element reference energies fitted to the user's DFT before fine-tuning (``reference_energies.fit``).

A foundation model's energy zero is its training data's code and functional. Data from another
setup (another code, pseudopotentials, functional) differs mostly by a per-element constant, which
the network would otherwise spend its first epochs learning. With N the (structures x elements)
matrix of atom counts and E the DFT energies, the per-element change d of the reference energies
minimises || N d - (E - baseline) ||^2:

* ``residual``: baseline = the starting model's predicted energies (MACE's "estimated" E0s): the
  model's energy zero moves to the user's setup and the network's interaction energies are kept;
* ``least_squares``: baseline = the checkpoint's reference energies alone, so the fitted table
  explains the DFT energies by itself (MACE's "average").

Each structure counts with its loss weight (one of weight 0 not at all). Elements absent from the data keep the
checkpoint's values. Directions the data cannot separate
(elements that only ever occur in one ratio, e.g. only H2O) get the smallest change (a tiny ridge),
so the foundation's split between them stays; their count is reported as the rank deficit.
"""

from dataclasses import dataclass, field
from typing import Dict, List, Optional

import numpy as np
from ase.data import chemical_symbols
from scipy import sparse

FIT_METHODS = ("residual", "least_squares")
MAX_Z = 118
RIDGE = 1e-9  # relative to the largest diagonal entry of N^T N: only breaks ties the data leaves open


@dataclass
class ReferenceFit:
    method: str
    table: np.ndarray  # (118,) the new reference energies, eV per atom, index = atomic number
    elements: List[int]  # atomic numbers present in the data (fitted)
    change: Dict[str, float] = field(default_factory=dict)  # symbol -> eV per atom added
    rank: int = 0
    structures: int = 0
    rmse_before: float = 0.0  # eV/atom, of (E - baseline) / atoms
    rmse_after: float = 0.0  # eV/atom, after the fitted shift

    def summary(self) -> str:
        deficit = len(self.elements) - self.rank
        shifts = ", ".join(f"{s} {v:+.4f}" for s, v in self.change.items())
        return (f"reference energies fitted ({self.method}) to {self.structures} structures: per-atom energy error "
                f"{self.rmse_before:.4g} -> {self.rmse_after:.4g} eV/atom (RMS); change per element (eV/atom): "
                f"{shifts}" + (f"; {deficit} direction(s) the data cannot separate kept at the checkpoint's split"
                               if deficit else ""))

    def to_dict(self) -> Dict:
        return {"method": self.method, "change": self.change, "rank": self.rank, "structures": self.structures,
                "rmse_before": self.rmse_before, "rmse_after": self.rmse_after,
                "table": {chemical_symbols[z]: float(self.table[z]) for z in self.elements}}


def count_matrix(positions: np.ndarray, numbers: np.ndarray, counts: np.ndarray, structures: int,
                 width: int) -> sparse.csr_matrix:
    """The (structures x width) atom-count matrix from (structure, atomic number, count) triples."""
    return sparse.csr_matrix((counts.astype(np.float64), (positions, numbers)), shape=(structures, width))


def fit_reference_energies(method: str, composition, energy: np.ndarray, baseline: np.ndarray,
                           current: np.ndarray, weights: Optional[np.ndarray] = None) -> ReferenceFit:
    """Fit the change of the reference energies ``current`` (118,) to ``energy - baseline`` (per structure, eV).

    ``composition``: (structure position, atomic number, count) triples (``AseDbDataset.composition``);
    ``weights``: each structure's loss weight, which weighs it here too (a structure the user set to 0, e.g. a
    label not trusted, moved the reference energies it was not trained on).
    """
    if method not in FIT_METHODS:
        raise ValueError(f"unknown fit method {method!r}; valid: {FIT_METHODS}")
    current = np.asarray(current, np.float64)
    weights = np.ones(len(energy)) if weights is None else np.asarray(weights, np.float64)
    counted = weights > 0
    n_matrix = count_matrix(*composition, len(energy), MAX_Z + 1)
    atoms = np.asarray(n_matrix.sum(1)).reshape(-1)
    present = np.flatnonzero(np.asarray(n_matrix[counted].sum(0)).reshape(-1) > 0)
    present = present[(present > 0) & (present < len(current))]  # Z = 118 has no reference energy (always 0)
    sub = n_matrix[:, present]
    residual = np.asarray(energy, np.float64) - np.asarray(baseline, np.float64)
    weighted = sparse.diags(weights) @ sub
    gram = (sub.T @ weighted).toarray()
    rhs = weighted.T @ residual
    ridge = RIDGE * max(float(np.max(np.diag(gram))), 1.0)
    delta = np.linalg.solve(gram + ridge * np.eye(len(present)), rhs)
    rank = int(np.linalg.matrix_rank(gram, tol=1e-8 * max(float(np.max(np.abs(gram))), 1.0)))
    table = current.copy()
    table[present] += delta
    after = residual - sub @ delta
    return ReferenceFit(
        method=method, table=table, elements=[int(z) for z in present],
        change={chemical_symbols[z]: float(d) for z, d in zip(present, delta)}, rank=rank,
        structures=int(counted.sum()), rmse_before=_weighted_rms(residual / atoms, weights),
        rmse_after=_weighted_rms(after / atoms, weights))


def _weighted_rms(values: np.ndarray, weights: np.ndarray) -> float:
    return float(np.sqrt(np.sum(weights * np.square(values)) / max(float(np.sum(weights)), 1e-300)))


def reference_baseline(composition, structures: int, current: np.ndarray) -> np.ndarray:
    """Each structure's energy from the reference energies alone (the ``least_squares`` baseline)."""
    table = np.zeros(MAX_Z + 1)
    table[:len(current)] = current
    return count_matrix(*composition, structures, MAX_Z + 1) @ table


def table_of_record(record: Dict, current: np.ndarray) -> np.ndarray:
    """The table a checkpoint's ``reference_energies_fit`` record (:meth:`ReferenceFit.to_dict`) holds, over
    ``current`` (the elements the data did not have keep their values)."""
    table = np.asarray(current, np.float64).copy()
    for symbol, value in record["table"].items():
        table[chemical_symbols.index(symbol)] = value
    return table
