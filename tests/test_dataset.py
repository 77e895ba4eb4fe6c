"""The ASE-db dataset: real MPtrj rows, bad input, augmentation, sampler."""

import os
import sqlite3

import ase.db
import numpy as np
import pytest
from ase import Atoms
from ase.build import bulk
from ase.calculators.emt import EMT
from ase.calculators.singlepoint import SinglePointCalculator

from conftest import DEMO_TRAIN, DEMO_VAL, MPTRJ_DB, MPTRJ_THIN_DB, ROOT
from orb.data.augmentation import random_rotation, rotate_structure
from orb.data.dataset import AseDbDataset
from orb.data.graphs import MISSING_STRESS
from orb.data.samplers import EpochSampler
from orb.errors import DatasetError


def write_rows(path, rows):
    with ase.db.connect(str(path), type="db") as db:
        for atoms in rows:
            db.write(atoms)
    return str(path)


def labelled(atoms, energy=-1.0, forces=None, stress="zeros"):
    kwargs = dict(energy=energy, forces=np.zeros((len(atoms), 3)) if forces is None else forces)
    if stress is not None:
        kwargs["stress"] = np.zeros(6) if isinstance(stress, str) else stress
    atoms.calc = SinglePointCalculator(atoms, **kwargs)
    return atoms


def cu(n=1):
    return bulk("Cu", "fcc", a=3.6).repeat((n, n, n))


@pytest.mark.parametrize("path", [MPTRJ_DB, MPTRJ_THIN_DB])
def test_reads_real_mptrj(path):
    ds = AseDbDataset(path)
    assert len(ds) in (10, 11) and ds.has_stress
    with ase.db.connect(path) as db:
        rows = list(db.select())
    for i, row in enumerate(rows):
        g = ds[i]
        assert g.num_nodes == row.natoms and g.system_id.tolist() == [row.id]
        np.testing.assert_allclose(g.energy, [row.energy], rtol=1e-6)
        np.testing.assert_allclose(g.forces, row.forces, atol=1e-6)
        np.testing.assert_allclose(g.stress[0], row.stress, atol=1e-7)
        assert np.all(np.bincount(g.senders, minlength=g.num_nodes) == 20)


def test_thin_cells_of_real_rows_match_reference(reference):
    """Rows 1 and 3 of the MPtrj db are reference structures 4 and 5: same graphs as orb-models."""
    ds = AseDbDataset(MPTRJ_DB)
    for row, ref in ((0, 4), (2, 5)):
        g = ds[row]
        np.testing.assert_array_equal(g.positions, reference[f"s{ref}/positions"])
        np.testing.assert_array_equal(g.energy, reference[f"s{ref}/label_energy"])
        np.testing.assert_array_equal(g.forces, reference[f"s{ref}/label_forces"])
        assert g.num_edges == len(reference[f"s{ref}/senders"])


def test_missing_and_non_sqlite_and_empty(tmp_path):
    with pytest.raises(DatasetError, match="does not exist"):
        AseDbDataset(str(tmp_path / "nope.db"))
    text = tmp_path / "notes.db"
    text.write_text("hello")
    with pytest.raises(DatasetError, match="not an SQLite database"):
        AseDbDataset(str(text))
    empty = tmp_path / "empty.db"
    ase.db.connect(str(empty)).write(Atoms("H"))
    with ase.db.connect(str(empty)) as db:
        db.delete([1])
    with pytest.raises(DatasetError, match="no rows"):
        AseDbDataset(str(empty))


def test_rows_without_labels(tmp_path):
    no_forces = cu()
    no_forces.calc = SinglePointCalculator(no_forces, energy=-1.0)
    path = write_rows(tmp_path / "a.db", [labelled(cu()), no_forces])
    with pytest.raises(DatasetError, match=r"a\.db, row 2, key 'forces'"):
        AseDbDataset(path).census()  # every row's labels, checked before training (the trainer starts with it)
    nan_energy = labelled(cu(), energy=np.nan)  # ASE stores a NaN energy as missing
    path = write_rows(tmp_path / "b.db", [nan_energy])
    with pytest.raises(DatasetError, match=r"row 1, key 'energy'"):
        AseDbDataset(path)[0]  # the first row read asks for the census
    assert AseDbDataset(path, require_labels=False)[0].energy is None
    # finite in float64, inf in the float32 loss (a training run of NaN steps and a NaN validation): named
    huge = labelled(cu(), forces=np.full((1, 3), 1e39))
    with pytest.raises(DatasetError, match=r"c\.db, row 2, key 'forces': label 1e\+39 is beyond float32's range"):
        AseDbDataset(write_rows(tmp_path / "c.db", [labelled(cu()), huge])).census()


