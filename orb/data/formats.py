"""Structures in the formats people have -- extxyz/xyz and anything ``ase.io`` reads, ASE-LMDB
(``.aselmdb``, through the optional ``ase-db-backends`` package), a folder of such files -- read
through the project's ASE SQLite reader.

A file that is not ASE SQLite is indexed once: its frames are copied, with their labels picked by
the configured keys, into an ASE SQLite database in the project's cache (``ORB_CACHE_DIR``),
named by the files' content (sha256: a copy staged to a job's scratch folder finds it) and the keys. Every later
start, and every data-parallel rank, reads that copy: random access per row as fast as SQLite's, the
neighbour counts and the row census cached per file as for any database. Bad input is one line
naming the file, the frame and the key.

Labels: with a key left empty, energy is ``info['REF_energy']`` (MACE's reference key: a file may also hold
another calculator's results, which differ, said once per file), else the stored calculator's energy (the
``energy=`` of an extxyz comment line), else ``info['energy']``; forces likewise from ``arrays`` (``REF_forces``,
the calculator's, ``forces``), stress from ``info`` (``REF_stress``, the calculator's, ``stress``), else from a
virial (``REF_virial``, ``virial``, ``REF_virials``, ``virials``: stress = -virial / volume). A key that is set names
the ``info`` entry (energy, stress, charge, spin) or the ``arrays`` entry (forces) to read, or a calculator result
of that name (``free_energy``), and every frame must carry it. An ASE database's labels are its rows' calculator
results, whatever its backend (as the SQLite reader reads them). Stress beyond :data:`STRESS_PLAUSIBLE` eV/Å³ (kBar
or GPa numbers) is said once per file.
"""

import json
import logging
import os
import sys
from dataclasses import dataclass
from typing import Iterator, List, Optional, Sequence, Tuple, Union
from urllib.parse import quote

import numpy as np

from orb import cache
from orb.data.digests import file_stamps, files_identity
from orb.data.sqlite_rows import (CHECKSUMS, INDEX_KIND, JOURNAL_AGE, add_checksums, name_sources,
                                  roll_back_unfinished_write)
from orb.errors import DatasetError
from orb.records import is_own_record
from orb.data.labels import AUTO, _checked, _label, said_if_implausible

log = logging.getLogger("orb")
SQLITE_MAGIC = b"SQLite format 3\x00"
# what makes an index's content besides the files and keys: this module's code, and ase (and its LMDB backend) that
# parse the files (ase 3.23 changed where an extxyz's energy= goes)
# (labels: which value of a frame each label is; sqlite_rows: the rows' and tables' checksums)
INDEX_CODE = ("orb.data.formats", "orb.data.labels", "orb.data.sqlite_rows")
# the per-atom arrays the indexed copy keeps (copy() keeps constraints): what orb-md needs (velocities, masses for
# isotopes), the user's marks (tags), and what a DFT relabelling of uncertain frames starts from (initial magnetic
# moments and charges); the rest (labels under their own keys, arbitrary arrays) is not a structure's own
KEPT_ARRAYS = ("numbers", "positions", "momenta", "masses", "tags", "initial_magmoms", "initial_charges")
LABEL_NAMES = frozenset({"free_energy", *(name for names in AUTO.values() for name in names)})  # never carried


@dataclass(frozen=True)
class LabelKeys:
    """Where each frame's labels are (empty: the defaults above). ``labels``: whether they are read at all (not by the
    commands that use the structures alone: orb-relax, orb-md, orb-properties, which a NaN energy left in a file
    stopped)."""

    energy: str = ""
    forces: str = ""
    stress: str = ""
    charge: str = "charge"
    spin: str = "spin"
    labels: bool = True


def is_ase_database(path: str) -> bool:
    """Whether ``path`` is read as an ASE database (its labels are its rows' calculator results): an SQLite file, or
    a file named ``.aselmdb`` or ``.json`` (ASE's LMDB and JSON backends)."""
    return path.endswith((".aselmdb", ".json")) or is_sqlite(path)


