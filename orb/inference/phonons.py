"""Phonons with phonopy: the displaced supercells phonopy asks for, their forces from an orb model (batched by
:class:`orb.inference.mechanics.SinglePoints`), frequencies on a mesh and along the standard band path.

phonopy is an optional dependency (``pip install phonopy``). The forces given to phonopy are each displaced
supercell's minus the perfect supercell's (phonopy's ``--fz``): what a relaxation left of the forces does not
enter the force constants, which are then symmetrised (phonopy's ``FC_SYMMETRY``: the acoustic sum rule). The band
path is ASE's standard one for the primitive cell phonopy finds (``ase.cell.Cell.bandpath``, Setyawan-Curtarolo;
phonopy's own automatic path needs seekpath, which is not a dependency).
"""

from typing import Dict, List, Optional, Sequence

import numpy as np

from orb.errors import OrbInputError

MISSING = ("phonons need phonopy, an optional dependency: pip install phonopy (in a checkout: pip install "
           "'.[properties]'); --no-phonons skips them")
SUPERCELL_WIDTH = 10.0  # Å: the automatic supercell is the smallest diagonal one this wide in every direction
ACOUSTIC = 3  # modes at Γ left out of the lowest frequency: those nearest zero (the sum rule's), whatever their sign


def require_phonopy() -> None:
    """One line naming the extra when phonopy cannot be imported."""
    try:
        import phonopy  # noqa: F401
    except ImportError:
        raise OrbInputError(MISSING) from None


def automatic_supercell(atoms, width: float = SUPERCELL_WIDTH) -> List[int]:
    """The smallest diagonal repetition of ``atoms``' cell at least ``width`` Å wide in each direction."""
    cell = np.asarray(atoms.cell.array, np.float64)
    volume = abs(np.linalg.det(cell))
    return [int(max(1, np.ceil(width * np.linalg.norm(np.cross(cell[(j + 1) % 3], cell[(j + 2) % 3])) / volume)))
            for j in range(3)]


def to_ase(cell):
    """A phonopy cell as ``ase.Atoms``."""
    from ase import Atoms

    return Atoms(numbers=cell.numbers, cell=cell.cell, scaled_positions=cell.scaled_positions, pbc=True)


class PhononJob:
    """One structure's phonons (with its atoms' masses): the supercells to compute, then frequencies from their
    forces."""

    def __init__(self, unit, supercell: Sequence[int], amplitude: float, symprec: float = 1e-5):
        from phonopy import Phonopy
        from phonopy.structure.atoms import PhonopyAtoms

        cell = PhonopyAtoms(symbols=unit.get_chemical_symbols(), cell=np.asarray(unit.cell.array),
                            scaled_positions=unit.get_scaled_positions(), masses=unit.get_masses())  # (ω ∝ m^-1/2)
        self.supercell = [int(n) for n in supercell]
        self.phonopy = Phonopy(cell, supercell_matrix=np.diag(self.supercell), primitive_matrix="auto",
                               symprec=symprec)
        self.phonopy.generate_displacements(distance=amplitude)

    def cells(self) -> List:
        """The perfect supercell, then every displaced one (``ase.Atoms``), in phonopy's order."""
        return [to_ase(self.phonopy.supercell)] + [to_ase(c) for c in self.phonopy.supercells_with_displacements]

    def force_constants(self, forces: Sequence[np.ndarray]) -> None:
        """Force constants from the forces of :meth:`cells` (the perfect supercell's subtracted), symmetrised."""
        forces = np.asarray(forces, np.float64)
        self.phonopy.forces = forces[1:] - forces[0]
        self.phonopy.produce_force_constants()
        self.phonopy.symmetrize_force_constants()

    def mesh(self, size: int, imaginary_below: float) -> Dict:
        """Frequencies (THz) on a Γ-centred ``size``³ mesh: the lowest (Γ's three acoustic modes, the three nearest
        zero, left out), the highest, and the modes below ``-imaginary_below`` THz (phonopy's negative numbers are
        imaginary frequencies), counted over the irreducible q-points."""
        self.phonopy.run_mesh([size] * 3, is_gamma_center=True)
        found = self.phonopy.mesh
        frequencies, qpoints = np.asarray(found.frequencies), np.asarray(found.qpoints)
        optical = frequencies.copy()
        gamma = np.flatnonzero(np.all(np.abs(qpoints) < 1e-12, axis=1))
        for g in gamma:  # the acoustic modes at Γ: zero by the sum rule, whatever the model (not the three lowest:
            optical[g, np.argsort(np.abs(optical[g]))[:ACOUSTIC]] = np.inf  # an imaginary optical mode is lower)
        lowest = float(optical.min()) if np.isfinite(optical).any() else float("nan")
        imaginary = int((optical < -imaginary_below).sum())
        return {"mesh": [size] * 3, "lowest_frequency": lowest, "max_frequency": float(frequencies.max()),
                "imaginary_modes": imaginary, "imaginary_below": -imaginary_below,
                "gamma_frequencies": [float(f) for f in np.sort(frequencies[gamma[0]])] if len(gamma) else [],
                "qpoints": qpoints, "weights": np.asarray(found.weights), "frequencies": frequencies}

    def band_path(self, points: int):
        """ASE's standard path through the Brillouin zone of phonopy's primitive cell, or None where ASE cannot
        tell the lattice."""
        from ase.cell import Cell

        try:
            return Cell(np.asarray(self.phonopy.primitive.cell)).bandpath(npoints=points)
        except Exception:  # a lattice ASE cannot classify: no bands, said in the report
            return None

    def bands(self, path) -> Optional[np.ndarray]:
        """Frequencies (THz) at the q-points of ``path`` (``band_path``'s, fractional in the primitive cell)."""
        if path is None:
            return None
        self.phonopy.run_qpoints(path.kpts)
        return np.asarray(self.phonopy.qpoints.frequencies)


def band_axis(path):
    """(x, special x, labels) of a band path, for the plot."""
    x, special, labels = path.get_linear_kpoint_axis()
    return np.asarray(x), np.asarray(special), ["Γ" if label == "G" else label for label in labels]
