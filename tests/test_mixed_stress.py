"""Training data with a stress label on some structures only (molecules or slabs beside crystals): a structure
without one weighs its stress at 0, as MACE's config_stress_weight does, and its energy and forces train as usual."""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from conftest import DEMO_TRAIN, ROOT, SMALL_MODEL

MODELS = ["orb_v2", "orb_v3_direct_20_omat", "orb_v3_conservative_20_omat"]


@pytest.mark.parametrize("name", MODELS)
def test_a_structure_without_stress_is_its_stress_weighed_at_0_and_nothing_else_changes(name):
    """One batch, its middle structure's stress left out (MISSING_STRESS, as the data gives it): the loss and gradient
    are the energy and force terms of the whole batch plus the stress term with that structure's weight 0; the stress
    normaliser absorbs the other structures only, the energy and force normalisers every one; the stress MAE is
    averaged over the structures with a stress (num_stress)."""
    import mindspore as ms

    from orb.data.batching import batch_graphs, pad_batch
    from orb.data.dataset import AseDbDataset
    from orb.data.graphs import MISSING_STRESS
    from orb.data.tensors import loss_inputs
    from orb.models import create
    from orb.training.config import config_from_dict
    from orb.training.engine import make_loss

    ms.set_context(mode=ms.GRAPH_MODE)

    def cell_of(**weights):
        cfg = config_from_dict(dict(model=dict(SMALL_MODEL, name=name), device_target="CPU",
                                    loss_weights=dict(dict(energy=1.0, forces=1.0, stress=1.0), **weights)))
        cell = make_loss(create(name, seed=1, **SMALL_MODEL), cfg, has_stress=True)
        return cell, ms.value_and_grad(cell, None, cell.trainable_params(), has_aux=True), cfg

    whole, whole_grad, cfg = cell_of()
    data = AseDbDataset(DEMO_TRAIN, settings=cfg.model.graph_settings())
    graphs = [data[i] for i in range(3)]
    missing = [graphs[0], data[1], graphs[2]]
    missing[1].stress = MISSING_STRESS[None].astype(np.float32)

    def inputs(graphs, weights=(1, 1, 1)):
        batch = pad_batch(batch_graphs(graphs), 96, 1800 if name == "orb_v2" else 3000, 4)
        weight = np.zeros(4, np.float32)
        weight[:len(graphs)] = np.asarray(weights, np.float32) / 3
        return loss_inputs(batch, weight)

    def run(grad_fn, cell, batch):
        stats = cell.current_stats()
        (loss, sums), grads = grad_fn(*batch, *stats, *stats)
        return float(loss.asnumpy()), np.concatenate([g.asnumpy().ravel() for g in grads]), sums.asnumpy()

    loss, grad, sums = run(whole_grad, whole, inputs(missing))
    assert np.isfinite(loss) and np.all(np.isfinite(grad)) and np.all(np.isfinite(sums))
    no_stress, no_stress_grad, _ = cell_of(stress=0.0)
    stress_only, stress_only_grad, _ = cell_of(energy=0.0, forces=0.0, confidence=0.0)
    rest = run(no_stress_grad, no_stress, inputs(graphs))
    stress_part = run(stress_only_grad, stress_only, inputs(graphs, (1, 0, 1)))
    assert loss == pytest.approx(rest[0] + stress_part[0], rel=1e-6, abs=1e-7)
    expected = rest[1] + stress_part[1]
    np.testing.assert_allclose(grad, expected, rtol=1e-4, atol=1e-6 * np.abs(expected).max())

    keys = list(whole.sum_keys)
    full_sums = run(whole_grad, whole, inputs(graphs))[2]
    alone = run(whole_grad, whole, inputs([graphs[1]], (3,)))[2]
    assert sums[keys.index("num_stress")] == 2 and full_sums[keys.index("num_stress")] == 3
    mae = keys.index("stress_mae")
    assert sums[mae] == pytest.approx(full_sums[mae] - alone[mae], rel=1e-5)
    assert whole.metrics(sums)["stress_mae"] == pytest.approx(sums[mae] / 2, rel=1e-6)
    none = whole.metrics(run(whole_grad, whole, inputs([missing[1]], (3,)))[2])  # (a logging interval of such)
    assert "stress_mae" not in none and "forces_mae" in none
    for key in ("energy_mae", "forces_mae", "num_graphs", "num_atoms"):
        assert sums[keys.index(key)] == full_sums[keys.index(key)], key

    new_missing = [s.asnumpy() for s in whole.new_stats(*inputs(missing))[0]]
    new_full = [s.asnumpy() for s in whole.new_stats(*inputs(graphs))[0]]
    new_two = [s.asnumpy() for s in whole.new_stats(*inputs([graphs[0], graphs[2]], (1, 1)))[0]]
    stress_from = 4  # (mean, variance) of energy, then forces; then stress (orb-v3 direct: diagonal, off-diagonal)
    for k in range(len(new_full)):
        if k < stress_from:
            np.testing.assert_array_equal(new_missing[k], new_full[k], err_msg=str(k))
        else:
            np.testing.assert_allclose(new_missing[k], new_two[k], rtol=1e-6, err_msg=str(k))
            assert not np.allclose(new_missing[k], new_full[k], rtol=1e-6), k


