"""Rows of an ASE SQLite database read directly: the columns training needs, through a read-only connection.

``ase.db``'s own reader opens the file read-write (shared locks on every query: one network round
trip each on NFS, refused on Lustre mounted without ``flock``), reads every column of a row and
queries the external tables. Here each process opens one read-only connection -- ``immutable`` when
no journal shows that something is writing the file, so SQLite takes no locks at all -- and reads
only what a graph and its labels need, decoded as ASE encodes them (schema version 6 and later).
"""

import contextlib
import functools
import json
import os
import sqlite3
import struct
import time
import zlib
from typing import Any, Dict, List, Optional, Sequence, Tuple
from urllib.parse import quote

import numpy as np

from orb.errors import DatasetError, RunError

COLUMNS = ("id, natoms, numbers, positions, cell, pbc, energy, forces, stress, key_value_pairs, data, momenta, masses, "
           "constraints, tags, initial_magmoms, initial_charges")
LOCK_FREE_UNLESS = ("-wal", "-journal")  # files that show a writer (then: read-only, with SQLite's locks)


def change_counters(path: str) -> bytes:
    """SQLite's file change counter and version-valid-for number (header bytes 24-27 and 92-95): every committed
    write outside WAL mode moves them, whatever the file's size and timestamps (a row rewritten in place keeps the
    size; NFS and FAT keep coarse times; ``cp -p`` and ``rsync -a`` copy them). Empty when unreadable."""
    try:
        with open(path, "rb") as f:
            header = f.read(100)
    except OSError:
        return b""
    return header[24:28] + header[92:96] if len(header) == 100 else b""


JOURNAL_AGE = 600.0  # seconds: a journal this old beside a user's database is a killed writer's, not a live one's


def roll_back_unfinished_write(path: str, min_age: float = 0.0) -> None:
    """A writer killed mid-commit (ASE commits each row: orb-relax's output, any database a killed script wrote)
    leaves ``-journal`` beside the file, which a read-only connection cannot roll back ("attempt to write a readonly
    database": the file looked damaged, and a resume refused it). One read-write connection rolls it back, as any
    writer's would; the committed rows stay. ``min_age``: only a journal unchanged for that long (a user's data,
    which a live writer on a file system whose locks do not reach this node may hold). Not possible (a read-only
    folder, a live writer holding it): left to the read-only connection's own error."""
    journal = path + "-journal"
    try:
        if os.path.getsize(journal) == 0 or time.time() - os.path.getmtime(journal) < min_age:
            return
    except OSError:  # (none)
        return
    try:
        with contextlib.closing(sqlite3.connect(f"file:{quote(os.path.abspath(path))}?mode=rw", uri=True,
                                                timeout=5.0)) as connection:
            connection.execute("SELECT count(*) FROM sqlite_master").fetchall()
    except sqlite3.Error:
        pass
CHECKSUMS = "orb_row_checksums"  # an index's table of each row's checksum (row_checksum), made with the index
TABLE_CHECKSUMS = "orb_table_checksums"  # and of each TABLE_QUERIES result's (result_checksum)
# the queries that read a column of every row at once (not through read_many), by name: an index keeps the checksums
# of their results too
TABLE_QUERIES = {
    "atoms": "SELECT id, SUM(n) FROM species GROUP BY id ORDER BY id",
    "composition": "SELECT id, Z, n FROM species ORDER BY id, Z",
    "energies": "SELECT id, energy FROM systems ORDER BY id",
    "weights": "SELECT id, value FROM number_key_values WHERE key = 'weight' ORDER BY id",
}
INDEX_KIND = "converted"  # the project cache's subfolder of indexes (orb.data.formats): the only files checked
BIG_ENDIAN = not np.little_endian
_NAMED_HERE: Dict[str, List[str]] = {}  # a cached index's real path -> the files this process's user named for it


class IndexPath(str):
    """A cached index's path, carrying the files this call named for it (``named``: :func:`name_sources`)."""


