"""Data in the formats people have (orb.data.formats): extxyz (calculator results or REF_ keys), a folder of
files and ASE-LMDB read as the same rows as the SQLite database they were written from; indexed once;
bad input is one line naming the file, the frame and the key."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import DEMO_VAL, ROOT


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ORB_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def demo_frames():
    from ase.db import connect

    return [row.toatoms() for row in connect(DEMO_VAL).select()]


def write_ref_keys(path, frames):
    """MACE's convention: labels in info['REF_energy'], arrays['REF_forces'], info['REF_stress']."""
    import ase.io

    out = []
    for atoms in frames:
        plain = atoms.copy()
        plain.info["REF_energy"] = atoms.get_potential_energy()
        plain.arrays["REF_forces"] = atoms.get_forces()
        plain.info["REF_stress"] = atoms.get_stress()
        out.append(plain)
    ase.io.write(path, out, format="extxyz")


def same_rows(path, reference=DEMO_VAL):
    from orb.data.dataset import AseDbDataset

    ours, theirs = AseDbDataset(path), AseDbDataset(reference)
    assert len(ours) == len(theirs)
    for i in range(len(theirs)):
        a, b = ours.get(i), theirs.get(i)
        # extxyz is text: 8 decimals of positions and labels, then float32 positions in the graph
        np.testing.assert_allclose(a.positions, b.positions, atol=1e-6)
        np.testing.assert_array_equal(a.numbers, b.numbers)
        for name in ("energy", "forces", "stress"):
            np.testing.assert_allclose(getattr(a, name), getattr(b, name), rtol=1e-7, atol=1e-7, err_msg=name)
    assert ours.has_stress == theirs.has_stress


def test_extxyz_a_folder_and_aselmdb_are_the_rows_of_the_database(tmp_path, cache):
    import ase.io
    from ase.db import connect

    from orb.data.formats import readable_database

    frames = demo_frames()
    ase.io.write(tmp_path / "val.extxyz", frames, format="extxyz")  # energy=, forces, stress as results
    same_rows(readable_database(str(tmp_path / "val.extxyz")))
    write_ref_keys(tmp_path / "ref.xyz", frames)
    same_rows(readable_database(str(tmp_path / "ref.xyz")))
    folder = tmp_path / "parts"
    folder.mkdir()
    ase.io.write(folder / "a.extxyz", frames[:5], format="extxyz")
    ase.io.write(folder / "b.extxyz", frames[5:], format="extxyz")
    same_rows(readable_database(str(folder)))
    with connect(str(tmp_path / "first.db")) as db:  # a list: files of any supported format, in its order
        for atoms in frames[:3]:
            db.write(atoms)
    ase.io.write(tmp_path / "rest.extxyz", frames[3:], format="extxyz")
    same_rows(readable_database([str(tmp_path / "first.db"), str(tmp_path / "rest.extxyz")]))
    with connect(str(tmp_path / "val.aselmdb")) as db:
        for atoms in frames:
            db.write(atoms)
    same_rows(readable_database(str(tmp_path / "val.aselmdb")))
    assert readable_database(DEMO_VAL) == DEMO_VAL  # SQLite is read as it is
    lmdb = tmp_path / "lmdb"  # a folder of ASE-LMDB files, each with the lock file ASE-LMDB writes beside it
    lmdb.mkdir()
    for name, part in (("a.aselmdb", frames[:4]), ("b.aselmdb", frames[4:])):
        with connect(str(lmdb / name), type="aselmdb") as db:
            for atoms in part:
                db.write(atoms)
    assert sorted(os.listdir(lmdb)) == ["a.aselmdb", "a.aselmdb-lock", "b.aselmdb", "b.aselmdb-lock"]
    same_rows(readable_database(str(lmdb)))


def test_indexed_once_and_again_when_the_file_changes(tmp_path, cache):
    import ase.io

    from orb.data.formats import readable_database

    frames = demo_frames()
    path = tmp_path / "val.extxyz"
    ase.io.write(path, frames, format="extxyz")
    first = readable_database(str(path))
    stamp = os.stat(first).st_mtime_ns
    assert readable_database(str(path)) == first and os.stat(first).st_mtime_ns == stamp  # kept, not redone
    ase.io.write(path, frames[:4], format="extxyz")
    second = readable_database(str(path))
    assert second != first
    from orb.data.dataset import AseDbDataset

    assert len(AseDbDataset(second)) == 4


def test_a_copy_staged_elsewhere_finds_the_index_and_names_its_own_files(tmp_path, cache, caplog):
    """A job that copies its data to a per-job scratch folder (new path, new times) indexed it again at every start:
    the index was keyed by the files' paths. Now by their content: the copy reads the first job's index, and every
    message (a data worker's too) names the copy, even once the first folder is gone; other content is its own."""
    import logging
    import pickle

    import ase.io

    from orb.data.dataset import AseDbDataset
    from orb.data.formats import readable_database

    frames = demo_frames()
    first_job, staged, other = tmp_path / "job1", tmp_path / "job2", tmp_path / "other"
    for folder in (first_job, staged, other):
        folder.mkdir()
    ase.io.write(first_job / "val.extxyz", frames, format="extxyz")
    ase.io.write(first_job / "more.extxyz", frames[:3], format="extxyz")
    index = readable_database(str(first_job))
    stamp = os.stat(index).st_mtime_ns
    time.sleep(0.01)
    for name in ("val.extxyz", "more.extxyz"):
        shutil.copy(first_job / name, staged / name)  # (new times, as cp gives)
    shutil.rmtree(first_job)
    with caplog.at_level(logging.INFO, logger="orb"):
        found = readable_database(str(staged))
        assert found == index
    assert os.stat(index).st_mtime_ns == stamp and not [r for r in caplog.records if "indexed" in r.message]
    data = AseDbDataset(found)
    in_worker = pickle.loads(pickle.dumps(data))
    for dataset in (data, in_worker):
        assert dataset.where(3 + 2) == f"{staged / 'val.extxyz'}, frame 1"  # (sorted: more, then val)
        assert dataset.error_at("bad", 2).args[0].startswith(str(staged / "more.extxyz"))
    frames[1].positions[0, 0] += 1e-3  # (one coordinate: the same size, other content)
    ase.io.write(other / "val.extxyz", frames, format="extxyz")
    shutil.copy(staged / "more.extxyz", other / "more.extxyz")
    assert readable_database(str(other)) != index



def test_label_keys_given_for_an_ase_database_are_said_to_be_unused(caplog):
    """energy_key/forces_key/stress_key name where other formats keep labels; an ASE SQLite database's are its rows'
    calculator results, and the keys were left out in silence."""
    from orb.data.formats import LabelKeys, readable_database

    caplog.set_level("WARNING", logger="orb")
    assert readable_database(DEMO_VAL) == DEMO_VAL and not caplog.records
    assert readable_database(DEMO_VAL, LabelKeys(energy="REF_energy", forces="REF_forces")) == DEMO_VAL
    assert caplog.records[0].getMessage() == (f"{DEMO_VAL}: energy_key 'REF_energy', forces_key 'REF_forces' not "
                                              "used: an ASE database's labels are its rows' calculator results")


