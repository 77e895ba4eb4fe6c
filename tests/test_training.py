"""Single-device fine-tuning: it learns, resumes exactly (or refuses and says why), is reproducible,
respects loss weights and frozen backbones, compiles once per bucket, protects earlier runs and
writes checkpoints that survive a crash."""

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
from orb.errors import ConfigError, DatasetError

BUCKET = [[136, 2720]]  # one static shape fits any 8 demo structures: one compilation per step kind
TIMING = ("train_time", "val_time", "compile_time", "data_wait")


def make_cfg(tmp_path, **overrides):
    from orb.training.config import config_from_dict

    values = dict(train_data_path=DEMO_TRAIN, val_data_path=DEMO_VAL, output_dir=str(tmp_path / "run"),
                  device_target="CPU", batch_size=8, max_epochs=2, lr=1e-3, lr_schedule="one_cycle", buckets=BUCKET,
                  progress_bar="false", log_every_n_steps=4, data_workers=0, model=dict(SMALL_MODEL))
    values.update(overrides)
    return config_from_dict(values)


def trainer_for(cfg, resume=None, accept=False, overwrite=False, callbacks=()):
    from orb.device import configure_mindspore
    from orb.training.outputs import prepare_output_dir
    from orb.training.setup import build_trainer

    configure_mindspore(cfg.device_target, cfg.device_id, cfg.num_threads)
    prepare_output_dir(cfg.output_dir, resume=bool(resume), overwrite=overwrite)
    return build_trainer(cfg, resume=resume, accept_config_changes=accept, callbacks=callbacks)


def params_of(model):
    return {name: p.asnumpy().copy() for name, p in model.parameters_and_names()}


def epochs_of(path):
    return [r for r in map(json.loads, open(path)) if r["type"] in ("initial", "epoch")]


def without_timing(record):
    return {part: {k: v for k, v in record.get(part, {}).items() if k not in TIMING} for part in ("train", "val")}


def test_loss_falls_on_a_fixed_batch():
    import mindspore as ms

    from orb.data.dataset import AseDbDataset
    from orb.data.batching import batch_graphs, pad_batch
    from orb.data.tensors import loss_inputs
    from orb.models.orb_v2 import orb_v2
    from orb.training.loss_v2 import OrbLoss
    from orb.training.optimizer import FlatAdam
    from orb.training.schedule import constant
    from orb.training.steps import TrainStep

    ms.set_context(mode=ms.GRAPH_MODE)
    ds = AseDbDataset(DEMO_TRAIN)
    batch = pad_batch(batch_graphs([ds[i] for i in range(4)]), 80, 1600, 5)
    model = orb_v2(**SMALL_MODEL)
    step = TrainStep(OrbLoss(model), FlatAdam(model.trainable_params(), constant(3e-3, 80), clip_mode="norm",
                                              clip_value=10.0))
    inputs = loss_inputs(batch)
    losses = [float(step(*inputs).asnumpy()) for _ in range(80)]
    assert np.isfinite(losses).all()
    assert losses[-1] < losses[0] / 5, (losses[0], losses[-1])


def test_train_step_updates_the_normalisers():
    """MindSpore warns at compilation that "side effect nodes were eliminated" in update_stats: the
    statistics are nevertheless updated, as BatchNorm(momentum=None) would, at every step."""
    import mindspore as ms

    from orb.data.dataset import AseDbDataset
    from orb.data.batching import batch_graphs, pad_batch
    from orb.data.tensors import loss_inputs
    from orb.models.orb_v2 import orb_v2
    from orb.training.loss_v2 import OrbLoss
    from orb.training.optimizer import FlatAdam
    from orb.training.schedule import constant
    from orb.training.steps import TrainStep

    ms.set_context(mode=ms.GRAPH_MODE)
    ds = AseDbDataset(DEMO_TRAIN)
    model = orb_v2(**SMALL_MODEL)
    step = TrainStep(OrbLoss(model), FlatAdam(model.trainable_params(), constant(1e-3, 4)))
    reference = model.graph_head.reference.linear.weight.asnumpy().copy()
    stats = {"energy": (0.17320099, 1.36038684 ** 2, 1000), "forces": (0.0, 1.0, 0), "stress": (0.0, 1.0, 0)}
    for first in (0, 4):
        graphs = [ds[i] for i in range(first, first + 4)]
        batch = batch_graphs(graphs)
        ref = np.array([reference[g.numbers].sum() for g in graphs], np.float64)
        values = {"energy": (batch.energy - ref) / batch.n_node, "forces": batch.forces.ravel(),
                  "stress": batch.stress.ravel()}
        for name, (mean, var, count) in stats.items():  # cumulative mean and unbiased variance, count + 1
            f = 1.0 / (count + 1)
            x = values[name].astype(np.float64)
            stats[name] = ((1 - f) * mean + f * x.mean(), (1 - f) * var + f * x.var(ddof=1), count + 1)
        step(*loss_inputs(pad_batch(batch, 80, 1600, 5)))
        reference = model.graph_head.reference.linear.weight.asnumpy().copy()  # trained: next batch's targets use it
    for name, head in (("energy", "graph_head"), ("forces", "node_head"), ("stress", "stress_head")):
        bn = getattr(model, head).normalizer.bn
        mean, var, count = stats[name]
        assert bn.running_mean.asnumpy()[0] == pytest.approx(mean, rel=1e-5, abs=1e-6), name
        assert bn.running_var.asnumpy()[0] == pytest.approx(var, rel=1e-5), name
        assert int(np.asarray(bn.num_batches_tracked.asnumpy()).reshape(-1)[0]) == count, name