def test_an_older_checkpoints_sums_take_num_stress_from_num_graphs():
    """A checkpoint saved before num_stress was summed (every structure had stress, or none was scored) resumes with
    its open interval's, epoch's and validation's sums in the new layout: num_graphs copied in, the per-element sums
    after it."""
    from orb.models import create
    from orb.training.checkpointing import Progress
    from orb.training.config import config_from_dict
    from orb.training.engine import make_loss

    for name in ("orb_v2", "orb_v3_direct_20_omat"):
        cfg = config_from_dict(dict(model=dict(SMALL_MODEL, name=name), device_target="CPU"))
        cell = make_loss(create(name, seed=1, **SMALL_MODEL), cfg, has_stress=True)
        keys = list(cell.sum_keys)
        new = np.arange(cell.num_sums, dtype=np.float64) + 1.0
        new[keys.index("num_stress")] = new[keys.index("num_graphs")]
        old = np.delete(new, keys.index("num_stress"))
        progress = Progress.from_meta(dict(step_in_epoch=3, epoch_sums=old.tolist(), interval_sums=[old, 2 * old],
                                           validation={"name": "val", "sums": [old.tolist()]}))
        progress.convert_sums(cell.sums_from)
        np.testing.assert_array_equal(progress.epoch_sums, new)
        np.testing.assert_array_equal(progress.interval_sums, [new, 2 * new])
        np.testing.assert_array_equal(progress.validation["sums"], [new])
        assert cell.metrics(progress.epoch_sums) == cell.metrics(new)
        np.testing.assert_array_equal(cell.sums_from(new), new)  # a checkpoint of this version: as it is


def test_only_the_marker_reads_as_a_missing_stress():
    """A label just below the refusal limit, rotated by augmentation (up to 3 times larger) or rounded to float32, is
    a label; the marker of a structure without one is not, in every component."""
    import mindspore as ms

    from orb.data.graphs import MISSING_STRESS, STRESS_LIMIT
    from orb.training.loss_base import NormalisedLoss

    rotated = np.full(6, 3 * STRESS_LIMIT, np.float32)
    rows = ms.Tensor(np.stack([rotated, MISSING_STRESS.astype(np.float32)]))
    stress, labelled = NormalisedLoss.stress_where_labelled(rows)
    np.testing.assert_array_equal(labelled.asnumpy(), [1, 0])
    np.testing.assert_array_equal(stress.asnumpy(), [rotated, np.zeros(6)])


def finetune(tmp_path, out, train, val, *extra):
    args = [sys.executable, os.path.join(ROOT, "finetune.py"), "--config", "finetune_orb_v3", "--train_data_path",
            str(train), "--val_data_path", str(val), "--val_fraction", "0", "--output_dir", str(tmp_path / out),
            "--checkpoint_path", "", "--batch_size", "3", "--max_epochs", "1", "--num_buckets", "1",
            "--device_target", "CPU", "--progress_bar", "false", "--data_workers", "0", "--model.name", "orb_v2",
            *extra]
    args += sum((["--model." + k, str(v)] for k, v in SMALL_MODEL.items()), [])
    done = subprocess.run(args, cwd=str(tmp_path), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    epoch = [r for r in map(json.loads, open(tmp_path / out / "metrics.jsonl")) if r["type"] == "epoch"][-1]
    return done.stdout, epoch


def test_fine_tuning_with_molecules_beside_crystals_trains_stress_where_there_is_one(tmp_path):
    """orb-finetune on an extxyz whose molecules have no stress, validated on molecules alone (refused before: "has no
    stress while the training data has"): the run trains, says how many training structures have a stress label and
    reports the stress MAE of those, none for the molecules. Molecules as the target beside crystals replayed with
    their own labels train the stress head on the crystals (it was left untrained: the target had no stress)."""
    import ase.io
    from ase.build import molecule
    from ase.calculators.singlepoint import SinglePointCalculator

    crystals = ase.io.read(DEMO_TRAIN, index=":6")
    molecules = []
    for k, name in enumerate(("H2O", "CH4", "NH3", "CO2")):
        gas = molecule(name)
        gas.center(vacuum=4.0)
        gas.calc = SinglePointCalculator(gas, energy=-10.0 - k, forces=np.full((len(gas), 3), 0.01 * k))
        molecules.append(gas)
    mixed = list(crystals)
    mixed[1], mixed[4] = molecules[0], molecules[1]
    ase.io.write(tmp_path / "mixed.extxyz", mixed, format="extxyz")
    ase.io.write(tmp_path / "molecules.extxyz", molecules, format="extxyz")
    ase.io.write(tmp_path / "crystals.extxyz", crystals, format="extxyz")

    log, epoch = finetune(tmp_path, "mixed", tmp_path / "mixed.extxyz", tmp_path / "molecules.extxyz")
    assert re.search(r"\(6 structures, \d+ atoms\), 4 of them with a stress label \(the others' stress weighed at 0\)",
                     log), log
    assert re.search(r"validation data: \S+molecules.extxyz \(4 structures\), no stress", log), log
    assert np.isfinite(epoch["train"]["stress_mae"]) and epoch["train"]["loss_stress"] > 0
    assert "stress_mae" not in epoch["val"] and epoch["val"]["loss_stress"] == 0 and np.isfinite(epoch["val"]["loss"])

    log, epoch = finetune(tmp_path, "replayed", tmp_path / "molecules.extxyz", tmp_path / "molecules.extxyz",
                          "--replay.data_path", str(tmp_path / "crystals.extxyz"), "--replay.fraction", "0.34",
                          "--replay.val_data_path", str(tmp_path / "crystals.extxyz"))
    assert "training without the stress loss" not in log and "no stress" in log
    assert epoch["train"]["loss_stress"] > 0 and np.isfinite(epoch["replay_val"]["stress_mae"])