def test_a_database_in_a_list_keeps_its_labels_when_label_keys_name_the_other_files(tmp_path, cache, caplog):
    """A list of an ASE database and extxyz frames whose energies are under energy_key: the database's rows keep
    their calculator results, as the database alone does (the keys were applied to its rows too, which have no
    such info entry: the list was refused), and the frames' come from the key."""
    import ase.io
    from ase.calculators.singlepoint import SinglePointCalculator

    from orb.data.dataset import AseDbDataset
    from orb.data.formats import LabelKeys, readable_database

    frames = demo_frames()[:2]
    tagged = []
    for atoms in frames:
        copy = atoms.copy()
        copy.calc = SinglePointCalculator(copy, forces=atoms.get_forces(), stress=atoms.get_stress())
        copy.info["E1"] = atoms.get_potential_energy() + 1.0
        tagged.append(copy)
    ase.io.write(tmp_path / "e1.extxyz", tagged, format="extxyz")
    caplog.set_level("WARNING", logger="orb")
    data = AseDbDataset(readable_database([DEMO_VAL, str(tmp_path / "e1.extxyz")], LabelKeys(energy="E1")))
    alone = AseDbDataset(DEMO_VAL)
    rows = len(alone)
    assert len(data) == rows + 2
    for i in (0, rows - 1):
        assert data.get(i).energy[0] == alone.get(i).energy[0]
    for k, atoms in enumerate(frames):
        assert data.get(rows + k).energy[0] == pytest.approx(atoms.get_potential_energy() + 1.0, rel=1e-7)
    assert [r.getMessage() for r in caplog.records] == [
        f"{DEMO_VAL}: energy_key 'E1' not used: an ASE database's labels are its rows' calculator results"]


def test_orb_evaluate_gives_the_same_metrics_on_extxyz(tmp_path, cache):
    """The same metrics from two extxyz files as from the database they came from; predictions.csv names each
    structure's file and frame (its row_id alone was a position across all the files)."""
    import csv

    import ase.io

    frames = demo_frames()
    ase.io.write(tmp_path / "a.extxyz", frames[:3], format="extxyz")
    ase.io.write(tmp_path / "b.extxyz", frames[3:], format="extxyz")
    summaries, tables = [], []
    for data in ([DEMO_VAL], [str(tmp_path / "a.extxyz"), str(tmp_path / "b.extxyz")]):
        out = tmp_path / ("eval_" + os.path.basename(data[0]))
        result = subprocess.run([sys.executable, "scripts/evaluate.py", "--checkpoint", "data/demo_pretrained.ckpt",
                                 "--data", *data, "--output_dir", str(out), "--progress_bar", "false"],
                                cwd=ROOT, capture_output=True, text=True, timeout=600,
                                env=dict(os.environ, ORB_CACHE_DIR=str(cache)))
        assert result.returncode == 0, result.stderr[-2000:]
        summaries.append(json.load(open(out / "summary.json")))
        with open(out / "predictions.csv") as f:
            tables.append(list(csv.DictReader(f)))
    for key in ("energy_mae", "forces_mae", "stress_mae", "energy_per_atom_mae"):
        assert summaries[0][key] == pytest.approx(summaries[1][key], rel=1e-6), key
    assert "source" not in tables[0][0]  # (a database's own row ids name its rows)
    assert [(os.path.basename(r["source"]), int(r["frame"])) for r in tables[1]] == (
        [("a.extxyz", k) for k in range(3)] + [("b.extxyz", k) for k in range(len(frames) - 3)])
    assert [r["formula"] for r in tables[1]] == [r["formula"] for r in tables[0]]


