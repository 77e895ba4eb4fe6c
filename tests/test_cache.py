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

    entry = CacheEntry("demo", 1, ("data", "model a"), ".npz")
    assert entry.read(load_values) is None
    path = entry.write(lambda tmp: np.savez(tmp, values=np.arange(5)), "demo values")
    assert path and os.listdir(os.path.dirname(path)) == [os.path.basename(path)]  # no temporary left
    np.testing.assert_array_equal(CacheEntry("demo", 1, ("data", "model a"), ".npz").read(load_values), np.arange(5))
    for other in (CacheEntry("demo", 2, ("data", "model a"), ".npz"), CacheEntry("demo", 1, ("data", "model b"),
                                                                                     ".npz")):
        assert other.name != entry.name and other.read(load_values) is None
    for how in ("empty", "garbage"):
        spoil(path, how)
        with caplog.at_level("WARNING", logger="orb"):
            assert CacheEntry("demo", 1, ("data", "model a"), ".npz").read(load_values) is None
        assert f"cache file {path} is damaged" in caplog.text and not os.path.exists(path)
        entry.write(lambda tmp: np.savez(tmp, values=np.arange(5)), "demo values")
    assert entry.read(load_values, valid=lambda values: len(values) == 6) is None  # implausible: rebuilt too


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


def test_a_damaged_native_library_is_built_again(cache_dir):
    from orb import native
    from orb.models import kernels

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

    entry = CacheEntry("demo", 1, ("data",), ".npz")
    path = entry.write(lambda tmp: np.savez(tmp, values=np.arange(3)), "demo values")

    def interrupted(_path):
        raise Stopped("stopped by SIGTERM during start-up")

    with pytest.raises(Stopped):
        entry.read(interrupted)
    assert os.path.exists(path)
    np.testing.assert_array_equal(entry.read(load_values), np.arange(3))


def test_a_cache_that_cannot_be_written_names_the_folder_and_the_run_goes_on(cache_dir, caplog):
    """A failed write (here: the entry's name taken by a folder, as a full disk fails it) leaves no temporary and one
    warning naming the folder; the writer's own temporaries of a killed earlier process untouched for an hour
    are removed at the next write, recent ones (perhaps another node's live writer) are kept."""
    import time

    from orb.cache import CacheEntry, load_values

    entry = CacheEntry("demo", 1, ("data",), ".npz")
    folder = cache_dir / "demo"
    os.makedirs(folder / entry.name)  # a folder where the file should go: the rename fails
    from orb.io.files import temporary_prefix

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
    entry = CacheEntry("demo", 1, ("data",), ".npz")
    damaged = entry.write(lambda tmp: np.savez(tmp, values=np.arange(4)), "demo values")
    assert damaged and damaged.startswith(str(shared))
    spoil(damaged, "garbage")
    result = subprocess.run(["mount", "-o", "remount,ro", str(shared)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert entry.read(load_values) is None  # damaged, and it cannot be removed
    kept = entry.write(lambda tmp: np.savez(tmp, values=np.arange(4)), "demo values")
    assert kept and kept.startswith(str(tmp_path / "tmp")) and os.path.exists(damaged)
    again = CacheEntry("demo", 1, ("data",), ".npz")
    np.testing.assert_array_equal(again.read(load_values), np.arange(4))
    assert again.read_from == kept