@pytest.mark.parametrize("family", ["orb_v2", "orb_v3_direct_20_omat"])
def test_atoms_on_top_of_each_other_are_named_not_trained_on(tmp_path, family):
    """Two atoms closer than 0.1 Å: an edge of (near) zero length, whose direction is NaN. The row is named (a training
    run had NaN losses, skipped steps, and a NaN validation that no epoch could beat); 0.12 Å apart passes."""
    from orb.models.config import ModelConfig

    settings = ModelConfig.from_dict({"name": family}).graph_settings()
    stacked = cu(2)
    stacked.positions[1] = stacked.positions[0] + [0.0, 0.0, 0.04]
    path = write_rows(tmp_path / "a.db", [labelled(cu()), labelled(stacked)])
    with pytest.raises(DatasetError, match=r"a\.db, row 2, key 'positions': atoms 0 and 1 are 0\.04 Å apart \(on "
                                           r"top of each other\)"):
        AseDbDataset(path, settings=settings).census()  # training data: before training starts (the census)
    AseDbDataset(path, settings=settings, require_labels=False).census()  # orb-relax, orb-md: named when reached
    from orb.data.graphs import graph_from_arrays
    from orb.errors import StructureError

    with pytest.raises(StructureError, match=r"atoms 0 and 1 are 0\.04 Å apart"):  # any graph (calculator, orb-md)
        graph_from_arrays(stacked.positions, stacked.numbers, stacked.cell.array, settings=settings,
                          pbc=stacked.pbc)
    apart = cu(2)
    apart.positions[1] = apart.positions[0] + [0.0, 0.0, 0.12]
    assert AseDbDataset(write_rows(tmp_path / "b.db", [labelled(apart)]), settings=settings)[0].num_nodes == len(cu(2))


def test_nan_forces_wrong_shape_bad_numbers_singular_cell(tmp_path):
    bad_forces = np.zeros((1, 3))
    bad_forces[0, 1] = np.nan
    path = write_rows(tmp_path / "c.db", [labelled(cu()), labelled(cu(), forces=bad_forces),
                                          labelled(cu(), forces=np.zeros((2, 3)))])
    ds = AseDbDataset(path)
    ds.check_rows(0, 1)
    with pytest.raises(DatasetError, match=r"row 2, key 'forces': label contains NaN"):
        ds.census()  # the first bad row, found before any training step
    with pytest.raises(DatasetError, match=r"row 3, key 'forces': forces of shape \(2, 3\) for 1 atoms"):
        ds.check_rows(2, 3)
    flat = Atoms("Cu2", positions=[[0, 0, 0], [1.8, 0, 0]], cell=[[3.6, 0, 0], [0, 3.6, 0], [0, 0, 0]])
    path = write_rows(tmp_path / "d.db", [labelled(cu()), labelled(flat, forces=np.zeros((2, 3)))])
    with pytest.raises(DatasetError, match=r"row 2, key 'cell': .*singular cell"):
        AseDbDataset(path)[1]
    con = sqlite3.connect(path)  # ASE refuses to write Z > 118; users' own writers may not
    con.execute("UPDATE systems SET numbers=? WHERE id=1", (np.array([119], np.int32).tobytes(),))
    con.commit()
    con.close()
    with pytest.raises(DatasetError, match=r"row 1, key 'numbers': atom 0 has atomic number 119"):
        AseDbDataset(path)[0]


def test_commands_that_use_the_structures_alone_read_no_labels_nor_weights(tmp_path, monkeypatch):
    """orb-relax, orb-md and orb-properties (labels=False) read an ASE database whose rows carry a NaN force, a
    wrong-shaped stress and a negative weight: labels they never use stopped them (a failed DFT run's leftovers)."""
    monkeypatch.setenv("ORB_CACHE_DIR", str(tmp_path / "cache"))
    bad_forces = np.zeros((1, 3))
    bad_forces[0, 1] = np.nan
    path = write_rows(tmp_path / "c.db", [labelled(cu()), labelled(cu(), forces=bad_forces)])
    with ase.db.connect(path) as db:
        db.update(1, weight=-1.0)
    with pytest.raises(DatasetError, match=r"row 1, key 'weight': weight must be a finite number >= 0"):
        AseDbDataset(path, require_labels=False)
    data = AseDbDataset(path, require_labels=False, labels=False)
    assert not data.census().any() and data[1].forces is None and data[1].energy is None
    assert data.weights.tolist() == [1.0, 1.0]


