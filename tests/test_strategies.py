"""Fine-tuning strategies that keep the foundation without its labels: freezing and learning-rate factors by
parameter group, anchoring to the starting weights (L2-SP) and low-rank adapters merged into exports -- each
checked against its definition, through a resume, and refused in one line when misconfigured."""

import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import DEMO_VAL, ROOT, SMALL_MODEL
from test_training import make_cfg, params_of, trainer_for


def test_freeze_and_lr_multipliers_scale_each_groups_update(tmp_path):
    """One Adam step from the same weights on the same batch: a frozen group stays bit for bit; a group with
    factor 0.5 moves by exactly half of what it moves with factor 1; the other groups move the same."""
    common = dict(max_epochs=1, batch_size=64, buckets=[], val_data_path="", lr_schedule="constant", ema_decay=0.0,
                  augmentation=False, freeze=["layers:0"], reference_energies=dict(trainable="false"))
    start = None
    moved = {}
    for factor in (1.0, 0.5):
        trainer = trainer_for(make_cfg(tmp_path / str(factor), lr_multipliers={"encoder": factor}, **common))
        before = params_of(trainer.model)
        start = start or before
        trainer.fit()
        after = params_of(trainer.model)
        moved[factor] = {k: after[k].astype(np.float64) - before[k] for k in before}
    for name, delta in moved[1.0].items():
        half = moved[0.5][name]
        ulp = 2 * float(np.spacing(np.abs(start[name]).max().astype(np.float32)))  # the weights' float32 rounding
        if name.startswith("model.gnn_stacks.0.") or "reference" in name:
            assert not delta.any() and not half.any(), name
        elif name.startswith("model._encoder."):
            assert np.abs(delta).max() > 0, name
            np.testing.assert_allclose(half, 0.5 * delta, rtol=1e-4, atol=ulp, err_msg=name)
        else:
            np.testing.assert_allclose(half, delta, rtol=1e-5, atol=ulp, err_msg=name)


def test_anchor_adds_the_penalty_gradient_of_its_groups():
    """With plain SGD the update is exactly -lr (g + 2 w (p - p0)) on the anchored elements and -lr g elsewhere; p0 is
    the weights the optimizer started from (a later load of other weights does not move it)."""
    import mindspore as ms
    from mindspore import Parameter, Tensor

    from orb.training.optimizer import FlatAdam
    from orb.training.schedule import constant

    ms.set_context(mode=ms.GRAPH_MODE)
    rng = np.random.default_rng(0)
    start = [rng.normal(size=(3, 4)).astype(np.float32), rng.normal(size=5).astype(np.float32)]
    params = [Parameter(Tensor(v), name=f"p{i}") for i, v in enumerate(start)]
    anchor = np.concatenate([np.full(12, 0.3, np.float32), np.zeros(5, np.float32)])  # only the first is anchored
    optimizer = FlatAdam(params, constant(0.1, 4), clip_mode="none", algorithm="sgd", anchor=anchor)
    moved = [v + rng.normal(size=v.shape).astype(np.float32) for v in start]  # e.g. a resume's weights
    for p, v in zip(params, moved):
        p.set_data(Tensor(v))
    optimizer.sync_from_model()
    grads = [rng.normal(size=v.shape).astype(np.float32) for v in start]
    optimizer(tuple(Tensor(g) for g in grads))
    expected = [moved[0] - 0.1 * (grads[0] + 2 * 0.3 * (moved[0] - start[0])), moved[1] - 0.1 * grads[1]]
    for p, e in zip(params, expected):
        np.testing.assert_allclose(p.asnumpy(), e, rtol=1e-5, atol=1e-6)