def test_resume_equals_straight_run_and_refuses_changes(tmp_path, caplog):
    from orb.errors import ConfigError

    straight = trainer_for(make_cfg(tmp_path / "a"))
    straight.fit()
    first = trainer_for(make_cfg(tmp_path / "b"))
    first.fit(until_epoch=1)
    run_dir = str(tmp_path / "b" / "run")
    with pytest.raises(ConfigError, match=r"max_epochs: 2 -> 3; lr: 0.001 -> 0.002.*--accept_config_changes"):
        trainer_for(make_cfg(tmp_path / "b", max_epochs=3, lr=2e-3), resume=run_dir)
    resumed = trainer_for(make_cfg(tmp_path / "b"), resume=run_dir)
    assert resumed.progress.epochs_done == 1 and resumed.progress.global_step == straight.data.steps_per_epoch
    resumed.fit()
    a, b = params_of(straight.model), params_of(resumed.model)
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)  # bit for bit: same steps, same kernels
    ep_a, ep_b = epochs_of(tmp_path / "a" / "run" / "metrics.jsonl"), epochs_of(f"{run_dir}/metrics.jsonl")
    assert [r["epoch"] for r in ep_b] == [0, 1, 2]
    assert without_timing(ep_a[-1]) == without_timing(ep_b[-1])
    assert "other arithmetic" not in caplog.text
    caplog.set_level("INFO", logger="orb")
    more = trainer_for(make_cfg(tmp_path / "b", max_epochs=3, precision="float32-highest"), resume=run_dir, accept=True)
    assert more.progress.epochs_done == 2 and len(more.engine.schedule.lr) == 3 * more.data.steps_per_epoch
    assert ("resuming with other arithmetic than the checkpoint's run (precision: 'float32-high' -> "
            "'float32-highest')") in caplog.text  # allowed, but no longer bit for bit: said once


def test_same_seed_same_metrics(tmp_path):
    """Two runs of one config give identical metrics.jsonl (training and validation numbers)."""
    cfg = dict(max_epochs=1, augmentation=True, buckets=[], num_buckets=2, data_workers=1)
    for name in ("one", "two"):
        trainer_for(make_cfg(tmp_path / name, **cfg)).fit()
    one, two = (epochs_of(tmp_path / n / "run" / "metrics.jsonl") for n in ("one", "two"))
    assert len(one) == 2 and [without_timing(r) for r in one] == [without_timing(r) for r in two]


def test_freeze_backbone_and_zero_weights(tmp_path, caplog):
    caplog.set_level("INFO", logger="orb")
    trainer = trainer_for(make_cfg(tmp_path, freeze_backbone=True, max_epochs=1,
                                   loss_weights=dict(energy=1.0, forces=1.0, stress=0.0)))
    assert "x 1 worker; 8 steps per epoch, 1 epoch" in caplog.text  # (it said "1 epochs")
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
    m = history[0]["train"]
    assert m["loss"] == pytest.approx(m["loss_energy"] + m["loss_forces"], rel=1e-4)  # energy + forces terms only