def name_sources(index: str, files: Sequence[str]) -> "IndexPath":
    """The files this process's user named for the cached index ``index`` (``orb.data.formats``, which finds an index
    by its files' content): its readers' messages name them, not the paths it was made from (another job's
    scratch folder, gone since)."""
    found = IndexPath(index)
    found.named = _NAMED_HERE[os.path.realpath(index)] = [os.path.abspath(f) for f in files]
    return found


def row_checksum(values: Sequence) -> int:
    """CRC-32 of a row's columns as stored (``COLUMNS``' values): SQLite's own check finds damaged pages of a file, not
    bytes changed inside a row's values (zeros where a disk lost a write read back as positions or forces)."""
    crc = 0
    for value in values:
        if value is None:
            piece = b"N"
        elif isinstance(value, bytes):
            piece = b"B" + struct.pack("<q", len(value)) + value
        elif isinstance(value, str):
            piece = b"S" + struct.pack("<q", len(value)) + value.encode()
        elif isinstance(value, float):
            piece = b"F" + struct.pack("<d", value)
        else:
            piece = b"I" + struct.pack("<q", int(value))
        crc = zlib.crc32(piece, crc)
    return crc


def result_checksum(rows: list) -> int:
    """CRC-32 of a TABLE_QUERIES result (numbers; NULL as NaN)."""
    return zlib.crc32(np.asarray(rows, np.float64).tobytes()) if rows else 0


def table_rows(connection: sqlite3.Connection, name: str) -> list:
    """The result of TABLE_QUERIES[name]; [] when its table does not exist (ASE makes the key-value tables with the
    first key-value pair)."""
    try:
        return connection.execute(TABLE_QUERIES[name]).fetchall()
    except sqlite3.OperationalError as exc:
        if "no such table" in str(exc):
            return []
        raise


def add_checksums(path: str) -> None:
    """Store every row's checksum, and every TABLE_QUERIES result's, in the database ``path`` (an index being made:
    nothing else has it open), so that a reader finds values changed on disk since."""
    connection = sqlite3.connect(path)
    try:
        with connection:
            connection.execute(f"CREATE TABLE {TABLE_CHECKSUMS} (name TEXT PRIMARY KEY, crc INTEGER)")
            connection.executemany(f"INSERT INTO {TABLE_CHECKSUMS} VALUES (?, ?)",
                                   [(name, result_checksum(table_rows(connection, name))) for name in TABLE_QUERIES])
            connection.execute(f"CREATE TABLE {CHECKSUMS} (id INTEGER PRIMARY KEY, crc INTEGER)")
            cursor = connection.execute(f"SELECT {COLUMNS} FROM systems")
            while True:
                values = cursor.fetchmany(4096)
                if not values:
                    break
                connection.executemany(f"INSERT INTO {CHECKSUMS} VALUES (?, ?)",
                                       [(v[0], row_checksum(v)) for v in values])
    finally:
        connection.close()


def origin_locator(sources: List[Tuple[str, int]], source_rows: Optional[Dict[str, list]] = None):
    """row id of a converted database (1, 2, ... in file order) -> ``(file, unit, number)``: where the user finds it,
    ``"row"`` and its id in an ASE database of theirs (``source_rows``: each such source's ids as runs
    ``[first id, count]``), else ``"frame"`` and its 0-based frame. Each file's first row found once, then bisections
    (every row of an evaluation over a folder of thousands of files)."""
    starts = np.cumsum([0] + [int(frames) for _, frames in sources])
    runs = {int(k): np.asarray(v, np.int64).reshape(-1, 2) for k, v in (source_rows or {}).items()}
    run_starts = {k: np.cumsum(np.concatenate([[0], v[:, 1]])) for k, v in runs.items()}

    def locate(row_id: int) -> Tuple[str, str, int]:
        position = int(row_id) - 1
        k = min(int(np.searchsorted(starts, position, side="right")) - 1, len(sources) - 1)
        index = position - int(starts[k])
        if k not in runs:
            return sources[k][0], "frame", index
        j = min(int(np.searchsorted(run_starts[k], index, side="right")) - 1, len(runs[k]) - 1)
        return sources[k][0], "row", int(runs[k][j, 0]) + index - int(run_starts[k][j])

    return locate