def test_lora_trains_only_adapters_exports_merged_weights_and_resumes_exactly(tmp_path):
    """lora: the starting predictions are the foundation's (B = 0); training moves the adapters and nothing else;
    best_weights.ckpt holds the plain model's keys with W + (alpha/r) B A, which a plain model loads and predicts
    with as the adapted one does; last.ckpt keeps the adapters apart, so a resume ends bit for bit where the
    uninterrupted run does; the calculator reads last.ckpt as merged weights too."""
    import ase.db

    from orb.data.batching import batch_graphs
    from orb.data.dataset import AseDbDataset
    from orb.inference.calculator import ORBCalculator
    from orb.inference.predictor import Predictor
    from orb.io.checkpoint import load_checkpoint, model_from_checkpoint, read_weights, to_torch_state_dict
    from orb.models import create

    lora = dict(rank=4, alpha=8.0, groups=["layers", "heads"])
    straight = trainer_for(make_cfg(tmp_path / "a", lora=lora, max_epochs=2))
    plain = create("orb_v2", seed=1234, **SMALL_MODEL)
    batch = batch_graphs([AseDbDataset(DEMO_VAL).get(i) for i in range(4)])
    adapted_predictor = Predictor(straight.model)  # compiled once, run before and after training
    np.testing.assert_allclose(adapted_predictor(batch)["energy"], Predictor(plain)(batch)["energy"],
                               atol=1e-6)  # the adapters start at zero
    before = params_of(straight.model)
    straight.fit()
    after = params_of(straight.model)
    for name in before:  # the normalisers' statistics (not parameters: no gradient) follow the data as always
        changed = not np.array_equal(before[name], after[name])
        assert changed == name.endswith(".lora_b") or (name.endswith(".lora_a") and changed) or \
            ("normalizer" in name and changed), name
    run = tmp_path / "a" / "run" / "checkpoints"
    exported, _, _ = load_checkpoint(str(run / "best_weights.ckpt"))
    assert set(exported) == set(to_torch_state_dict(plain))  # orb-models' keys, no adapters
    last, _, _ = load_checkpoint(str(run / "last.ckpt"))
    assert any(k.endswith(".lora_a") for k in last)
    with straight.engine.evaluation_weights():  # best_weights holds the EMA of the weights
        adapted = adapted_predictor(batch)
    merged = Predictor(model_from_checkpoint(str(run / "best_weights.ckpt")))(batch)
    np.testing.assert_allclose(merged["energy"], adapted["energy"], atol=1e-5, rtol=1e-6)
    np.testing.assert_allclose(merged["forces"], adapted["forces"], atol=1e-5)
    assert not any(k.endswith(".lora_a") for k in read_weights(str(run / "last.ckpt"))[0])
    atoms = ase.db.connect(DEMO_VAL).get(1).toatoms()
    atoms.calc = ORBCalculator.from_checkpoint(str(run / "last.ckpt"))
    assert np.isfinite(atoms.get_potential_energy())
    first = trainer_for(make_cfg(tmp_path / "b", lora=lora, max_epochs=2))
    first.fit(until_epoch=1)
    resumed = trainer_for(make_cfg(tmp_path / "b", lora=lora, max_epochs=2), resume=str(tmp_path / "b" / "run"))
    resumed.fit()
    for (name, a), (_, b) in zip(straight.model.parameters_and_names(), resumed.model.parameters_and_names()):
        np.testing.assert_array_equal(a.asnumpy(), b.asnumpy(), err_msg=name)