def test_stressless_database_trains(tmp_path):
    path = str(tmp_path / "nostress.db")
    with ase.db.connect(DEMO_TRAIN) as src, ase.db.connect(path) as dst:
        for row in list(src.select())[:16]:
            atoms = row.toatoms()
            atoms.calc = SinglePointCalculator(atoms, energy=row.energy, forces=row.forces)
            dst.write(atoms)
    trainer = trainer_for(make_cfg(tmp_path, train_data_path=path, val_data_path="", max_epochs=2))
    assert not trainer.data.has_stress
    before = params_of(trainer.model)["stress_head.mlp.NN-1.weight"]
    history = trainer.fit()["history"]
    assert "stress_mae" not in history[-1]["train"] and np.isfinite(history[-1]["train"]["loss"])
    np.testing.assert_array_equal(before, params_of(trainer.model)["stress_head.mlp.NN-1.weight"])
    only_stress = dict(energy=0.0, forces=0.0, stress=1.0)  # nothing to train there: refused (it trained a loss of 0)
    with pytest.raises(ConfigError, match="config key 'loss_weights.stress' is the only loss weight above 0, but "
                                          f"{path} has no stress labels: nothing to train"):
        trainer_for(make_cfg(tmp_path, train_data_path=path, val_data_path="", loss_weights=only_stress,
                             output_dir=str(tmp_path / "only_stress")))
    with ase.db.connect(path) as db:  # every structure weighed at 0: the same
        for row_id in range(1, 17):
            db.update(row_id, weight=0.0)
    with pytest.raises(DatasetError, match=f"{path}, key 'weight': every structure trained on has weight 0: nothing"):
        trainer_for(make_cfg(tmp_path, train_data_path=path, val_data_path="", output_dir=str(tmp_path / "zero")))
    with pytest.raises(DatasetError, match=f"{path}, key 'weight': every structure trained on has weight 0: nothing"):
        trainer_for(make_cfg(tmp_path, train_data_path=path, val_data_path="", output_dir=str(tmp_path / "zero_fit"),
                             reference_energies=dict(fit="least_squares")))  # (the fit's traceback came first)


def test_one_compilation_per_bucket(tmp_path):
    """MindSpore's own record of compiled graphs (``Cell.compile_cache``, one phase per real compilation):
    exactly one per (step kind, bucket) that the batches use."""
    trainer = trainer_for(make_cfg(tmp_path, buckets=[], num_buckets=2, max_epochs=3))
    trainer.fit()
    used_train = {s.bucket for e in range(3) for s in trainer.data.train_steps(e)}
    used_val = {s.bucket for s in trainer.data.eval_steps("val")}
    assert len(used_train) == 2  # both buckets are used, so a recompilation would show
    assert len(trainer.engine.train_step.compile_cache) == len(used_train)
    assert len(trainer.engine.eval_step.compile_cache) == len(used_val)


def run_cli(*args, timeout=600, cwd=ROOT):
    return subprocess.run([sys.executable, os.path.join(ROOT, "finetune.py"), *args], cwd=cwd, timeout=timeout,
                          capture_output=True, text=True)


def small_model_args():
    return sum((["--model." + k, str(v)] for k, v in SMALL_MODEL.items()), [])


