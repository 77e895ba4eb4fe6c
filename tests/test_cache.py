"""The project's cache (orb.cache): every entry named by everything that determines it, written atomically, and a
damaged or empty file (a power loss, a full disk) rebuilt with one warning, never fatal -- for each kind of entry."""

import os
import shutil

import numpy as np
import pytest

from conftest import DEMO_TRAIN, DEMO_VAL, MPTRJ_DB


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("ORB_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def spoil(path, how):
    """``empty``, ``garbage``, or ``pages``: an array file's values (after its header) made zeros, or three pages in
    the middle of an SQLite file overwritten, the size kept (what a disk's lost or stray writes leave)."""
    if how == "pages":
        data = bytearray(open(path, "rb").read())
        if data.startswith(b"SQLite format 3"):
            start = 4096 * 13  # (pages 14-16 of an index of the demo's 64 training structures: its tables' pages)
            data[start:start + 3 * 4096] = np.random.default_rng(0).bytes(3 * 4096)
        else:
            start = data.index(b"\n", data.index(b"'descr'")) + 1  # the .npy header's end
            stop = data.find(b"PK\x01\x02") if data.find(b"PK\x01\x02") > 0 else len(data)  # a zip's directory
            data[start:stop] = bytes(stop - start)
        with open(path, "wb") as f:
            f.write(data)
        return
    with open(path, "wb") as f:
        f.write(b"" if how == "empty" else b"\x93NUMPY garbage")


def test_an_entry_is_named_by_its_whole_identity_and_a_damaged_file_is_rebuilt(cache_dir, caplog):
    from orb.cache import CacheEntry, load_values

    entry = CacheEntry("demo", ("orb.cache",), ("data", "model a"), ".npz")
    assert entry.read(load_values) is None
    path = entry.write(lambda tmp: np.savez(tmp, values=np.arange(5)), "demo values")
    assert path and os.listdir(os.path.dirname(path)) == [os.path.basename(path)]  # no temporary left
    np.testing.assert_array_equal(CacheEntry("demo", ("orb.cache",), ("data", "model a"), ".npz").read(load_values),
                                  np.arange(5))
    for other in (CacheEntry("demo", ("orb.cache", "orb.errors"), ("data", "model a"), ".npz"),
                  CacheEntry("demo", ("orb.cache",), ("data", "model b"), ".npz"),
                  CacheEntry("demo", ("orb.cache",), ("data", "model a"), ".npz", ("numpy",))):
        assert other.name != entry.name and other.read(load_values) is None
    for how in ("empty", "garbage"):
        spoil(path, how)
        with caplog.at_level("WARNING", logger="orb"):
            assert CacheEntry("demo", ("orb.cache",), ("data", "model a"), ".npz").read(load_values) is None
        assert f"cache file {path} is damaged" in caplog.text and not os.path.exists(path)
        entry.write(lambda tmp: np.savez(tmp, values=np.arange(5)), "demo values")
    assert entry.read(load_values, valid=lambda values: len(values) == 6) is None  # implausible: rebuilt too


def test_an_entry_written_by_other_code_or_another_library_version_is_not_read(cache_dir, tmp_path):
    """An entry is keyed by the source of the code that computes it and the versions of the libraries that take part,
    not by a number bumped by hand (the index and the census had one, which an edit could forget, and neither knew
    ase's version, which decides how an extxyz is parsed): a process running edited code misses the entry an older
    one wrote, one running the same code reads it."""
    import subprocess
    import sys

    from conftest import ROOT
    from orb.cache import library_versions

    package = tmp_path / "src" / "counting"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("SCALE = 1\n")
    script = ("import numpy as np, counting; from orb.cache import CacheEntry, load_values\n"
              "entry = CacheEntry('demo', ('counting',), ('data',), '.npz', ('ase',))\n"
              "values = entry.read(load_values)\n"
              "if values is None: entry.write(lambda tmp: np.savez(tmp, values=np.arange(3) * counting.SCALE), 'demo')\n"
              "print('miss' if values is None else values.tolist())")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "src"), ROOT])}

    def run():
        return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                              check=True).stdout.split("\n")[-2]

    assert run() == "miss" and run() == "[0, 1, 2]"
    (package / "__init__.py").write_text("SCALE = 2  # an edit\n")
    assert run() == "miss" and run() == "[0, 2, 4]"
    import ase

    assert library_versions("ase", "no-such-package") == (("ase", ase.__version__), ("no-such-package", "absent"))


