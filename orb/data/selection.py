"""Choosing replay structures: a held-out validation part, then a diverse or random sample of the rest.

Every choice is a pure function of the seed and the inputs, so each data-parallel rank and a resumed
run choose the same structures.
"""

from typing import Tuple

import numpy as np


def hold_out(count: int, held_out: int, seed: int) -> Tuple[np.ndarray, np.ndarray]:
    """(kept, held out) positions of ``count`` items, ``held_out`` of them chosen at random; both ascending."""
    order = np.random.default_rng([seed, 3]).permutation(count)
    return np.sort(order[held_out:]), np.sort(order[:held_out])


def random_sample(candidates: np.ndarray, count: int, seed: int) -> np.ndarray:
    """``count`` of ``candidates`` chosen at random (ascending)."""
    order = np.random.default_rng([seed, 4]).permutation(len(candidates))
    return np.sort(np.asarray(candidates)[order[:count]])


def farthest_point_sampling(points: np.ndarray, count: int, seed: int) -> np.ndarray:
    """Indices of ``count`` rows of ``points`` (n, d), chosen greedily: the first at random (seeded), each next one
    the row farthest (Euclidean, float64) from every row chosen so far; in the order chosen.

    Exact, O(n x count x d): covering the space spanned by the candidates, not its dense regions, is what
    keeps rare chemistry in a small replay sample.
    """
    x = np.asarray(points, np.float64)
    n = len(x)
    count = min(int(count), n)
    chosen = np.empty(count, np.int64)
    if count == 0:
        return chosen
    chosen[0] = np.random.default_rng([seed, 5]).integers(n)
    nearest = np.square(x - x[chosen[0]]).sum(1)  # squared distance to the nearest chosen row
    for k in range(1, count):
        chosen[k] = int(np.argmax(nearest))
        np.minimum(nearest, np.square(x - x[chosen[k]]).sum(1), out=nearest)
    return chosen