def test_cli_end_to_end_output_dir_and_config_typo(tmp_path):
    out = tmp_path / "cli"
    args = ("--config", "configs/demo.yaml", "--max_epochs", "1", "--output_dir", str(out), "--checkpoint_path", "",
            "--device_target", "CPU", "--buckets", "[[136, 2720]]", *small_model_args())
    result = run_cli(*args)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "[ERROR]" not in result.stderr, result.stderr[-2000:]  # (MindSpore's synchronize on the CPU said one)
    assert (out / "checkpoints" / "last.ckpt").exists() and (out / "checkpoints" / "best_weights.ckpt").exists()
    records = [json.loads(l) for l in open(out / "metrics.jsonl")]
    assert records[0]["type"] == "initial" and "forces_mae" in records[0]["val"]  # the starting point
    assert records[-1]["type"] == "epoch" and "forces_mae" in records[-1]["val"]
    assert "Epoch: 1/1, train_metrics:" in (out / "train.log").read_text()
    # evaluate.py on the validation db reproduces the epoch's validation metrics of the same (EMA) weights
    evaluation = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "evaluate.py"), "--checkpoint",
                                 str(out / "checkpoints" / "best_weights.ckpt"), "--data", DEMO_VAL, "--output_dir",
                                 str(tmp_path / "eval"), "--device_target", "CPU"], capture_output=True, text=True,
                                timeout=600)
    assert evaluation.returncode == 0, evaluation.stderr[-2000:]
    summary = json.load(open(tmp_path / "eval" / "summary.json"))
    val = records[-1]["val"]
    for key in ("energy_mae", "energy_per_atom_mae", "forces_mae", "forces_cosine", "forces_within_0.03",
                "stress_mae", "energy_per_atom_reference_mae"):
        if key in summary:
            # float32 sums in the graph vs float64 on the host, and other padded shapes: rounding only
            # (the cosine of this barely trained model's tiny forces is the most sensitive)
            tol = 2e-5 if key == "forces_cosine" else 1e-7
            assert summary[key] == pytest.approx(val[key], rel=2e-5, abs=tol), key
    assert {"energy_mae", "forces_mae", "stress_mae"} <= set(summary)
    checkpoints_read_as_what_was_validated(out / "checkpoints", tmp_path)
    again = run_cli(*args, timeout=120)  # a fresh run into the same output_dir is refused ...
    assert again.returncode == 2 and "already holds a run" in again.stderr and "--resume" in again.stderr
    assert len(again.stderr.strip().splitlines()) == 1 and "Traceback" not in again.stderr
    assert len(open(out / "metrics.jsonl").readlines()) == len(records)  # ... and loses nothing
    stale = out / "checkpoints" / ".last.ckpt.tmp-999999999.ckpt"
    stale.write_bytes(b"half a checkpoint")
    redo = run_cli(*args, "--overwrite")  # ... unless asked to start over
    assert redo.returncode == 0, redo.stderr[-2000:]
    assert len([json.loads(l) for l in open(out / "metrics.jsonl")]) == len(records) and not stale.exists()
    bad = run_cli("--config", "configs/demo.yaml", "--max_epoch", "1", timeout=120)
    assert bad.returncode != 0 and "max_epoch" in bad.stderr and "did you mean 'max_epochs'" in bad.stderr
    bad_row = run_cli(*args, "--output_dir", str(tmp_path / "bad"), "--train_data_path",
                      os.path.join(ROOT, "README.md"), timeout=120)
    assert bad_row.returncode == 2 and "holds no structures: not an ASE database" in bad_row.stderr
    assert not (tmp_path / "bad").exists()  # a run that never trained leaves nothing, so the fixed command runs


def checkpoints_read_as_what_was_validated(checkpoints, tmp_path):
    """The training state of the best epoch (best.ckpt) is read, by orb-evaluate and the other tools, as the EMA
    weights its validation used (best_weights.ckpt's, value for value), not as its raw weights; and a config naming
    no model that starts from this program's checkpoint takes the checkpoint's architecture (it was compared with
    full-size orb-v2 and refused)."""
    from orb.io.checkpoint import load_checkpoint, read_weights
    from orb.models.config import ModelConfig
    from orb.training.config import load_config

    state, validated = (read_weights(str(checkpoints / name))[0] for name in ("best.ckpt", "best_weights.ckpt"))
    assert state.keys() == validated.keys() and all(np.array_equal(state[k], validated[k]) for k in state)
    raw = load_checkpoint(str(checkpoints / "best.ckpt"))[0]
    assert any(not np.array_equal(raw[k], validated[k]) for k in validated)  # (the EMA is not the raw weights)
    config = tmp_path / "no_model.yaml"
    config.write_text(f"train_data_path: {DEMO_TRAIN}\ncheckpoint_path: {checkpoints / 'best_weights.ckpt'}\n")
    assert load_config(str(config)).model == ModelConfig.from_dict(dict(SMALL_MODEL))
    wider = load_config(str(config), ["--model.max_neighbors", "30"]).model  # a key the config sets: on top
    assert wider == ModelConfig.from_dict(dict(SMALL_MODEL, max_neighbors=30))


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
    from orb.files import remove_stale_temporaries

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
    remove_stale_temporaries(str(tmp_path))  # their writers are dead: cleaned up at the next start
    assert os.listdir(tmp_path) == ["last.ckpt"]


class _StopInStartingValidation:
    """SIGTERM at the starting model's third validation batch (in this process: the phase notes it)."""

    def on_validation_batch(self, trainer, name, index):
        if trainer.progress.global_step == 0 and index == 2:
            os.kill(os.getpid(), signal.SIGTERM)


class _SeenBatches:
    def __init__(self):
        self.seen = []

    def on_validation_batch(self, trainer, name, index):
        self.seen.append((trainer.progress.global_step, name, index))


