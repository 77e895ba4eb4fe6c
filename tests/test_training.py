"""Single-device fine-tuning: it learns, resumes exactly, respects loss weights and frozen backbones,
compiles a bounded number of times, and writes checkpoints that survive a crash."""

import json
import os
import signal
import subprocess
import sys
import time

import ase.db
import numpy as np
import pytest
from ase.calculators.singlepoint import SinglePointCalculator

from conftest import DEMO_TRAIN, DEMO_VAL, ROOT, SMALL_MODEL

BUCKET = [[136, 2720]]  # one static shape fits any 8 demo structures: one compilation per step kind


def make_cfg(tmp_path, **overrides):
    from orb.training.config import config_from_dict

    values = dict(train_data_path=DEMO_TRAIN, val_data_path=DEMO_VAL, output_dir=str(tmp_path / "run"),
                  device_target="CPU", batch_size=8, max_epochs=2, lr=1e-3, buckets=BUCKET, progress_bar="false",
                  log_every_n_steps=4, model=dict(SMALL_MODEL))
    values.update(overrides)
    return config_from_dict(values)


def trainer_for(cfg, resume=None):
    from orb.training.cli import set_environment
    from orb.training.trainer import Trainer, configure_mindspore

    set_environment(cfg)
    configure_mindspore(cfg)
    return Trainer(cfg, resume=resume)


def params_of(model):
    return {name: p.asnumpy().copy() for name, p in model.parameters_and_names()}


def test_loss_falls_on_a_fixed_batch():
    import mindspore as ms
    from mindspore import Tensor, nn

    from orb.data.dataset import AseDbDataset
    from orb.data.graphs import batch_graphs, pad_batch
    from orb.training.loss import OrbLoss
    from orb.models.orb_v2 import orb_v2
    from orb.data.tensors import loss_inputs
    from orb.training.steps import TrainStep

    ms.set_context(mode=ms.GRAPH_MODE)
    ds = AseDbDataset(DEMO_TRAIN)
    batch = pad_batch(batch_graphs([ds[i] for i in range(4)]), 80, 1600, 5)
    model = orb_v2(**SMALL_MODEL)
    step = TrainStep(OrbLoss(model), nn.Adam(model.trainable_params(), learning_rate=Tensor(np.float32(3e-3))),
                     "norm", 10.0)
    inputs = loss_inputs(batch)
    losses = [float(step(*inputs).asnumpy()) for _ in range(80)]
    assert np.isfinite(losses).all()
    assert losses[-1] < losses[0] / 5, (losses[0], losses[-1])


def test_resume_equals_straight_run(tmp_path):
    straight = trainer_for(make_cfg(tmp_path / "a"))
    straight.fit()
    first = trainer_for(make_cfg(tmp_path / "b"))
    first.fit(until_epoch=1)
    resumed = trainer_for(make_cfg(tmp_path / "b"), resume=str(tmp_path / "b" / "run"))
    assert resumed.start_epoch == 1 and resumed.global_step == straight.steps_per_epoch
    resumed.fit()
    a, b = params_of(straight.model), params_of(resumed.model)
    for name in a:
        np.testing.assert_allclose(a[name], b[name], atol=1e-6, rtol=1e-6, err_msg=name)
    rec_a = [json.loads(l) for l in open(tmp_path / "a" / "run" / "metrics.jsonl")]
    rec_b = [json.loads(l) for l in open(tmp_path / "b" / "run" / "metrics.jsonl")]
    ep_a = [r for r in rec_a if r["type"] == "epoch"]
    ep_b = [r for r in rec_b if r["type"] == "epoch"]
    assert [r["epoch"] for r in ep_b] == [1, 2]
    for key in ("loss", "energy_mae", "node_mae", "stress_mae"):
        assert ep_a[1]["train"][key] == pytest.approx(ep_b[1]["train"][key], rel=1e-5)
        assert ep_a[1]["val"][key] == pytest.approx(ep_b[1]["val"][key], rel=1e-5)


def test_freeze_backbone_and_zero_weights(tmp_path):
    trainer = trainer_for(make_cfg(tmp_path, freeze_backbone=True, max_epochs=1,
                                   loss_weights=dict(energy=1.0, forces=1.0, stress=0.0)))
    before = params_of(trainer.model)
    history = trainer.fit()["history"]
    after = params_of(trainer.model)
    for name in before:
        if name.startswith("model."):
            np.testing.assert_array_equal(before[name], after[name], err_msg=name)
    assert not np.array_equal(before["node_head.mlp.NN-0.weight"], after["node_head.mlp.NN-0.weight"])
    # stress weight 0: its head gets no gradient (its normaliser still tracks the data)
    np.testing.assert_array_equal(before["stress_head.mlp.NN-1.weight"], after["stress_head.mlp.NN-1.weight"])
    assert "stress_mae" not in history[0]["train"]
    # loss = energy + forces terms only
    m = history[0]["train"]
    assert m["loss"] == pytest.approx(m["energy_mae"] + m["node_mae"], rel=1e-4)


