"""Structures in the formats people have -- extxyz/xyz and anything ``ase.io`` reads, ASE-LMDB
(``.aselmdb``, through the optional ``ase-db-backends`` package), a folder of such files -- read
through the project's ASE SQLite reader.

A file that is not ASE SQLite is indexed once: its frames are copied, with their labels picked by
the configured keys, into an ASE SQLite database in the project's cache (``ORB_CACHE_DIR``),
named by the files' identity (path, size, modification time) and the keys. Every later start,
and every data-parallel rank, reads that copy: random access per row as fast as SQLite's, the
neighbour counts and the row census cached per file as for any database. Bad input is one line
naming the file, the frame and the key.

Labels (MACE's conventions): with a key left empty, energy is the stored calculator's energy (the
``energy=`` of an extxyz comment line), else ``info['REF_energy']``, else ``info['energy']``;
forces likewise from ``arrays`` (``REF_forces``, ``forces``), stress from ``info`` (``REF_stress``,
``stress``). A key that is set names the ``info`` entry (energy, stress, charge, spin) or the
``arrays`` entry (forces) to read, and every frame must carry it.
"""

import hashlib
import json
import logging
import os
import sys
from dataclasses import dataclass
from typing import Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np

from orb import cache
from orb.errors import DatasetError

log = logging.getLogger("orb")
SQLITE_MAGIC = b"SQLite format 3\x00"
CONVERTED = "converted"
VERSION = 1
AUTO = {"energy": ("REF_energy", "energy"), "forces": ("REF_forces", "forces"), "stress": ("REF_stress", "stress")}


@dataclass(frozen=True)
class LabelKeys:
    """Where each frame's labels are (empty: the defaults above)."""

    energy: str = ""
    forces: str = ""
    stress: str = ""
    charge: str = "charge"
    spin: str = "spin"


def is_sqlite(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(len(SQLITE_MAGIC)) == SQLITE_MAGIC


def describe_path(path: Union[str, Sequence[str]]) -> str:
    """A data path as a log line or an error names it: the path, or the listed paths joined."""
    return path if isinstance(path, str) else ", ".join(path)


def source_files(path: Union[str, Sequence[str]]) -> List[str]:
    """The files a data path names: itself, the files of a folder (sorted; hidden files left out), or those of
    each path of a list, in its order."""
    if not isinstance(path, str):
        if not path:
            raise DatasetError("<empty list>", "no database path given")
        return [f for item in path for f in source_files(item)]
    if not path:
        raise DatasetError("<empty path>", "no database path given")
    if not os.path.exists(path):
        raise DatasetError(path, "database file does not exist")
    if not os.path.isdir(path):
        return [path]
    files = sorted(os.path.join(path, name) for name in os.listdir(path)
                   if not name.startswith(".") and os.path.isfile(os.path.join(path, name)))
    if not files:
        raise DatasetError(path, "is an empty folder: no structure files in it")
    return files


def readable_database(path: Union[str, Sequence[str]], keys: LabelKeys = LabelKeys(),
                      progress: Optional[bool] = None) -> str:
    """An ASE SQLite database holding the structures of ``path``: ``path`` itself when it is one, else the
    cached copy of its frames (made now if needed)."""
    files = source_files(path)
    if len(files) == 1 and is_sqlite(files[0]):
        return files[0]
    identity = [(os.path.abspath(f), os.stat(f).st_size, os.stat(f).st_mtime_ns) for f in files]
    name = hashlib.sha256(repr((VERSION, identity, keys)).encode()).hexdigest()[:32] + ".db"
    found = cache.find(name, CONVERTED)
    if found is not None:
        return found
    folder = cache.writable_dir(CONVERTED)
    if folder is None:
        raise DatasetError(describe_path(path), "cannot index it: no writable cache folder "
                           f"({', '.join(cache.cache_dirs(CONVERTED))})")
    target = os.path.join(folder, name)
    temporary = f"{target}.{os.getpid()}.tmp"
    try:
        count = _convert(files, keys, temporary, sys.stderr.isatty() if progress is None else progress)
        os.replace(temporary, target)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)
    log.info("indexed %s: %d structures, kept in %s", describe_path(path), count, target)
    return target


def _frames(path: str) -> Iterator:
    """The structures of one file (ASE database rows or ``ase.io`` frames)."""
    if path.endswith(".aselmdb"):
        try:
            import ase_db_backends  # noqa: F401  (registers the lmdb backend with ase.db)
        except ImportError:
            raise DatasetError(path, "reading .aselmdb needs the ase-db-backends package: pip install "
                                     "ase-db-backends (or pip install .[lmdb])") from None
    if path.endswith(".aselmdb") or is_sqlite(path):
        from ase.db import connect

        for row in connect(path, type="aselmdb" if path.endswith(".aselmdb") else "db").select():
            atoms = row.toatoms()
            atoms.info.update(row.key_value_pairs)
            atoms.info.update(row.data or {})
            yield atoms
        return
    import ase.io

    try:
        for atoms in ase.io.iread(path, index=":"):
            yield atoms
    except Exception as exc:  # ase.io's errors vary by format: one line, the reason
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DatasetError(path, f"ase.io cannot read it ({reason})") from None