def test_stress_optional_on_every_row_or_some(tmp_path):
    """No row with stress: none trained. Some: a row without is marked MISSING_STRESS for training (its stress
    weighed at 0), rotated or not, and read without stress for evaluation."""
    path = write_rows(tmp_path / "e.db", [labelled(cu(), stress=None), labelled(cu(2), stress=None)])
    ds = AseDbDataset(path)
    assert not ds.has_stress and ds.stress_rows == 0 and ds[1].stress is None
    path = write_rows(tmp_path / "f.db", [labelled(cu()), labelled(cu(), stress=None)])
    for ds in (AseDbDataset(path), AseDbDataset(path, augmentation=True)):
        assert ds.has_stress and ds.stress_rows == 1
        np.testing.assert_array_equal(ds.get(1, rotation_seed=3).stress[0], MISSING_STRESS.astype(np.float32))
        assert np.isfinite(ds.get(0, rotation_seed=3).stress).all()
    evaluated = AseDbDataset(path, require_labels=False)  # evaluation: stress where a row has it
    assert evaluated[1].stress is None and np.isfinite(evaluated[0].stress).all()
    assert np.isfinite(MISSING_STRESS.astype(np.float32)).all()  # (not NaN: Ascend's saturation mode makes NaN 0)
    path = write_rows(tmp_path / "g.db", [labelled(cu()), labelled(cu(), stress=np.full(6, 2e6))])
    with pytest.raises(DatasetError, match=r"g.db, row 2, key 'stress': stress 2e\+06 eV/Å³ is beyond any stress"):
        AseDbDataset(path).census()  # (a label that large would read as a structure without stress)


def test_stress_in_kbar_in_a_database_is_said_when_data_workers_check_it_and_on_a_cached_start(tmp_path, caplog):
    """An ASE database's stress in kBar was said by the rows' check, which data workers run (their warnings are not
    shown) and later starts read from the cache: said by the main process now, every start."""
    from conftest import said_by_a_census_in_workers

    path = write_rows(tmp_path / "kbar.db", [labelled(cu()), labelled(cu(2), stress=np.full(6, 25.0))])
    for _ in range(2):  # the rows checked by the workers, then the check read from the cache
        said = said_by_a_census_in_workers(path, "values in kBar or GPa must be converted", caplog)
        assert len(said) == 1 and said[0].startswith(f"{path}, row 2, key 'stress': a stress of 25 eV/Å³"), said
    demo = os.path.join(ROOT, "data", "pretrain", "pretrain_train.db")  # 5 of 512 rattled cells beyond 1 eV/Å³
    assert not said_by_a_census_in_workers(demo, "values in kBar or GPa must be converted", caplog)


def test_atoms_too_close_are_said_also_when_a_second_look_does_not_find_the_pair(caplog):
    """The census found the pair (on another machine, whose rounding put it just under 0.5 Å, or read from a shared
    cache): the structure is said without the pair, not a TypeError as the run starts."""
    import logging

    from orb.data.labels import _SAID, said_if_too_close

    _SAID.clear()
    with caplog.at_level(logging.WARNING, logger="orb"):
        said_if_too_close(None, "data", "data.db, row 4", 3)
    assert caplog.records[-1].getMessage().startswith("data.db, row 4: two atoms are about 0.5 Å apart, closer than "
                                                      "any chemical bond (H2's is 0.74 Å; 3 structure(s) of this data")


def test_rotation_matches_emt_on_rotated_cell():
    atoms = bulk("Cu", "fcc", a=3.7).repeat((2, 2, 2))
    atoms.set_cell(atoms.cell.array @ np.array([[1.0, 0.03, 0.0], [0.0, 0.98, 0.02], [0.01, 0.0, 1.02]]),
                   scale_atoms=True)
    atoms.rattle(0.05, seed=1)
    atoms.calc = EMT()
    forces, stress = atoms.get_forces(), atoms.get_stress()
    rotation = random_rotation(np.random.default_rng(7))
    assert np.allclose(rotation @ rotation.T, np.eye(3)) and np.isclose(np.linalg.det(rotation), 1.0)
    pos, cell, f_rot, s_rot = rotate_structure(atoms.positions, atoms.cell.array, forces, stress, rotation)
    rotated = Atoms(atoms.numbers, positions=pos, cell=cell, pbc=True)
    rotated.calc = EMT()
    np.testing.assert_allclose(f_rot, rotated.get_forces(), atol=1e-8)
    np.testing.assert_allclose(s_rot, rotated.get_stress(), atol=1e-9)
    # orb-models 0.4.2's rule (R S R^T) is wrong for this rotation
    full = np.array([[stress[0], stress[5], stress[4]], [stress[5], stress[1], stress[3]],
                     [stress[4], stress[3], stress[2]]])
    wrong = rotation @ full @ rotation.T
    assert not np.allclose([wrong[0, 0], wrong[1, 1], wrong[2, 2]], rotated.get_stress()[:3], atol=1e-6)