def _array(blob, dtype=np.float64, shape=None) -> Optional[np.ndarray]:
    """ASE's blob encoding: little-endian raw values (read-only arrays over the bytes)."""
    if blob is None:
        return None
    array = np.frombuffer(blob, dtype)
    if BIG_ENDIAN:
        array = array.byteswap()
    return array.reshape(shape) if shape is not None else array


def _decode(value) -> Any:
    """ASE's encoding of key-value pairs and data: JSON text, or its binary object format."""
    if value is None:
        return {}
    decode, bytes_to_object = _ase_decoders()
    return decode(value) if isinstance(value, str) else bytes_to_object(value)


@functools.lru_cache(maxsize=None)
def _ase_decoders():
    """ASE's decoders, imported once with stop signals held: the import (~235 modules, scipy's extensions among them)
    turned a stop signal landing in an extension's initialisation into its ImportError, which the caller reported as
    a damaged row (exit 2, not 75)."""
    from orb.signals import STOP

    with STOP.held():
        from ase.db.core import bytes_to_object
        from ase.io.jsonio import decode
    return decode, bytes_to_object


def _pbc_flags(bits: int) -> np.ndarray:
    flags = (np.array([1, 2, 4]) & bits).astype(bool)
    flags.flags.writeable = False
    return flags


_PBC = [_pbc_flags(bits) for bits in range(8)]  # ASE stores pbc as bits x=1, y=2, z=4


