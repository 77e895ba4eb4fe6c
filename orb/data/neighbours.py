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
