"""Results per row of a database: those that take reading every row (neighbour counts, the row census), computed once,
in shares by the ranks of a data-parallel run, and kept in the project's cache (:mod:`orb.cache`); and the labels
that replace a database's own for some rows (:class:`LabelTable`: a model's predictions, for replay)."""

from dataclasses import dataclass
from typing import Callable, Optional, Protocol, Tuple

import numpy as np

from orb import cache
from orb.errors import ClusterError, ClusterInputError, OrbInputError


class Ranks(Protocol):
    """The processes of a data-parallel run as the data layer sees them (``DataParallel`` is one)."""

    rank: int
    world_size: int

    def sum(self, values: np.ndarray) -> np.ndarray:
        """Element-wise sum over all ranks of a small array (float64, the same bits on every rank)."""

    def sum_shares(self, values: np.ndarray) -> np.ndarray:
        """Element-wise sum over all ranks of an array each of whose elements at most one rank makes non-zero."""


class _OneProcess:
    rank, world_size = 0, 1

    @staticmethod
    def sum(values: np.ndarray) -> np.ndarray:
        return np.asarray(values, np.float64)

    sum_shares = sum


ONE_PROCESS: Ranks = _OneProcess()


class RowPass:
    """A result per row that takes reading every row of a database, computed once and kept in the project's cache.

    Keyed (:class:`orb.cache.CacheEntry`) by the database's identity (:meth:`orb.data.dataset.AseDbDataset.identity`), ``code`` and
    ``libraries`` (what computes it) and ``key`` (the settings it is computed with): any change to the rows or to
    what is computed misses the cache; a copy
    that keeps the modification time hits it. In a data-parallel run each rank computes its share of the
    rows and the shares are summed over ranks; every rank takes the same path (the cache is used only if
    every rank has it), so their collectives match, and a bad row found by one rank stops every rank at
    once.
    """

    def __init__(self, dataset, kind: str, code: Tuple[str, ...], key: tuple, width: int, what: str,
                 plausible: Callable[[np.ndarray], bool], libraries: Tuple[str, ...] = ()):
        self.dataset, self.kind, self.code, self.key, self.width = dataset, kind, code, key, width
        self.what, self.plausible, self.libraries = what, plausible, libraries
        self.read_from: Optional[str] = None  # the cache file the result came from
        self.kept_in: Optional[str] = None  # the cache file it was written to when computed

    def _valid(self, values: np.ndarray) -> bool:
        rows = len(self.dataset)
        return (values.dtype == np.int64 and values.ndim >= 1 and values.shape[0] == rows
                and values.reshape(rows, -1).shape[1] == self.width and self.plausible(values))

    def result(self, compute: Callable[[int, int], np.ndarray], ranks: Ranks) -> np.ndarray:
        # .npz: its zip CRC-32 finds damaged values (zeroed pages of a plain .npy were read back as a row count of 0)
        entry = cache.CacheEntry(self.kind, self.code, self.key + (self.dataset.identity(),), ".npz",  # before any
                                 self.libraries)  # row is read
        cached = entry.read(cache.load_values, self._valid)
        if cache.everyone_has(cached is not None, ranks):
            self.read_from = entry.read_from
            return cached
        rows = len(self.dataset)
        start, stop = (rows * r // ranks.world_size for r in (ranks.rank, ranks.rank + 1))
        share = np.zeros((rows, self.width), np.float64)
        failure = None
        try:
            share[start:stop] = (cached[start:stop] if cached is not None else compute(start, stop)).reshape(
                stop - start, self.width)
        except Exception as exc:  # a bad row, a damaged index, dead data workers: every rank stops (a stop signal,
            # not an Exception, is every rank's own)
            failure = exc
        # (the last two: ranks that found bad input, and other faults: every rank then exits with the status of
        # bad input, 2, even if msrun ends the rank that found it before that rank says so)
        bad_input = isinstance(failure, OrbInputError)
        total = ranks.sum_shares(np.concatenate([share.reshape(-1), [float(bad_input),  # (flags: small counts)
                                                                     float(failure is not None and not bad_input)]]))
        if failure is not None:
            raise failure
        if total[-2]:  # every rank stops now, not when the cluster notices the failed one
            raise ClusterInputError(f"{self.dataset.source}: another rank found bad input (a bad row or a damaged "
                                    f"file) while {self.what} (its log names it)")
        if total[-1]:
            raise ClusterError(f"{self.dataset.source}: another rank failed while {self.what} (its log says why)")
        values = np.rint(total[:-2]).astype(np.int64).reshape((rows,) if self.width == 1 else (rows, self.width))
        self.kept_in = entry.write(lambda tmp: np.savez(tmp, values=values),
                                   f"{self.kind.replace('_', ' ')} of {self.dataset.source}")
        return values


@dataclass
class LabelTable:
    """Labels that replace a database's own for some of its rows (e.g. a model's predictions).

    ``positions``: the dataset positions labelled, ascending; for the k-th of them ``energy[k]`` (eV),
    ``forces[offsets[k]:offsets[k + 1]]`` (eV/Å) and ``stress[k]`` (eV/Å^3 Voigt, or no stress at all).
    """

    positions: np.ndarray
    energy: np.ndarray
    forces: np.ndarray
    offsets: np.ndarray
    stress: Optional[np.ndarray] = None

    def find(self, position: int) -> int:
        k = int(np.searchsorted(self.positions, position))
        if k == len(self.positions) or self.positions[k] != position:
            raise KeyError(position)
        return k

    def labels(self, position: int) -> Tuple[float, np.ndarray, Optional[np.ndarray]]:
        k = self.find(position)
        stress = None if self.stress is None else np.asarray(self.stress[k], np.float64)
        return float(self.energy[k]), np.asarray(self.forces[self.offsets[k]:self.offsets[k + 1]], np.float64), stress