class Row:
    """What training reads of one database row (names as ``ase.db``'s rows)."""

    __slots__ = ("id", "natoms", "numbers", "positions", "cell", "pbc", "energy", "forces", "stress", "_kvp",
                 "raw_data", "momenta", "masses", "constraints", "tags", "initial_magmoms", "initial_charges", "path")

    def __init__(self, values, path: str = ""):
        """A row's columns decoded; one that cannot be (a damaged file) is one line naming ``path``, row and column."""
        (self.id, self.natoms, numbers, positions, cell, pbc, self.energy, forces, stress, self._kvp,
         self.raw_data, momenta, masses, self.constraints, tags, magmoms, charges) = values
        self.path = path
        # what dynamics needs beyond training: the structure's own velocities, masses (isotopes), constraints, tags;
        # and what a DFT relabelling of its frames starts from: initial magnetic moments (collinear or not), charges
        self.momenta = self._column("momenta", momenta, shape=(-1, 3))
        self.initial_magmoms = self._column("initial_magmoms", magmoms, per_atom=False)  # (N,) or (N, 3) flat
        if self.initial_magmoms is not None and self.initial_magmoms.size == 3 * self.natoms != self.natoms:
            self.initial_magmoms = self.initial_magmoms.reshape(-1, 3)
        self.initial_charges = self._column("initial_charges", charges)
        self.tags = self._column("tags", tags, np.int32)
        self.masses = self._column("masses", masses)
        self.numbers = self._column("numbers", numbers, np.int32)
        self.positions = self._column("positions", positions, shape=(-1, 3))
        self.cell = self._column("cell", cell, shape=(3, 3), per_atom=False)
        self.pbc = _PBC[pbc or 0]
        self.forces = self._column("forces", forces, shape=(-1, 3), per_atom=False)  # (a label: checked with the others)
        self.stress = self._column("stress", stress, per_atom=False)

    def _column(self, name: str, blob, dtype=np.float64, shape=None, per_atom: bool = True) -> Optional[np.ndarray]:
        """One array column (:func:`_array`), checked: a per-atom one has a row per atom."""
        try:
            array = _array(blob, dtype, shape)
        except ValueError as exc:  # a blob of the wrong size
            raise DatasetError(self.path, f"cannot decode it ({exc}): the file may be damaged", self.id, name) from None
        if per_atom and array is not None and len(array) != self.natoms:
            raise DatasetError(self.path, f"{len(array)} entries for {self.natoms} atoms: the file may be damaged",
                               self.id, name)
        return array

    def _decoded(self, value, column: str, empty) -> Dict[str, Any]:
        if value in (None, empty):
            return {}
        try:
            return _decode(value)
        except Exception as exc:  # json's, or ase's binary format's, error on damaged bytes
            raise DatasetError(self.path, f"cannot decode it ({str(exc).strip()[:120] or type(exc).__name__}): the "
                               "file may be damaged", self.id, column) from None

    @property
    def key_value_pairs(self) -> Dict[str, Any]:
        if not isinstance(self._kvp, dict):
            self._kvp = self._decoded(self._kvp, "key_value_pairs", "{}")
        return self._kvp

    def get(self, key: str, default=None):
        value = getattr(self, key, None)
        return default if value is None else value

    @property
    def data(self) -> Dict[str, Any]:
        if not isinstance(self.raw_data, dict):
            self.raw_data = self._decoded(self.raw_data, "data", "null")
        return self.raw_data

    @property
    def formula(self) -> str:
        from ase.formula import Formula
        from ase.data import chemical_symbols

        return Formula("".join(chemical_symbols[z] for z in self.numbers)).format("metal")

    def decoded_constraints(self) -> list:
        """The row's constraints as ASE's objects (fixed atoms, ...), each tried on the row's atoms; one line naming
        the row and key where ASE cannot make them (a constraint this ASE does not know, or damaged bytes) or they do
        not fit the atoms (an index past the last atom), not ASE's bare error mid-run."""
        if not self.constraints:
            return []
        from ase.constraints import dict2constraint
        from ase.io.jsonio import decode

        try:
            stored = decode(self.constraints)
        except Exception as exc:  # json's error on damaged bytes
            raise DatasetError(self.path, f"cannot decode its constraints ({str(exc).strip()[:120]}): the file may "
                               "be damaged", self.id, "constraints") from None
        made = []
        for constraint in stored if isinstance(stored, list) else [stored]:
            try:
                made.append(dict2constraint(constraint))
            except Exception as exc:  # ase's bare ValueError (an unknown name), KeyError or TypeError (its arguments)
                name = constraint.get("name") if isinstance(constraint, dict) else None
                reason = str(exc).strip()[:120] or type(exc).__name__
                raise DatasetError(self.path, f"ASE cannot make its constraints ({name or 'unnamed'}: {reason}): a "
                                   f"constraint this ASE ({_ase_version()}) does not know, or a damaged file",
                                   self.id, "constraints") from None
        from ase import Atoms

        probe = Atoms(numbers=self.numbers, positions=self.positions, cell=self.cell, pbc=self.pbc)
        for constraint in made:
            try:
                constraint.adjust_positions(probe, np.array(self.positions, np.float64))
                constraint.adjust_forces(probe, np.zeros((self.natoms, 3)))
            except Exception as exc:  # numpy's IndexError of an index past the last atom, ...
                reason = str(exc).strip()[:120] or type(exc).__name__
                raise DatasetError(self.path, f"its constraint {type(constraint).__name__} does not fit its "
                                   f"{self.natoms} atoms ({reason})", self.id, "constraints") from None
        return made

    def toatoms(self):
        """The structure as ``ase.Atoms``, its labels as a single-point calculator."""
        from ase import Atoms
        from ase.calculators.singlepoint import SinglePointCalculator

        atoms = Atoms(numbers=self.numbers, positions=self.positions, cell=self.cell, pbc=self.pbc,
                      momenta=self.momenta, masses=self.masses, tags=self.tags, magmoms=self.initial_magmoms,
                      charges=self.initial_charges, info=dict(self.key_value_pairs))
        if self.constraints:
            atoms.set_constraint(self.decoded_constraints())
        results = {k: v for k, v in (("energy", self.energy), ("forces", self.forces), ("stress", self.stress))
                   if v is not None}
        if results:
            atoms.calc = SinglePointCalculator(atoms, **results)
        return atoms




def _ase_version() -> str:
    import ase

    return ase.__version__


