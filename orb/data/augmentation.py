"""Random rotations of a structure with its labels (training augmentation): positions, cell and forces as row
vectors x @ R, the stress tensor as R^T S R."""

import numpy as np


def voigt_to_matrix(stress: np.ndarray) -> np.ndarray:
    """ASE Voigt order [xx, yy, zz, yz, xz, xy] to a symmetric 3x3 matrix."""
    xx, yy, zz, yz, xz, xy = stress
    return np.array([[xx, xy, xz], [xy, yy, yz], [xz, yz, zz]])


def matrix_to_voigt(m: np.ndarray) -> np.ndarray:
    """Symmetric 3x3 matrix to ASE Voigt order [xx, yy, zz, yz, xz, xy]."""
    return np.array([m[0, 0], m[1, 1], m[2, 2], m[1, 2], m[0, 2], m[0, 1]])


def random_rotation(rng: np.random.Generator) -> np.ndarray:
    """A uniformly random proper rotation matrix (Haar measure, det = +1)."""
    q, r = np.linalg.qr(rng.standard_normal((3, 3)))
    q = q * np.sign(np.diag(r))
    if np.linalg.det(q) < 0:
        q[:, 0] = -q[:, 0]
    return q


def rotate_structure(positions, cell, forces, stress, rotation):
    """Rotate row-vector quantities as x @ R and the stress tensor as R^T S R.

    orb-models 0.4.2 rotates stress as R S R^T, which is wrong for row-vector rotation
    (fixed in later releases); the rule here is checked against EMT on a rotated cell.
    """
    positions = positions @ rotation
    cell = cell @ rotation
    forces = None if forces is None else forces @ rotation
    if stress is not None:
        stress = matrix_to_voigt(rotation.T @ voigt_to_matrix(stress) @ rotation)
    return positions, cell, forces, stress