def test_stressless_database_trains(tmp_path):
    path = str(tmp_path / "nostress.db")
    with ase.db.connect(DEMO_TRAIN) as src, ase.db.connect(path) as dst:
        for row in list(src.select())[:16]:
            atoms = row.toatoms()
            atoms.calc = SinglePointCalculator(atoms, energy=row.energy, forces=row.forces)
            dst.write(atoms)
    trainer = trainer_for(make_cfg(tmp_path, train_data_path=path, val_data_path="", max_epochs=2))
    assert not trainer.has_stress
    before = params_of(trainer.model)["stress_head.mlp.NN-1.weight"]
    history = trainer.fit()["history"]
    assert "stress_mae" not in history[-1]["train"] and np.isfinite(history[-1]["train"]["loss"])
    np.testing.assert_array_equal(before, params_of(trainer.model)["stress_head.mlp.NN-1.weight"])


def test_compilations_bounded_by_buckets(tmp_path):
    trainer = trainer_for(make_cfg(tmp_path, buckets=[], num_buckets=2, max_epochs=3))
    trainer.fit()
    kinds = [k for k, _ in trainer.compiled]
    assert len(trainer.train_buckets) <= 2
    assert kinds.count("train") <= len(trainer.train_buckets)
    assert kinds.count("eval") <= len(trainer.val_buckets)


def run_cli(*args, timeout=600):
    return subprocess.run([sys.executable, os.path.join(ROOT, "finetune.py"), *args], cwd=ROOT, timeout=timeout,
                          capture_output=True, text=True)


def test_cli_end_to_end_and_config_typo(tmp_path):
    out = tmp_path / "cli"
    result = run_cli("--config", "configs/demo.yaml", "--max_epochs", "1", "--output_dir", str(out), "--checkpoint_path", "",
                     "--device_target", "CPU", "--buckets", "[[136, 2720]]",
                     *sum((["--model." + k, str(v)] for k, v in SMALL_MODEL.items()), []))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert (out / "checkpoints" / "last.ckpt").exists() and (out / "checkpoints" / "best_weights.ckpt").exists()
    records = [json.loads(l) for l in open(out / "metrics.jsonl")]
    assert records[0]["type"] == "initial" and "energy_mae" in records[0]["val"]  # the starting point
    assert records[-1]["type"] == "epoch" and "energy_mae" in records[-1]["val"]
    assert "Epoch: 1/1, train_metrics:" in (out / "train.log").read_text()
    bad = run_cli("--config", "configs/demo.yaml", "--max_epoch", "1", timeout=120)
    assert bad.returncode != 0 and "max_epoch" in bad.stderr and "did you mean 'max_epochs'" in bad.stderr


KILL_SCRIPT = """
import sys
sys.path.insert(0, {root!r})
from orb.io.checkpoint import save_checkpoint
from orb.models.orb_v2 import orb_v2
model = orb_v2(latent_dim=64, mlp_hidden_dim=128, num_message_passing_steps=3)
print("ready", flush=True)
i = 0
while True:
    i += 1
    save_checkpoint({path!r}, model, {{"i": i}})
"""


def test_killed_while_saving_never_leaves_a_broken_checkpoint(tmp_path):
    from orb.io.checkpoint import load_checkpoint, save_checkpoint
    from orb.models.orb_v2 import orb_v2

    path = str(tmp_path / "last.ckpt")
    save_checkpoint(path, orb_v2(**SMALL_MODEL), {"i": 0})
    for delay in (0.3, 0.9, 1.7):
        proc = subprocess.Popen([sys.executable, "-c", KILL_SCRIPT.format(root=ROOT, path=path)],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        weights, _, meta = load_checkpoint(path)  # must always be a complete checkpoint
        assert "model.atom_emb.embeddings.weight" in weights and "i" in meta
    leftovers = [f for f in os.listdir(tmp_path) if f != "last.ckpt"]
    assert all(f.startswith(".last.ckpt.tmp-") for f in leftovers)  # temp files never replace the checkpoint