@pytest.mark.parametrize("how", ["empty", "garbage", "pages"])
def test_damaged_row_census_and_neighbour_counts_are_computed_again(cache_dir, tmp_path, how):
    from orb.data.dataset import AseDbDataset
    from orb.models.config import ModelConfig

    path = str(tmp_path / "data.db")
    shutil.copy2(MPTRJ_DB, path)
    settings = ModelConfig.from_dict(dict(name="orb_v3_direct_20_omat")).graph_settings()
    first = AseDbDataset(path, settings=settings)
    census, counts = first.census(), first.edge_capacities()
    for kept in (first.census_pass.kept_in, first.capacities_kept_in):
        spoil(kept, how)
    again = AseDbDataset(path, settings=settings)
    np.testing.assert_array_equal(again.census(), census)
    np.testing.assert_array_equal(again.edge_capacities(), counts)
    assert again.census_pass.read_from is None and again.capacities_read_from is None
    assert again.capacities_kept_in == first.capacities_kept_in  # and written again
    third = AseDbDataset(path, settings=settings)
    third.edge_capacities()
    assert third.capacities_read_from == first.capacities_kept_in


@pytest.mark.parametrize("how", ["empty", "garbage", "pages"])
def test_a_damaged_index_of_another_format_is_made_again(cache_dir, tmp_path, how):
    import ase.io
    from ase.db import connect

    from orb.data.dataset import AseDbDataset
    from orb.data.formats import readable_database

    frames = [row.toatoms() for row in connect(DEMO_TRAIN).select()]
    ase.io.write(tmp_path / "train.extxyz", frames, format="extxyz")
    index = readable_database(str(tmp_path / "train.extxyz"))
    census = AseDbDataset(index).census()
    spoil(index, how)
    again = readable_database(str(tmp_path / "train.extxyz"))
    assert again == index and len(AseDbDataset(again)) == len(frames)
    np.testing.assert_array_equal(AseDbDataset(again).census(), census)  # every row read again


def zero_bytes_inside(path, row, column, count):
    """``count`` bytes of a row's ``column`` value made zeros inside the database file, its pages otherwise intact
    (what SQLite's own check does not see)."""
    import sqlite3

    connection = sqlite3.connect(path)
    (blob,) = connection.execute(f"SELECT {column} FROM systems WHERE id = ?", (row,)).fetchone()
    connection.close()
    data = bytearray(open(path, "rb").read())
    start = data.index(blob)
    assert data.find(blob, start + 1) < 0  # the row's value, nothing else
    data[start:start + count] = bytes(count)
    with open(path, "wb") as f:
        f.write(data)


