"""Every input format gives the same answer for the same structures (a review of the formats found these differ):
a stress on some structures only, label keys given beside an ASE database of any backend, non-collinear magnetic
moments, a charge or spin that is NaN, a constraint ASE cannot make, info a database row cannot hold, and the key
a message names."""

import logging
import sqlite3

import numpy as np
import pytest

from test_formats import ATTRIBUTES, cache, demo_frames, write_with_attributes  # noqa: F401 (cache: a fixture)

KINDS = ["sqlite", "list", "extxyz", "folder", "aselmdb", "json"]


def without_stress(frames, k):
    """``frames`` with structure ``k``'s stress dropped from its labels (energy and forces kept)."""
    from ase.calculators.singlepoint import SinglePointCalculator

    atoms = frames[k]
    atoms.calc = SinglePointCalculator(atoms, energy=atoms.get_potential_energy(), forces=atoms.get_forces())
    return frames


@pytest.mark.parametrize("kind", KINDS)
def test_a_stress_on_some_structures_is_read_for_prediction_and_weighed_at_0_in_training(tmp_path, cache, kind):
    """Molecules beside crystals: orb-evaluate, orb-relax and orb-md read them in every format (an extxyz, a folder
    or a list of databases was refused when indexed, the same rows as one database were read); training reads the
    same structures, the one without stress marked MISSING_STRESS (weighed at 0 in the loss), the others' stress as
    stored (training refused the mixture before)."""
    from orb.data.dataset import AseDbDataset
    from orb.data.formats import readable_database
    from orb.data.graphs import MISSING_STRESS

    frames = without_stress(demo_frames()[:len(ATTRIBUTES)], 2)
    path = readable_database(write_with_attributes(kind, tmp_path, frames, [{}] * len(frames)))
    read = AseDbDataset(path, require_labels=False)
    np.testing.assert_array_equal(read.census()[:, 2], [1, 1, 0, 1])
    training = AseDbDataset(path)
    assert training.has_stress and training.stress_rows == 3 and len(training) == 4
    for k in range(4):
        stress, predicted = training[k].stress, read[k].stress
        if k == 2:
            np.testing.assert_array_equal(stress, MISSING_STRESS[None].astype(np.float32))
            assert predicted is None
        else:
            np.testing.assert_array_equal(stress, predicted)
            np.testing.assert_allclose(stress[0], frames[k].get_stress(), rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("kind", KINDS)
def test_positions_in_nm_are_said_naming_the_file_and_structure_in_every_format(tmp_path, cache, kind, caplog):
    """A structure whose positions are in nm (its atoms 0.25 Å apart: nothing refused it above 0.1 Å, and training on
    it diverges) is said before training, once, naming where the user finds it: when data workers check the rows
    (a worker's warning is not shown) and again on a later start that reads the check from the cache. Data of
    ordinary structures says nothing."""
    from ase.calculators.singlepoint import SinglePointCalculator

    from conftest import said_by_a_census_in_workers
    from orb.data.dataset import AseDbDataset
    from orb.data.formats import readable_database

    frames = demo_frames()[:len(ATTRIBUTES)]
    nm = frames[2]
    labels = dict(energy=nm.get_potential_energy(), forces=nm.get_forces(), stress=nm.get_stress())
    nm.set_cell(nm.cell / 10, scale_atoms=True)
    nm.calc = SinglePointCalculator(nm, **labels)
    path = readable_database(write_with_attributes(kind, tmp_path, frames, [{}] * len(frames)))
    at = {"sqlite": "all.db, row 3", "list": "p2.db, row 2", "extxyz": "all.extxyz, frame 2",
          "folder": "b.extxyz, frame 0", "aselmdb": "all.aselmdb, row 3", "json": "all.json, row 3"}[kind]
    for start in ("checked by two data workers", "the check read from the cache"):
        said = said_by_a_census_in_workers(path, "closer than any chemical bond", caplog)
        assert len(said) == 1 and f"{at}: atoms " in said[0] and "1 structure(s) of this data" in said[0], (start, said)
    caplog.clear()
    (tmp_path / "ok").mkdir()
    with caplog.at_level(logging.WARNING, logger="orb"):
        AseDbDataset(readable_database(write_with_attributes(kind, tmp_path / "ok", demo_frames()[:4],
                                                             [{}] * 4))).census()
    assert not [r for r in caplog.records if "closer than any chemical bond" in r.getMessage()]


@pytest.mark.parametrize("kind", ["sqlite", "json", "aselmdb"])
def test_label_keys_never_reach_an_ase_database_of_any_backend(tmp_path, cache, kind, caplog):
    """An ASE database's labels are its rows' calculator results whatever its backend: energy_key given for the other
    files of a run was applied to an ASE-LMDB or JSON database (and refused it: no such info entry), not to SQLite."""
    from orb.data.dataset import AseDbDataset
    from orb.data.formats import LabelKeys, label_keys_apply, readable_database

    frames = demo_frames()[:len(ATTRIBUTES)]
    written = write_with_attributes(kind, tmp_path, frames, [{}] * len(frames))
    assert not label_keys_apply([written])
    with caplog.at_level(logging.WARNING, logger="orb"):
        data = AseDbDataset(readable_database([written], LabelKeys(energy="dft_energy")))
    assert "energy_key 'dft_energy' not used" in caplog.text
    np.testing.assert_allclose(data.energies(), [a.get_potential_energy() for a in frames], rtol=1e-12)


@pytest.mark.parametrize("kind", KINDS)
def test_non_collinear_magnetic_moments_survive_every_format(tmp_path, cache, kind):
    """(n, 3) initial magnetic moments, which a DFT relabelling of uncertain frames starts from: an SQLite database
    in a list was refused (ase's own row reader cannot make them), alone it was read."""
    from orb.data.dataset import AseDbDataset
    from orb.data.formats import readable_database

    frames = demo_frames()[:len(ATTRIBUTES)]
    for k, atoms in enumerate(frames):
        calc = atoms.calc
        atoms.set_initial_magnetic_moments(np.arange(3 * len(atoms)).reshape(-1, 3) * 0.25 - k)  # exact in text
        atoms.calc = calc
    data = AseDbDataset(readable_database(write_with_attributes(kind, tmp_path, frames, [{}] * len(frames))))
    for i, atoms in enumerate(frames):
        np.testing.assert_array_equal(data.get_atoms(i).get_initial_magnetic_moments(),
                                      atoms.get_initial_magnetic_moments())


@pytest.mark.parametrize("kind", ["sqlite", "list", "extxyz"])
def test_a_charge_that_is_nan_is_an_extra_key_to_models_without_charge_and_named_for_omol(tmp_path, cache, kind):
    """A NaN charge under the user's own key: a model without charge reads the structure (an extxyz, or a database in
    a list, was refused when indexed; the database alone was read); an OMol model's census names the frame or row
    and the user's key, not the indexed copy's ``charge``."""
    from orb.data.dataset import AseDbDataset
    from orb.data.formats import LabelKeys, readable_database
    from orb.errors import DatasetError

    frames = demo_frames()[:len(ATTRIBUTES)]
    stored = [dict(q=float("nan") if i == 1 else float(i), mult=1.0) for i in range(len(frames))]
    keys = LabelKeys(charge="q", spin="mult")
    path = readable_database(write_with_attributes(kind, tmp_path, frames, stored), keys)
    plain = AseDbDataset(path, charge_spin_keys=("q", "mult"))
    plain.census()
    assert [plain.charge_and_spin(i) for i in range(len(frames))] == [(0.0, 1.0), (None, 1.0), (2.0, 1.0), (3.0, 1.0)]
    where = {"sqlite": "all.db, row 2", "list": "p2.db, row 1", "extxyz": "all.extxyz, frame 1"}[kind]
    with pytest.raises(DatasetError, match=rf"{where}, key 'q': must be finite, got nan$"):
        AseDbDataset(path, charge_spin=True, charge_spin_keys=("q", "mult")).census()


@pytest.mark.parametrize("kind", ["sqlite", "extxyz"])
def test_a_missing_charge_is_named_by_the_users_key_with_advice_for_its_format(tmp_path, cache, kind):
    from orb.data.dataset import AseDbDataset
    from orb.data.formats import LabelKeys, readable_database
    from orb.errors import DatasetError

    frames = demo_frames()[:2]
    stored = [dict(q=0.0, mult=1.0), dict(mult=1.0)]
    path = readable_database(write_with_attributes(kind, tmp_path, frames, stored), LabelKeys(charge="q", spin="mult"))
    advice = ("store it with db.write(atoms, q=..., mult=...)" if kind == "sqlite"
              else "set info['q'] and info['mult'] on each structure")
    with pytest.raises(DatasetError) as raised:
        AseDbDataset(path, charge_spin=True, charge_spin_keys=("q", "mult")).census()
    where = "all.db, row 2" if kind == "sqlite" else "all.extxyz, frame 1"
    assert str(raised.value).endswith(f"{where}, key 'q': {'row' if kind == 'sqlite' else 'frame'} has no total "
                                      f"charge, which OMol models need ({advice})"), str(raised.value)


def test_a_database_in_a_list_is_named_by_its_own_row_ids(tmp_path, cache):
    """A database whose ids are not 1, 2, 3 (a row deleted): in a list its row was named by its position ("frame 2")
    while alone by its id ("row 4"); now by its id either way, and so in orb-evaluate's predictions.csv."""
    import ase.db

    from orb.data.dataset import AseDbDataset
    from orb.data.formats import readable_database
    from orb.errors import DatasetError

    from ase.calculators.singlepoint import SinglePointCalculator

    frames = demo_frames()[:6]
    frames[5].calc = SinglePointCalculator(frames[5], energy=frames[5].get_potential_energy())  # no forces
    with ase.db.connect(str(tmp_path / "p1.db")) as db:
        for atoms in frames[:2]:
            db.write(atoms)
    with ase.db.connect(str(tmp_path / "p2.db")) as db:
        for atoms in frames[2:]:
            db.write(atoms)
    with ase.db.connect(str(tmp_path / "p2.db")) as db:
        db.delete([2])  # p2.db's ids: 1, 3, 4 (row 4 without forces)
    for data in (str(tmp_path / "p2.db"), [str(tmp_path / "p1.db"), str(tmp_path / "p2.db")]):
        with pytest.raises(DatasetError, match=r"p2.db, row 4, key 'forces': "):
            AseDbDataset(readable_database(data)).census()
    listed = AseDbDataset(readable_database([str(tmp_path / "p1.db"), str(tmp_path / "p2.db")]), require_labels=False)
    locate = listed.rows.origin_locator()
    assert [locate(i)[1:] for i in range(1, 6)] == [("row", 1), ("row", 2), ("row", 1), ("row", 3), ("row", 4)]


def unknown_constraint(path, row: int) -> None:
    """Row ``row`` of the ASE database ``path`` given a constraint no ASE knows (a newer ASE's, or edited bytes)."""
    connection = sqlite3.connect(str(path))
    connection.execute("UPDATE systems SET constraints = ? WHERE id = ?",
                       ('[{"name": "FixSomethingNew", "kwargs": {"indices": [0]}}]', row))
    connection.commit()
    connection.close()


def test_a_constraint_ase_cannot_make_is_one_line_naming_the_row(tmp_path, cache):
    """It passed every check, then stopped orb-md's start and orb-relax mid-run with ASE's bare ValueError and a
    traceback; now every check names the row and key, and so does reading the structure."""
    from ase.constraints import FixAtoms

    from orb.data.dataset import AseDbDataset
    from orb.data.formats import readable_database
    from orb.errors import DatasetError

    frames = demo_frames()[:3]
    for atoms in frames:
        atoms.set_constraint(FixAtoms(indices=[0]))
    path = write_with_attributes("sqlite", tmp_path, frames, [{}] * 3)
    unknown_constraint(path, 2)
    pattern = r"all.db, row 2, key 'constraints': ASE cannot make its constraints .*FixSomethingNew"
    for check in (lambda d: d.census(), lambda d: d.check_structures(), lambda d: d.get_atoms(1)):
        with pytest.raises(DatasetError, match=pattern):
            check(AseDbDataset(readable_database(path), require_labels=False))
    assert AseDbDataset(path, require_labels=False).get_atoms(0).constraints[0].index.tolist() == [0]
    with pytest.raises(DatasetError, match=r"all.db: cannot read it as an ASE database at row 2 "):
        readable_database([path, path])  # (a list is indexed through ase's own reader)
    # one ASE makes but that does not fit the atoms (an index past the last): orb-relax stopped with numpy's
    # IndexError and a traceback at its first step; now refused by every check, by file, row or frame, and key
    (tmp_path / "beyond").mkdir()
    plain = [atoms.copy() for atoms in frames]  # (unlabelled: ASE's write of forces applies the constraint itself)
    plain[1].set_constraint(FixAtoms(indices=[len(plain[1]) + 5]))
    beyond = write_with_attributes("sqlite", tmp_path / "beyond", plain, [{}] * 3)
    for data in (beyond, [beyond, beyond]):
        with pytest.raises(DatasetError, match=r"all.db, row 2, key 'constraints': its constraint FixAtoms does not "
                                               rf"fit its {len(plain[1])} atoms"):
            AseDbDataset(readable_database(data), require_labels=False).census()


def test_info_a_database_row_cannot_hold_is_said_once_per_key(tmp_path, cache, caplog):
    """Text that reads as a number (an id ``000123``), a reserved name (``id``) and a formula-like name (``CO``)
    cannot be a row's key-value pair: it was dropped silently; now said once per file and key."""
    import ase.db
    import ase.io

    from orb.data.dataset import AseDbDataset
    from orb.data.formats import readable_database

    frames = demo_frames()[:3]
    for k, atoms in enumerate(frames):
        atoms.info.update(structure_id=["000123", "mp-149", "1e3"][k], CO="x", name=f"w{k}")
    ase.io.write(tmp_path / "ids.traj", frames)
    with caplog.at_level(logging.WARNING, logger="orb"):
        data = AseDbDataset(readable_database(str(tmp_path / "ids.traj")))
    said = [r.getMessage() for r in caplog.records if "is not carried" in r.getMessage()]
    assert len(said) == 2 and "'structure_id' ('000123')" in said[0] and "'CO' ('x')" in said[1], said
    assert [data.get_atoms(i).info.get("structure_id") for i in range(3)] == [None, "mp-149", None]
    # an ASE SQLite database read as it is: its rows' data alike (dropped silently)
    caplog.clear()
    with ase.db.connect(str(tmp_path / "ids.db")) as db:
        for k, atoms in enumerate(frames):
            db.write(atoms, data={"structure_id": ["000123", "mp-149", "1e3"][k], "CO": "x", "site": [1, 2],
                                  "free_energy": "1e3"})  # (a label's name: never carried, not said)
    with caplog.at_level(logging.WARNING, logger="orb"):
        data = AseDbDataset(readable_database(str(tmp_path / "ids.db")))
        assert data.get_atoms(0).info.get("structure_id") is None and not caplog.records  # (said where written out)
        carried = [data.get_atoms(i, say_dropped=True).info.get("structure_id") for i in range(3)]
    said = [r.getMessage() for r in caplog.records if "is not carried" in r.getMessage()]
    assert len(said) == 2 and "row data key 'structure_id' ('000123')" in said[0] and "'CO' ('x')" in said[1], said
    assert carried == [None, "mp-149", None]


def test_orb_properties_names_a_structure_that_is_no_crystal_by_its_file_and_frame(tmp_path, cache):
    import ase.io
    from ase.build import bulk, molecule

    from orb.errors import DatasetError
    from orb.inference.crystals import read_structures

    ase.io.write(tmp_path / "cu.extxyz", [bulk("Cu", cubic=True), bulk("Cu")])
    ase.io.write(tmp_path / "water.extxyz", [molecule("H2O")])
    with pytest.raises(DatasetError, match=r"water.extxyz, frame 0, key 'pbc': H2O is not a 3D periodic crystal"):
        read_structures([str(tmp_path / "cu.extxyz"), str(tmp_path / "water.extxyz")])


def test_a_frame_ase_cannot_read_is_named(tmp_path, cache):
    """A damaged frame of an extxyz was ``ase.io cannot read it`` with no frame: in a file of 100,000 frames."""
    import ase.io

    from orb.data.formats import readable_database
    from orb.errors import DatasetError

    ase.io.write(tmp_path / "bad.extxyz", demo_frames()[:3], format="extxyz")
    lines = (tmp_path / "bad.extxyz").read_text().splitlines()
    starts = [k for k, line in enumerate(lines) if line.strip().isdigit()]
    fields = lines[starts[2] + 2].split()
    fields[1] = "1.2.3"  # frame 2's first atom's x
    lines[starts[2] + 2] = " ".join(fields)
    (tmp_path / "bad.extxyz").write_text("\n".join(lines) + "\n")
    with pytest.raises(DatasetError, match=r"bad.extxyz, frame 2: ase.io cannot read it \(.*1\.2\.3"):
        readable_database(str(tmp_path / "bad.extxyz"))


@pytest.mark.parametrize("kind", KINDS)
def test_structures_read_without_labels_keep_their_weight_in_every_format(tmp_path, cache, kind):
    """orb-relax, orb-md and orb-properties read no labels (LabelKeys(labels=False), AseDbDataset(labels=False)): a
    NaN force and a negative weight do not stop them, and the weight, unread, reaches their outputs as any attribute
    (it was left out of an extxyz's, a folder's or a list's indexed copy)."""
    from ase.calculators.singlepoint import SinglePointCalculator

    from orb.data.dataset import AseDbDataset
    from orb.data.formats import LabelKeys, readable_database

    frames = demo_frames()[:len(ATTRIBUTES)]  # (a folder and a list split them in two)
    forces = frames[1].get_forces().copy()
    forces[0, 0] = np.nan
    frames[1].calc = SinglePointCalculator(frames[1], energy=frames[1].get_potential_energy(), forces=forces)
    given = [(0.5, "bulk"), (-1.0, "surface"), (2.0, "slab"), (1.0, "bulk")]
    path = write_with_attributes(kind, tmp_path, frames, [{"weight": w, "config_type": c} for w, c in given])
    data = AseDbDataset(readable_database(path, LabelKeys(labels=False)), require_labels=False, labels=False)
    assert not data.census().any() and data.weights.tolist() == [1.0] * len(given)
    infos = [data.get_atoms(i).info for i in range(len(given))]
    assert [(info.get("weight"), info.get("config_type")) for info in infos] == given