@pytest.mark.parametrize("args, message", [
    (["--freeze", "[embedings]"], "config key 'freeze[0]': unknown parameter group 'embedings'; valid: embeddings"),
    (["--lr_multipliers", "{layers:2-9: 0.1}"], "config key 'lr_multipliers.layers:2-9': 'layers:2-9' names layers "
                                                "the model does not have (it has 4 message-passing layers, 0 to 3)"),
    (["--lora.rank", "-2"], "config key 'lora.rank' must be at least 1 (leave it null for no adapters), got -2"),
    (["--lora.rank", "0"], "config key 'lora.rank' must be at least 1 (leave it null for no adapters), got 0"),
    (["--lora.rank", "999"], "config key 'lora.rank' (999) is above the narrowest layer width (128)"),
    (["--anchor.weight", "-0.5"], "config key 'anchor.weight' must be >= 0 (0 = off), got -0.5"),
    (["--freeze", "[backbone, heads, reference_energies]"], "config key 'freeze' (['backbone', 'heads', "
                                                            "'reference_energies']): no parameter of orb_v2 is left "
                                                            "to train"),
    (["--freeze_backbone", "true", "--lr_multipliers", "{heads: 0}", "--reference_energies.trainable", "false"],
     "config keys 'lr_multipliers' (0 for ['heads']) and 'freeze_backbone': no parameter of orb_v2 is left to train"),
    (["--lora.rank", "4", "--lora.groups", "[embeddings]"], "config key 'lora.groups' (['embeddings']): no MLP layer "
                                                             "of orb_v2 is in these groups"),
    (["--lr_multipliers", "{confidence_head: 5}"],  # (orb-v2 has none: the factor acted on nothing, in silence)
     "config key 'lr_multipliers.confidence_head': no parameter of group 'confidence_head' trains in this run "
     "(orb_v2 has none, or they are frozen or kept"),
    (["--anchor.weight", "1", "--anchor.groups", "[heads]", "--freeze", "[heads]"],
     "config key 'anchor.groups[0]': no parameter of group 'heads' trains in this run"),
])
def test_a_misconfigured_strategy_is_one_line_and_writes_nothing(tmp_path, args, message):
    """Refused before any data is read: no output, and nothing in the cache (a strategy that trains nothing was
    found only after the databases were surveyed and the replay labels computed)."""
    out = tmp_path / "run"
    result = subprocess.run([sys.executable, "finetune.py", "--config", "configs/demo.yaml", "--output_dir", str(out),
                             "--device_target", "CPU", "--max_epochs", "1", *args], cwd=ROOT, capture_output=True,
                            text=True, timeout=300, env=dict(os.environ, ORB_CACHE_DIR=str(tmp_path / "cache")))
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert result.stderr.strip().splitlines() == [f"error: {message}"] or \
        result.stderr.strip().startswith(f"error: {message}"), result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not out.exists() or not os.listdir(out)
    assert not [kind for kind in os.listdir(tmp_path / "cache") if not kind.startswith("native")] \
        if (tmp_path / "cache").exists() else True  # no census, counts or labels: no data was read


def test_an_anchored_run_resumes_exactly_and_refuses_other_starting_weights(tmp_path):
    """anchor: the resumed run pulls toward the weights the run started from (not the resumed ones) and ends bit
    for bit where the uninterrupted run does; resuming with another checkpoint_path (other starting weights, hence
    another anchor, other pseudo-labels) is refused naming the key, unless accepted."""
    from orb.errors import ConfigError
    from orb.io.checkpoint import save_checkpoint
    from orb.models import create

    start = tmp_path / "start.ckpt"
    model = create("orb_v2", seed=7, **SMALL_MODEL)
    save_checkpoint(str(start), model, exported=True)
    common = dict(checkpoint_path=str(start), anchor=dict(weight=5.0, groups=["layers", "heads"]), max_epochs=2)
    straight = trainer_for(make_cfg(tmp_path / "a", **common))
    straight.fit()
    first = trainer_for(make_cfg(tmp_path / "b", **common))
    first.fit(until_epoch=1)
    resumed = trainer_for(make_cfg(tmp_path / "b", **common), resume=str(tmp_path / "b" / "run"))
    resumed.fit()
    for (name, a), (_, b) in zip(straight.model.parameters_and_names(), resumed.model.parameters_and_names()):
        np.testing.assert_array_equal(a.asnumpy(), b.asnumpy(), err_msg=name)
    other = tmp_path / "other.ckpt"
    model.graph_head.mlp.layer(0).weight.set_data(model.graph_head.mlp.layer(0).weight * 1.01)
    save_checkpoint(str(other), model, exported=True)
    changed = make_cfg(tmp_path / "b", **dict(common, checkpoint_path=str(other)))
    with pytest.raises(ConfigError, match="checkpoint_path: its weights .* differ from those the run started from"):
        trainer_for(changed, resume=str(tmp_path / "b" / "run"))