def test_an_index_whose_row_values_changed_on_disk_is_found_removed_and_made_again(cache_dir, tmp_path):
    """An atom's position zeroed inside a cached index's page (a lost write; SQLite's quick check passes) is found
    when the row is read: one line naming the user's file and frame, exit 1 from orb-evaluate, the index removed;
    the next start indexes the file again and reads the true positions. It was read back as (0, 0, 0) without a
    word: a structure with an atom at the origin trained on, or evaluated."""
    import json
    import subprocess
    import sys

    import ase.io
    from ase.db import connect

    from conftest import ROOT
    from orb.data.dataset import AseDbDataset
    from orb.data.formats import readable_database
    from orb.errors import RunError

    frames = [row.toatoms() for row in connect(DEMO_VAL).select()]
    source = str(tmp_path / "val.extxyz")
    ase.io.write(source, frames, format="extxyz")
    index = readable_database(source)
    expected = AseDbDataset(index).rows.read(5).positions.copy()  # (extxyz keeps 8 decimals: not frames' own)
    zero_bytes_inside(index, 5, "positions", 24)
    assert readable_database(source) == index and os.path.exists(index)  # its pages are sound
    with pytest.raises(RunError, match=rf"^{source}, frame 4: its copy in the cached index {index} is damaged"):
        AseDbDataset(index)[4]
    assert not os.path.exists(index)
    again = readable_database(source)
    np.testing.assert_array_equal(AseDbDataset(again).rows.read(5).positions, expected)
    assert expected[0].any()

    zero_bytes_inside(again, 3, "forces", 8)
    result = subprocess.run([sys.executable, "scripts/evaluate.py", "--checkpoint", "data/demo_pretrained.ckpt",
                             "--data", source, "--output_dir", str(tmp_path / "eval"), "--progress_bar", "false"],
                            cwd=ROOT, capture_output=True, text=True, timeout=600,
                            env=dict(os.environ, ORB_CACHE_DIR=str(cache_dir)))
    assert result.returncode == 1, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if "damaged" in line]
    assert len(lines) == 1 and f"{source}, frame 2: its copy in the cached index" in lines[0], result.stderr[-2000:]
    assert "Traceback" not in result.stderr and not os.path.exists(again)
    assert not os.path.exists(tmp_path / "eval" / "summary.json")
    result = subprocess.run([sys.executable, "scripts/evaluate.py", "--checkpoint", "data/demo_pretrained.ckpt",
                             "--data", source, "--output_dir", str(tmp_path / "eval"), "--progress_bar", "false"],
                            cwd=ROOT, capture_output=True, text=True, timeout=600,
                            env=dict(os.environ, ORB_CACHE_DIR=str(cache_dir)))
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.load(open(tmp_path / "eval" / "summary.json"))["forces_mae"] > 0


def test_a_damaged_index_is_named_to_every_reader_a_weight_changed_on_disk_is_found_and_a_users_copy_is_left(
        cache_dir, tmp_path):
    """Two processes reading an index that one finds damaged: the other is told it was removed (not "could not be
    removed: remove it"); a weight changed in ASE's key-value table (read without the rows) is found at the next
    start (it was used without a word); an index copied out of the cache and written to is the user's database,
    never checked nor removed (it was removed as damaged)."""
    import shutil
    import sqlite3

    import ase.io
    from ase.db import connect

    from orb.data.dataset import AseDbDataset
    from orb.data.formats import readable_database
    from orb.data.sqlite_rows import RowReader
    from orb.errors import RunError

    frames = [row.toatoms() for row in connect(DEMO_VAL).select()]
    for i, atoms in enumerate(frames):
        atoms.info["weight"] = 1.0 + i
    source = str(tmp_path / "val.extxyz")
    ase.io.write(source, frames, format="extxyz")
    index = readable_database(source)
    assert AseDbDataset(index).weights[3] == 4.0
    mine = str(tmp_path / "mine.db")
    shutil.copy(index, mine)
    first, second = RowReader(index), RowReader(index)
    zero_bytes_inside(index, 2, "positions", 24)
    with pytest.raises(RunError, match="frame 1: its copy in the cached index .* it was removed and is made again .*"
                                       "--resume for orb-relax and orb-md"):
        first.read(2)
    with pytest.raises(RunError, match=f"the cached index {index} was removed while this run read it"):
        second.read(3)

    index = readable_database(source)
    connection = sqlite3.connect(index)
    connection.execute("UPDATE number_key_values SET value = 0 WHERE key = 'weight' AND id = 4")
    connection.commit()
    connection.close()
    with pytest.raises(RunError, match=rf"^{source}: its copy in the cached index .* \(its weights do not match"):
        AseDbDataset(index)
    assert not os.path.exists(index)
    assert AseDbDataset(readable_database(source)).weights[3] == 4.0

    with connect(mine) as db:
        db.update(3, note="checked by hand")
        db.write(frames[0])
    assert len(AseDbDataset(mine)) == len(frames) + 1 and os.path.exists(mine)


