"""Each atom's k nearest periodic images within a cutoff: the search behind both graph constructions.

The candidates are every atom shifted by every given lattice translation (orb-v2: the 27 cells
around the home cell; orb-v3: the minimal supercell); an atom's own untranslated copy is
excluded. ``neighbours.cc`` does the search natively (a cell list that also writes the edges, so
no per-edge numpy work remains: graphs ~2.5x faster on MPtrj rows, docs/benchmarks.md), built
once per machine (``orb.native``); without a C++ compiler the same search runs on scipy's k-d tree.
Both return the same edges except among candidates at exactly equal distance around the k-th
neighbour, where the native search takes the lower candidate index and the tree any of them.
"""

import ctypes
import os
from functools import lru_cache
from typing import Tuple

import numpy as np
from scipy.spatial import cKDTree

from orb.errors import StructureError
from orb.native import build

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "neighbours.cc")
Edges = Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]  # senders, receivers, vectors, unit shifts


@lru_cache(maxsize=1)
def native_search():
    """The compiled search function, or None when it cannot be built (the k-d tree is used)."""
    path = build(SOURCE, "building graphs with scipy's k-d tree (about 2.5x slower); install g++ to speed it up")
    if path is None:
        return None
    function = ctypes.CDLL(path).orb_knn_edges
    pointer, int64 = ctypes.c_void_p, ctypes.c_int64
    function.argtypes = [pointer, int64, pointer, pointer, int64, int64, ctypes.c_int32, ctypes.c_double,
                         pointer, pointer, pointer, pointer]
    function.restype = int64
    return function


def _native_edges(search, positions, translations, shifts, self_image: int, k: int, cutoff: float) -> Edges:
    n = len(positions)
    senders, receivers = np.empty(n * k, np.int64), np.empty(n * k, np.int64)
    vectors, unit_shifts = np.empty((n * k, 3), np.float32), np.empty((n * k, 3), np.float32)
    count = search(positions.ctypes.data, n, translations.ctypes.data, shifts.ctypes.data, len(translations),
                   self_image, k, cutoff, senders.ctypes.data, receivers.ctypes.data, vectors.ctypes.data,
                   unit_shifts.ctypes.data)
    if count < 0:
        raise MemoryError(f"out of memory searching the neighbours of {n} atoms in {len(translations)} images")
    return senders[:count], receivers[:count], vectors[:count], unit_shifts[:count]


def tree_edges(positions, translations, shifts, self_image: int, k: int, cutoff: float) -> Edges:
    """The portable search (scipy's k-d tree over all candidates), same contract as :func:`nearest_images`."""
    n = len(positions)
    candidates = (positions[None, :, :] + translations[:, None, :]).reshape(-1, 3)
    columns = min(k + 1, len(candidates))
    tree = cKDTree(candidates, balanced_tree=False, compact_nodes=False)  # 2-3x faster to build, same answers
    dist, idx = tree.query(positions, k=columns, distance_upper_bound=cutoff)
    dist, idx = dist.reshape(n, columns), idx.reshape(n, columns)
    own = idx == (self_image * n + np.arange(n))[:, None]
    if columns == k + 1:  # at most k each: without itself (coincident atoms), the farthest goes
        own[:, -1] |= ~own.any(axis=1)
    keep = ~own & (dist < cutoff)
    senders = np.repeat(np.arange(n, dtype=np.int64), keep.sum(axis=1))
    images = idx[keep]
    return senders, images % n, candidates[images] - positions[senders], shifts[images // n]


def nearest_images(positions: np.ndarray, translations: np.ndarray, shifts: np.ndarray, self_image: int, k: int,
                   cutoff: float) -> Edges:
    """Directed edges from each atom to its ``k`` nearest candidates closer than ``cutoff`` (Å, strict),
    grouped by sender, nearest first.

    ``positions`` (n, 3) and ``translations`` (t, 3) are float32; candidate ``image * n + atom`` is
    ``positions[atom] + translations[image]``, and ``translations[self_image]`` is zero. Returns
    senders, receivers (atom indices), vectors (candidate minus sender, float32) and each edge's
    ``shifts[image]`` (the integer cell offset of the receiver's image, float32).
    """
    positions = np.ascontiguousarray(positions, np.float32)
    translations = np.ascontiguousarray(translations, np.float32)
    shifts = np.ascontiguousarray(shifts, np.float32)
    search = native_search()
    if search is None:
        return tree_edges(positions, translations, shifts, self_image, k, cutoff)
    return _native_edges(search, positions, translations, shifts, self_image, k, cutoff)


MAX_IMAGE_OFFSETS = 1_000_000  # a cell whose search box is larger (heights under ~0.05 Å): refused, not a hang


def minimal_supercell_offsets(cell: np.ndarray, radius: float) -> np.ndarray:
    """Integer offsets of every cell image that can hold a neighbour within ``radius`` (sorted, float32).

    A neighbour's image ``n`` of an atom at fractional distance ``f`` (each component in (-1, 1), positions wrapped)
    lies at ``(n + f) @ cell``; within ``radius`` only if ``|n_k| < h_k + 1`` on each axis (``h_k``: the radius over
    the cell's height along it) and ``|n @ cell|`` minus the cube's reach along that direction is within it. Every
    offset passing both is searched: the offsets of orb-models 0.5.5 (the lattice points within the radius, each
    widened by one cell, from [-4, 4]^3), whose neighbours and their order it keeps, and those a short or skewed
    lattice vector needs beyond them (a 0.9 Å vector lost 4 % of the neighbours, a skewed 2-atom cell 43 %)."""
    if radius > 6.0:
        raise StructureError(f"orb-v3 graphs are validated for radii up to 6 Å, got {radius}")
    cell64 = np.asarray(cell, np.float64)
    reach = np.floor(radius * np.linalg.norm(np.linalg.inv(cell64), axis=0) + 1 + 1e-6).astype(np.int64)
    if np.prod(2 * reach + 1) > MAX_IMAGE_OFFSETS:
        faces = np.linalg.norm(np.cross(cell64[[1, 2, 0]], cell64[[2, 0, 1]]), axis=1)
        heights = np.abs(np.linalg.det(cell64)) / faces
        shown = ", ".join(f"{h:.3g}" for h in heights)
        raise StructureError(f"a cell this thin (heights {shown} Å) needs more than {MAX_IMAGE_OFFSETS:,} periodic "
                             f"images for a neighbour search within {radius} Å: give it in a reduced basis "
                             "(ase.build.niggli_reduce) or as a supercell")
    box = np.stack(np.meshgrid(*(np.arange(-r, r + 1) for r in reach), indexing="ij"), -1).reshape(-1, 3)
    vectors = box @ cell64
    length = np.sqrt(np.einsum("ij,ij->i", vectors, vectors))
    spread = np.abs(vectors @ cell64.T).sum(axis=1) / np.maximum(length, 1e-300)  # the cube's reach towards it
    # (lexicographic, as orb-models' torch.unique(dim=0): meshgrid's "ij" order)
    return box[length - spread <= radius + 1e-4].astype(np.float32)
