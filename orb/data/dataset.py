"""ASE SQLite databases of DFT-labelled structures as orb graphs, read lazily row by row.

Labels are the calculator columns ``row.energy`` (eV), ``row.forces`` (eV/Å) and ``row.stress`` (eV/Å^3, Voigt,
ASE sign), what ``db.write(atoms)`` stores for an ``Atoms`` with a ``SinglePointCalculator`` (MPtrj's convention), or a
:class:`LabelTable` that replaces them (a model's predictions, for replay). Stress is optional: a database where no row
has stress trains without the stress loss, and a row without stress among rows with one weighs its stress at 0. A
row's ``weight`` key-value pair scales its share of the loss (default 1).
"""

import hashlib
import logging
import os
import sqlite3
from typing import Callable, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from orb.data.row_results import ONE_PROCESS, LabelTable, Ranks, RowPass
from orb.errors import DatasetError, StructureError
from orb.data.formats import LABEL_NAMES, check_sqlite_file, say_not_carried, storable_pairs
from orb.data.labels import (checked_labels, missing_label, said_if_implausible, said_if_too_close,
                             stress_implausible)
from orb.data.weights import read_weights_in_data, stored_weights
from orb.data.sqlite_rows import TABLE_QUERIES, RowReader, change_counters, structures_digest
from orb.data.augmentation import random_rotation, rotate_structure
from orb.data.graphs import (EDGE_CAPACITY_MARGIN, MISSING_STRESS, AtomGraphs, GraphSettings,
                             capacity_is_counted, check_no_overlap_before_graphs, edge_capacity, graph_from_arrays,
                             structure_periodicity, total_charge_or_spin)

log = logging.getLogger("orb")

GRAPH_CODE = ("orb.data.graphs", "orb.data.neighbours", "orb.native")  # the code that builds graphs
# what the neighbour counts' cache is computed by (orb.cache), and the row census's: the rows' reader and decoder
# (ase's for key-value pairs), and the structure checks
CAPACITY_CODE = ("orb.data.dataset", "orb.data.row_results", "orb.data.sqlite_rows") + GRAPH_CODE
CENSUS_CODE = ("orb.data.dataset", "orb.data.row_results", "orb.data.sqlite_rows", "orb.data.augmentation",
               "orb.data.weights", "orb.data.labels") + GRAPH_CODE  # (labels: the checks of each label)
CENSUS_LIBRARIES = ("ase",)
CAPACITY_CACHE = "neighbour_counts"  # the subfolder of the project's cache (``orb.cache``)
CENSUS_CACHE = "row_census"
LABELS = ("energy", "forces", "stress")
# The census's columns per row: each label stored, then whether its weight is in row.data, whether two atoms are
# closer than CLOSE and whether its stress is beyond STRESS_PLAUSIBLE (the last two said by the main process: a data
# worker's warnings are not shown, and later starts read the census from the cache)
CENSUS_COLUMNS = len(LABELS) + 3
WEIGHT_IN_DATA, TOO_CLOSE, STRESS_UNITS = len(LABELS), len(LABELS) + 1, len(LABELS) + 2
UNITS_SHARE = 0.1  # of the rows with stress beyond STRESS_PLAUSIBLE, before other units are suspected


def _plausible_flags(flags: np.ndarray) -> bool:  # (a function: datasets travel to the data workers pickled)
    return bool(np.isin(flags, (0, 1)).all())


