"""The orb-v3 confidence head put to use (orb.inference.uncertainty): each atom's predicted force error from the
calculator, orb-evaluate's per-structure predicted error and its rank correlation with the true error, and the
frames past --uncertain_above collected for labelling (orb-evaluate, orb-relax); orb-v2 refused in one line."""

import csv
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import DEMO_VAL, ROOT

V3 = os.path.join(ROOT, "data", "demo_v3_pretrained.ckpt")


def test_predicted_error_is_the_expectation_over_the_confidence_bins():
    from orb.inference.uncertainty import frame_error, per_atom_error

    confidence = np.zeros((3, 50))
    confidence[0, 0] = 1.0  # certainly in the first bin (0-0.006 eV/Å)
    confidence[1, [9, 10]] = 0.5  # halfway: bins 0.054-0.060 and 0.060-0.066
    confidence[2, :] = 1 / 50  # uniform over 0-0.3
    np.testing.assert_allclose(per_atom_error(confidence), [0.003, 0.06, 0.15])
    assert frame_error(per_atom_error(confidence)) == pytest.approx({"max": 0.15, "mean": 0.071})


def test_the_calculator_gives_each_atoms_predicted_force_error():
    import ase.db

    from orb.inference.calculator import ORBCalculator
    from orb.inference.uncertainty import per_atom_error

    atoms = ase.db.connect(DEMO_VAL).get(1).toatoms()
    atoms.calc = ORBCalculator.from_checkpoint(V3, device_target="CPU")
    atoms.get_forces()
    error = atoms.calc.results["force_error"]
    assert error.shape == (len(atoms),) and np.all((error > 0) & (error < 0.3))
    np.testing.assert_allclose(error, per_atom_error(atoms.calc.results["confidence"]))


def test_orb_evaluate_correlates_the_predicted_error_and_collects_uncertain_frames(tmp_path):
    """The per-structure predicted errors go to predictions.csv, their rank correlation with the true force MAE to
    summary.json (recomputed here from the CSV), and exactly the structures past the threshold to
    uncertain.extxyz, with their labels removed and their per-atom predicted errors kept."""
    import ase.io
    from scipy.stats import spearmanr

    out = tmp_path / "evaluation"
    result = subprocess.run([sys.executable, "scripts/evaluate.py", "--checkpoint", V3, "--data", DEMO_VAL,
                             "--output_dir", str(out), "--device_target", "CPU", "--progress_bar", "false",
                             "--uncertain_above", "0.13"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = list(csv.DictReader(open(out / "predictions.csv")))
    summary = json.load(open(out / "summary.json"))["confidence"]
    predicted = np.array([float(r["predicted_force_error_mean"]) for r in rows])
    true = np.array([float(r["forces_mae"]) for r in rows])
    assert summary["structures"] == len(rows) == 16
    assert summary["spearman_mean"] == pytest.approx(spearmanr(predicted, true).correlation)
    above = sorted(int(r["row_id"]) for r in rows if float(r["predicted_force_error_max"]) > 0.13)
    frames = ase.io.read(out / "uncertain.extxyz", index=":") if above else []
    assert 0 < len(above) < len(rows) and [f.info["source_row"] for f in frames] == above  # in the input's order
    for frame in frames:
        assert frame.arrays["predicted_force_error"].max() > 0.13 and frame.calc is None
    assert os.path.exists(out / "confidence.png") and "rank correlation" in result.stdout
    # an evaluation that fails after collecting (a --compare checkpoint that does not load) leaves the earlier
    # uncertain.extxyz as it was and nothing of its own (its hidden collection stayed in the folder)
    kept = (out / "uncertain.extxyz").read_bytes()
    junk = tmp_path / "junk.ckpt"
    junk.write_bytes(b"not a checkpoint" * 100)
    failed = subprocess.run([sys.executable, "scripts/evaluate.py", "--checkpoint", V3, "--data", DEMO_VAL,
                             "--output_dir", str(out), "--device_target", "CPU", "--progress_bar", "false",
                             "--uncertain_above", "0.13", "--compare", str(junk)], cwd=ROOT, capture_output=True,
                            text=True, timeout=600)
    assert failed.returncode == 2 and len(failed.stderr.strip().splitlines()) == 1, failed.stderr[-2000:]
    assert (out / "uncertain.extxyz").read_bytes() == kept
    assert not [name for name in os.listdir(out) if name.startswith(".")]
    # an --output_dir that is a file is said before the predictions (it was said after them)
    taken = subprocess.run([sys.executable, "scripts/evaluate.py", "--checkpoint", V3, "--data", DEMO_VAL,
                            "--output_dir", str(junk), "--device_target", "CPU"], cwd=ROOT, capture_output=True,
                           text=True, timeout=600)
    assert taken.returncode == 2 and taken.stderr.strip().splitlines() == [
        f"error: --output_dir {junk}: cannot write there ({junk} is a file)"], taken.stderr[-2000:]


def test_an_orb_v2_model_has_no_confidence_head_and_says_so(tmp_path):
    """One line, and nothing an earlier run wrote is deleted first (orb-evaluate removed its folder's
    uncertain.extxyz before the check)."""
    result = subprocess.run([sys.executable, "scripts/relax.py", "--checkpoint", "data/demo_pretrained.ckpt", "--data",
                             DEMO_VAL, "--output", str(tmp_path / "out.db"), "--device_target", "CPU",
                             "--uncertain_above", "0.1"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == ["error: --uncertain_above: orb_v2 has no confidence head: predicted "
                                                  "force errors need an orb-v3 model"]
    assert not os.path.exists(tmp_path / "out.db")
    earlier = tmp_path / "evaluation" / "uncertain.extxyz"
    earlier.parent.mkdir()
    earlier.write_text("frames of an earlier evaluation\n")
    result = subprocess.run([sys.executable, "scripts/evaluate.py", "--checkpoint", "data/demo_pretrained.ckpt",
                             "--data", DEMO_VAL, "--output_dir", str(earlier.parent), "--device_target", "CPU",
                             "--progress_bar", "false", "--uncertain_above", "0.1"], cwd=ROOT, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 2 and result.stderr.strip().splitlines()[-1] == (
        "error: --uncertain_above: orb_v2 has no confidence head: predicted force errors need an orb-v3 model")
    assert earlier.read_text() == "frames of an earlier evaluation\n"
    result = subprocess.run([sys.executable, "scripts/evaluate.py", "--checkpoint", V3, "--compare", "data/nope.ckpt",
                             "--data", DEMO_VAL, "--output_dir", str(earlier.parent), "--device_target", "CPU",
                             "--progress_bar", "false", "--uncertain_above", "0.1"], cwd=ROOT, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 2 and result.stderr.strip().splitlines()[-1] == (
        "error: --compare data/nope.ckpt: checkpoint file does not exist")  # found before the first evaluation
    assert earlier.read_text() == "frames of an earlier evaluation\n"
    broken = tmp_path / "broken.ckpt"  # found only after the first evaluation collected its frames
    broken.write_text("not a checkpoint")
    result = subprocess.run([sys.executable, "scripts/evaluate.py", "--checkpoint", V3, "--compare", str(broken),
                             "--data", DEMO_VAL, "--output_dir", str(earlier.parent), "--device_target", "CPU",
                             "--progress_bar", "false", "--uncertain_above", "0.1"], cwd=ROOT, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 2 and str(broken) in result.stderr.strip().splitlines()[-1], result.stderr[-2000:]
    assert earlier.read_text() == "frames of an earlier evaluation\n"  # an evaluation that ends early keeps them
