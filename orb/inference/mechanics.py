"""Relaxed cells, equations of state and elastic tensors from an orb model, the many single points batched.

Every cell this needs (the volumes of an equation of state, the strained cells of the elastic tensor, phonopy's
displaced supercells) is independent of the others: :class:`SinglePoints` computes them through the batched
predictor, many structures per compiled call (:mod:`orb.inference.predictor`, as orb-evaluate and orb-md do),
each graph built exactly as :class:`orb.inference.calculator.ORBCalculator` builds it, so the numbers are the
calculator's. Relaxations are :class:`orb.inference.relax.BatchRelaxer`'s (FIRE, ``FrechetCellFilter`` for the
cell), as orb-relax's.
"""

import warnings
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np

from orb.errors import RunError

VOIGT_PAIRS = ((0, 0), (1, 1), (2, 2), (1, 2), (0, 2), (0, 1))  # ASE's Voigt order: xx yy zz yz xz xy
MAX_BATCH_ATOMS = 4096  # a batch of large supercells is cut to about this many atoms (memory of one call)


class SinglePoints:
    """Energy, forces and stress of many structures, ``batch_size`` per compiled call."""

    def __init__(self, model, batch_size: int = 16, predictor=None):
        from orb.inference.predictor import Predictor

        self.model, self.batch_size = model, batch_size
        self.settings = model.cfg.graph_settings()
        self.predictor = predictor or Predictor(model)
        self.calls = 0
        self.structures = 0

    def batches(self, structures: Sequence) -> List[List[int]]:
        """Consecutive positions of ``structures``: at most ``batch_size`` structures and, past one structure,
        about MAX_BATCH_ATOMS atoms each."""
        batches, current, atoms = [], [], 0
        for i, s in enumerate(structures):
            if current and (len(current) == self.batch_size or atoms + len(s) > MAX_BATCH_ATOMS):
                batches.append(current)
                current, atoms = [], 0
            current.append(i)
            atoms += len(s)
        return batches + ([current] if current else [])

    def __call__(self, structures: Sequence, keys: bool = False, stop: Callable[[], None] = lambda: None,
                 progress: Callable[[int], None] = lambda n: None) -> List[Dict]:
        """Each structure's ``energy`` (eV), ``forces`` (eV/Å) and ``stress`` (eV/Å³, ASE's Voigt order); with
        ``keys`` also ``neighbours``, the fingerprint of the neighbour sets of its graph (:func:`neighbour_key`).
        ``stop()`` is called between calls (a stop signal), ``progress(n)`` after each."""
        from orb.data.batching import batch_graphs
        from orb.data.graphs import atoms_to_graph
        from orb.inference.crystals import neighbour_key
        from orb.inference.predictor import per_structure

        results: List[Optional[Dict]] = [None] * len(structures)
        for batch in self.batches(structures):
            stop()
            graphs = [atoms_to_graph(structures[i], settings=self.settings, float64=self.predictor.float64)
                      for i in batch]
            parts = per_structure(self.predictor(batch_graphs(graphs)), [len(structures[i]) for i in batch])
            self.calls += 1
            self.structures += len(batch)
            for i, graph, part in zip(batch, graphs, parts):
                part.pop("confidence", None)
                if not all(np.all(np.isfinite(value)) for value in part.values()):
                    raise RunError(f"the model's energy, forces or stress of {structures[i].get_chemical_formula()} "
                                   "are not finite")
                if keys:
                    part["neighbours"] = neighbour_key(structures[i], graph)
                results[i] = part
            progress(len(batch))
        return results


def relax_all(relaxer, structures: Sequence, stop: Callable[[], bool] = lambda: False) -> List[Dict]:
    """``structures`` relaxed together by ``relaxer`` (a :class:`BatchRelaxer`, its cell relaxed or not): each one's
    relaxed atoms (copies: the inputs are left as they are), ``converged`` and ``steps``."""
    done: Dict[int, Dict] = {}

    def finished(r, converged: bool) -> None:
        done[r.source_row] = {"atoms": r.atoms, "converged": bool(converged), "steps": int(r.steps),
                              "stress": r.atoms.calc.results.get("stress")}

    def failed(r) -> None:
        raise RunError(f"relaxing {r.atoms.get_chemical_formula()}: {r.error}")

    relaxer.run(((i, s.copy()) for i, s in enumerate(structures)), finished, stop=stop, on_failed=failed)
    return [done[i] for i in range(len(structures))] if len(done) == len(structures) else []


def scaled_cells(atoms, volume_span: float, points: int) -> List:
    """``atoms`` scaled isotropically to ``points`` volumes evenly spaced over ±``volume_span`` of its own (the
    atoms' fractional coordinates kept)."""
    cells = []
    for factor in np.linspace(1.0 - volume_span, 1.0 + volume_span, points):
        scaled = atoms.copy()
        scaled.set_cell(atoms.cell.array * factor ** (1.0 / 3.0), scale_atoms=True)
        cells.append(scaled)
    return cells