def test_augmentation_is_reproducible_and_rotates_labels():
    ds = AseDbDataset(MPTRJ_DB, augmentation=True)
    plain = AseDbDataset(MPTRJ_DB)
    a, b = ds.get(0, rotation_seed=5), ds.get(0, rotation_seed=5)
    np.testing.assert_array_equal(a.vectors, b.vectors)
    ref = plain[0]
    # same graph up to rotation: edge lengths, energies and force norms unchanged
    np.testing.assert_allclose(np.sort(a.r), np.sort(ref.r), atol=1e-4)
    np.testing.assert_allclose(np.linalg.norm(a.forces, axis=1), np.linalg.norm(ref.forces, axis=1), atol=1e-5)
    assert not np.allclose(a.forces, ref.forces)


def test_sampler_and_shards_cover_each_row_once():
    for n, batch, world in [(10, 4, 2), (9, 4, 2), (7, 3, 3), (5, 5, 1)]:
        sampler = EpochSampler(n, batch, seed=3)
        for epoch in range(3):
            shards = sampler.shards(epoch, world)
            parts = [[shards.part(s, rank) for s in range(len(shards))] for rank in range(world)]
            seen = np.concatenate([np.concatenate(p) for p in parts])
            assert sorted(seen.tolist()) == list(range(n))
            assert all(len(p) == len(sampler) for p in parts)  # every rank runs every step
        assert not np.array_equal(sampler.order(0), sampler.order(1)) or n < 3
    np.testing.assert_array_equal(EpochSampler(10, 4, seed=1).order(2), EpochSampler(10, 4, seed=1).order(2))


def test_the_demo_data_script_remakes_the_shipped_demo_and_refuses_bad_arguments(tmp_path):
    """scripts/make_demo_dataset.py with its defaults writes the shipped demo databases row for row; a bad argument
    is one line and exit 2 (a negative seed, a file as --out and a negative rattle were tracebacks; --train -5 and
    --cluster_fraction 2 were accepted)."""
    import subprocess
    import sys

    from ase.db import connect

    script = os.path.join(ROOT, "scripts", "make_demo_dataset.py")
    made = subprocess.run([sys.executable, script, "--out", str(tmp_path)], capture_output=True, text=True,
                          timeout=300)
    assert made.returncode == 0, made.stderr[-2000:]
    assert sorted(os.listdir(tmp_path)) == ["demo_train.db", "demo_val.db"]  # no temporary left
    for shipped, remade in ((DEMO_TRAIN, tmp_path / "demo_train.db"), (DEMO_VAL, tmp_path / "demo_val.db")):
        a, b = list(connect(shipped).select()), list(connect(str(remade)).select())
        assert len(a) == len(b)
        for x, y in zip(a, b):  # float64 to 1e-12: a host whose BLAS and libm round otherwise (EMT's exp, the
            assert x.symbols == y.symbols, x.id  # strained cells' products) changed the last bits on one of CI's
            for key in ("positions", "cell", "energy", "forces"):  # machines
                np.testing.assert_allclose(np.asarray(y[key]), np.asarray(x[key]), rtol=1e-12, atol=1e-12,
                                           err_msg=f"{remade} row {y.id} {key}")
    for args in (["--seed", "-1"], ["--train", "-5"], ["--cluster_fraction", "2"], ["--max_rattle", "-1"],
                 ["--out", DEMO_VAL]):
        bad = subprocess.run([sys.executable, script, "--out", str(tmp_path / "x"), *args], capture_output=True,
                             text=True, timeout=300)
        assert bad.returncode == 2 and "Traceback" not in bad.stderr and "error: --" in bad.stderr, (args, bad.stderr)


def test_a_row_rewritten_in_place_changes_the_databases_identity(tmp_path):
    """The caches of a database (neighbour counts, census, pseudo-labels) were keyed by its size and modification
    time: a row's positions rewritten in place keep the size, and a coarse or restored time (NFS, FAT, ``cp -p``)
    kept the key, so the old counts were read for new positions. SQLite's change counter is in the key now."""
    import shutil

    path = str(tmp_path / "rows.db")
    shutil.copy(DEMO_VAL, path)
    stat = os.stat(path)
    before = AseDbDataset(path).identity()
    with sqlite3.connect(path) as connection:  # the same bytes' length, other values
        (blob,) = connection.execute("SELECT positions FROM systems WHERE id = 1").fetchone()
        moved = np.frombuffer(blob, np.float64) + 0.1
        connection.execute("UPDATE systems SET positions = ? WHERE id = 1", (moved.tobytes(),))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert os.path.getsize(path) == stat.st_size and os.stat(path).st_mtime_ns == stat.st_mtime_ns
    assert AseDbDataset(path).identity() != before