def test_bad_input_is_one_line_naming_file_frame_and_key(tmp_path, cache):
    import ase.io

    from orb.data.dataset import AseDbDataset
    from orb.data.formats import LabelKeys, readable_database
    from orb.errors import DatasetError

    frames = demo_frames()
    garbage = tmp_path / "garbage.xyz"
    garbage.write_text("this is not\na structure file\n")
    with pytest.raises(DatasetError, match=r"garbage.xyz, frame 0: ase.io cannot read it"):
        readable_database(str(garbage))
    write_ref_keys(tmp_path / "ref.xyz", frames)
    with pytest.raises(DatasetError, match=r"ref.xyz, key 'energy_key': frame 0 has no energy under the configured "
                                           r"key \(info\['DFT_energy'\] or the calculator's 'DFT_energy'\)"):
        readable_database(str(tmp_path / "ref.xyz"), LabelKeys(energy="DFT_energy"))
    bad = [a.copy() for a in frames[:3]]
    for a in bad:
        a.info["E"] = [1.0, 2.0]
    ase.io.write(tmp_path / "shape.xyz", bad, format="extxyz")
    with pytest.raises(DatasetError, match=r"shape.xyz, key 'E': frame 0: E of shape \(2,\), expected a number"):
        readable_database(str(tmp_path / "shape.xyz"), LabelKeys(energy="E"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetError, match=r"empty: is an empty folder"):
        readable_database(str(tmp_path / "empty"))
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    ase.io.write(mixed / "a.extxyz", frames[:3], format="extxyz")
    unstressed = []
    for atoms in frames[3:6]:
        plain = atoms.copy()
        plain.info["REF_energy"] = atoms.get_potential_energy()
        plain.arrays["REF_forces"] = atoms.get_forces()
        unstressed.append(plain)
    ase.io.write(mixed / "b.extxyz", unstressed, format="extxyz")
    from orb.data.graphs import MISSING_STRESS

    both = AseDbDataset(readable_database(str(mixed)))  # (training: the frames without stress weigh theirs at 0)
    assert both.stress_rows == 3
    marked = [bool((both[k].stress == MISSING_STRESS.astype(np.float32)).all()) for k in range(6)]
    assert marked == [False] * 3 + [True] * 3


def labels_of(path, keys=None, require_labels=True):
    from orb.data.dataset import AseDbDataset
    from orb.data.formats import LabelKeys, readable_database

    data = AseDbDataset(readable_database(str(path), keys or LabelKeys()), require_labels=require_labels)
    return [(data.get(i).energy, data.get(i).forces, data.get(i).stress) for i in range(len(data))]


def test_labels_are_the_ones_the_user_meant_whatever_else_the_file_holds(tmp_path, cache, caplog):
    """REF_ entries are the reference labels beside another calculator's results (the calculator's won, silently:
    a file of a model's predictions with the DFT values as REF_ trained on the predictions); a key names a
    calculator result too (ASE keeps an extxyz's free_energy= there: it could not be read); a virial is a stress of
    -virial / volume (it was ignored), and a stress_key naming one is refused; stress in kBar is said once."""
    import ase.io
    from ase.calculators.singlepoint import SinglePointCalculator
    from ase.stress import full_3x3_to_voigt_6_stress, voigt_6_to_full_3x3_stress

    from orb.data.formats import LabelKeys
    from orb.errors import DatasetError

    frames = demo_frames()[:4]
    truth = [(a.get_potential_energy(), a.get_forces(), a.get_stress()) for a in frames]

    def assert_labels(path, expected=truth, keys=None, stress=True):
        got = labels_of(path, keys)
        for (energy, forces, stress_got), (e, f, s) in zip(got, expected):
            assert energy == pytest.approx(e, abs=1e-6)
            np.testing.assert_allclose(forces, f, atol=1e-6)
            if stress:
                np.testing.assert_allclose(np.reshape(stress_got, -1), s, atol=1e-6)

    both = []
    for atoms, (e, f, s) in zip(frames, truth):
        other = atoms.copy()
        other.calc = SinglePointCalculator(other, energy=e + 5.0, forces=np.zeros_like(f), stress=np.zeros(6))
        other.info.update(REF_energy=e, REF_stress=s)
        other.arrays["REF_forces"] = f
        both.append(other)
    ase.io.write(tmp_path / "both.extxyz", both, format="extxyz")
    caplog.set_level("WARNING", logger="orb")
    assert_labels(tmp_path / "both.extxyz")
    said = [r.getMessage() for r in caplog.records if "REF_ entries are the reference labels" in r.getMessage()]
    assert len(said) == 3 and all("both.extxyz, frame 0" in line for line in said), said  # energy, forces, stress

    free = []
    for atoms, (e, f, s) in zip(frames, truth):
        other = atoms.copy()
        other.calc = SinglePointCalculator(other, free_energy=e, forces=f, stress=s)
        free.append(other)
    ase.io.write(tmp_path / "free.extxyz", free, format="extxyz")
    assert_labels(tmp_path / "free.extxyz", keys=LabelKeys(energy="free_energy"))

    virial = []
    for atoms, (e, f, s) in zip(frames, truth):
        other = atoms.copy()
        other.calc = SinglePointCalculator(other, energy=e, forces=f)
        other.info["virial"] = -voigt_6_to_full_3x3_stress(s) * atoms.get_volume()
        virial.append(other)
    ase.io.write(tmp_path / "virial.extxyz", virial, format="extxyz")
    assert_labels(tmp_path / "virial.extxyz")
    with pytest.raises(DatasetError, match=r"virial.extxyz, key 'stress_key': stress_key 'virial' names a virial"):
        labels_of(tmp_path / "virial.extxyz", LabelKeys(stress="virial"))
    assert all(stress is None for _, _, stress in labels_of(tmp_path / "virial.extxyz", LabelKeys(stress="none")))
    from ase.build import molecule

    gas = molecule("H2")  # a molecule's virial (GAP sets: isolated atoms and dimers beside crystals): no stress
    gas.calc = SinglePointCalculator(gas, energy=-1.0, forces=np.zeros((2, 3)))
    gas.info["virial"] = np.zeros((3, 3))
    ase.io.write(tmp_path / "gas.extxyz", [virial[0], gas], format="extxyz")
    caplog.clear()
    from orb.data.graphs import MISSING_STRESS

    trained = labels_of(tmp_path / "gas.extxyz")  # (training: its stress weighed at 0, marked MISSING_STRESS)
    assert (trained[1][2] == MISSING_STRESS.astype(np.float32)).all()
    assert np.allclose(np.reshape(trained[0][2], -1), truth[0][2], atol=1e-6)
    got = labels_of(tmp_path / "gas.extxyz", require_labels=False)  # (evaluation: stress where there is one)
    assert got[1][2] is None and np.allclose(np.reshape(got[0][2], -1), truth[0][2], atol=1e-6)
    assert [r.getMessage() for r in caplog.records if "not read as a stress" in r.getMessage()] == [
        f"{tmp_path / 'gas.extxyz'}, frame 1: its virial is not read as a stress (no periodic cell to divide by: said "
        "once per file)"]
    agree = []  # REF_stress as 3x3 (as ASE writes it), the calculator's as Voigt: the same values, nothing said
    for atoms, (e, f, s) in zip(frames, truth):
        other = atoms.copy()
        other.calc = SinglePointCalculator(other, energy=e, forces=f, stress=s)
        other.info["REF_stress"] = voigt_6_to_full_3x3_stress(s)
        agree.append(other)
    ase.io.write(tmp_path / "agree.extxyz", agree, format="extxyz")
    caplog.clear()
    assert_labels(tmp_path / "agree.extxyz")
    assert not [r for r in caplog.records if "reference labels" in r.getMessage()]

    kbar = []
    for atoms, (e, f, s) in zip(frames, truth):
        other = atoms.copy()
        other.calc = SinglePointCalculator(other, energy=e, forces=f, stress=np.full(6, 12.5))
        kbar.append(other)
    ase.io.write(tmp_path / "kbar.extxyz", kbar, format="extxyz")
    caplog.clear()
    labels_of(tmp_path / "kbar.extxyz")
    said = [r.getMessage() for r in caplog.records if "must be converted" in r.getMessage()]
    assert len(said) == 1 and "kbar.extxyz, frame 0, key 'stress': a stress of 12.5 eV/Å³ (2003 GPa)" in said[0]
    ase.io.write(tmp_path / "kbar.db", kbar)  # an ASE SQLite database, read as it is
    caplog.clear()
    labels_of(tmp_path / "kbar.db")
    said = [r.getMessage() for r in caplog.records if "must be converted" in r.getMessage()]
    assert len(said) == 1 and "kbar.db, row 1, key 'stress': a stress of 12.5 eV/Å³" in said[0]
    assert full_3x3_to_voigt_6_stress(voigt_6_to_full_3x3_stress(truth[0][2])) == pytest.approx(truth[0][2])


@pytest.mark.parametrize("backend", ["json", "aselmdb"])
def test_an_ase_databases_labels_are_its_calculators_in_every_backend_and_errors_name_its_row_ids(tmp_path, cache,
                                                                                                  backend):
    """A .json or .aselmdb database is indexed like a file, and its rows' data and key-value pairs became labels
    (a stress in GPa in row.data trained on, a REF_energy pair read) where the same rows in SQLite have none; and an
    error named the row by its position, not by its id."""
    from ase.db import connect

    from orb.errors import DatasetError

    if backend == "aselmdb":
        pytest.importorskip("ase_db_backends")
    frames = demo_frames()[:4]
    for suffix in ("db", backend):
        with connect(str(tmp_path / f"rows.{suffix}"), use_lock_file=False) as db:
            for atoms in frames:
                db.write(atoms, REF_energy=1000.0, data={"stress": np.full(6, 3.0), "REF_stress": np.ones(6)})
    sqlite, other = labels_of(tmp_path / "rows.db"), labels_of(tmp_path / f"rows.{backend}")
    assert len(other) == len(sqlite) == 4
    for (e1, f1, s1), (e2, f2, s2), atoms in zip(sqlite, other, frames):
        assert float(np.ravel(e1)[0]) == float(np.ravel(e2)[0]) == pytest.approx(atoms.get_potential_energy(), abs=1e-6)
        np.testing.assert_array_equal(f2, f1)
        np.testing.assert_allclose(np.reshape(s2, -1), atoms.get_stress(), atol=1e-6)  # the calculator's
    with connect(str(tmp_path / f"ids.{backend}"), use_lock_file=False) as db:
        for atoms in frames:
            db.write(atoms)
        del db[1]  # ids 2, 3, 4
    with connect(str(tmp_path / f"ids.{backend}"), use_lock_file=False) as db:
        bad = frames[0].copy()
        from ase.calculators.singlepoint import SinglePointCalculator

        forces = frames[0].get_forces().copy()
        forces[0, 0] = np.nan
        bad.calc = SinglePointCalculator(bad, energy=1.0, forces=forces)
        db.write(bad)  # id 5, the fourth row
    with pytest.raises(DatasetError, match=rf"ids.{backend}, key 'forces': row 5: forces contains NaN or inf"):
        labels_of(tmp_path / f"ids.{backend}")
    with connect(str(tmp_path / f"pairs.{backend}"), use_lock_file=False) as db:
        for atoms in frames:
            plain = atoms.copy()  # (no calculator: its energy as a key-value pair only)
            db.write(plain, REF_energy=1.0)
    with pytest.raises(DatasetError, match=rf"pairs.{backend}, row 1, key 'energy': row has no label \(store it with "
                                           r"a SinglePointCalculator\)"):  # (not: name it with energy_key, ignored)
        labels_of(tmp_path / f"pairs.{backend}")


def test_a_data_folders_notes_and_scripts_are_left_out_and_said(tmp_path, cache, caplog):
    """A README.txt (or a script, a plot) beside the structure files stopped the run: "ase.io cannot read it (txt)".
    Such files are left out, said once; the folder reads as its structure files."""
    import ase.io

    folder = tmp_path / "data"
    folder.mkdir()
    ase.io.write(folder / "frames.extxyz", demo_frames(), format="extxyz")
    for name in ("README.txt", "make_data.py", "notes.md"):
        (folder / name).write_text("how these frames were made\n")
    caplog.set_level("WARNING", logger="orb")
    assert [energy for energy, _, _ in labels_of(folder)] == [e for e, _, _ in labels_of(folder / "frames.extxyz")]
    said = [r.getMessage() for r in caplog.records if "not read (notes" in r.getMessage()]
    assert said == [f"{folder}: README.txt, make_data.py, notes.md not read (notes, scripts, images or orb's own "
                    "records, not structures)"]


def test_a_folder_as_orb_relax_or_orb_md_leaves_it_reads_as_its_structures(tmp_path, cache, caplog):
    """orb-relax's OUTPUT.run.json and OUTPUT.summary.json, orb-md's run.json, summary.json and state_k.json
    beside the structures stopped the run ("cannot read it as an ASE database"): left out by name, said once per
    folder; an ASE JSON database beside them is still read."""
    import ase.io
    from ase.calculators.singlepoint import SinglePointCalculator
    from ase.db import connect

    from orb.data.formats import LabelKeys, readable_database
    from orb.data.dataset import AseDbDataset

    frames = demo_frames()[:2]
    start = str(tmp_path / "start.extxyz")
    ase.io.write(start, [a.copy() for a in frames], format="extxyz")
    common = ["--checkpoint", "data/demo_pretrained.ckpt", "--data", start, "--steps", "2", "--device_target", "CPU",
              "--progress_bar", "false"]
    for command, output in (("relax", ["--output", str(tmp_path / "relaxed" / "x.db")]),
                            ("md", ["--output", str(tmp_path / "md"), "--timestep", "1", "--write_every", "1"])):
        result = subprocess.run([sys.executable, f"scripts/{command}.py", *common, *output], cwd=ROOT, text=True,
                                capture_output=True, timeout=600, env=dict(os.environ, ORB_CACHE_DIR=str(cache)))
        assert result.returncode == 0, result.stderr[-2000:]
    with connect(str(tmp_path / "relaxed" / "more.json"), use_lock_file=False) as db:  # a real ASE JSON database
        atoms = frames[0].copy()
        atoms.calc = SinglePointCalculator(atoms, energy=-1.0, forces=np.zeros((len(atoms), 3)))
        db.write(atoms)
    caplog.set_level("WARNING", logger="orb")
    read = {name: len(AseDbDataset(readable_database(str(tmp_path / name), LabelKeys()), require_labels=False))
            for name in ("relaxed", "md")}
    assert read == {"relaxed": 2 + 1, "md": 2 * 3}  # the relaxed rows and the JSON database's; each frame of steps 0-2
    said = [r.getMessage() for r in caplog.records if "not read (notes" in r.getMessage()]
    assert said == [f"{tmp_path / 'relaxed'}: x.run.json, x.summary.json not read (notes, scripts, images or orb's own "
                    "records, not structures)",
                    f"{tmp_path / 'md'}: log_0.csv, log_1.csv, run.json, state_0.json, state_1.json ... not read "
                    "(notes, scripts, images or orb's own records, not structures)"], said


def test_a_frame_without_labels_is_named_by_file_and_frame_when_training(tmp_path, cache):
    """Unlabelled frames index (orb-evaluate predicts them); training names the original file and frame, in one
    line, and writes nothing."""
    import ase.io

    frames = demo_frames()
    plain = [a.copy() for a in frames]  # copies carry no calculator: no labels
    ase.io.write(tmp_path / "train.extxyz", frames[:6] + plain[6:8], format="extxyz")
    out = tmp_path / "run"
    result = subprocess.run([sys.executable, "finetune.py", "--config", "configs/demo.yaml", "--train_data_path",
                             str(tmp_path / "train.extxyz"), "--output_dir", str(out), "--max_epochs", "1"],
                            cwd=ROOT, capture_output=True, text=True, timeout=600,
                            env=dict(os.environ, ORB_CACHE_DIR=str(cache)))
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert "train.extxyz, frame 6" in lines[0] and "has no" in lines[0], lines[0]
    assert not out.exists() or not any(out.iterdir())
    renamed = []  # labels under names of the user's own: the message said "store it with a SinglePointCalculator"
    for atoms in frames[:4]:
        copy = atoms.copy()
        copy.info["dft_energy"], copy.arrays["dft_forces"] = atoms.get_potential_energy(), atoms.get_forces()
        renamed.append(copy)
    ase.io.write(tmp_path / "renamed.extxyz", renamed, format="extxyz")
    from orb.data.dataset import AseDbDataset
    from orb.data.formats import LabelKeys, readable_database
    from orb.errors import DatasetError

    with pytest.raises(DatasetError) as refusal:
        AseDbDataset(readable_database(str(tmp_path / "renamed.extxyz"))).census()
    assert str(refusal.value) == (
        f"{tmp_path / 'renamed.extxyz'}, frame 0, key 'energy': frame has no energy (looked for the calculator's "
        "energy, info['REF_energy'], info['energy']; its info holds dft_energy): name the info entry holding it with "
        "energy_key")
    renamed_keys = LabelKeys(energy="dft_energy")
    with pytest.raises(DatasetError, match="frame has no forces .*arrays\\['REF_forces'\\], arrays\\['forces'\\]\\): "
                                           "name the arrays entry holding it with forces_key$"):
        AseDbDataset(readable_database(str(tmp_path / "renamed.extxyz"), renamed_keys)).census()
    named = LabelKeys(energy="dft_energy", forces="dft_forces")
    assert AseDbDataset(readable_database(str(tmp_path / "renamed.extxyz"), named)).census()[:, :2].all()


ATTRIBUTES = [dict(weight=7.0, charge=-1.0, spin=2.0, config_type="bulk", md_step=0, relaxed=True),
              dict(weight=1.0, charge=0.0, spin=1.0, config_type="surface", md_step=40, relaxed=False),
              dict(weight=0.0, charge=1.0, spin=3.0, config_type="bulk", md_step=80, relaxed=True),
              dict(weight=2.5, charge=0.0, spin=1.0, config_type="defect", md_step=120, relaxed=False)]


def write_with_attributes(kind, folder, frames, attributes=ATTRIBUTES):
    """``frames`` with ``attributes[k]`` as their per-structure attributes, written as a user of format ``kind``
    would."""
    import ase.io
    from ase.db import connect

    def to_db(path, items, backend="db"):
        with connect(str(path), type=backend) as db:
            for atoms, attributes in items:
                db.write(atoms, **attributes)
        return str(path)

    def tagged(items):
        out = []
        for atoms, attributes in items:
            copy = atoms.copy()
            copy.calc = atoms.calc
            copy.info.update(attributes)
            out.append(copy)
        return out

    items = list(zip(frames, attributes))
    if kind == "sqlite":
        return to_db(folder / "all.db", items)
    if kind == "list":
        return [to_db(folder / "p1.db", items[:1]), to_db(folder / "p2.db", items[1:])]
    if kind == "extxyz":
        ase.io.write(folder / "all.extxyz", tagged(items), format="extxyz")
        return str(folder / "all.extxyz")
    if kind == "folder":
        (folder / "parts").mkdir()
        ase.io.write(folder / "parts" / "a.extxyz", tagged(items[:2]), format="extxyz")
        ase.io.write(folder / "parts" / "b.extxyz", tagged(items[2:]), format="extxyz")
        return str(folder / "parts")
    if kind == "json":
        return to_db(folder / "all.json", items, backend="json")
    return to_db(folder / "all.aselmdb", items, backend="aselmdb")


@pytest.mark.parametrize("kind", ["sqlite", "list", "extxyz", "folder", "aselmdb", "json"])
def test_per_structure_attributes_survive_every_format(tmp_path, cache, kind):
    """A structure's loss weight, total charge and spin reach the graphs the trainer batches whatever the format
    (a list of databases, extxyz and ASE-LMDB dropped the weight: every structure weighed 1), with its labels; its
    tags and other info reach the structures orb-md and orb-relax start from."""
    from ase.calculators.singlepoint import SinglePointCalculator

    from orb.data.dataset import AseDbDataset
    from orb.data.formats import readable_database

    frames = demo_frames()[:len(ATTRIBUTES)]
    for k, atoms in enumerate(frames):  # adsorbate / layer labels, as a user marks atoms; a DFT set-up's start
        atoms.set_tags(np.arange(len(atoms)) % 3 + k)
        labels = atoms.calc.results
        atoms.set_initial_magnetic_moments(np.arange(len(atoms)) * 0.25 - 1.0 + k)  # exact in extxyz text
        atoms.set_initial_charges((np.arange(len(atoms)) % 4 - 1.5) * (k + 1))
        atoms.calc = SinglePointCalculator(atoms, **labels)  # the same labels, for the structure as it now is
    data = AseDbDataset(readable_database(write_with_attributes(kind, tmp_path, frames)), charge_spin=True)
    data.census()
    np.testing.assert_array_equal(data.weights, [a["weight"] for a in ATTRIBUTES])
    for i, (atoms, attributes) in enumerate(zip(frames, ATTRIBUTES)):
        graph = data.get(i)
        assert (float(graph.weight[0]), float(graph.charge[0]), float(graph.spin[0])) == (
            attributes["weight"], attributes["charge"], attributes["spin"])
        assert data.charge_and_spin(i) == (attributes["charge"], attributes["spin"])
        np.testing.assert_allclose(graph.energy, [atoms.get_potential_energy()], rtol=1e-7)
        np.testing.assert_allclose(graph.forces, atoms.get_forces(), atol=1e-6)
        # what orb-md's trajectories and orb-relax's rows start from: the tags and the structure's other info (an
        # extxyz frame's config_type was dropped, and every format's tags; initial magnetic moments and charges
        # reached them only from a single database)
        start = data.get_atoms(i)
        np.testing.assert_array_equal(start.get_tags(), atoms.get_tags())
        np.testing.assert_array_equal(start.get_initial_magnetic_moments(), atoms.get_initial_magnetic_moments())
        np.testing.assert_array_equal(start.get_initial_charges(), atoms.get_initial_charges())
        assert {k: start.info.get(k) for k in ("config_type", "md_step", "relaxed")} == {
            k: attributes[k] for k in ("config_type", "md_step", "relaxed")}


def test_only_what_a_database_row_and_an_extxyz_line_can_hold_is_carried(tmp_path):
    """Of a structure's info, what ASE can store as a key-value pair without a warning and an extxyz comment line can
    hold (a newline broke the trajectory file; ``external_tables`` and a 70-bit integer made ASE raise; ``id``
    and ``free_energy`` are ASE's own names); labels are not carried onto new geometries."""
    import warnings

    from ase import Atoms
    from ase.db import connect

    from orb.data.formats import storable_pairs, without_labels

    info = {"config_type": "bulk", "note": "two\nlines", "external_tables": {"a": 1}, "big": 2 ** 70, "CO": 1.0,
            "flag": np.bool_(True), "n": np.int64(3), "x": float("nan"), "arr": np.zeros(3), "id": 5,
            "REF_energy": -3.0, "DFT_forces_max": 0.2, "free_energy": -2.9}
    carried = storable_pairs(info)
    assert carried == {"config_type": "bulk", "flag": True, "n": 3, "REF_energy": -3.0, "DFT_forces_max": 0.2}
    assert without_labels(carried) == {"config_type": "bulk", "flag": True, "n": 3}
    # a label word inside another word is no label (forcefield_origin, reinforced were dropped from orb-md's frames)
    assert without_labels({"forcefield_origin": "uff", "reinforced": True, "energy_per_atom": -1.0, "DFT-virial": 0,
                           "Stress": 1, "totalEnergy": 1, "DFTEnergy": 1, "refForces": 1, "energy0": 1,
                           "enforce": 1}) == {"forcefield_origin": "uff", "reinforced": True, "enforce": 1}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with connect(str(tmp_path / "x.db")) as db:
            db.write(Atoms("H"), key_value_pairs=carried)


@pytest.mark.parametrize("value, key, message", [
    ("abc", "REF_energy", "REF_energy must be numbers, got 'abc'"),
    ("-2", "weight", "weight must be >= 0, got -2.0"),
    ("heavy", "weight", "weight must be numbers, got 'heavy'"),
])
def test_a_bad_value_in_extxyz_is_one_line_naming_file_frame_and_key(tmp_path, cache, value, key, message):
    """Non-numeric labels or attributes in a comment line (REF_energy=abc) were a traceback; in a data-parallel
    run the other ranks then waited for the cluster's timeout."""
    import re

    frames = demo_frames()[:3]
    write_ref_keys(tmp_path / "ok.extxyz", frames)
    text = open(tmp_path / "ok.extxyz").read().splitlines()
    comment = 1 + len(frames[0]) + 2  # the second frame's comment line
    text[comment] = re.sub(r"\bREF_energy=\S+ ", "", text[comment])
    text[comment] = f"{key}={value} " + text[comment]
    (tmp_path / "bad.extxyz").write_text("\n".join(text) + "\n")
    result = subprocess.run([sys.executable, "scripts/evaluate.py", "--checkpoint", "data/demo_pretrained.ckpt",
                             "--data", str(tmp_path / "bad.extxyz"), "--device_target", "CPU", "--output_dir",
                             str(tmp_path / "evaluation")], cwd=ROOT,
                            capture_output=True, text=True, timeout=300,
                            env=dict(os.environ, ORB_CACHE_DIR=str(cache)))
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines() == [f"error: {tmp_path / 'bad.extxyz'}, key '{key}': frame 1: {message}"]


@pytest.mark.parametrize("name, content", [
    ("bad.db", b"SQLite format 3\x00" + b"\x07" * 200),  # a cut-off or overwritten SQLite file
    ("bad.aselmdb", b"not an lmdb file" * 8),
])
def test_a_damaged_database_in_a_list_is_one_line_naming_it(tmp_path, cache, name, content):
    """A damaged SQLite or ASE-LMDB file among the paths of a list (or a folder) was a traceback from sqlite3 or
    lmdb while indexing; now one line naming that file."""
    from orb.data.formats import readable_database
    from orb.errors import DatasetError

    (tmp_path / name).write_bytes(content)
    with pytest.raises(DatasetError, match=rf"{name}: cannot read it as an ASE database \("):
        readable_database([DEMO_VAL, str(tmp_path / name)])
    assert not [f for f in os.listdir(cache / "converted") if f.startswith(".")]  # no temporary left


def test_an_sqlite_file_that_is_not_an_ase_database_is_refused_and_left_as_it_was(tmp_path, cache):
    """In a list, an SQLite file of another program was read as an empty ASE database (no structures from it, no
    warning), and ASE wrote its own tables into it."""
    import sqlite3

    from orb.data.formats import readable_database
    from orb.errors import DatasetError

    other = tmp_path / "results.db"
    connection = sqlite3.connect(other)
    connection.execute("CREATE TABLE runs (id INTEGER, energy REAL)")
    connection.commit()
    connection.close()
    before = (other.read_bytes(), os.stat(other).st_mtime_ns)
    with pytest.raises(DatasetError, match=r"results\.db: an SQLite file, but not an ASE database"):
        readable_database([DEMO_VAL, str(other)])
    assert (other.read_bytes(), os.stat(other).st_mtime_ns) == before


def test_a_structure_without_atoms_is_named_in_a_database_and_in_an_extxyz(tmp_path, cache):
    """A database row without atoms was left out without a word (ASE's species table, which the dataset reads its
    rows from, has no entry for it; a reference fit then failed on 65 energies for 64 structures); an extxyz frame
    without atoms was a traceback from ASE while indexing."""
    import ase.io
    from ase import Atoms
    from ase.calculators.singlepoint import SinglePointCalculator
    from ase.db import connect

    from orb.data.dataset import AseDbDataset
    from orb.data.formats import readable_database
    from orb.errors import DatasetError

    frames = demo_frames()[:3]
    with connect(str(tmp_path / "empty_row.db")) as db:
        for atoms in frames[:2]:
            db.write(atoms)
        db.write(Atoms())
        db.write(frames[2])
    with pytest.raises(DatasetError, match=r"empty_row\.db, row 3: structure has no atoms"):
        AseDbDataset(str(tmp_path / "empty_row.db"))
    empty = Atoms()
    empty.calc = SinglePointCalculator(empty, energy=0.0, forces=np.zeros((0, 3)))
    ase.io.write(tmp_path / "empty.extxyz", frames[:2] + [empty], format="extxyz")
    with pytest.raises(DatasetError, match=r"empty\.extxyz: frame 2: structure has no atoms"):
        readable_database(str(tmp_path / "empty.extxyz"))


@pytest.mark.parametrize("column, value, message", [
    ("positions", "x'010203'", "cannot decode it \\(buffer size must be a multiple of element size\\)"),
    ("cell", "x'" + "00" * 48 + "'", "cannot decode it \\(cannot reshape array of size 6 into shape \\(3,3\\)\\)"),
    ("key_value_pairs", "'{not json'", "cannot decode it \\(Expecting property name"),
    ("forces", "x'" + "00" * 24 + "'", "forces of shape \\(1, 3\\) for 8 atoms"),
    ("numbers", "x'01000000'", "1 entries for 8 atoms"),
])
def test_a_damaged_value_in_a_row_is_one_line_naming_row_and_column(tmp_path, cache, column, value, message):
    """A row whose stored bytes cannot be what ASE wrote (a damaged file) was a numpy or json traceback."""
    import sqlite3

    from orb.data.dataset import AseDbDataset
    from orb.errors import DatasetError

    path = str(tmp_path / "damaged.db")
    shutil.copy(DEMO_VAL, path)
    connection = sqlite3.connect(path)
    connection.execute(f"UPDATE systems SET {column} = {value} WHERE id = 5")
    connection.commit()
    connection.close()
    with pytest.raises(DatasetError, match=rf"damaged\.db, row 5, key '{column}': {message}"):
        data = AseDbDataset(path)
        data.census()
        for i in range(len(data)):
            data.get_atoms(i)


def test_messages_name_the_users_file_not_the_cached_index(tmp_path, cache):
    """A validation extxyz with a bad label beside the training data: the message names the user's file and frame (a
    message once named the cache's indexed copy, converted-....db, a file the user never named)."""
    import ase.io

    frames = demo_frames()
    frames[3].calc.results["energy"] = float("nan")
    ase.io.write(tmp_path / "val_bad.extxyz", frames, format="extxyz")
    result = subprocess.run([sys.executable, "finetune.py", "--config", "configs/demo.yaml", "--val_data_path",
                             str(tmp_path / "val_bad.extxyz"), "--output_dir", str(tmp_path / "run"),
                             "--device_target", "CPU", "--progress_bar", "false"], cwd=ROOT, capture_output=True,
                            text=True, timeout=300, env=dict(os.environ, ORB_CACHE_DIR=str(cache)))
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and lines[-1].startswith(
        f"error: {tmp_path / 'val_bad.extxyz'}, key 'energy': frame 3: "), result.stderr[-2000:]
    assert "converted" not in result.stderr


def test_a_folders_subfolders_are_said_not_to_be_read(tmp_path, cache, caplog):
    """A folder's subfolders were left out without a word (a split of OMat24 in folders of its own)."""
    import ase.io

    from orb.data.formats import source_files
    from orb.errors import DatasetError

    frames = demo_frames()
    os.makedirs(tmp_path / "data" / "part2")
    ase.io.write(tmp_path / "data" / "a.extxyz", frames[:2], format="extxyz")
    ase.io.write(tmp_path / "data" / "part2" / "b.extxyz", frames[2:4], format="extxyz")
    with caplog.at_level("WARNING", logger="orb"):
        assert source_files(str(tmp_path / "data")) == [str(tmp_path / "data" / "a.extxyz")]
        source_files(str(tmp_path / "data"))
    assert caplog.text.count("its subfolders (part2) are not read") == 1
    os.makedirs(tmp_path / "only" / "inner")
    with pytest.raises(DatasetError, match=r"only: is an empty folder: no structure files in it \(its subfolders"):
        source_files(str(tmp_path / "only"))


def test_a_stop_signal_while_indexing_exits_75_and_leaves_no_temporary(tmp_path, cache):
    """SIGTERM while a large extxyz is indexed (start-up: nothing to save) ends the run with exit status 75 (it was
    turned into 'ase.io cannot read it', exit 2, when the signal landed in the reader), and the half-made index
    is removed; the next start indexes it whole."""
    import time

    import ase.io

    frames = demo_frames()
    ase.io.write(tmp_path / "big.extxyz", frames * 250, format="extxyz")  # 4,000 frames: seconds to index
    process = subprocess.Popen(
        [sys.executable, "finetune.py", "--config", "configs/demo.yaml", "--train_data_path",
         str(tmp_path / "big.extxyz"), "--output_dir", str(tmp_path / "run"), "--device_target", "CPU",
         "--progress_bar", "false"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=dict(os.environ, ORB_CACHE_DIR=str(cache)))
    folder = cache / "converted"
    deadline = time.time() + 300
    while not (folder.is_dir() and any(f.startswith(".") for f in os.listdir(folder))):  # indexing has begun
        assert process.poll() is None and time.time() < deadline, process.communicate()[1][-2000:]
        time.sleep(0.02)
    time.sleep(0.3)
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 75, err[-2000:]
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("stopped by SIGTERM")
    assert os.listdir(folder) == []


@pytest.mark.parametrize("kind", ["sqlite", "list", "extxyz", "folder", "aselmdb"])
def test_charge_and_spin_under_keys_of_their_own_are_read_in_every_format(tmp_path, cache, kind):
    """charge_key / spin_key name where the total charge and spin are, in every format: a single ASE database
    ignored them (it read 'charge' and 'spin', here decoys) while the same database in a list honoured them."""
    from orb.data.dataset import AseDbDataset
    from orb.data.formats import LabelKeys, readable_database

    frames = demo_frames()[:len(ATTRIBUTES)]
    stored = [dict(total_charge=a["charge"], total_spin=a["spin"], charge=a["charge"] + 5, spin=a["spin"] + 7)
              for a in ATTRIBUTES]
    keys = LabelKeys(charge="total_charge", spin="total_spin")
    path = readable_database(write_with_attributes(kind, tmp_path, frames, stored), keys)
    data = AseDbDataset(path, charge_spin=True, charge_spin_keys=(keys.charge, keys.spin))
    data.census()
    for i, attributes in enumerate(ATTRIBUTES):
        graph = data.get(i)
        assert (float(graph.charge[0]), float(graph.spin[0])) == (attributes["charge"], attributes["spin"]), i
        assert data.charge_and_spin(i) == (attributes["charge"], attributes["spin"])


@pytest.mark.parametrize("kind", ["sqlite", "list", "extxyz", "folder", "aselmdb"])
def test_a_charge_or_spin_that_is_text_is_an_extra_key_to_models_without_them(tmp_path, cache, kind):
    """``spin="high"``: a model that reads no charge or spin ignores it like any other extra key (an orb-v2 run stopped
    at the first batch holding that row, after its start-up; an extxyz was refused when indexed); an OMol model's
    census refuses it before training, naming the row and key, in every format."""
    from orb.data.dataset import AseDbDataset
    from orb.data.formats import readable_database
    from orb.errors import DatasetError

    frames = demo_frames()[:len(ATTRIBUTES)]
    stored = [dict(charge=a["charge"], spin="high" if i == 1 else a["spin"]) for i, a in enumerate(ATTRIBUTES)]
    path = readable_database(write_with_attributes(kind, tmp_path, frames, stored))
    plain = AseDbDataset(path)
    plain.census()
    for i, attributes in enumerate(ATTRIBUTES):
        plain.get(i)
        assert plain.charge_and_spin(i) == (attributes["charge"], None if i == 1 else attributes["spin"]), i
    with pytest.raises(DatasetError, match=r"(all.db, row 2|p2.db, row 1|all.aselmdb, row 2|extxyz, frame 1), "
                                           r"key 'spin': must be a number, got 'high'"):
        AseDbDataset(path, charge_spin=True).census()


@pytest.mark.parametrize("kind", ["sqlite", "list", "aselmdb"])
def test_a_weight_kept_in_row_data_counts_in_every_database_format(tmp_path, cache, kind):
    """A database row's loss weight in ``row.data`` (where ASE-LMDB files keep such values) is its weight whether
    the database is given alone or in a list (alone it was ignored: every such structure weighed 1); a key-value
    pair comes first; a bad one is named. The data's other entries reach the structure's info alike (alone: lost)."""
    from ase.db import connect

    from orb.data.dataset import AseDbDataset
    from orb.data.formats import readable_database
    from orb.errors import DatasetError

    frames = demo_frames()[:3]
    name = {"sqlite": "w.db", "list": "w.db", "aselmdb": "w.aselmdb"}[kind]
    with connect(str(tmp_path / name), type="aselmdb" if kind == "aselmdb" else "db") as db:
        db.write(frames[0], data={"weight": "7.0"})  # one number, as the index of a list reads it
        db.write(frames[1], weight=2.0, data={"weight": 9.0})  # the key-value pair is the weight
        db.write(frames[2], data={"note": "from the cluster", "grid": np.zeros(3)})
    path = [str(tmp_path / name), str(tmp_path / name)] if kind == "list" else str(tmp_path / name)
    data = AseDbDataset(readable_database(path))
    data.census()
    expected = [7.0, 2.0, 1.0] * (2 if kind == "list" else 1)
    np.testing.assert_array_equal(data.weights, expected)
    assert [float(data.get(i).weight[0]) for i in range(len(expected))] == expected
    # what orb-md's frames and orb-relax's rows start from: the data's entries a row can hold, in every format
    assert data.get_atoms(2).info.get("note") == "from the cluster" and "grid" not in data.get_atoms(2).info
    if kind == "sqlite":
        with connect(str(tmp_path / "bad.db")) as db:
            db.write(frames[0], data={"weight": -3.0})
        with pytest.raises(DatasetError, match=r"bad\.db, row 1, key 'weight': weight must be a finite number >= 0"):
            AseDbDataset(str(tmp_path / "bad.db")).census()


def test_the_structures_fingerprint_sees_every_attribute_a_resumed_run_starts_from(tmp_path, cache):
    """orb-relax and orb-md refuse a --resume whose input changed: positions, momenta, masses, tags, constraints, and
    the total charge or spin (as a key-value pair or in row.data) each change the fingerprint; a row's other info
    does not (another charge resumed an OMol trajectory silently, the energy jumping mid-run)."""
    import ase.db
    from ase.constraints import FixAtoms

    from orb.data.dataset import AseDbDataset

    frames = demo_frames()[:3]

    def fingerprint(edit=None, name=[0]):
        name[0] += 1
        path = tmp_path / f"in{name[0]}.db"
        with ase.db.connect(str(path)) as db:
            for k, atoms in enumerate(frames):
                atoms = atoms.copy()
                pairs, data = dict(charge=0, config_type="bulk"), dict(spin=1)
                if edit is not None and k == 1:
                    edit(atoms, pairs, data)
                db.write(atoms, data=data, **pairs)
        return AseDbDataset(str(path), require_labels=False, charge_spin=True).structures_fingerprint()  # (OMol)

    plain = fingerprint()
    assert fingerprint() == plain
    assert fingerprint(lambda atoms, pairs, data: pairs.update(config_type="surface")) == plain
    edits = {"positions": lambda atoms, pairs, data: atoms.positions.__setitem__(0, atoms.positions[0] + 0.01),
             "momenta": lambda atoms, pairs, data: atoms.set_momenta(np.full((len(atoms), 3), 0.1)),
             "masses": lambda atoms, pairs, data: atoms.set_masses(atoms.get_masses() * 1.5),
             "tags": lambda atoms, pairs, data: atoms.set_tags(1),
             "constraints": lambda atoms, pairs, data: atoms.set_constraint(FixAtoms([0])),
             "charge": lambda atoms, pairs, data: pairs.update(charge=1),
             "spin": lambda atoms, pairs, data: data.update(spin=3)}
    changed = {name: fingerprint(edit) != plain for name, edit in edits.items()}
    assert changed == {name: True for name in edits}
    # an input without charge and spin fingerprints as the previous version did, so its runs still resume
    import hashlib

    data = AseDbDataset(DEMO_VAL, require_labels=False)
    digest = hashlib.sha256(data.content_fingerprint().encode())
    for row in ase.db.connect(DEMO_VAL).select():
        for values in (row.numbers.astype(np.int32), row.positions, np.asarray(row.cell), row.pbc, row.get("momenta"),
                       row.get("masses"), row.get("tags")):
            digest.update(b"-" if values is None else np.ascontiguousarray(values).tobytes())
        assert not row.constraints
        digest.update(b"-")
    assert data.structures_fingerprint() == digest.hexdigest()


def test_rows_an_sqlite_file_holds_in_its_write_ahead_log_are_indexed(tmp_path, cache):
    """An SQLite database in WAL mode, listed with another file: a row written since keeps the main file's size and
    modification time until SQLite checkpoints it, but is in the data; its -wal keys the indexed copy (the stale copy
    was read back, without the new row)."""
    import sqlite3

    import ase.db
    import ase.io
    from ase.build import bulk
    from ase.calculators.singlepoint import SinglePointCalculator

    from orb.data.formats import readable_database

    def cu(energy):
        atoms = bulk("Cu", "fcc", a=3.6)
        atoms.calc = SinglePointCalculator(atoms, energy=energy, forces=np.zeros((1, 3)))
        return atoms

    db, other = str(tmp_path / "a.db"), str(tmp_path / "b.extxyz")
    ase.db.connect(db).write(cu(-1.0))
    reader = sqlite3.connect(db)  # another process reading it: SQLite then keeps the log (no checkpoint at close)
    reader.execute("PRAGMA journal_mode=WAL")
    reader.execute("SELECT count(*) FROM systems").fetchall()
    ase.io.write(other, [cu(-2.0)], format="extxyz")
    first = readable_database([db, other])
    stamp = os.stat(db).st_mtime_ns, os.stat(db).st_size
    ase.db.connect(db).write(cu(-3.0))
    assert os.path.exists(db + "-wal") and (os.stat(db).st_mtime_ns, os.stat(db).st_size) == stamp
    again = readable_database([db, other])
    assert again != first and [row.energy for row in ase.db.connect(again).select()] == [-1.0, -3.0, -2.0]
    reader.close()


def test_a_file_changed_while_indexed_keeps_no_index_and_a_log_belongs_to_its_own_database(tmp_path, cache,
                                                                                           monkeypatch):
    """Keyed by content, an index must hold the content it is filed under: a file still growing while it was indexed
    (hashed with 8 frames, read with 16) filed the 16-row index under the 8-frame digest, which a complete copy
    of those 8 frames elsewhere then read. A database's -wal belongs to that database: the same log beside the
    other of two identical databases is other data. An unreadable file is one line naming it."""
    import sqlite3

    import ase.db
    import ase.io
    from ase.build import bulk
    from ase.calculators.singlepoint import SinglePointCalculator

    import orb.data.digests as digests
    import orb.data.formats as formats
    from orb.data.dataset import AseDbDataset
    from orb.data.formats import readable_database
    from orb.errors import DatasetError

    frames = (demo_frames() * 4)[:16]
    live, snapshot = tmp_path / "live", tmp_path / "snapshot"
    live.mkdir(), snapshot.mkdir()
    ase.io.write(live / "data.extxyz", frames[:8], format="extxyz")
    shutil.copy2(live / "data.extxyz", snapshot / "data.extxyz")
    convert = formats._convert

    def appended_meanwhile(*args, **kwargs):
        ase.io.write(live / "data.extxyz", frames[8:], format="extxyz", append=True)
        return convert(*args, **kwargs)

    monkeypatch.setattr(formats, "_convert", appended_meanwhile)
    with pytest.raises(DatasetError, match="changed while it was indexed"):
        readable_database(str(live))
    monkeypatch.setattr(formats, "_convert", convert)
    assert len(AseDbDataset(readable_database(str(snapshot)))) == 8
    assert len(AseDbDataset(readable_database(str(live)))) == 16

    def cu(energy, element="Cu"):
        atoms = bulk(element, "fcc", a=3.6)
        atoms.calc = SinglePointCalculator(atoms, energy=energy, forces=np.zeros((1, 3)))
        return atoms

    base = str(tmp_path / "base.db")
    with ase.db.connect(base) as db:
        for k in range(3):
            db.write(cu(-float(k)))
    connection = sqlite3.connect(base)
    connection.execute("PRAGMA journal_mode=WAL")  # (in the file's header: every copy in WAL mode alike)
    connection.close()
    first, second = tmp_path / "X", tmp_path / "Y"
    for folder in (first, second):
        folder.mkdir()
        for name in ("a.db", "b.db"):
            shutil.copy(base, folder / name)
    reader = sqlite3.connect(str(first / "a.db"))  # (a reader keeps the log: no checkpoint at the writer's close)
    reader.execute("SELECT count(*) FROM systems").fetchall()
    ase.db.connect(str(first / "a.db")).write(cu(-9.0, "Ni"))
    shutil.copy(str(first / "a.db") + "-wal", str(second / "b.db") + "-wal")  # the same log, beside b.db
    one = readable_database([str(first / "a.db"), str(first / "b.db")])
    reader.close()
    other = readable_database([str(second / "a.db"), str(second / "b.db")])
    assert other != one
    assert AseDbDataset(other).where(7) == f"{second / 'b.db'}, row 4"  # (its Ni row: a.db's 3, then b.db's 4th)

    unreadable = tmp_path / "unreadable"
    unreadable.mkdir()
    ase.io.write(unreadable / "a.extxyz", frames[:2], format="extxyz")
    ase.io.write(unreadable / "b.extxyz", frames[2:4], format="extxyz")

    def refused(path, *args, **kwargs):
        if str(path).endswith("b.extxyz"):
            raise PermissionError(13, "Permission denied", str(path))
        return open(path, *args, **kwargs)

    monkeypatch.setattr(digests, "open", refused, raising=False)
    with pytest.raises(DatasetError) as refusal:
        readable_database(str(unreadable))
    assert str(refusal.value) == f"{unreadable / 'b.extxyz'}: cannot read it (Permission denied)"