def fit_eos(volumes: Sequence[float], energies: Sequence[float], natoms: int) -> Dict:
    """ASE's Birch-Murnaghan fit (``ase.eos.EquationOfState``): the minimum energy and volume per atom (eV, Å³) and
    the bulk modulus (GPa), with the points fitted."""
    from ase.eos import EquationOfState
    from ase.units import GPa

    eos = EquationOfState(list(volumes), list(energies), eos="birchmurnaghan")
    with warnings.catch_warnings():  # ASE's warning of a minimum outside the volumes: said in the result instead
        warnings.simplefilter("ignore")
        try:
            v0, e0, b = eos.fit()
        except (RuntimeError, ValueError):  # scipy's "Optimal parameters not found": that structure's result
            return failed_eos(volumes, energies, natoms)
    return {"energy_per_atom": float(e0) / natoms, "volume_per_atom": float(v0) / natoms,
            "bulk_modulus": float(b) / GPa, "volumes": [float(v) for v in volumes],
            "energies": [float(e) for e in energies], "natoms": int(natoms),
            "fit": [float(p) for p in eos.eos_parameters],
            "minimum_inside": bool(min(volumes) <= v0 <= max(volumes))}  # (E0, B0, B0', V0) of ase.eos.birchmurnaghan


def failed_eos(volumes: Sequence[float], energies: Sequence[float], natoms: int) -> Dict:
    """:func:`fit_eos`'s result where the fit found no minimum: the points, no numbers, and ``failed``, the reason
    the report gives."""
    span = (max(volumes) - min(volumes)) / (max(volumes) + min(volumes))
    nan = float("nan")
    return {"energy_per_atom": nan, "volume_per_atom": nan, "bulk_modulus": nan,
            "volumes": [float(v) for v in volumes], "energies": [float(e) for e in energies], "natoms": int(natoms),
            "fit": None, "minimum_inside": False,
            "failed": f"EOS fit failed: the energy has no minimum in the volumes ±{100 * span:.3g} %"}


def strain_matrix(component: int, amount: float) -> np.ndarray:
    """The symmetric strain tensor of Voigt component ``component`` (0-5) of size ``amount`` (engineering strain
    for the shears: each off-diagonal entry ``amount / 2``)."""
    strain = np.zeros((3, 3))
    p, q = VOIGT_PAIRS[component]
    strain[p, q] += amount if p == q else amount / 2
    if p != q:
        strain[q, p] += amount / 2
    return strain


def strained_cells(atoms, amplitudes: Sequence[float]) -> List:
    """``atoms`` under each Voigt strain component at ``-a, +a`` for every amplitude ``a`` (order: component, then
    amplitude, then sign), atoms moved with the cell."""
    cells = []
    for component in range(6):
        for amount in amplitudes:
            for sign in (-1.0, 1.0):
                strained = atoms.copy()
                deformation = np.eye(3) + strain_matrix(component, sign * amount)
                strained.set_cell(atoms.cell.array @ deformation.T, scale_atoms=True)
                cells.append(strained)
    return cells


def strain_labels(amplitudes: Sequence[float]) -> List[str]:
    """Names of :func:`strained_cells`' strains, in their order: Voigt component and signed amount (``ε4 -0.5 %``)."""
    return [f"ε{component + 1} {sign * amount * 100:+g} %" for component in range(6) for amount in amplitudes
            for sign in (-1.0, 1.0)]


def elastic_tensor(stresses: Sequence[np.ndarray], amplitudes: Sequence[float]) -> np.ndarray:
    """The 6x6 elastic tensor (GPa, Voigt) from the stresses of :func:`strained_cells`: each column the central
    difference of the stress at each amplitude, Richardson-extrapolated over the amplitudes (two amplitudes: the
    O(h^2) error of each removed; ±0.5 % and ±1 % give the five-point derivative)."""
    from ase.units import GPa

    h = np.asarray(amplitudes, np.float64)
    s = np.asarray(stresses, np.float64).reshape(6, len(h), 2, 6) / GPa
    central = (s[:, :, 1, :] - s[:, :, 0, :]) / (2.0 * h[None, :, None])  # (component, amplitude, stress)
    if len(h) == 1:
        columns = central[:, 0, :]
    else:  # a + b h^2 through the central differences: a, least squares over the amplitudes
        design = np.column_stack([np.ones_like(h), h ** 2])
        columns = np.stack([np.linalg.lstsq(design, central[j], rcond=None)[0][0] for j in range(6)])
    return columns.T  # C[i, j] = d stress_i / d strain_j


def smallest_stiffness(c: np.ndarray) -> float:
    """The smallest eigenvalue of the elastic tensor's symmetric part (GPa): Born's criterion of mechanical stability
    in its general form is that it be positive (every strain costs energy); cubic crystals' C11 > |C12|, C44 > 0."""
    c = np.asarray(c, np.float64)
    if not np.isfinite(c).all():  # (a model's NaN stress: no criterion, not "unstable"; eigvalsh fails on inf)
        return float("nan")
    return float(np.linalg.eigvalsh((c + c.T) / 2.0).min())


def bulk_modulus_voigt(c: np.ndarray) -> float:
    """Voigt's bulk modulus of an elastic tensor (GPa)."""
    return float((c[0, 0] + c[1, 1] + c[2, 2] + 2.0 * (c[0, 1] + c[0, 2] + c[1, 2])) / 9.0)


def lattice(atoms, repeat: Sequence[int] = (1, 1, 1)) -> Dict:
    """Lattice lengths (Å, per unit of a repeated cell) and angles (degrees), and the volume per atom (Å³)."""
    a, b, c, alpha, beta, gamma = atoms.cell.cellpar()
    return {"a": float(a / repeat[0]), "b": float(b / repeat[1]), "c": float(c / repeat[2]), "alpha": float(alpha),
            "beta": float(beta), "gamma": float(gamma), "volume_per_atom": float(atoms.get_volume() / len(atoms))}