def is_sqlite(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(len(SQLITE_MAGIC)) == SQLITE_MAGIC
    except OSError as exc:
        raise DatasetError(path, f"cannot read it ({exc.strerror or exc})") from None


def check_sqlite_file(path: str) -> None:
    """Raise DatasetError unless ``path`` is an existing SQLite file."""
    if not path:
        raise DatasetError("<empty path>", "no database path given")
    if not os.path.exists(path):
        raise DatasetError(path, "database file does not exist")
    if os.path.isdir(path):
        raise DatasetError(path, "is a directory, expected an ASE SQLite database file")
    with open(path, "rb") as f:
        head = f.read(len(SQLITE_MAGIC))
    if head != SQLITE_MAGIC:
        raise DatasetError(path, "is not an SQLite database (an ASE db written with ase.db.connect('x.db'))")


def describe_path(path: Union[str, Sequence[str]]) -> str:
    """A data path as a log line or an error names it: the path, or the listed paths joined."""
    return path if isinstance(path, str) else ", ".join(path)


# files of a data folder that hold no structures: read, they stopped the run (ase.io guesses no format for them)
NOT_STRUCTURES = (".txt", ".md", ".rst", ".log", ".yaml", ".yml", ".py", ".sh", ".ipynb", ".png", ".jpg", ".pdf",
                  ".csv")
# files a database keeps beside itself: ASE-LMDB's lock, SQLite's write-ahead log, shared memory and journal
COMPANIONS = ("-lock", "-wal", "-shm", "-journal")


def source_files(path: Union[str, Sequence[str]]) -> List[str]:
    """The files a data path names: itself, the files of a folder (sorted; hidden files and the companions of a
    database in it left out: every ASE-LMDB file written has its ``-lock``, which was refused as data), or those
    of each path of a list, in its order."""
    if not isinstance(path, str):
        if not path:
            raise DatasetError("<empty list>", "no database path given")
        return [f for item in path for f in source_files(item)]
    if not path:
        raise DatasetError("<empty path>", "no database path given")
    if not os.path.exists(path):
        raise DatasetError(path, "database file does not exist" if path.endswith((".db", ".aselmdb", ".json")) else
                           "does not exist")
    if not os.path.isdir(path):
        return [path]
    names = set(os.listdir(path))
    files = sorted(os.path.join(path, name) for name in names
                   if not name.startswith(".") and os.path.isfile(os.path.join(path, name))
                   and not any(name.endswith(end) and name[:-len(end)] in names for end in COMPANIONS))
    notes = [f for f in files if f.lower().endswith(NOT_STRUCTURES) or is_own_record(os.path.basename(f))]
    if notes:  # (a README.txt beside the data, or an orb-relax or orb-md output's run.json, stopped the run: "ase.io
        files = [f for f in files if f not in notes]  # cannot read it (txt)", "cannot read it as an ASE database")
        if path not in _SUBFOLDERS_SAID:
            log.warning("%s: %s not read (notes, scripts, images or orb's own records, not structures)", path,
                        ", ".join(os.path.basename(f) for f in notes[:5]) + (" ..." if len(notes) > 5 else ""))
    folders = sorted(name for name in names if not name.startswith(".") and os.path.isdir(os.path.join(path, name)))
    if folders and path not in _SUBFOLDERS_SAID:  # (once per folder: the path is resolved several times a run)
        log.warning("%s: its subfolders (%s) are not read, only the files directly in it: list the folders "
                    "(train_data_path: [a/, b/]) to include them", path, ", ".join(folders[:5]) +
                    (f" and {len(folders) - 5} more" if len(folders) > 5 else ""))
    _SUBFOLDERS_SAID.add(path)
    if not files:
        raise DatasetError(path, "is an empty folder: no structure files in it" +
                           (" (its subfolders are not read: list them)" if folders else ""))
    return files


_SUBFOLDERS_SAID: set = set()


def readable_database(path: Union[str, Sequence[str]], keys: LabelKeys = LabelKeys(),
                      progress: Optional[bool] = None) -> str:
    """An ASE SQLite database holding the structures of ``path``: ``path`` itself when it is one, else the
    cached copy of its frames (made now if needed; a damaged copy is made again)."""
    files = source_files(path)
    if len(files) == 1 and is_sqlite(files[0]):
        database_keys(files[0], keys)
        return files[0]
    owners = [i for i, f in enumerate(files) if os.path.exists(f + "-wal")]  # (an ASE SQLite's rows not yet in it)
    digests = files_identity(files + [files[i] + "-wal" for i in owners])
    identity = (digests[:len(files)], tuple(zip(owners, digests[len(files):])))  # (each log with its database)
    plain = [f for f in files if not is_sqlite(f)]  # (an ASE SQLite in a list is checkpointed by ase's reader)
    before = file_stamps(plain)
    libraries = ("ase", "ase-db-backends") if any(f.endswith(".aselmdb") for f in files) else ("ase",)
    entry = cache.CacheEntry(INDEX_KIND, INDEX_CODE, (identity, keys), ".db", libraries)
    found = entry.read(lambda p: p, _complete_index)
    if found is not None:
        return name_sources(found, files)
    counted = []

    def convert(tmp: str) -> None:
        counted.append(_convert(files, keys, tmp, sys.stderr.isatty() if progress is None else progress))
        if file_stamps(plain) != before:  # (kept under the digests of what was hashed, it would be another's index)
            raise DatasetError(describe_path(path), "changed while it was indexed (a copy or a write still under "
                               "way?): run again once it is complete")

    target = entry.write(convert, f"index of {describe_path(path)}")
    if target is None:
        raise DatasetError(describe_path(path), "cannot index it: no writable cache folder, or writing there failed "
                           f"({', '.join(cache.cache_dirs(INDEX_KIND))}; set ORB_CACHE_DIR)")
    log.info("indexed %s: %d structures, kept in %s", describe_path(path), counted[0], target)
    return name_sources(target, files)


def label_keys_apply(paths: Sequence) -> bool:
    """Whether energy_key/forces_key/stress_key reach any file of these data paths: only files that are not ASE
    databases read them (:func:`database_keys`)."""
    return any(not is_ase_database(f) for path in paths if path for f in source_files(path))


def database_keys(path: str, keys: LabelKeys) -> LabelKeys:
    """The label keys that apply to an ASE database of the user's (SQLite, LMDB or JSON): its labels are its rows'
    calculator results, alone or in a list (in a list the configured keys were applied to it, and refused it: its rows
    had no such info entries); the energy, forces and stress keys, which apply to the other formats of the run, said
    not to be used here, not silently left out."""
    named = {k: getattr(keys, k) for k in ("energy", "forces", "stress") if getattr(keys, k)}
    if named:
        log.warning("%s: %s not used: an ASE database's labels are its rows' calculator results", path,
                    ", ".join(f"{k}_key '{v}'" for k, v in named.items()))
    return LabelKeys(charge=keys.charge, spin=keys.spin, labels=keys.labels)


def _complete_index(path: str) -> bool:
    """Whether a cached index is sound (SQLite's quick check: pages damaged in the middle were found only when a row
    on them was read, fatal then; ~0.5 s per GB read) and holds every frame its metadata lists, each with its
    checksum (a copy cut short is made again). A row's values changed inside their pages are found when it is read
    (``RowReader``)."""
    import sqlite3

    if not is_sqlite(path):
        return False
    connection = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        (check,) = connection.execute("PRAGMA quick_check(1)").fetchone()
        if check != "ok":
            raise ValueError(f"SQLite's check: {check}")
        (meta,) = connection.execute("SELECT value FROM information WHERE name='metadata'").fetchone()
        (rows,) = connection.execute("SELECT COUNT(*) FROM systems").fetchone()
        (checksums,) = connection.execute(f"SELECT COUNT(*) FROM {CHECKSUMS}").fetchone()
    finally:
        connection.close()
    return rows == checksums == sum(frames for _, frames in json.loads(meta)["orb_sources"])


def _frames(path: str) -> Iterator[Tuple[object, Optional[int]]]:
    """The structures of one file, each with its row id in an ASE database (None for an ``ase.io`` frame)."""
    if path.endswith(".aselmdb"):
        try:
            import ase_db_backends  # noqa: F401  (registers the lmdb backend with ase.db)
        except ImportError:
            raise DatasetError(path, "reading .aselmdb needs the ase-db-backends package: pip install "
                                     "ase-db-backends (or pip install .[lmdb])") from None
    if is_ase_database(path):
        from ase.db import connect

        row_id, reading = None, False
        try:
            if path.endswith(".aselmdb"):
                _check_lmdb(path)
                database = connect(path, type="aselmdb", readonly=True, use_lock_file=False)
            elif path.endswith(".json"):  # through ase.io its rows came without their key-value pairs (weight, ...)
                database = connect(path, type="json", use_lock_file=False)
            else:
                _check_ase_sqlite(path)
                database = connect(path, type="db", use_lock_file=False)
            for row in database.select():
                row_id, reading = row.id, True
                magmoms = row.get("initial_magmoms")  # non-collinear moments: ase 3.29's row.toatoms refuses its own
                if magmoms is not None and np.ndim(magmoms) == 1 and row.natoms and len(magmoms) == 3 * row.natoms:
                    row.initial_magmoms = np.reshape(magmoms, (-1, 3))  # (it keeps them flat, n x 3 values)
                atoms = row.toatoms()
                atoms.info.update(row.data or {})
                # the stored values: ase's row.key_value_pairs gives a key named like one of its row properties
                # (``charge``: the sum of the initial charges) that property's value instead
                atoms.info.update({key: vars(row).get(key) for key in row.key_value_pairs})
                reading = False
                yield atoms, row_id
        except DatasetError:
            raise
        except Exception as exc:  # sqlite3's, lmdb's or ase's error on a damaged file: one line, the reason
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            where = "" if row_id is None else f" {'at' if reading else 'after'} row {row_id}"
            raise DatasetError(path, f"cannot read it as an ASE database{where} ({reason})") from None
        return
    import ase.io

    frame = 0
    try:
        for atoms in ase.io.iread(path, index=":"):
            yield atoms, None
            frame += 1
    except Exception as exc:  # ase.io's errors vary by format: one line, the reason and the frame
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DatasetError(path, f"ase.io cannot read it ({reason})", frame, unit="frame") from None


def _check_ase_sqlite(path: str) -> None:
    """Refuse an SQLite file that is not an ASE database, read-only: ``ase.db.connect`` read it as empty and wrote its
    own tables into it."""
    import sqlite3

    roll_back_unfinished_write(path, JOURNAL_AGE)  # (a killed writer's journal: the file looked damaged)
    connection = sqlite3.connect(f"file:{quote(os.path.abspath(path))}?mode=ro", uri=True)
    try:
        found = connection.execute("SELECT name FROM sqlite_master WHERE type='table' AND name='systems'").fetchall()
    finally:
        connection.close()
    if not found:
        raise DatasetError(path, "an SQLite file, but not an ASE database (it has no 'systems' table)")


def _check_lmdb(path: str) -> None:
    """Open an ASE-LMDB file read-only before ase does: a damaged one is one line here, where through
    ``ase_db_backends`` it also left an object whose clean-up printed a traceback at exit."""
    import lmdb

    try:
        lmdb.open(path, subdir=False, readonly=True, lock=False).close()
    except lmdb.Error as exc:
        raise DatasetError(path, f"cannot read it as an ASE database ({str(exc).split(': ', 1)[-1]})") from None


def _convert(files: List[str], keys: LabelKeys, target: str, progress: bool) -> int:
    from ase.calculators.singlepoint import SinglePointCalculator
    from ase.db import connect
    from tqdm import tqdm

    count = 0
    sources, source_rows = [], {}
    with connect(target, type="db", use_lock_file=False) as db, \
            tqdm(desc="indexing structures", unit=" frames", disable=not progress) as bar:
        for path in files:
            frames, ids = 0, []
            own = database_keys(path, keys) if is_ase_database(path) else keys
            for frame, (atoms, row_id) in enumerate(_frames(path)):
                n = len(atoms)
                at = f"frame {frame}" if row_id is None else f"row {row_id}"  # (a database's row by its id)
                if n == 0:  # (ASE's write of its labels failed with a traceback)
                    raise DatasetError(path, f"{at}: structure has no atoms")
                (energy, energy_key), (forces, forces_key), (stress, stress_key) = (
                    _label(atoms, name, own, path, at, database=row_id is not None) if keys.labels else (None, name)
                    for name in ("energy", "forces", "stress"))
                results = {}
                if energy is not None:
                    results["energy"] = float(_checked(energy, lambda s: int(np.prod(s)) == 1, energy_key, path,
                                                       at, "a number"))
                if forces is not None:
                    results["forces"] = _checked(forces, lambda s: s == (n, 3), forces_key, path, at, f"({n}, 3)")
                if stress is not None:
                    stress = _checked(stress, lambda s: s in ((6,), (3, 3), (9,)), stress_key, path, at,
                                      "(6,) or (3, 3)")
                    said_if_implausible(stress, stress_key, path, at)
                    results["stress"] = stress.reshape(3, 3) if stress.size == 9 else stress
                # (frames with and without stress: indexed as they are, as an ASE database holds them; training
                # weighs a missing stress at 0, orb-evaluate scores stress where there is one)
                pairs = _structure_attributes(atoms, keys, path, at)
                pairs.update(_other_attributes(atoms, keys, pairs, path))
                clean = atoms.copy()
                clean.info = {}
                for extra in list(clean.arrays):
                    if extra not in KEPT_ARRAYS:
                        del clean.arrays[extra]
                if results:
                    clean.calc = SinglePointCalculator(clean, **results)
                db.write(clean, key_value_pairs=pairs)
                frames += 1
                if row_id is not None:
                    ids.append(row_id)
                bar.update(1)
            if ids:  # an ASE database's rows: named by their ids, which need not be 1, 2, 3, ...
                source_rows[str(len(sources))] = id_runs(ids)
            sources.append([os.path.abspath(path), frames])
            count += frames
        db.metadata = {"orb_sources": sources, "orb_source_rows": source_rows,
                       "orb_label_keys": json.dumps(keys.__dict__)}
    if count == 0:
        raise DatasetError(files[0] if len(files) == 1 else os.path.dirname(files[0]),
                           "holds no structures: not an ASE database, and ase.io reads no frames from it")
    add_checksums(target)
    return count


def id_runs(ids: List[int]) -> List[List[int]]:
    """Row ids as runs ``[first id, count]`` (a database's ids, 1 to n but for deleted rows: a few runs, not n ids)."""
    runs: List[List[int]] = []
    for row_id in ids:
        if runs and row_id == runs[-1][0] + runs[-1][1]:
            runs[-1][1] += 1
        else:
            runs.append([int(row_id), 1])
    return runs


def _structure_attributes(atoms, keys: LabelKeys, path: str, at: str) -> dict:
    """The per-structure attributes a frame carries in ``info`` (its loss ``weight``, total charge and spin), checked,
    as the key-value pairs the indexed copy stores: everything a row of an ASE database carries, whatever the
    format it came in."""
    pairs = {}
    for name, key in (("weight", "weight" if keys.labels else ""), ("charge", keys.charge), ("spin", keys.spin)):
        if key and atoms.info.get(key) is not None:
            value = atoms.info[key]
            if name != "weight" and _not_a_finite_number(value):
                # text, NaN or inf: kept as it is, as an ASE database's row keeps it (an extra key to a model
                # without charge and spin; an OMol model's census refuses it naming the frame)
                pairs.update({name: float(value)} if not isinstance(value, str) else storable_pairs({name: value}))
                continue
            value = float(_checked(value, lambda s: int(np.prod(s)) == 1, key, path, at, "a number").reshape(-1)[0])
            if name == "weight" and value < 0:
                raise DatasetError(path, f"{at}: weight must be >= 0, got {value}", key=key)
            pairs[name] = value
    return pairs


def _not_a_finite_number(value) -> bool:
    """Text that does not read as a number, or one number that is NaN or inf (an array is checked by its shape)."""
    if isinstance(value, str):
        try:
            return not np.isfinite(float(value))
        except ValueError:
            return True
    return isinstance(value, (float, np.floating)) and not np.isfinite(value)


def _other_attributes(atoms, keys: LabelKeys, pairs: dict, path: str) -> dict:
    """The frame's other per-structure attributes in ``info`` (its ``config_type``, a source id, a flag) that a row
    of an ASE database can hold, so that an extxyz frame reaches orb-md's trajectories and orb-relax's rows as a
    database row does; its labels are not among them. A single value a row cannot hold (text that reads as a
    number, ``000123``; a name ASE reserves, ``id``; a name that reads as a formula, ``CO``) is said once per key,
    not left out silently."""
    skip = set(pairs) | {keys.energy, keys.forces, keys.stress, "charge", "spin"} | LABEL_NAMES | (
        {"weight"} if keys.labels else set())  # (unread: carried as it is)
    kept = storable_pairs(atoms.info, skip=skip)
    say_not_carried(atoms.info, kept, skip | {keys.charge, keys.spin}, path, "info key")
    return kept


def say_not_carried(attributes: dict, kept: dict, skip, path: str, what: str) -> None:
    """Say once per file and key which single values of a structure's ``attributes`` (an extxyz frame's info, an ASE
    database row's data) are not among the ``kept`` key-value pairs its outputs carry: not left out silently."""
    for key, value in attributes.items():
        if key not in kept and key not in skip \
                and isinstance(value, (str, bool, int, float, np.generic)) and (path, key) not in _NOT_CARRIED_SAID:
            _NOT_CARRIED_SAID.add((path, key))
            log.warning("%s: %s %r (%r) is not carried to orb-relax's and orb-md's outputs: an ASE database row "
                        "cannot hold it (text that reads as a number, a name ASE reserves or one that reads as a "
                        "chemical formula); rename it or store the text otherwise", path, what, key, value)


_NOT_CARRIED_SAID: set = set()


def storable_pairs(info: dict, skip=()) -> dict:
    """The entries of a structure's ``info`` that a row of an ASE database can hold as key-value pairs and an extxyz
    comment line can carry (a valid name ASE neither reserves nor reads as a chemical formula; a bool, a 64-bit
    integer, a finite number or one line of printable text), except ``skip``: how every output row carries the
    attributes its input structure came with. Arrays and nested values are not carried."""
    import warnings

    from ase.db.core import check

    out = {}
    for key, value in info.items():
        if key in skip or not isinstance(key, str) or key == "external_tables":
            continue
        if isinstance(value, (bool, np.bool_)):
            value = bool(value)
        elif isinstance(value, (int, np.integer)) and -2 ** 63 <= int(value) < 2 ** 63:
            value = int(value)
        elif isinstance(value, (float, np.floating)) and np.isfinite(value):
            value = float(value)
        elif not (isinstance(value, str) and value and value.isprintable() and len(value) <= 1000):
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # ASE warns of a key that reads as a formula (CO, HF) at every write
            try:
                check({key: value})
            except (ValueError, UserWarning):  # a name ASE reserves, cannot store or would warn of
                continue
        out[key] = value
    return out


def without_labels(info: dict) -> dict:
    """A structure's ``info`` without what reads as a label (a key naming an energy, forces, stress or virial:
    ``REF_energy``, ``DFT_energy``, ``free_energy``): carried onto the new geometries of a relaxation or dynamics,
    a label would be another structure's."""
    import re

    words = {"energy", "energies", "force", "forces", "stress", "stresses", "virial", "virials"}
    # whole words of the key, split at separators, case changes and digits (``forcefield_origin``, ``reinforced`` are
    # no labels, and were dropped; ``totalEnergy``, ``DFTEnergy``, ``energy0`` are)
    return {k: v for k, v in info.items()
            if not words & {w.lower() for w in re.findall(r"[A-Z]?[a-z]+|[A-Z]+(?![a-z])|\d+", str(k))}}
