"""``counts``: orb-v3's neighbour counts as a training start makes them (counted once, then read from the cache);
``rows``: row reads in random order, ase.db's reader against RowReader, each in its own process
(``children/read_rows.py``); ``formats``: an extxyz file indexed, then read against the SQLite database."""

import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

from .common import calibration, child, gemm_rate
from .mptrj import MPTRJ_FRAMES, mptrj_copies

# read(ids) -> rows; a step reads its structures' rows (8 here) together. Each reader's label -> its name in
# children/read_rows.py: ase.db's own reader (before) and the project's RowReader.
ROW_READERS = {"ase.db (before)": "ase.db", "RowReader": "RowReader"}


def read_rows(reader: str, path: str, rows: int, count: int) -> list:
    """The arguments (after the interpreter) of a process that reads ``count`` of database ``path``'s ``rows`` rows in
    random order with ``reader`` and prints microseconds per row."""
    return [child("read_rows.py"), reader, path, str(rows), str(count)]


def bench_counts(args) -> None:
    """orb-v3's neighbour counts for the batch shapes, as a training start makes them: counted by the
    data workers the first time, read from the cache at every later start. Rows: the MPtrj test rows,
    each copy randomly rotated (a distinct structure for the search)."""
    from orb.data.dataset import AseDbDataset
    from orb.data.loader import BatchLoader
    from orb.models.config import ModelConfig

    settings = ModelConfig.from_dict(dict(name=args.model)).graph_settings()
    rate_before = gemm_rate()
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["ORB_CACHE_DIR"] = os.path.join(tmp, "cache")
        path = os.path.join(tmp, "rows.db")
        mptrj_copies(path, args.rows)  # seed 0

        def start():
            dataset = AseDbDataset(path, settings=settings, require_labels=False)
            loader = BatchLoader({"train": dataset}, args.workers)
            began = time.perf_counter()
            loader.edge_capacities("train")
            return time.perf_counter() - began, dataset

        first, counted = start()
        later, read = start()
        assert counted.capacities_kept_in and read.capacities_read_from == counted.capacities_kept_in
    print(f"host calibration: {calibration(rate_before, gemm_rate())}")
    rate = args.rows / first
    print(f"| graphs | rows | data workers | first start: counted (s) | structures/s | later starts: read | "
          f"MPtrj's {MPTRJ_FRAMES:,} frames at this rate (min) |")
    print("|---|---|---|---|---|---|---|")
    print(f"| {args.model} | {args.rows} | {args.workers} | {first:.1f} | {rate:.0f} | {later * 1e3:.1f} ms | "
          f"{MPTRJ_FRAMES / rate / 60:.0f} |")


def bench_rows(args) -> None:
    """Row reads in random order, 8 per step (as a shuffled epoch reads them), from an MPtrj-like database, each
    reader in its own process: microseconds per row, alternated rounds, and the file-lock system calls one
    process makes (strace), as data workers on a shared file system would."""
    rate_before = gemm_rate()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "rows.db")
        mptrj_copies(path, args.rows)
        size = os.path.getsize(path) / 1e6
        times = {name: [] for name in ROW_READERS}

        def script(name, count):
            return read_rows(ROW_READERS[name], path, args.rows, count)

        for _ in range(args.rounds):
            for name in ROW_READERS:
                out = subprocess.run([sys.executable, *script(name, args.reads)], capture_output=True, text=True,
                                     check=True).stdout
                times[name].append(float(out.split()[-1]))
        locks = {}
        for name in ROW_READERS:
            if shutil.which("strace"):
                subprocess.run(["strace", "-f", "-e", "trace=fcntl,flock", "-o", os.path.join(tmp, "trace"),
                                sys.executable, *script(name, 1000)], capture_output=True, text=True, check=True)
                with open(os.path.join(tmp, "trace")) as f:
                    locks[name] = sum(1 for line in f if "F_SETLK" in line or "F_GETLK" in line or "flock(" in line)
    print(f"host calibration: {calibration(rate_before, gemm_rate())}")
    print(f"{args.rows:,} MPtrj-like rows ({size:.0f} MB), {args.reads:,} reads in random order per round, "
          f"{args.rounds} alternated rounds\n")
    print("| reader | µs per row (median) | rounds | lock calls per 1,000 rows |")
    print("|---|---|---|---|")
    for name, values in times.items():
        print(f"| {name} | {np.median(values):.1f} | {', '.join(f'{v:.1f}' for v in values)} | "
              f"{locks.get(name, 'no strace')} |")
    first, second = (np.median(v) for v in times.values())
    print(f"\nRowReader: {first / second:.1f}x the rows per second of ase.db's reader")


def bench_formats(args) -> None:
    """Other formats (orb.data.formats): an extxyz file of MPtrj-like frames indexed once (frames per second; a
    second start finds the index), then rows of the index read in random order against the same rows in the
    ASE SQLite database they were written from (RowReader, each reader in its own process, alternated)."""
    import ase.db
    import ase.io

    from orb.data.formats import readable_database

    with tempfile.TemporaryDirectory() as tmp:
        os.environ["ORB_CACHE_DIR"] = os.path.join(tmp, "cache")
        database, text = os.path.join(tmp, "rows.db"), os.path.join(tmp, "rows.extxyz")
        mptrj_copies(database, args.rows)
        with ase.db.connect(database) as src:
            ase.io.write(text, [row.toatoms() for row in src.select()], format="extxyz")
        start = time.perf_counter()
        indexed = readable_database(text, progress=False)
        first = time.perf_counter() - start
        start = time.perf_counter()
        readable_database(text, progress=False)
        again = time.perf_counter() - start
        staged = os.path.join(tmp, "job2", "rows.extxyz")  # a copy in a job's scratch folder, new times
        os.makedirs(os.path.dirname(staged))
        shutil.copyfile(text, staged)
        start = time.perf_counter()
        assert readable_database(staged, progress=False) == indexed
        copy = time.perf_counter() - start
        times = {"ASE SQLite": [], "extxyz (its index)": []}
        for _ in range(args.rounds):
            for name, path in (("ASE SQLite", database), ("extxyz (its index)", indexed)):
                reader = read_rows(ROW_READERS["RowReader"], path, args.rows, args.reads)
                out = subprocess.run([sys.executable, *reader], capture_output=True, text=True, check=True).stdout
                times[name].append(float(out.split()[-1]))
        size = os.path.getsize(text) / 1e6
    print(f"{args.rows:,} MPtrj-like frames in extxyz ({size:.0f} MB): indexed in {first:.1f} s "
          f"({args.rows / first:,.0f} frames/s); second start {again * 1000:.0f} ms; a copy in another folder, new "
          f"times: found in {copy * 1000:.0f} ms (hashed at {size / 1e3 / copy:.2f} GB/s)\n")
    print("| rows read from | µs per row (median) | rounds |")
    print("|---|---|---|")
    for name, values in times.items():
        print(f"| {name} | {np.median(values):.1f} | {', '.join(f'{v:.1f}' for v in values)} |")
    sqlite, extxyz = (np.median(v) for v in times.values())
    print(f"\nextxyz rows at {sqlite / extxyz:.2f}x SQLite's rate")
