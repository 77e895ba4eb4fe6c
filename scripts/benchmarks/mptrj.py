"""MPtrj-like data for the data benchmarks: rotated copies of the shipped MPtrj rows (``counts``, ``rows``,
``formats``), and structures of MPtrj's size distribution in trajectories (``relax``), written into an MPtrj-sized
database kept in the project's cache (``scale``)."""

import hashlib
import sys
import time

import numpy as np

from .common import MPTRJ

MPTRJ_FRAMES = 1_580_395  # structures in MPtrj


def mptrj_copies(path: str, rows: int, seed: int = 0) -> None:
    """An MPtrj-like database: the shipped MPtrj rows, each copy randomly rotated, with their labels."""
    import ase.db

    from orb.data.augmentation import random_rotation

    rng = np.random.default_rng(seed)
    with ase.db.connect(MPTRJ) as src, ase.db.connect(path) as dst:
        sources = [row.toatoms() for row in src.select()]
        for i in range(rows):
            atoms = sources[i % len(sources)].copy()
            rotation = random_rotation(rng)
            atoms.set_cell(atoms.cell.array @ rotation)
            atoms.positions = atoms.positions @ rotation
            dst.write(atoms)


MPTRJ_SIZES = (np.log(20), 0.86, 444)  # log-normal atom counts (median 20, mean ~29), MPtrj's largest cell 444
TRAJECTORY = 11  # MPtrj: 1.58 M frames of 146 k materials, the frames of a relaxation stored together


def mptrj_like_rows(count: int, seed: int):
    """``count`` structures of MPtrj's size distribution in trajectories of ~11 jittered frames, each cut from a
    supercell of a shipped MPtrj frame (energy per atom and forces kept, stress copied)."""
    import ase.db
    from ase.calculators.singlepoint import SinglePointCalculator

    rng = np.random.default_rng(seed)
    with ase.db.connect(MPTRJ) as src:
        frames = [(row.toatoms(), row.energy / row.natoms, row.forces, row.stress) for row in src.select()]
    made = 0
    while made < count:
        mu, sigma, largest = MPTRJ_SIZES
        natoms = int(np.clip(np.rint(np.exp(rng.normal(mu, sigma))), 1, largest))
        atoms, per_atom, forces, stress = frames[int(rng.integers(len(frames)))]
        repeat = 1
        while len(atoms) * repeat ** 3 < natoms:
            repeat += 1
        big = atoms.repeat(repeat)
        base_forces = np.tile(forces, (repeat ** 3, 1))
        keep = np.arange(natoms)
        for _ in range(min(int(rng.geometric(1 / TRAJECTORY)), count - made)):
            frame = big[keep]
            frame.positions += rng.normal(0, 0.02, frame.positions.shape)
            frame.calc = SinglePointCalculator(frame, energy=per_atom * natoms + rng.normal(0, 0.01),
                                               forces=base_forces[keep] + rng.normal(0, 0.01, (natoms, 3)),
                                               stress=stress)
            made += 1
            yield frame


def _this_file_digest() -> str:
    """This file's source hashed: the code that makes the benchmark's databases (not importable as part of orb)."""
    with open(__file__, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def mptrj_sized_database(rows: int, seed: int = 0, distinct: int = 20000) -> str:
    """An MPtrj-sized ASE database, built once and kept in the project's cache (``benchmark_data``): ``distinct``
    structures written by ase.db, then copied as whole trajectories by SQL until it holds ``rows`` rows."""
    from orb import cache

    entry = cache.CacheEntry("benchmark_data", (), ("mptrj_like", rows, seed, distinct, _this_file_digest()),
                             ".db", ("ase",))
    found = entry.read(lambda path: path)
    if found:
        return found
    start = time.perf_counter()
    entry.write(lambda temporary: _fill_mptrj_sized(temporary, rows, seed, distinct), "MPtrj-sized database")
    print(f"\nbuilt {entry.kept_in} in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    return entry.kept_in


def _fill_mptrj_sized(temporary: str, rows: int, seed: int, distinct: int) -> None:
    import sqlite3

    import ase.db

    with ase.db.connect(temporary, type="db") as db:
        for atoms in mptrj_like_rows(min(rows, distinct), seed):
            db.write(atoms)
    connection = sqlite3.connect(temporary)
    columns = [c[1] for c in connection.execute("PRAGMA table_info(systems)") if c[1] not in ("id", "unique_id")]
    base = min(rows, distinct)
    while True:
        (have,) = connection.execute("SELECT COUNT(*) FROM systems").fetchone()
        if have >= rows:
            break
        take = min(base, rows - have)
        cols = ", ".join(columns)
        connection.execute(f"INSERT INTO systems (unique_id, {cols}) SELECT lower(hex(randomblob(16))), {cols} "
                           f"FROM systems WHERE id <= {take} ORDER BY id")
        connection.execute(f"INSERT INTO species (Z, n, id) SELECT Z, n, id + {have} FROM species WHERE id <= {take}")
        connection.commit()
        print(f"\rbuilding an MPtrj-sized database: {have + take:,} / {rows:,} rows", end="", file=sys.stderr,
              flush=True)
    connection.close()