def _calculator_result(atoms, name: str):
    calc = atoms.calc
    return None if calc is None else calc.results.get(name)


def _label(atoms, name: str, keys: LabelKeys, where: str, frame: int):
    """The frame's ``name`` label by the configured key (required) or the defaults (optional)."""
    key = getattr(keys, name)
    table = atoms.arrays if name == "forces" else atoms.info
    if key:
        value = table.get(key, _calculator_result(atoms, name) if key == name else None)
        if value is None:
            raise DatasetError(where, f"frame {frame} has no {name} under the configured key "
                                      f"({'arrays' if name == 'forces' else 'info'}['{key}'])", key=f"{name}_key")
        return value
    value = _calculator_result(atoms, name)
    for candidate in AUTO[name]:
        if value is None:
            value = table.get(candidate)
    return value


def _checked(value, shape_ok, name: str, where: str, frame: int, expected: str):
    array = np.asarray(value, dtype=np.float64)
    if not shape_ok(array.shape):
        raise DatasetError(where, f"frame {frame}: {name} of shape {array.shape}, expected {expected}", key=name)
    if not np.all(np.isfinite(array)):
        raise DatasetError(where, f"frame {frame}: {name} contains NaN or inf", key=name)
    return array


def _convert(files: List[str], keys: LabelKeys, target: str, progress: bool) -> int:
    from ase.calculators.singlepoint import SinglePointCalculator
    from ase.db import connect
    from tqdm import tqdm

    count, stressed, first_stress = 0, None, None
    sources = []
    with connect(target, type="db", use_lock_file=False) as db, \
            tqdm(desc="indexing structures", unit=" frames", disable=not progress) as bar:
        for path in files:
            frames = 0
            for frame, atoms in enumerate(_frames(path)):
                n = len(atoms)
                energy = _label(atoms, "energy", keys, path, frame)
                forces = _label(atoms, "forces", keys, path, frame)
                stress = _label(atoms, "stress", keys, path, frame)
                results = {}
                if energy is not None:
                    results["energy"] = float(_checked(energy, lambda s: int(np.prod(s)) == 1, "energy", path,
                                                       frame, "a number"))
                if forces is not None:
                    results["forces"] = _checked(forces, lambda s: s == (n, 3), "forces", path, frame, f"({n}, 3)")
                if stress is not None:
                    stress = _checked(stress, lambda s: s in ((6,), (3, 3), (9,)), "stress", path, frame,
                                      "(6,) or (3, 3)")
                    results["stress"] = stress.reshape(3, 3) if stress.size == 9 else stress
                has_stress = stress is not None
                if energy is None and forces is None and stress is None:
                    pass  # an unlabelled frame (predicted only; training names it)
                elif stressed is None:
                    stressed, first_stress = has_stress, (path, frame)
                elif has_stress != stressed:
                    with_it, without = ((first_stress, (path, frame)) if stressed else ((path, frame), first_stress))
                    raise DatasetError(without[0], f"frame {without[1]} has no stress while {with_it[0]} frame "
                                                   f"{with_it[1]} has one: give every structure a stress or none",
                                       key="stress")
                pairs = {}
                for name in ("charge", "spin"):
                    key = getattr(keys, name)
                    if key and key in atoms.info:
                        value = _checked(atoms.info[key], lambda s: int(np.prod(s)) == 1, name, path, frame,
                                         "a number")
                        pairs[name] = float(value.reshape(-1)[0])
                clean = atoms.copy()
                clean.info = {}
                for extra in list(clean.arrays):
                    if extra not in ("numbers", "positions"):
                        del clean.arrays[extra]
                if results:
                    clean.calc = SinglePointCalculator(clean, **results)
                db.write(clean, key_value_pairs=pairs)
                frames += 1
                bar.update(1)
            sources.append([os.path.abspath(path), frames])
            count += frames
        db.metadata = {"orb_sources": sources, "orb_label_keys": json.dumps(keys.__dict__)}
    if count == 0:
        raise DatasetError(files[0] if len(files) == 1 else os.path.dirname(files[0]),
                           "holds no structures: not an ASE database, and ase.io reads no frames from it")
    return count


def frame_of(sources: List[Tuple[str, int]], row_id: int) -> Tuple[str, int]:
    """The file and frame a converted database's row (ids 1, 2, ... in file order) came from."""
    position = int(row_id) - 1
    for path, frames in sources:
        if position < frames:
            return path, position
        position -= frames
    return sources[-1][0], position