def test_a_damaged_index_in_a_read_only_cache_folder_is_made_again_in_another(tmp_path, monkeypatch, small_disk):
    """ORB_CACHE_DIR read-only (a shared cache): an index found damaged there cannot be removed; it is marked in the
    user's own cache folder, so the next start, in another job with its own $TMPDIR, makes a copy there and uses it,
    and later starts read that copy (the damaged one was read again, and failed, at every start; a mark in $TMPDIR
    was not seen by the next job)."""
    import subprocess

    import ase.io
    from ase.db import connect

    from orb.data.dataset import AseDbDataset
    from orb.data.formats import readable_database
    from orb.errors import RunError

    shared = small_disk(4 << 20)
    monkeypatch.setenv("ORB_CACHE_DIR", str(shared))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    frames = [row.toatoms() for row in connect(DEMO_VAL).select()]
    source = str(tmp_path / "val.extxyz")
    ase.io.write(source, frames, format="extxyz")
    index = readable_database(source)
    first = AseDbDataset(index)
    expected = first.rows.read(6).positions.copy()
    first.close()
    assert index.startswith(str(shared))
    zero_bytes_inside(index, 6, "positions", 24)
    result = subprocess.run(["mount", "-o", "remount,ro", str(shared)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    damaged = AseDbDataset(index)
    with pytest.raises(RunError, match="could not be removed .* made again elsewhere at the next start"):
        damaged.rows.read(6)
    damaged.close()  # (an open file would keep the test's file system from being unmounted)
    assert os.path.exists(index)
    for job in range(2):  # each job (or node) has a $TMPDIR of its own: the mark is kept where every one sees it
        monkeypatch.setenv("TMPDIR", str(tmp_path / f"tmp{job}"))
        again = readable_database(source)
        assert again.startswith(str(tmp_path / f"tmp{job}"))
        np.testing.assert_array_equal(AseDbDataset(again).rows.read(6).positions, expected)
        assert AseDbDataset(readable_database(source)).rows.read(6).positions.tolist() == expected.tolist()


def test_an_entry_of_other_code_is_kept_beside_the_new_one(cache_dir):
    """Another installation sharing the cache (a second virtual environment, another version of the project) may be
    reading the entry its code made: writing this code's entry for the same data leaves it (removing it broke the
    other installation's running job, and each then made its copy again at every start)."""
    from orb.cache import CacheEntry, load_values

    old = CacheEntry("demo", ("orb.cache",), ("data",), ".npz")
    old.write(lambda tmp: np.savez(tmp, values=np.arange(3)), "demo values")
    new = CacheEntry("demo", ("orb.cache", "orb.errors"), ("data",), ".npz")
    assert new.read(load_values) is None
    new.write(lambda tmp: np.savez(tmp, values=np.arange(4)), "demo values")
    np.testing.assert_array_equal(old.read(load_values), np.arange(3))
    np.testing.assert_array_equal(new.read(load_values), np.arange(4))


def test_compiled_code_goes_to_its_own_folder_and_data_stays(cache_dir, tmp_path, monkeypatch):
    """ORB_COMPILE_CACHE_DIR set: compiled graphs and native libraries are kept and found there, the data's entries
    in ORB_CACHE_DIR; unset, both in ORB_CACHE_DIR (a folder of compiled code can serve runs whose data caches are
    apart, as the test suite's do)."""
    from orb.cache import CacheEntry, load_values

    def keep(compiled):
        entry = CacheEntry("demo", ("orb.cache",), ("data", compiled), ".npz", compiled=compiled)
        entry.write(lambda tmp: np.savez(tmp, values=np.arange(3)), "demo values")
        return entry

    monkeypatch.delenv("ORB_COMPILE_CACHE_DIR")
    assert all(keep(c).kept_in.startswith(str(cache_dir / "demo")) for c in (False, True))
    monkeypatch.setenv("ORB_COMPILE_CACHE_DIR", str(tmp_path / "compiled"))
    data, compiled = keep(False), keep(True)
    assert data.kept_in.startswith(str(cache_dir / "demo"))
    assert compiled.kept_in.startswith(str(tmp_path / "compiled" / "demo"))
    np.testing.assert_array_equal(compiled.read(load_values), np.arange(3))
    assert compiled.read_from == compiled.kept_in


def test_an_index_cut_short_is_made_again(cache_dir, tmp_path):
    """A copy that lost rows (its metadata lists more frames than it holds) is indexed again."""
    import sqlite3

    import ase.io
    from ase.db import connect

    from orb.data.dataset import AseDbDataset
    from orb.data.formats import readable_database

    frames = [row.toatoms() for row in connect(DEMO_VAL).select()]
    ase.io.write(tmp_path / "val.extxyz", frames, format="extxyz")
    index = readable_database(str(tmp_path / "val.extxyz"))
    connection = sqlite3.connect(index)
    connection.execute("DELETE FROM systems WHERE id > 3")
    connection.commit()
    connection.close()
    assert len(AseDbDataset(readable_database(str(tmp_path / "val.extxyz")))) == len(frames)


def test_a_damaged_native_library_is_built_again(cache_dir, monkeypatch):
    from orb import native
    from orb.models import kernels

    monkeypatch.setenv("ORB_COMPILE_CACHE_DIR", str(cache_dir))
    native.build.cache_clear()
    try:
        path = kernels.library_path()
        assert path is not None and path.startswith(str(cache_dir))
        spoil(path, "empty")
        native.build.cache_clear()
        assert kernels.library_path() == path and os.path.getsize(path) > 0
    finally:
        native.build.cache_clear()


def test_a_stop_signal_while_reading_a_cache_entry_stops_and_keeps_the_file(cache_dir):
    """A stop signal that arrives while a cache file is read ends the run (exit 75), and the file stays: it was
    taken for damaged and deleted, and the signal swallowed, when Stopped was an ordinary Exception."""
    from orb.cache import CacheEntry, load_values
    from orb.signals import Stopped

    entry = CacheEntry("demo", ("orb.cache",), ("data",), ".npz")
    path = entry.write(lambda tmp: np.savez(tmp, values=np.arange(3)), "demo values")

    def interrupted(_path):
        raise Stopped("stopped by SIGTERM during start-up")

    with pytest.raises(Stopped):
        entry.read(interrupted)
    assert os.path.exists(path)
    np.testing.assert_array_equal(entry.read(load_values), np.arange(3))


def test_threads_reading_one_entry_at_once_keep_it(cache_dir, caplog):
    """Threads of one process reading cache entries at once (orb-md's runs; ranks standing in as threads) read them
    one at a time: numpy's header parsing from two threads at once can fail in CPython 3.11 ("AST constructor
    recursion depth mismatch"), and the file was then taken for damaged and removed (a neighbour count recounted).
    The stand-in loader fails the same way whenever another thread is inside it."""
    import threading
    import time

    from orb.cache import CacheEntry, load_values

    entry = CacheEntry("demo", ("orb.cache",), ("data",), ".npz")
    path = entry.write(lambda tmp: np.savez(tmp, values=np.arange(4)), "demo values")
    inside, lock, barrier, results = [0], threading.Lock(), threading.Barrier(3), []

    def racy(file):
        with lock:
            inside[0] += 1
        try:
            time.sleep(0.05)
            if inside[0] > 1:
                raise SystemError("AST constructor recursion depth mismatch (before=51, after=48)")
            return load_values(file)
        finally:
            with lock:
                inside[0] -= 1

    def reader():
        barrier.wait()
        results.append(CacheEntry("demo", ("orb.cache",), ("data",), ".npz").read(racy))

    threads = [threading.Thread(target=reader) for _ in range(3)]
    with caplog.at_level("WARNING", logger="orb"):
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    assert len(results) == 3 and all(r is not None and list(r) == [0, 1, 2, 3] for r in results), results
    assert os.path.exists(path) and "damaged" not in caplog.text


def test_a_cache_that_cannot_be_written_names_the_folder_and_the_run_goes_on(cache_dir, caplog):
    """A failed write (here: the entry's name taken by a folder, as a full disk fails it) leaves no temporary and one
    warning naming the folder; the writer's own temporaries of a killed earlier process untouched for an hour
    are removed at the next write, recent ones (perhaps another node's live writer) are kept."""
    import time

    from orb.cache import CacheEntry, load_values

    entry = CacheEntry("demo", ("orb.cache",), ("data",), ".npz")
    folder = cache_dir / "demo"
    os.makedirs(folder / entry.name)  # a folder where the file should go: the rename fails
    from orb.files import temporary_prefix

    dead = 2 ** 22 + 12345  # above any pid_max default: no such process
    old, recent = folder / f".x.npy.tmp-{dead}-ab12.npy", folder / f".y.npy.tmp-{dead}-cd34.npy"
    # a recent temporary of a dead process of this host (its name says so: a killed export's stayed 10 minutes)
    here = folder / (os.path.basename(temporary_prefix(str(folder / "z.npy"))).replace(f"-{os.getpid()}@", f"-{dead}@")
                     + ".npy")
    for stale in (old, recent, here):
        stale.write_bytes(b"partial")
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    with caplog.at_level("WARNING", logger="orb"):
        assert entry.write(lambda tmp: np.savez(tmp, values=np.arange(3)), "demo values") is None
    assert f"could not keep the demo values in {folder}" in caplog.text
    assert sorted(os.listdir(folder)) == sorted([entry.name, recent.name])  # no temporary of this write left
    assert entry.read(load_values) is None


def test_a_damaged_entry_in_a_read_only_cache_folder_is_rebuilt_once(tmp_path, monkeypatch, small_disk, caplog):
    """ORB_CACHE_DIR on a read-only file system holding a damaged entry: it cannot be removed, so the entry is kept
    in the per-user temporary folder, and the next start reads that copy (it found the damaged one first and
    computed the entry again at every start)."""
    import subprocess

    from orb.cache import CacheEntry, load_values

    shared = small_disk(1 << 20)
    monkeypatch.setenv("ORB_CACHE_DIR", str(shared))
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    entry = CacheEntry("demo", ("orb.cache",), ("data",), ".npz")
    damaged = entry.write(lambda tmp: np.savez(tmp, values=np.arange(4)), "demo values")
    assert damaged and damaged.startswith(str(shared))
    spoil(damaged, "garbage")
    result = subprocess.run(["mount", "-o", "remount,ro", str(shared)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert entry.read(load_values) is None  # damaged, and it cannot be removed
    kept = entry.write(lambda tmp: np.savez(tmp, values=np.arange(4)), "demo values")
    assert kept and kept.startswith(str(tmp_path / "tmp")) and os.path.exists(damaged)
    again = CacheEntry("demo", ("orb.cache",), ("data",), ".npz")
    np.testing.assert_array_equal(again.read(load_values), np.arange(4))
    assert again.read_from == kept


def test_a_read_only_folder_of_compiled_code_is_read_and_what_it_lacks_is_kept_in_the_users_cache(
        tmp_path, monkeypatch, small_disk, caplog):
    """ORB_COMPILE_CACHE_DIR shared read-only (filled once for a group): its entries are read; an entry it lacks
    is kept in the run's own ORB_CACHE_DIR and read back at the next start (not compiled again in every job's
    $TMPDIR); a damaged one is marked where every run that reads the folder sees it, whatever its ORB_CACHE_DIR:
    warned of once, not again by runs with other data caches."""
    import subprocess

    from orb.cache import CacheEntry, load_values

    shared = small_disk(1 << 20)
    monkeypatch.setenv("ORB_COMPILE_CACHE_DIR", str(shared))
    monkeypatch.setenv("ORB_CACHE_DIR", str(tmp_path / "data_a"))
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp_a"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))

    def graph(name):
        return CacheEntry("demo", ("orb.cache",), (name,), ".npz", compiled=True)

    for name in ("filled", "damaged"):
        assert graph(name).write(lambda tmp: np.savez(tmp, values=np.arange(4)), "demo").startswith(str(shared))
    spoil(graph("damaged").path(), "garbage")
    result = subprocess.run(["mount", "-o", "remount,ro", str(shared)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    np.testing.assert_array_equal(graph("filled").read(load_values), np.arange(4))
    lacking = graph("lacking")
    assert lacking.write(lambda tmp: np.savez(tmp, values=np.arange(2)), "demo").startswith(str(tmp_path / "data_a"))
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp_next_job"))
    again = graph("lacking")
    np.testing.assert_array_equal(again.read(load_values), np.arange(2))
    assert again.read_from == lacking.kept_in
    with caplog.at_level("WARNING", logger="orb"):
        assert graph("damaged").read(load_values) is None
        for data in ("data_b", "data_c"):  # other runs with data caches of their own
            monkeypatch.setenv("ORB_CACHE_DIR", str(tmp_path / data))
            assert graph("damaged").path() is None
    assert caplog.text.count("is damaged") == 1


HOLDER = """
import sys, time
import numpy as np
from orb.cache import CacheEntry, one_builder
entry = CacheEntry("demo", ("orb.cache",), ("built once",), ".npz")
with one_builder(entry, "demo values"):
    print("holding", flush=True)
    time.sleep(float(sys.argv[1]))
    entry.write(lambda tmp: np.savez(tmp, values=np.arange(7)), "demo values")
"""


def hold_the_build(seconds: float, env: dict):
    """A process that takes ``one_builder`` of the entry ("built once"), holds it ``seconds``, then writes the entry;
    returned once it holds it."""
    import subprocess
    import sys

    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(seconds)], env=env, stdout=subprocess.PIPE,
                              text=True)
    assert holder.stdout.readline().strip() == "holding"
    return holder


def test_one_process_builds_an_entry_and_the_others_wait_and_read_it_even_when_the_builder_is_killed(
        cache_dir, caplog):
    """``one_builder``: while one process builds an entry (a job's rank compiling a graph) another waits (one line
    said), then reads what the first wrote instead of building it again; a builder killed while it holds the lock
    (SIGKILL: nothing of it runs) leaves it free at once, and the waiter builds the entry itself."""
    import time

    from orb.cache import CacheEntry, load_values, one_builder

    env = dict(os.environ, ORB_CACHE_DIR=str(cache_dir), PYTHONPATH=os.path.dirname(os.path.dirname(__file__)))
    entry = CacheEntry("demo", ("orb.cache",), ("built once",), ".npz")
    holder = hold_the_build(3.0, env)
    start = time.monotonic()
    with caplog.at_level("INFO", logger="orb"), one_builder(entry, "demo values"):
        waited = time.monotonic() - start
        found = entry.read(load_values)
    assert holder.wait(timeout=30) == 0
    assert waited > 1.5 and found is not None and list(found) == list(range(7))
    assert caplog.text.count("another process is building the demo values") == 1

    os.remove(entry.path())
    holder = hold_the_build(600.0, env)
    start = time.monotonic()
    holder.kill()
    with one_builder(entry, "demo values"):
        waited = time.monotonic() - start
        assert entry.read(load_values) is None  # the killed builder wrote nothing: this process builds it
        entry.write(lambda tmp: np.savez(tmp, values=np.arange(3)), "demo values")
    holder.wait(timeout=30)
    assert waited < 10 and list(entry.read(load_values)) == [0, 1, 2]
    lock_folder = os.path.join(str(cache_dir), "demo", "locks")
    assert [name for name in os.listdir(os.path.join(str(cache_dir), "demo")) if name != "locks"] == [entry.name]
    assert os.listdir(lock_folder) == [entry.name + ".lock"]  # no temporary beside the entry, one empty lock file


def test_a_stop_signal_or_a_holder_that_never_lets_go_ends_the_wait_and_the_waiter_builds_it(cache_dir, monkeypatch):
    """A process waiting for another's build stops waiting when a stop signal is noted (a requeue's SIGTERM must not
    wait for another job's compilation) or after the longest wait (a suspended holder, a crashed NFSv3 client's
    lock): it then builds the entry itself, without the lock."""
    import threading
    import time

    from orb import files
    from orb.cache import CacheEntry, one_builder
    from orb.signals import STOP

    env = dict(os.environ, ORB_CACHE_DIR=str(cache_dir), PYTHONPATH=os.path.dirname(os.path.dirname(__file__)))
    entry = CacheEntry("demo", ("orb.cache",), ("built once",), ".npz")
    holder = hold_the_build(600.0, env)
    try:
        stop = threading.Timer(1.0, lambda: setattr(STOP, "received", "SIGTERM"))
        start = time.monotonic()
        stop.start()
        try:
            with one_builder(entry, "demo values") as waited:
                assert waited and STOP.received == "SIGTERM" and time.monotonic() - start < 30
        finally:
            STOP.reset()
        monkeypatch.setattr(files, "LOCK_MAX_WAIT", 1.5)
        start = time.monotonic()
        with one_builder(entry, "demo values") as waited:
            assert waited and 1.5 <= time.monotonic() - start < 30
        assert holder.poll() is None  # the holder still holds it: the waiter went on without the lock
    finally:
        holder.kill()
        holder.wait(timeout=30)
