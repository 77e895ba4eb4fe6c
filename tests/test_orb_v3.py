"""What a user does with orb-v3: fine-tune a (small) conservative model with the trainer, evaluate it, run it as an
ASE calculator with charge and spin, export it to PyTorch's format and read it back, and the mistakes that must get
one clear line. (The full-size models against PyTorch orb-models 0.5.5: tests/test_orb_v3_parity.py.)
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import DEMO_TRAIN, DEMO_VAL, ROOT
from test_orb_v3_parity import V3_NPZ


def test_model_names_and_mistakes():
    from orb.models import create
    from orb.models.config import ModelConfig

    cfg = ModelConfig.from_dict({"name": "orb_v3_conservative_inf_omat"})
    assert (cfg.max_neighbors, cfg.radius, cfg.conservative, cfg.has_stress) == (120, 6.0, True, True)
    assert ModelConfig.from_dict({"name": "orb_v3_direct_20_omat"}).max_neighbors == 20
    omol = ModelConfig.from_dict({"name": "orb_v3_direct_omol"})
    assert omol.omol and not omol.has_stress and not omol.conservative
    with pytest.raises(ValueError, match="orb_v3_conservative_inf_omat"):  # the message lists the known names
        create("orb_v3_conservative")


def small_v3_cfg(tmp_path, name="orb_v3_conservative_20_omat", **overrides):
    from orb.training.config import config_from_dict

    values = dict(train_data_path=DEMO_TRAIN, val_data_path=DEMO_VAL, output_dir=str(tmp_path / "run"),
                  checkpoint_path="", device_target="CPU", batch_size=8, max_epochs=1, lr=1e-3,
                  buckets=[[136, 2720]], progress_bar="false", log_every_n_steps=4, data_workers=0,
                  model=dict(name=name, latent_dim=32, mlp_hidden_dim=64, num_message_passing_steps=2,
                             head_mlp_hidden_dim=32))
    values.update(overrides)
    return config_from_dict(values)


def run_cli(*args, timeout=900):
    return subprocess.run([sys.executable, os.path.join(ROOT, "finetune.py"), *args], cwd=ROOT, timeout=timeout,
                          capture_output=True, text=True)


SMALL_V3 = ("--model.latent_dim", "32", "--model.mlp_hidden_dim", "64", "--model.num_message_passing_steps", "2",
            "--model.head_mlp_hidden_dim", "32")


def test_fine_tune_evaluate_calculate_and_export_a_conservative_model(tmp_path):
    """The user's path with a (small, randomly initialised) orb-v3 conservative model: finetune.py
    trains it (the loss differentiates through the forces: a gradient of a gradient), evaluate.py
    reproduces its validation metrics, the ASE calculator's forces and stress are the derivatives
    of its energy (finite differences), and the export to PyTorch's format reads back the same."""
    from ase.calculators.fd import calculate_numerical_forces, calculate_numerical_stress
    from ase.io import read

    from orb.inference.calculator import ORBCalculator

    out = tmp_path / "v3"
    result = run_cli("--config", "configs/demo.yaml", "--max_epochs", "2", "--output_dir", str(out),
                     "--checkpoint_path", "", "--device_target", "CPU", "--buckets", "[[136, 2720]]", "--lr", "1e-3",
                     "--model.name", "orb_v3_conservative_20_omat", *SMALL_V3)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    records = [json.loads(l) for l in open(out / "metrics.jsonl")]
    epochs = [r for r in records if r["type"] in ("initial", "epoch")]
    assert [r["epoch"] for r in epochs] == [0, 1, 2]
    assert {"loss_confidence", "confidence_accuracy", "stress_mae"} <= set(epochs[-1]["val"])
    assert epochs[-1]["val"]["loss"] < epochs[0]["val"]["loss"]  # it learns (from random weights)
    best = str(out / "checkpoints" / "best_weights.ckpt")
    evaluation = subprocess.run([sys.executable, "-m", "orb.inference.evaluate", "--checkpoint", best, "--data",
                                 DEMO_VAL, "--output_dir", str(tmp_path / "eval"), "--device_target", "CPU",
                                 "--progress_bar", "false"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert evaluation.returncode == 0, evaluation.stderr[-2000:]
    summary = json.load(open(tmp_path / "eval" / "summary.json"))
    best_epoch = min(epochs[1:], key=lambda r: r["val"]["loss"])
    for key in ("energy_mae", "forces_mae", "stress_mae"):
        assert summary[key] == pytest.approx(best_epoch["val"][key], rel=2e-5, abs=1e-7), key

    atoms = read(DEMO_VAL, index=0)
    distances = atoms.get_all_distances(mic=True) + 9 * np.eye(len(atoms))
    i, j = np.unravel_index(distances.argmin(), distances.shape)
    bond = atoms.get_distance(i, j, mic=True, vector=True)
    atoms.positions[j] -= bond * (1 - 1.3 / np.linalg.norm(bond))  # a close pair: forces well above the noise
    atoms.calc = ORBCalculator.from_checkpoint(best, device_target="CPU")
    forces, stress = atoms.get_forces(), atoms.get_stress()
    assert atoms.calc.results["confidence"].shape == (len(atoms), 50)
    assert np.abs(forces).max() > 0.1 and np.abs(stress).max() > 1e-3
    # float32 energies carry ~1e-5 eV of rounding: steps of 3e-3 Å and 1e-3 strain keep both errors small
    np.testing.assert_allclose(forces, calculate_numerical_forces(atoms, eps=3e-3), atol=4e-3)
    np.testing.assert_allclose(stress, calculate_numerical_stress(atoms, eps=1e-3), atol=1e-4)

    exported = tmp_path / "export.ckpt"
    convert = subprocess.run([sys.executable, "-m", "orb.io.convert", best, str(exported), "--to", "torch",
                              "--model", "orb_v3_conservative_20_omat"], cwd=ROOT, capture_output=True, text=True,
                             timeout=600)
    assert convert.returncode == 0, convert.stderr[-2000:]
    again = ORBCalculator.from_checkpoint(str(exported), device_target="CPU",
                                          model_name="orb_v3_conservative_20_omat")
    copy = atoms.copy()
    copy.calc = again
    np.testing.assert_array_equal(copy.get_forces(), forces)
    assert copy.get_potential_energy() == atoms.get_potential_energy()


@pytest.mark.parametrize("name", ["orb_v3_conservative_20_omat", "orb_v3_direct_omol"])
def test_pytorch_orb_models_055_loads_our_export_and_predicts_the_same(tmp_path, name):
    """Our orb-v3 export in the PyTorch peer environment (``ORB_TORCH_V3_PYTHON``: torch 2.13 +
    orb-models 0.5.5, set up by .ci/run): orb-models' own loader (load_state_dict strict) accepts it
    and predicts what our calculator predicts from the same file. Randomly initialised full-size
    weights (not the recipe), a periodic crystal and a charged open-shell cluster; the model carries random
    low-rank adapters, which the export merges: orb-models predicts what our adapted model predicts."""
    peer = os.environ.get("ORB_TORCH_V3_PYTHON", "")
    if not peer:
        pytest.skip("ORB_TORCH_V3_PYTHON (a python with torch and orb-models 0.5.5) is not set; .ci/run sets it")
    from ase import Atoms

    from orb.inference.calculator import ORBCalculator
    from orb.io.checkpoint import to_torch_state_dict
    from orb.io.torch_format import write_torch_checkpoint
    from orb.models import create

    from test_checkpoint import add_random_adapters

    path = str(tmp_path / "export.ckpt")
    adapted = add_random_adapters(create(name, seed=3))
    write_torch_checkpoint(to_torch_state_dict(adapted), path)
    z = np.load(V3_NPZ)
    names = ["s0", "s1", "s4"]  # alloy (32 atoms), cluster (13, charge 1, spin 2), periodic ion (charge 2)
    structures = {"names": np.array(names)}
    for n in names:
        for key in ("numbers", "positions", "cell"):
            structures[f"{n}/{key}"] = z[f"{n}/{key}"]
        if name.endswith("_omol"):
            structures[f"{n}/charge"], structures[f"{n}/spin"] = float(z[f"{n}/charge"][0]), float(z[f"{n}/spin"][0])
    np.savez(tmp_path / "structures.npz", **structures)
    result = subprocess.run([peer, os.path.join(ROOT, "tests", "torch_peer.py"), name, path,
                             str(tmp_path / "structures.npz"), str(tmp_path / "torch.npz")],
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    theirs = np.load(tmp_path / "torch.npz")
    calculators = [ORBCalculator.from_checkpoint(path, device_target="CPU", model_name=name), ORBCalculator(adapted)]
    for n, calculator in ((n, c) for n in names for c in calculators):
        cell = structures[f"{n}/cell"]
        atoms = Atoms(numbers=structures[f"{n}/numbers"], positions=structures[f"{n}/positions"], cell=cell,
                      pbc=bool(np.any(cell != 0)))
        atoms.info.update({k: structures[f"{n}/{k}"] for k in ("charge", "spin") if f"{n}/{k}" in structures})
        atoms.calc = calculator
        energy = theirs[f"{n}/energy"][0]
        assert np.abs(theirs[f"{n}/forces"]).max() > 1e-2  # a comparison of zeros would prove nothing
        np.testing.assert_allclose(atoms.get_potential_energy(), energy, atol=2e-4, rtol=1e-6, err_msg=n)
        np.testing.assert_allclose(atoms.get_forces(), theirs[f"{n}/forces"], atol=2e-5, rtol=2e-5, err_msg=n)
        if f"{n}/stress" in theirs and atoms.pbc.all():
            np.testing.assert_allclose(atoms.get_stress(), theirs[f"{n}/stress"], atol=5e-6, err_msg=n)


def omol_db(path, charge_spin=True, skip_row=None, in_data=False):
    """Small molecules labelled with EMT (which knows H, C, N, O) and their total charge and spin."""
    import ase.db
    from ase.build import molecule
    from ase.calculators.emt import EMT

    rng = np.random.default_rng(0)
    with ase.db.connect(str(path), append=False) as db:
        for i, name in enumerate(["H2O", "CH4", "NH3", "C2H6", "CO2", "HCN", "H2O2", "C2H4"]):
            atoms = molecule(name)
            atoms.positions += rng.normal(0, 0.05, atoms.positions.shape)
            atoms.calc = EMT()
            atoms.get_potential_energy()
            extra = dict(charge=0, spin=1) if charge_spin and i != skip_row else {}
            db.write(atoms, **({"data": extra} if in_data else extra))
    return str(path)


def test_conservative_omol_model_predicts_stress_as_the_strain_derivative_of_its_energy():
    """orb-models 0.7.0 gives orb_v3_conservative_omol stress (has_stress true): (1/V) dE/d(strain) of a periodic
    structure, ASE's sign, as the omat conservative models; the direct OMol model has no stress head."""
    from ase.build import bulk
    from ase.calculators.fd import calculate_numerical_stress

    from orb.inference.calculator import ORBCalculator
    from orb.models import build
    from orb.models.config import ModelConfig

    assert ModelConfig.from_dict({"name": "orb_v3_conservative_omol"}).has_stress
    assert not ModelConfig.from_dict({"name": "orb_v3_direct_omol"}).has_stress
    cfg = ModelConfig.from_dict(dict(name="orb_v3_conservative_omol", latent_dim=32, mlp_hidden_dim=64,
                                     num_message_passing_steps=2, head_mlp_hidden_dim=32))
    atoms = bulk("Cu", "fcc", a=3.2, cubic=True).repeat((2, 1, 1))  # compressed: stress well above the noise
    atoms.rattle(0.05, seed=1)
    atoms.info.update(charge=0, spin=1)
    atoms.calc = ORBCalculator(build(cfg, seed=3))
    stress = atoms.get_stress()
    assert np.abs(stress).max() > 1e-3
    np.testing.assert_allclose(stress, calculate_numerical_stress(atoms, eps=1e-3), atol=1e-4)


def test_charge_and_spin_in_row_data_are_checked_once_per_database(tmp_path, monkeypatch):
    """OMol data keeping charge and spin in ``row.data`` (OMol25's conversions do) is read row by row only by the
    census, which is kept in the cache: a later start reads no row; a row without them is named."""
    from orb.data.dataset import AseDbDataset
    from orb.errors import DatasetError

    monkeypatch.setenv("ORB_CACHE_DIR", str(tmp_path / "cache"))
    path = omol_db(tmp_path / "mol.db", in_data=True)
    first = AseDbDataset(path, charge_spin=True)
    first.census()
    again = AseDbDataset(path, charge_spin=True)
    again.census()
    assert again.census_pass.read_from == first.census_pass.kept_in is not None  # no row read: the census kept
    assert float(again.get(0).charge[0]) == 0 and float(again.get(0).spin[0]) == 1
    bad = omol_db(tmp_path / "bad.db", skip_row=2, in_data=True)
    with pytest.raises(DatasetError, match="bad.db, row 3, key 'charge'"):
        AseDbDataset(bad, charge_spin=True).census()


def test_omol_model_trains_on_charge_and_spin_and_names_a_row_without(tmp_path):
    from orb.device import configure_mindspore
    from orb.training.outputs import prepare_output_dir
    from orb.training.setup import build_trainer

    data = omol_db(tmp_path / "mol.db")
    cfg = small_v3_cfg(tmp_path, name="orb_v3_direct_omol", train_data_path=data, val_data_path=data, batch_size=4,
                       buckets=[])
    configure_mindspore(cfg.device_target, cfg.device_id, cfg.num_threads)
    prepare_output_dir(cfg.output_dir, resume=False, overwrite=False)
    trainer = build_trainer(cfg)
    trainer.fit()
    epochs = [json.loads(l) for l in open(os.path.join(cfg.output_dir, "metrics.jsonl"))]
    assert "stress_mae" not in epochs[-1]["val"] and np.isfinite(epochs[-1]["val"]["loss"])

    bad = omol_db(tmp_path / "bad.db", skip_row=5)
    result = run_cli("--config", "configs/demo.yaml", "--output_dir", str(tmp_path / "bad_run"), "--checkpoint_path",
                     "", "--device_target", "CPU", "--train_data_path", bad, "--val_data_path", data,
                     "--model.name", "orb_v3_direct_omol", *SMALL_V3, timeout=300)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert len(result.stderr.strip().splitlines()) == 1
    assert "bad.db, row 6, key 'charge'" in result.stderr and "OMol" in result.stderr


def test_bad_row_found_while_counting_neighbours_stops_with_one_line(tmp_path):
    """orb-v3 counts every structure's neighbours before training (in the data workers) to size the
    batch shapes: a broken row stops the run there with its row and key named, and the worker
    processes end quietly (no traceback at exit)."""
    import ase.db
    from ase.calculators.singlepoint import SinglePointCalculator

    bad = str(tmp_path / "bad.db")
    with ase.db.connect(DEMO_VAL) as src, ase.db.connect(bad) as dst:
        for i, row in enumerate(src.select()):
            atoms = row.toatoms()
            if i == 5:
                cell = atoms.cell.array.copy()
                cell[2] = cell[0]  # singular
                atoms.set_cell(cell)
            atoms.calc = SinglePointCalculator(atoms, energy=row.energy, forces=row.forces, stress=row.stress)
            dst.write(atoms)
    result = run_cli("--config", "configs/demo.yaml", "--output_dir", str(tmp_path / "run"), "--checkpoint_path", "",
                     "--device_target", "CPU", "--train_data_path", bad, "--data_workers", "2",
                     "--model.name", "orb_v3_direct_inf_omat", *SMALL_V3, timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr[-2000:]
    assert "bad.db, row 6, key 'cell'" in result.stderr and "singular" in result.stderr


def test_pseudo_labels_of_omol_rows_follow_where_their_charge_and_spin_are_read(tmp_path, monkeypatch, caplog):
    """An OMol model's replay pseudo-labels depend on each row's total charge and spin: a run reading them under
    other keys (charge_key, spin_key) computes its own; the cache handed it the first run's labels, computed for
    another charge state."""
    import ase.db

    from orb.io.checkpoint import save_checkpoint
    from orb.models import create
    from orb.training.setup import build_trainer

    monkeypatch.setenv("ORB_CACHE_DIR", str(tmp_path / "cache"))
    model = create("orb_v3_direct_omol", seed=3, latent_dim=32, mlp_hidden_dim=64, num_message_passing_steps=2,
                   head_mlp_hidden_dim=32)
    checkpoint = str(tmp_path / "omol.ckpt")
    save_checkpoint(checkpoint, model, {"model": model.cfg.to_dict()}, exported=True)
    data = str(tmp_path / "mol.db")
    with ase.db.connect(omol_db(tmp_path / "plain.db")) as src, ase.db.connect(data) as dst:
        for row in src.select():
            dst.write(row.toatoms(), charge=0, spin=1, q=2, s=3)
    replay = dict(data_path=data, fraction=0.5, val_samples=2, labels="model", selection="random")
    caplog.set_level("INFO", logger="orb")
    energies = {}
    for keys in (("charge", "spin"), ("q", "s"), ("charge", "spin")):
        caplog.clear()
        cfg = small_v3_cfg(tmp_path / "_".join(keys), name="orb_v3_direct_omol", train_data_path=data,
                           val_data_path=data, batch_size=4, buckets=[], replay=replay, charge_key=keys[0],
                           spin_key=keys[1], checkpoint_path=checkpoint)
        trainer = build_trainer(cfg)
        table = trainer.data.databases["replay"].label_table
        trainer.data.loader.close()
        assert ("read from the cache" in caplog.text) == (keys in energies), keys
        energies.setdefault(keys, table.energy)
    neutral, charged = energies.values()
    assert np.abs(neutral - charged).max() > 1e-3  # the charge changes the predictions: one entry would show