def test_a_stopped_validation_is_continued_only_over_the_same_data(tmp_path, caplog):
    """A validation stopped at its third batch is continued by a resume over the same rows and batches; a resume
    whose validation data changed (a copy with one structure moved: as many batches) validates from the first
    batch again, said in one line (it added the new data's batches to the old data's sums)."""
    import ase.db
    from ase.calculators.singlepoint import SinglePointCalculator

    from orb.io.checkpoint import load_checkpoint
    from orb.signals import Stopped

    cfg = make_cfg(tmp_path, max_epochs=1, batch_size=2)  # 8 validation batches
    with pytest.raises(Stopped):
        trainer_for(cfg, callbacks=[_StopInStartingValidation()]).fit()
    last = os.path.join(cfg.output_dir, "checkpoints", "last.ckpt")
    batches = load_checkpoint(last)[2]["validation"]["of"]
    moved = str(tmp_path / "moved_val.db")
    with ase.db.connect(DEMO_VAL) as source, ase.db.connect(moved) as target:
        for k, row in enumerate(source.select()):
            atoms = row.toatoms()
            labels = dict(atoms.calc.results)
            if k == 0:
                atoms.positions[0] += 1e-3
            atoms.calc = SinglePointCalculator(atoms, **labels)
            target.write(atoms)
    caplog.set_level("INFO", logger="orb")
    metrics = os.path.join(cfg.output_dir, "metrics.jsonl")
    for val, expected in ((moved, list(range(batches))), (DEMO_VAL, list(range(3, batches))),
                          (DEMO_VAL, list(range(3, batches)))):
        seen = _SeenBatches()
        trainer = trainer_for(make_cfg(tmp_path, max_epochs=1, batch_size=2, val_data_path=val), resume=last,
                              callbacks=[seen])
        trainer.fit(until_epoch=0)  # the starting model's validation alone
        assert [index for step, name, index in seen.seen if name == "val"] == expected, val
    # resumed again from the same save at step 0 (as after a kill before the next save): one initial record (two)
    assert [json.loads(line)["type"] for line in open(metrics)].count("initial") == 1
    assert "the stopped validation of val is done again" in caplog.text
    assert f"continuing the stopped validation of val after batch 3 of {batches}" in caplog.text


def test_an_epoch_line_lost_after_its_save_is_written_again_on_resume(tmp_path):
    """A kill (or a full disk) between an epoch's checkpoint and its metrics.jsonl line lost the line for good: the
    resume started after that epoch. The checkpoint keeps the line; the resume writes it again, value for value."""
    cfg = make_cfg(tmp_path, max_epochs=2)
    trainer_for(cfg).fit(until_epoch=1)
    metrics = os.path.join(cfg.output_dir, "metrics.jsonl")
    lines = open(metrics).read().splitlines()
    epoch_line = [line for line in lines if '"type": "epoch"' in line]
    assert len(epoch_line) == 1
    with open(metrics, "w") as f:  # as the kill left it: every line but the epoch's
        f.write("".join(line + "\n" for line in lines if line != epoch_line[0]))
    trainer_for(cfg, resume=os.path.join(cfg.output_dir, "checkpoints", "last.ckpt"))
    assert open(metrics).read().splitlines() == [line for line in lines if line != epoch_line[0]] + epoch_line


def test_the_recorded_learning_rate_is_the_one_applied_after_skipped_steps(tmp_path):
    """fp16-mixed skips a step whose loss-scaled gradient overflows; the schedule advances with the updates applied,
    so after skipped steps each record's lr is the rate of its latest applied update (it gave the global step's)."""
    from orb.training.schedule import make_schedule

    cfg = make_cfg(tmp_path, max_epochs=1, batch_size=2, log_every_n_steps=1, precision="fp16-mixed",
                   lr_schedule="cosine")
    trainer = trainer_for(cfg)
    trainer.fit()
    schedule = make_schedule("cosine", cfg.lr, trainer.data.steps_per_epoch, cfg.warmup_fraction).lr
    steps = [r for r in map(json.loads, open(os.path.join(cfg.output_dir, "metrics.jsonl"))) if r["type"] == "step"]
    skipped = np.cumsum([r.get("nonfinite_steps", 0) for r in steps])
    assert skipped[-1] > 0  # the first steps overflow the starting loss scale
    for record, before in zip(steps, skipped):  # (before any update: the first update's rate)
        assert record["lr"] == schedule[max(int(record["step"] - before), 1) - 1], record