class AseDbDataset:
    """Lazy, validated access to an ASE SQLite database as :class:`AtomGraphs`.

    Up front only row ids and atom counts are read, from ASE's small species table (not the rows).
    Every row's labels are checked once by the census (:meth:`census`: each row read, a bad one
    named before training; the result kept in the project's cache, so later starts read nothing),
    which also tells which labels the rows carry. Each item is read and turned into a graph when asked
    for. ``require_labels=False`` allows rows without energy or forces (prediction only). With labels required, a
    row without stress among rows with one, or in a set beside training data with stress
    (:meth:`mark_missing_stress`), is given MISSING_STRESS.
    ``settings`` chooses the model family's graph (default: orb-v2's with ``radius`` and
    ``max_neighbors``). ``charge_spin`` (OMol models) requires each row's total charge and spin:
    key-value pairs ``charge`` and ``spin`` (``db.write(atoms, charge=0, spin=1)``) or entries of
    ``row.data``; ``charge_spin_keys`` names them otherwise in a database of the user's own (an indexed copy
    of other formats holds them under ``charge`` and ``spin`` already, read with those keys when it was made).
    """

    def __init__(
        self,
        path: str,
        radius: float = 10.0,
        max_neighbors: int = 20,
        augmentation: bool = False,
        require_labels: bool = True,
        settings: Optional[GraphSettings] = None,
        charge_spin: bool = False,
        charge_spin_keys: Tuple[str, str] = ("charge", "spin"),
        labels: bool = True,
    ):
        self.path = str(path)
        self.settings = settings or GraphSettings(float(radius), int(max_neighbors))
        self.radius, self.max_neighbors = self.settings.radius, self.settings.max_neighbors
        self.augmentation = augmentation
        self._edge_capacities: Optional[np.ndarray] = None
        self._labels_stored: Optional[np.ndarray] = None  # per row: energy, forces, stress stored (the census)
        self.require_labels = require_labels
        self.labels = labels  # False: the rows' labels and weights are not read (orb-relax, orb-md, orb-properties)
        self.charge_spin = charge_spin
        self.float64 = False  # graphs in float64 (precision float64: set by the model's user)
        self.label_table: Optional[LabelTable] = None
        self.stress_trained = False  # the run trains stress: see mark_missing_stress
        check_sqlite_file(self.path)
        self.rows = RowReader(path if isinstance(path, str) else self.path)
        self.sources: list = self.rows.sources()
        self.charge_spin_keys = tuple(charge_spin_keys) if not self.sources else ("charge", "spin")  # where read
        self.charge_spin_names = tuple(charge_spin_keys)  # what the user calls them (for messages)
        self._fingerprint: Optional[str] = None
        self.ids, self.natoms = self._scan()
        self.capacity_pass = RowPass(self, CAPACITY_CACHE, CAPACITY_CODE, (EDGE_CAPACITY_MARGIN, repr(self.settings)),
                                     1, "counting neighbours", self._plausible_capacities)
        self.census_pass = RowPass(self, CENSUS_CACHE, CENSUS_CODE, (charge_spin, self.charge_spin_keys,
                                                        require_labels, self.settings.minimal_supercell, labels),
                                   CENSUS_COLUMNS, "checking the rows", _plausible_flags, CENSUS_LIBRARIES)
        self.weights = stored_weights(self) if labels else np.ones(len(self.ids))  # (labels: also their weights)

    def _scan(self) -> Tuple[np.ndarray, np.ndarray]:
        """Row ids and atom counts from ASE's species table (a few bytes per element of a row, not the rows)."""
        rows = self._read_table("atoms")
        (count,) = self._read("SELECT COUNT(*) FROM systems")[0]  # (through one of ASE's indexes: no row is read)
        if count != len(rows):  # a row without atoms has no species entry: it was left out without a word
            empty = self._read("SELECT id FROM systems WHERE natoms = 0 ORDER BY id LIMIT 1")
            raise self.error_at("structure has no atoms", int(empty[0][0]) if empty else None)
        if not rows:
            raise self.error_at("database has no rows")
        ids, natoms = np.array(rows, dtype=np.int64).T
        return ids, natoms

    def _plausible_capacities(self, capacities: np.ndarray) -> bool:
        return bool((capacities >= 0).all() and (capacities <= self.natoms * self.settings.max_neighbors).all())

    # ----------------------------------------------------------------- the census of the labels
    def check_rows(self, start: int, stop: int) -> np.ndarray:
        """Rows ``start:stop`` read, their structures and labels (and for OMol models their charge and spin) checked,
        a bad one named by row and key; per row the columns CENSUS_COLUMNS names."""
        stored = np.zeros((stop - start, CENSUS_COLUMNS), np.int64)
        for k, row in enumerate(self.rows.read_many(self.ids[start:stop])):
            close = None
            try:
                periodic = structure_periodicity(row.positions, row.numbers, row.cell, row.pbc, self.settings)
                if self.require_labels:  # training data: before training, not hours in (orb-relax, orb-md name
                    close = check_no_overlap_before_graphs(row.positions, row.cell, periodic)  # it when they reach it)
            except StructureError as exc:
                raise self._structure_error(row, exc) from None
            self._check_constraints(row)  # (what orb-relax and orb-md fix: refused now, by name, if ASE cannot)
            in_data = self.labels and "weight" not in row.key_value_pairs and row.data.get("weight") is not None
            labels = self._stored_labels(row)  # (stress units: an indexed copy's files were said as they were indexed)
            units = self.require_labels and labels[2] is not None and not self.sources and stress_implausible(labels[2])
            stored[k] = [value is not None for value in labels] + [in_data, close is not None, units]
            if self.charge_spin:
                self._charge_spin(row)  # OMol models: every row's total charge and spin (key-value pairs or data)
        return stored

    def census(self, check: Optional[Callable[[int, int], np.ndarray]] = None,
               ranks: Optional[Ranks] = None) -> np.ndarray:
        """Per row, which labels it stores (energy, forces, stress), every row's labels checked once per database
        (``check(start, stop)``: :meth:`check_rows` of those rows, e.g. in worker processes; default here). Rows
        without energy or forces are refused unless ``require_labels`` is off."""
        if self._labels_stored is None:
            flags = self.census_pass.result(check or self.check_rows, ranks or ONE_PROCESS).reshape(-1, CENSUS_COLUMNS)
            stored = flags[:, :len(LABELS)]
            read_weights_in_data(self, np.flatnonzero(flags[:, WEIGHT_IN_DATA]))
            self._say_findings(flags)
            if self.require_labels:
                for column, key in ((0, "energy"), (1, "forces")):
                    if not stored[:, column].all():
                        row = int(self.ids[np.argmin(stored[:, column])])
                        held = self.rows.read(row).key_value_pairs
                        raise self.error_at(missing_label(key, self._keyed(row), held), row, key)
            self._labels_stored = stored
            self._all_labelled = bool(stored[:, :2].all())  # asked for every structure read: not O(rows) each time
            self._any_stress = bool(stored[:, 2].any())
        return self._labels_stored

    @property
    def has_stress(self) -> bool:
        """Whether any row's labels include stress (pseudo-labels: whether they do); a row without one among rows
        with one trains with its stress weighed at 0 (:data:`orb.data.graphs.MISSING_STRESS`)."""
        if self.label_table is not None:
            return self.label_table.stress is not None
        self.census()
        return self._any_stress

    def stress_labelled(self) -> np.ndarray:
        """Per row, whether it holds a stress label (every row, or none, with a label table)."""
        if self.label_table is not None:
            return np.full(len(self), self.label_table.stress is not None)
        return self.census()[:, 2].astype(bool)

    @property
    def stress_rows(self) -> int:
        """How many rows hold a stress label."""
        return int(self.stress_labelled().sum())

    def mark_missing_stress(self) -> None:
        """The run trains stress: a structure without a stress label gets MISSING_STRESS (none would read as 0)."""
        self.stress_trained = True

    @property
    def has_labels(self) -> bool:
        if self.label_table is not None:
            return True
        self.census()
        return self._all_labelled

    @property
    def source(self) -> str:
        """The user's data as messages and logs name it: this database, or the files it was indexed from (not the
        cache's copy, which the user never named)."""
        files = [path for path, _ in self.sources]
        if not files:
            return self.path
        return files[0] if len(files) == 1 else f"{files[0]} and {len(files) - 1} more file(s)"

    def _keyed(self, row: int) -> bool:  # from a file read by the label keys (an ASE database's: its calculator's)
        return bool(self.sources) and self.rows.origin_locator()(row)[1] == "frame"

    def error_at(self, message: str, row: Optional[int] = None, key: Optional[str] = None) -> DatasetError:
        """A bad row named where the user can find it: this database's row, or for a database indexed from other
        files (``orb.data.formats``) the original file and frame, or its row in an ASE database of the user's."""
        if self.sources and row is not None:
            path, unit, number = self.rows.origin_locator()(row)
            return DatasetError(path, message.replace("row has", f"{unit} has"), number, key, unit=unit)
        return DatasetError(self.path, message, row, key)

    def where(self, row: int) -> str:
        """Row ``row`` as :meth:`error_at` names it."""
        return "{}, {} {}".format(*self.rows.origin_locator()(row)) if self.sources else f"row {row}"

    def _say_findings(self, flags: np.ndarray) -> None:
        """What the census found and a run should hear on every start: atoms nearer than any bond, and stress in other
        units (a tenth of the rows with stress or more beyond STRESS_PLAUSIBLE); each said once, naming the first
        such row (read again here)."""
        close = np.flatnonzero(flags[:, TOO_CLOSE])
        if len(close):
            row = self.rows.read(int(self.ids[close[0]]))
            periodic = structure_periodicity(row.positions, row.numbers, row.cell, row.pbc, self.settings)
            said_if_too_close(check_no_overlap_before_graphs(row.positions, row.cell, periodic), self.source,
                              self.located(int(row.id)), len(close))
        units = np.flatnonzero(flags[:, STRESS_UNITS])
        if len(units) and len(units) >= UNITS_SHARE * flags[:, 2].sum():  # (a file in kBar: most rows; a few
            # structures under very high stress, as the pretraining demo's rattled EMT cells: not said)
            said_if_implausible(np.asarray(self.rows.read(int(self.ids[units[0]])).stress), "stress", self.path,
                                f"row {int(self.ids[units[0]])}")

    def located(self, row: int) -> str:
        """Row ``row`` with its file, as a warning names it."""
        return self.where(row) if self.sources else f"{self.path}, row {row}"

    def check_elements_up_to(self, z_max: int, why: str) -> None:
        """Refuse, in one line naming the first such row, a structure holding an element above ``z_max`` (read from
        ASE's species table, without touching the rows)."""
        from ase.data import chemical_symbols

        found = self._read(f"SELECT id, Z FROM species WHERE Z > {int(z_max)} ORDER BY id LIMIT 1", [])
        if found:
            row, z = int(found[0][0]), int(found[0][1])
            symbol = chemical_symbols[z] if z < len(chemical_symbols) else f"element {z}"
            raise self.error_at(f"{symbol} (Z={z}) {why}", row, "numbers")

    def _read_table(self, name: str) -> list:
        """A column of every row at once (``TABLE_QUERIES[name]``), checked against a cached index's checksum (these
        are not read through its rows: a weight or an energy changed on disk was used without a word)."""
        rows = self._read(TABLE_QUERIES[name], [])
        self.rows.check_table(name, rows)
        return rows

    def _read(self, query: str, default=None) -> list:
        """Rows of a read-only query (this process's connection); ``default`` when a table the query needs does not
        exist (ASE creates the key-value tables with the first key-value pair)."""
        try:
            return self.rows.connection().execute(query).fetchall()
        except sqlite3.OperationalError as exc:
            if default is not None and "no such table" in str(exc):
                return default
            raise self.error_at(f"cannot read as an ASE database ({exc})") from None
        except sqlite3.DatabaseError as exc:
            raise self.error_at(f"cannot read as an ASE database ({exc})") from None

    def energies(self) -> np.ndarray:
        """Every row's stored energy (eV), read from its column alone; a row without one is named."""
        rows = np.array(self._read_table("energies"), dtype=np.float64).reshape(-1, 2)
        missing = np.isnan(rows[:, 1])
        if missing.any():
            raise self.error_at("row has no energy", int(rows[np.argmax(missing), 0]), "energy")
        return rows[:, 1]

    def composition(self) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(dataset position, atomic number, count) for every element of every row, from ASE's species table
        (no row is read)."""
        table = np.array(self._read_table("composition"), np.int64).reshape(-1, 3)
        positions = np.searchsorted(self.ids, table[:, 0])
        known = (positions < len(self.ids)) & (self.ids[np.minimum(positions, len(self.ids) - 1)] == table[:, 0])
        return positions[known], table[known, 1], table[known, 2]

    def set_labels(self, table: Optional[LabelTable]) -> None:
        """Use ``table``'s labels instead of the database's for the rows it holds (None: the database's again)."""
        self.label_table = table

    def __len__(self) -> int:
        return len(self.ids)

    def __repr__(self) -> str:
        return f"AseDbDataset({self.path!r}, {len(self)} rows)"

    def close(self) -> None:
        self.rows.close()

    def row(self, index: int):  # the row at position ``index`` (0-based, id order): orb.data.sqlite_rows.Row
        return self.rows.read(int(self.ids[index]))

    def get_atoms(self, index: int, say_dropped: bool = False):
        """The ``ase.Atoms`` (with its calculator results) at ``index``; ``info``: the row's key-value pairs over the
        entries of ``row.data`` a row can hold (as an indexed copy holds them: they reach orb-md's and orb-relax's);
        ``say_dropped``: the others are said once per key (by the commands that write them out)."""
        row = self.row(index)
        atoms = row.toatoms()
        if row.data:
            kept = storable_pairs(row.data)
            if say_dropped:
                say_not_carried(row.data, kept, set(atoms.info) | LABEL_NAMES, self.source, "row data key")
            atoms.info = {**kept, **atoms.info}
        return atoms

    def _labels(self, row, index: int) -> Tuple[Optional[float], Optional[np.ndarray], Optional[np.ndarray]]:
        """The labels a graph of this row carries: the label table's, else the row's (stress only when some row has
        stress, or when evaluating)."""
        if self.label_table is not None:
            return self._checked_labels(row, *self.label_table.labels(index))
        energy, forces, stress = self._stored_labels(row)
        if stress is not None and not self.require_labels and not self.sources:  # (evaluation: the training data's
            said_if_implausible(stress, "stress", self.path, f"row {row.id}")  # census says it on every start)
        return energy, forces, stress if self.has_stress or not self.require_labels else None

    def _stored_labels(self, row) -> Tuple[Optional[float], Optional[np.ndarray], Optional[np.ndarray]]:
        """The labels the row stores, checked (shapes, finite values); none read where labels are not used."""
        if not self.labels:
            return None, None, None
        return self._checked_labels(row, row.get("energy"), row.get("forces"), row.get("stress"))

    def _checked_labels(self, row, energy, forces, stress):
        return checked_labels(row, energy, forces, stress, self.error_at)

    def _charge_spin(self, row) -> Tuple[Optional[np.ndarray], Optional[np.ndarray]]:
        """The row's total charge and spin (key-value pairs or ``row.data``); required for OMol models, and for the others
        kept where they are numbers (they reach orb-md's and orb-relax's outputs)."""
        values = []
        charge_key, spin_key = self.charge_spin_names
        advice = (f"set info['{charge_key}'] and info['{spin_key}'] on each structure" if self.sources else
                  f"store it with db.write(atoms, {charge_key}=..., {spin_key}=...)")
        for name, key, named in zip(("charge", "spin"), self.charge_spin_keys, self.charge_spin_names):
            value = row.key_value_pairs.get(key, (row.data or {}).get(key))
            if value is None and self.charge_spin:
                raise self.error_at(f"row has no total {name}, which OMol models need ({advice})", row.id, named)
            if value is not None:
                try:
                    value = np.array([total_charge_or_spin(value)], np.float32)
                except ValueError as exc:
                    if self.charge_spin:  # (the census checks every row before training)
                        raise self.error_at(str(exc), row.id, named) from None
                    value = None  # a model without charge and spin: an extra key like any other, ignored
            values.append(value)
        return values[0], values[1]

    def charge_and_spin(self, index: int) -> Tuple[Optional[float], Optional[float]]:
        """The total charge and spin of the structure at ``index`` (None where the row has none)."""
        charge, spin = self._charge_spin(self.row(index))
        return (None if charge is None else float(charge[0])), (None if spin is None else float(spin[0]))

    def get(self, index: int, rotation_seed: Optional[int] = None) -> AtomGraphs:
        """Graph with targets of the row at ``index``; with augmentation on and a ``rotation_seed``, rotated by the
        random rotation that seed draws (the training loop derives it from the run seed, epoch and position, so
        a resumed run sees the same rotations). Without a seed the structure is never rotated (validation and
        the model's passes over the data before training)."""
        return self.get_many([index], [rotation_seed])[0]

    def get_many(self, indices: Sequence[int], rotation_seeds: Sequence) -> List[AtomGraphs]:
        """:meth:`get` of several positions, their rows read together (one query: a query costs more than a row)."""
        rows = self.rows.read_many([int(self.ids[i]) for i in indices])
        return [self._graph(row, int(i), seed) for row, i, seed in zip(rows, indices, rotation_seeds)]

    def _graph(self, row, index: int, rotation_seed) -> AtomGraphs:
        energy, forces, stress = self._labels(row, index)
        positions, cell = np.asarray(row.positions, np.float64), np.asarray(row.cell, np.float64)
        if self.augmentation and rotation_seed is not None:
            rng = np.random.default_rng(rotation_seed)
            positions, cell, forces, stress = rotate_structure(positions, cell, forces, stress, random_rotation(rng))
        try:
            graph = graph_from_arrays(positions, row.numbers, cell, system_id=row.id, pbc=row.pbc,
                                      settings=self.settings, float64=self.float64)
        except StructureError as exc:
            raise self._structure_error(row, exc) from None
        graph.charge, graph.spin = self._charge_spin(row)
        real = np.float64 if self.float64 else np.float32  # labels in the graph's float type
        graph.weight = np.array([self.weights[index]], real)
        graph.energy = None if energy is None else np.array([energy], real)
        graph.forces = None if forces is None else forces.astype(real)
        if stress is None and self.require_labels and (self.stress_trained or self.has_stress):
            stress = MISSING_STRESS  # (after the rotation: nothing to rotate)
        graph.stress = None if stress is None else stress.astype(real)[None]
        return graph

    def check_structures(self) -> None:
        """Every row's structure (positions, numbers, cell, constraints), not its labels, checked; the first bad one
        named by row and key: for commands that start from the structures and discard the labels (orb-md)."""
        for start in range(0, len(self), 256):
            for row in self.rows.read_many(self.ids[start:start + 256]):
                try:
                    structure_periodicity(row.positions, row.numbers, row.cell, row.pbc, self.settings)
                except StructureError as exc:
                    raise self._structure_error(row, exc) from None
                self._check_constraints(row)

    def _check_constraints(self, row) -> None:
        try:
            row.decoded_constraints()
        except DatasetError as exc:  # named where the user finds the row (not the cached copy of other files)
            raise self.error_at(exc.message, row.id, "constraints") from None

    def _structure_error(self, row, exc: StructureError) -> DatasetError:
        key = ("numbers" if "atomic number" in str(exc) else "pbc" if "pbc" in str(exc)
               else "cell" if "cell" in str(exc) else "positions")
        return self.error_at(str(exc), row.id, key)

    def count_edge_capacities(self, start: int, stop: int) -> np.ndarray:
        """The edge capacities (:func:`edge_capacity`) of rows ``start:stop``."""
        capacities = np.empty(stop - start, np.int64)
        for i, row in zip(range(start, stop), self.rows.read_many(self.ids[start:stop])):
            try:
                capacities[i - start] = edge_capacity(row.positions, row.numbers, row.cell, row.pbc, self.settings)
            except StructureError as exc:
                raise self._structure_error(row, exc) from None
        return capacities

    def edge_capacities(self, count: Optional[Callable[[int, int], np.ndarray]] = None,
                        ranks: Optional[Ranks] = None) -> np.ndarray:
        """Per row, an upper bound on its graph's edges under any rotation, known before any batch is
        built (the batch shapes are planned from it).

        Where it takes a neighbour search (:func:`capacity_is_counted`), it is counted once per database
        and graph settings and kept in the project's cache: an MPtrj-sized dataset takes minutes to
        count. ``count(start, stop)`` counts rows ``start:stop`` (e.g. in worker processes; default:
        here, row by row). In a data-parallel run (``ranks``) each rank counts its share of the rows and
        the shares are summed over ranks; every rank takes the same path (the cache is used only if
        every rank has it), so their collectives always match.
        """
        if self._edge_capacities is None:
            if not capacity_is_counted(self.settings):
                self._edge_capacities = self.natoms * self.settings.max_neighbors  # no row read
            else:
                self._edge_capacities = self.capacity_pass.result(count or self.count_edge_capacities,
                                                                  ranks or ONE_PROCESS)
        return self._edge_capacities

    @property
    def capacities_read_from(self) -> Optional[str]:
        """The cache file the edge capacities came from (None: counted, or not counted at all)."""
        return self.capacity_pass.read_from

    @property
    def capacities_kept_in(self) -> Optional[str]:
        """The cache file the counted edge capacities were written to."""
        return self.capacity_pass.kept_in

    def identity(self) -> str:
        """The database's identity for caches (file size and modification time, row ids and atom counts),
        hashed: any change to the rows misses a cache. Not its path: a copy that keeps the modification time
        (``rsync -a`` to a node's scratch disk) is the same data."""
        files = [p for p in (self.path, self.path + "-wal") if os.path.exists(p)]
        digest = hashlib.sha256(repr([(os.stat(p).st_size, os.stat(p).st_mtime_ns) for p in files]).encode())
        digest.update(change_counters(self.path))  # (a row rewritten in place, its size kept, within a coarse mtime)
        digest.update(self.ids.tobytes())
        digest.update(self.natoms.tobytes())
        return digest.hexdigest()

    def inputs_identity(self) -> tuple:
        """The key of every cached model output over these rows (the replay's pseudo-labels and descriptors): the rows
        (:meth:`identity`) and where their total charge and spin are read, which an OMol model's predictions
        depend on (pseudo-labels of one charge_key were read back for another)."""
        return self.identity(), self.charge_spin, self.charge_spin_keys

    def content_fingerprint(self) -> str:
        """The rows' ids, atom counts and elements (ASE's species table), hashed: the same data wherever it lies
        and whenever it was copied (what a resume compares), read without touching the rows themselves."""
        if self._fingerprint is None:
            digest = hashlib.sha256(self.ids.tobytes())
            digest.update(self.natoms.tobytes())
            digest.update(np.array(self._read_table("composition"), np.int64).tobytes())
            self._fingerprint = digest.hexdigest()
        return self._fingerprint

    def structures_fingerprint(self) -> str:
        """Every row's structure (atomic numbers, positions, cell, periodicity, momenta, masses, tags, constraints,
        total charge and spin), hashed: what a resumed orb-relax or orb-md starts the structures it has not finished
        from (the content fingerprint sees only ids, atom counts and elements: edited positions resumed silently,
        and another charge mixed two charge states in one OMol trajectory). Reads every row once (~40,000 a
        second)."""
        digest = hashlib.sha256(self.content_fingerprint().encode())
        return structures_digest(self.rows, self.ids, digest, self.charge_spin_keys, self.charge_spin)

    def __getitem__(self, index: int) -> AtomGraphs:
        return self.get(index)

    def __iter__(self) -> Iterator[AtomGraphs]:
        for i in range(len(self)):
            yield self.get(i)