class RowReader:
    """Reads rows of one database by id, through this process's own read-only connection (opened on first use)."""

    def __init__(self, path: str):
        self.path = str(path)
        self._connection: Optional[sqlite3.Connection] = None
        self._checked: Optional[bool] = None  # whether its rows have checksums (an index's), known once connected
        self._sources: Optional[list] = None
        self._source_rows: Dict[str, list] = {}
        self._named = getattr(path, "named", None) or _NAMED_HERE.get(os.path.realpath(path))  # (and to workers)

    def __getstate__(self):  # each process (data worker) opens its own
        return {"path": self.path, "_connection": None, "_checked": None, "_sources": None, "_source_rows": {},
                "_named": self._named}

    @property
    def immutable(self) -> bool:
        return not any(os.path.exists(self.path + suffix) for suffix in LOCK_FREE_UNLESS)

    def connection(self) -> sqlite3.Connection:
        if self._connection is None:
            if not os.path.exists(self.path):
                if self.is_cached_index():  # removed by another process that found it damaged
                    raise RunError(f"the cached index {self.path} was removed while this run read it (by a process "
                                   "that found it damaged, whose log says which file and frame, or by hand): run the "
                                   "command again")
                raise DatasetError(self.path, "database file does not exist (was it removed during the run?)")
            roll_back_unfinished_write(self.path, JOURNAL_AGE)
            uri = f"file:{quote(os.path.abspath(self.path))}?mode=ro" + ("&immutable=1" if self.immutable else "")
            try:
                self._connection = sqlite3.connect(uri, uri=True, check_same_thread=False)
            except sqlite3.Error as exc:
                raise DatasetError(self.path, f"cannot open it ({exc})") from None
            try:
                version = self._connection.execute("SELECT value FROM information WHERE name = 'version'").fetchall()
            except sqlite3.DatabaseError as exc:
                self.close()
                raise DatasetError(self.path, f"cannot read as an ASE database ({exc})") from None
            if not version or int(version[0][0]) < 6:
                self.close()
                raise DatasetError(self.path, f"written by an ASE too old to read directly (schema version "
                                   f"{version[0][0] if version else 'unknown'}); rewrite it with a current ASE")
            self._checked = self.is_cached_index() and len(self._connection.execute(
                "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name IN (?, ?)",
                (CHECKSUMS, TABLE_CHECKSUMS)).fetchall()) == 2
        return self._connection

    def is_cached_index(self) -> bool:
        """Whether this is an index in the project's cache, which may be checked and removed (a copy taken out of the
        cache and written to is a user's database: it is neither)."""
        from orb.cache import cache_dirs

        folder = os.path.realpath(os.path.dirname(os.path.abspath(self.path)))
        return folder in {os.path.realpath(f) for f in cache_dirs(INDEX_KIND)}

    def check_table(self, name: str, rows: list) -> None:
        """Refuse a TABLE_QUERIES result of a cached index that is not what the index was made with."""
        self.connection()
        if self._checked:
            stored = self.query(f"SELECT crc FROM {TABLE_CHECKSUMS} WHERE name = ?", (name,))
            if not stored or stored[0][0] != result_checksum(rows):
                raise self._damaged(None, f"its {name} do not match their checksum")

    def sources(self) -> list:
        """[(file, frames), ...] of a database indexed from other files (``orb.data.formats``), else []; the files as
        this run named them (:func:`name_sources`)."""
        if self._sources is None:
            found = self.query("SELECT value FROM information WHERE name = 'metadata'")
            try:
                metadata = json.loads(found[0][0]) if found else {}
                self._sources = metadata.get("orb_sources", [])
                self._source_rows = metadata.get("orb_source_rows", {})
            except (ValueError, AttributeError):
                self._sources, self._source_rows = [], {}
            if self._named and len(self._named) == len(self._sources):
                self._sources = [[named, frames] for named, (_, frames) in zip(self._named, self._sources)]
        return self._sources

    def origin_locator(self):
        """:func:`origin_locator` of this database's sources: row id -> (file, "row" or "frame", number)."""
        return origin_locator(self.sources(), self._source_rows)

    def _damaged(self, row_id: Optional[int], what: str = "its checksum does not match") -> RunError:
        """Values of a cached index that are not those it was made with: the index is removed (in a read-only cache
        folder, marked: ``orb.cache.mark_damaged``, and later starts skip it), so the next start makes it again from
        the user's files, and the run stops naming the file and frame."""
        try:
            os.remove(self.path)
            then = "it was removed and is made again at the next start"
        except FileNotFoundError:  # another process found it first
            then = "it was removed and is made again at the next start"
        except OSError as exc:  # a read-only cache folder: skipped from now on
            from orb.cache import mark_damaged

            mark_damaged(self.path)
            then = f"it could not be removed ({exc.strerror}) and is made again elsewhere at the next start"
        sources = self.sources()
        if row_id is None:
            where = ", ".join(path for path, _ in sources) or self.path
        else:
            where = "{}, {} {}".format(*self.origin_locator()(row_id)) if sources else f"{self.path}, row {row_id}"
        return RunError(f"{where}: its copy in the cached index {self.path} is damaged ({what}); {then}: run the "
                        "command again, continuing what it had done (resume: true for training, --resume for "
                        "orb-relax and orb-md)")

    def query(self, sql: str, args=(), row: Optional[int] = None) -> list:
        """A read-only query; a damaged file is one line naming it (and the row, when known)."""
        try:
            return self.connection().execute(sql, args).fetchall()
        except sqlite3.DatabaseError as exc:
            raise DatasetError(self.path, f"cannot read the database ({exc}): the file may be damaged or "
                               "incomplete; copy it again", row) from None

    def read(self, row_id: int) -> Row:
        return self.read_many([row_id])[0]

    def read_many(self, row_ids) -> List[Row]:
        """Rows by id, in the order asked, with one query per batch of at most 256 (a query costs more than
        decoding a row)."""
        ids = [int(i) for i in row_ids]
        found: Dict[int, Row] = {}
        self.connection()
        checksum = f", (SELECT crc FROM {CHECKSUMS} c WHERE c.id = systems.id)" if self._checked else ""
        for start in range(0, len(ids), 256):
            part = ids[start:start + 256]
            for values in self.query(f"SELECT {COLUMNS}{checksum} FROM systems WHERE id IN "
                                     f"({','.join('?' * len(part))})", part, part[0] if len(part) == 1 else None):
                if checksum:
                    values, crc = values[:-1], values[-1]
                    if crc != row_checksum(values):
                        raise self._damaged(values[0])
                found[values[0]] = Row(values, self.path)
        missing = [i for i in ids if i not in found]
        if missing:
            raise DatasetError(self.path, "row is gone (was the database changed during the run?)", missing[0])
        return [found[i] for i in ids]

    def close(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None


def structures_digest(rows: RowReader, ids, digest, charge_spin_keys, with_data: bool) -> str:
    """``digest`` (hashlib's) updated with rows ``ids``' structures (atomic numbers, positions, cell, periodicity,
    momenta, masses, tags, constraints, and the values under ``charge_spin_keys``, from ``row.data`` too when
    ``with_data``): :meth:`orb.data.dataset.AseDbDataset.structures_fingerprint`."""
    for start in range(0, len(ids), 4096):
        for row in rows.read_many(ids[start:start + 4096]):
            for values in (row.numbers, row.positions, row.cell, row.pbc, row.momenta, row.masses, row.tags):
                digest.update(b"-" if values is None else np.ascontiguousarray(values).tobytes())
            digest.update(str(row.constraints or "-").encode())  # fixed atoms: what relaxes or moves
            for key in charge_spin_keys:  # as stored: what an OMol model reads; hashed only where present,
                value = row.key_value_pairs.get(key)  # so an input without them fingerprints as it did before
                if value is None and with_data and row.raw_data:  # (row.data: decoded for OMol only)
                    value = row.data.get(key)
                if value is not None:
                    digest.update(f"{key}={value!r}".encode())
    return digest.hexdigest()