def test_a_valueless_token_close_to_an_option_is_named_as_that_option():
    """`orb-finetune --config my.yaml --over` said "override '--over' has no value"."""
    from orb.errors import ConfigError
    from orb.training.cli import parse_command_line

    with pytest.raises(ConfigError, match=r"^unknown option --over \(did you mean --overwrite\?\)$"):
        parse_command_line(["--config", "demo", "--over"], None)
    with pytest.raises(ConfigError, match=r"^unknown option --acept_config_changes \(did you mean "
                                          r"--accept_config_changes\?\)$"):
        parse_command_line(["--config", "demo", "--acept_config_changes", "--max_epochs", "3"], None)
    for key in ("--lr", "--freeze", "--forces_key", "--replay.fraction"):  # config keys: their own "has no value"
        assert parse_command_line(["--config", "demo", key], None)[1] == [key]
    args, overrides = parse_command_line(["--config", "demo", "--overwrite", "--max_epochs", "3"], None)
    assert args.overwrite and overrides == ["--max_epochs", "3"]  # (a key with its value: an override as before)
    # with a value, a token that is no config key is the option it is close to (it said "no --config", and given
    # --config, "unknown config key 'confg'")
    for argv in (["--confg", "demo"], ["--config", "demo", "--confg", "x.yaml"], ["--config", "demo", "--resum=auto"]):
        with pytest.raises(ConfigError, match=r"^unknown option --(confg|resum=auto) \(did you mean "
                                              r"--(config|resume)\?\)$"):
            parse_command_line(argv, None)
    assert parse_command_line(["--config", "demo", "--max_epoch", "3"], None)[1] == ["--max_epoch", "3"]  # a key's


@pytest.mark.parametrize("fault", ["download", "diverged"])
def test_a_fault_before_any_work_leaves_nothing_and_one_later_keeps_everything(tmp_path, fault):
    """A run whose weights could not be downloaded left train.log and checkpoints/ (refused bad input left nothing);
    discarding on every fault then removed a run that had trained 8 steps and diverged before its first metrics
    record, its log with the error in it."""
    from orb.errors import DivergedError
    from orb.pretrained import DownloadError
    from orb.training.cli import run
    from orb.training.outputs import prepare_output_dir, setup_logging

    out = tmp_path / "run"

    def fine_tune(cfg, args):
        prepare_output_dir(cfg.output_dir, resume=False, overwrite=False)
        setup_logging(cfg.output_dir)
        if fault == "download":
            raise DownloadError("orb_v2: cannot reach the host")
        (out / "metrics.jsonl").write_text('{"type": "initial"}\n')  # (trained; no step record yet)
        raise DivergedError("8 steps in a row were not finite")

    assert run(["--config", "demo", "--output_dir", str(out)], None, fine_tune) == 1
    if fault == "download":
        assert not out.exists()
    else:
        assert "8 steps in a row were not finite" in (out / "train.log").read_text()
        assert (out / "metrics.jsonl").exists()


def test_a_data_path_that_does_not_exist_is_said_before_published_weights_are_fetched(tmp_path):
    """The orb-v3 template as printed, its data file not made yet: it tried to download the published weights first
    (a user with internet waited for them to learn the path was wrong). Every data path the config names is checked
    before anything else; an extxyz's is not called a database."""
    from orb.files import free_port

    env = dict(os.environ, ORB_CACHE_DIR=str(tmp_path / "cache"), ORB_WEIGHTS_URL=f"http://127.0.0.1:{free_port()}")
    made = subprocess.run([sys.executable, os.path.join(ROOT, "finetune.py"), "--print-config", "finetune_orb_v3"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)
    assert made.returncode == 0
    (tmp_path / "my.yaml").write_text(made.stdout)
    for extra, named in (([], "config key 'train_data_path': my_train.extxyz: does not exist"),
                         (["--train_data_path", os.path.join(ROOT, "data", "demo_train.db"), "--val_data_path",
                           "held_out.db"], "config key 'val_data_path': held_out.db: database file does not exist"),
                         (["--train_data_path", os.path.join(ROOT, "data", "demo_train.db"), "--replay.data_path",
                           "foundation/"], "config key 'replay.data_path': foundation/: does not exist")):
        result = subprocess.run([sys.executable, os.path.join(ROOT, "finetune.py"), "--config", "my.yaml", *extra],
                                cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)
        assert result.returncode == 2, result.stderr
        assert result.stderr.strip().splitlines()[-1] == f"error: {named}"
        assert "download" not in result.stderr and not (tmp_path / "cache" / "weights").exists()
        assert not (tmp_path / "outputs").exists()
