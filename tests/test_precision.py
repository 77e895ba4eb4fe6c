"""Precision modes (orb.precision): float64 equals PyTorch orb-models' float64; the mixed modes stay within their
measured bounds of float64 in predictions and of float32 in the training gradient, for orb-v2 and orb-v3 direct and
conservative (the parity references' weights and structures); fp16's loss scaling; the settings and their refusals."""

import json
import os
import subprocess

import ase.db
import numpy as np
import pytest

from conftest import DEMO_VAL, ROOT, release_memory

V3_NPZ = os.path.join(ROOT, "tests", "data", "orb_v3_parity.npz")
FAMILIES = ("orb_v2", "orb_v3_direct_20_omat", "orb_v3_conservative_20_omat")
NAMES = ("s0", "s1", "s4")  # an alloy (32 atoms), a cluster (13, not periodic), a periodic ionic cell (10)
# Largest errors against float64 over NAMES (eV/atom, eV/Å, eV/Å³), about twice those measured here
# (docs/benchmarks.md, `benchmark.py precision`): a regression that loses a digit fails.
BOUNDS = {
    ("bf16-mixed", "orb_v2"): (2.5e-2, 2.5e-2, 1.5e-2),
    ("bf16-mixed", "orb_v3_direct_20_omat"): (1e-2, 3e-2, 3e-2),
    ("bf16-mixed", "orb_v3_conservative_20_omat"): (2.5e-2, 1.5e-2, 1e-3),
    ("fp16-mixed", "orb_v2"): (4e-3, 5e-3, 3e-3),
    ("fp16-mixed", "orb_v3_direct_20_omat"): (1e-3, 4e-3, 4e-3),
    ("fp16-mixed", "orb_v3_conservative_20_omat"): (2.5e-3, 1.5e-3, 1e-4),
}


def structures():
    """NAMES with positions wrapped in float64 (both sides then build the same graphs)."""
    from orb.data.graphs import wrap_positions64

    z = np.load(V3_NPZ)
    out = {"names": np.array(NAMES)}
    for name in NAMES:
        cell = z[f"{name}/cell"].astype(np.float64)
        positions = z[f"{name}/positions_input"].astype(np.float64)
        out[f"{name}/numbers"], out[f"{name}/cell"] = z[f"{name}/numbers"], cell
        out[f"{name}/positions"] = wrap_positions64(positions, cell) if cell.any() else positions
        for key in ("energy", "forces", "stress"):
            out[f"{name}/label_{key}"] = z[f"{name}/label_{key}"]
    return out


def recipe_model(name, **sizes):
    """The model ``name`` (``sizes``: architecture overrides) with the references' weights, built in the precision in
    force."""
    from orb.io.checkpoint import load_torch_state_dict
    from orb.models import create
    from orb.models.recipe import model_recipe_weights

    model = create(name, **sizes)
    load_torch_state_dict(model, model_recipe_weights(model, int(np.load(V3_NPZ)["meta/seed"])))
    model.set_train(False)
    return model


def predictions(model, data):
    from ase import Atoms

    from orb.inference.calculator import ORBCalculator

    calculator, out = ORBCalculator(model), {}
    for name in data["names"]:
        cell = data[f"{name}/cell"]
        atoms = Atoms(numbers=data[f"{name}/numbers"], positions=data[f"{name}/positions"], cell=cell,
                      pbc=bool(cell.any()))
        atoms.calc = calculator
        out[name] = (atoms.get_potential_energy() / len(atoms), atoms.get_forces(),
                     atoms.get_stress() if cell.any() else np.zeros(6))
    return out


def largest_errors(pred, reference):
    return tuple(max(float(np.abs(np.asarray(pred[n][k]) - np.asarray(reference[n][k])).max()) for n in pred)
                 for k in range(3))


@pytest.fixture(scope="module")
def float64_predictions():
    """Our float64 predictions of each family, computed once."""
    from orb import precision
    from orb.device import configure_mindspore

    configure_mindspore("CPU")
    data, out = structures(), {}
    for name in FAMILIES:
        precision.set_precision("float64")
        out[name] = predictions(recipe_model(name), data)
    precision.set_precision(precision.DEFAULT)
    release_memory()  # the full-size float64 models' memory, before each test's PyTorch peer adds its own
    return out


@pytest.mark.parametrize("name", FAMILIES)
def test_float64_equals_pytorch_orb_models_in_float64(tmp_path, name, float64_predictions):
    """orb-models in float64 (0.5.5's precision="float64"; 0.4.2 as model.double() on float64 graphs) and ours agree
    to float64 rounding: 1e-8 eV/atom, 1e-7 eV/Å (float32 agrees to ~1e-5)."""
    variable = "ORB_TORCH_PYTHON" if name == "orb_v2" else "ORB_TORCH_V3_PYTHON"
    peer = os.environ.get(variable, "")
    if not peer:
        pytest.skip(f"{variable} (a python with torch and orb-models) is not set; .ci/run sets it")
    from orb.io.checkpoint import to_torch_state_dict
    from orb.io.torch_format import write_torch_checkpoint

    data = structures()
    path = str(tmp_path / "weights.ckpt")
    write_torch_checkpoint(to_torch_state_dict(recipe_model(name)), path)
    np.savez(tmp_path / "structures.npz", **data)
    result = subprocess.run([peer, os.path.join(ROOT, "tests", "torch_peer.py"), name, path,
                             str(tmp_path / "structures.npz"), str(tmp_path / "torch.npz"), "float64"],
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    theirs = np.load(tmp_path / "torch.npz")
    ours = float64_predictions[name]
    for n in NAMES:
        energy, forces, stress = ours[n]
        assert np.abs(theirs[f"{n}/forces"]).max() > 1e-2  # a comparison of zeros would prove nothing
        assert abs(energy - theirs[f"{n}/energy"][0] / len(forces)) < 1e-8, n
        np.testing.assert_allclose(forces, theirs[f"{n}/forces"], rtol=0, atol=1e-7, err_msg=n)
        if data[f"{n}/cell"].any() and f"{n}/stress" in theirs:
            np.testing.assert_allclose(stress, theirs[f"{n}/stress"], rtol=0, atol=1e-8, err_msg=n)


@pytest.mark.parametrize("mode", ["bf16-mixed", "fp16-mixed"])
@pytest.mark.parametrize("name", FAMILIES)
def test_mixed_predictions_stay_within_their_bounds_of_float64(name, mode, float64_predictions):
    """bf16 (emulated exactly on the CPU) and fp16 predictions against float64: within the measured bounds, and
    not float32's (a mode that silently computed in float32 would be ~1e-5 away)."""
    from orb import precision

    precision.set_precision(mode)
    errors = largest_errors(predictions(recipe_model(name), structures()), float64_predictions[name])
    bounds = BOUNDS[(mode, name)]
    assert all(e <= b for e, b in zip(errors, bounds)), (errors, bounds)
    assert errors[1] > 1e-5, errors  # rounded: not float32


# The gradient tests' model: the reference model's architecture and weights' recipe through 2 of its 5 message-passing
# layers, 64 wide (256, and 512-1,024 in its MLPs, at full size): every operation of the full model in the precision
# under test, so a mode that computed one in the wrong type shows as it would at full size, compiled as long (the
# graph is the same) but small. Each test still runs in a process of its own (isolated: a worker that computed
# gradients keeps 0.3 GB more for the rest of the run), which peaks at 0.6-0.8 GB (2026-11-30): they run beside the
# other worker's tests, where full-width ones (2.2 GB each) needed the whole machine.
GRADIENT_SIZES = dict(num_message_passing_steps=2, latent_dim=64, mlp_hidden_dim=128, head_mlp_hidden_dim=64)


def training_gradient(name: str, mode: str) -> np.ndarray:
    """The training loss's gradient of the reference model ``name`` computed in ``mode``, on the references' labels
    of two structures, as one flat float32 vector (the confidence head left out: see the test below)."""
    import mindspore as ms

    from orb import precision
    from orb.data.batching import batch_graphs
    from orb.data.graphs import graph_from_arrays
    from orb.data.tensors import loss_inputs
    from orb.device import configure_mindspore
    from orb.training.config import config_from_dict
    from orb.training.engine import make_loss

    configure_mindspore("CPU")  # graph mode, as training compiles it (whatever mode the test before left)
    data = structures()
    precision.set_precision(mode)
    model = recipe_model(name, **GRADIENT_SIZES)
    model.set_train(True)
    graphs = []
    for n in ("s1", "s4"):
        graph = graph_from_arrays(data[f"{n}/positions"], data[f"{n}/numbers"], data[f"{n}/cell"],
                                  settings=model.cfg.graph_settings(), pbc=np.full(3, data[f"{n}/cell"].any()))
        graph.energy = data[f"{n}/label_energy"].astype(np.float32).reshape(1)
        graph.forces = data[f"{n}/label_forces"].astype(np.float32)
        graph.stress = data[f"{n}/label_stress"].astype(np.float32).reshape(1, 6)
        graphs.append(graph)
    loss = make_loss(model, config_from_dict(dict(model=dict(name=name))), has_stress=True)
    inputs = loss_inputs(batch_graphs(graphs))
    stats = loss.current_stats()
    params = [p for p in model.trainable_params() if p.requires_grad and ".confidence." not in p.name]

    def training_loss(*x):
        return loss(*x)[0]

    _, grads = ms.value_and_grad(training_loss, None, params)(*inputs, *stats, *stats)
    return np.concatenate([g.asnumpy().reshape(-1) for g in grads])


@pytest.mark.isolated
@pytest.mark.parametrize("name", ["orb_v2", "orb_v3_conservative_20_omat"])
def test_mixed_training_gradient_stays_close_to_float32(name):
    """The training loss's gradient in each mixed mode (half products, float32 everything else; the conservative
    model differentiates through its force derivative) against float32's, on the references' labels, through the
    reduced reference model GRADIENT_SIZES (full-size mixed predictions: the test above): within 5 % in
    L2 norm, direction within 0.999 cosine. The orb-v3 confidence head is left out: its targets are the bins of
    the force errors, which rounding moves (atoms change bin, and its gradient by ~40 %, by design)."""
    reference = training_gradient(name, "float32-highest").astype(np.float64)
    for mode in ("bf16-mixed", "fp16-mixed"):
        mixed = training_gradient(name, mode).astype(np.float64)
        assert mixed.shape == reference.shape and np.linalg.norm(reference) > 0
        relative = np.linalg.norm(mixed - reference) / np.linalg.norm(reference)
        cosine = mixed @ reference / (np.linalg.norm(mixed) * np.linalg.norm(reference))
        assert relative < 0.05 and cosine > 0.999, (mode, relative, cosine)
        assert relative > 1e-6, mode  # rounded: not float32


@pytest.mark.isolated
@pytest.mark.parametrize("name", ["orb_v2", "orb_v3_conservative_20_omat"])
def test_float64_training_gradient_equals_finite_differences(name):
    """Training in float64 differentiates the float64 loss: the compiled gradient (orb-v3 conservative: through
    its force and stress derivatives) equals central differences of the loss, in each of several parameters'
    largest-gradient elements, to 1e-6 -- what no float32 gradient could (float32's loss has ~1e-7 noise, a
    difference over h = 1e-5 ~1e-2 error). The orb-v3 confidence loss is off: its targets are bins of the force
    errors (a step function) and, as in orb-models, its head reads the backbone's features without their gradient,
    so the loss it adds is not the function its gradient differentiates."""
    import mindspore as ms

    from orb import precision
    from orb.data.batching import batch_graphs
    from orb.data.graphs import graph_from_arrays
    from orb.data.tensors import loss_inputs
    from orb.device import configure_mindspore
    from orb.training.config import config_from_dict
    from orb.training.engine import make_loss
    from orb.training.steps import write_parameter

    configure_mindspore("CPU", precision="float64")
    data = structures()
    model = recipe_model(name, **GRADIENT_SIZES)
    model.set_train(True)
    graphs = []
    for n in ("s1", "s4"):
        graph = graph_from_arrays(data[f"{n}/positions"], data[f"{n}/numbers"], data[f"{n}/cell"], float64=True,
                                  settings=model.cfg.graph_settings(), pbc=np.full(3, data[f"{n}/cell"].any()))
        graph.energy = data[f"{n}/label_energy"].astype(np.float64).reshape(1)
        graph.forces = data[f"{n}/label_forces"].astype(np.float64)
        graph.stress = data[f"{n}/label_stress"].astype(np.float64).reshape(1, 6)
        graphs.append(graph)
    cfg = config_from_dict(dict(model=dict(name=name), precision="float64", loss_weights=dict(confidence=0.0)))
    loss = make_loss(model, cfg, has_stress=True)
    inputs = loss_inputs(batch_graphs(graphs))
    assert inputs[1].dtype == ms.float64
    stats = loss.current_stats()
    params = [p for p in model.trainable_params() if p.requires_grad and ".confidence." not in p.name]
    assert all(p.dtype == ms.float64 for p in params)

    def training_loss(*x):
        return loss(*x)[0]

    value = ms.jit(training_loss)
    _, grads = ms.value_and_grad(training_loss, None, params)(*inputs, *stats, *stats)
    step, checked = 1e-5, 0
    for param, grad in list(zip(params, grads))[::max(1, len(params) // 6)]:
        grad = grad.asnumpy()
        if not np.abs(grad).max() > 1e-6:
            continue
        k = int(np.argmax(np.abs(grad)))
        start = param.asnumpy().copy()
        sides = []
        for sign in (1, -1):
            moved = start.copy()
            moved.reshape(-1)[k] += sign * step
            write_parameter(param, moved)
            sides.append(float(value(*inputs, *stats, *stats).asnumpy()))
        write_parameter(param, start)
        difference = (sides[0] - sides[1]) / (2 * step)
        assert difference == pytest.approx(grad.reshape(-1)[k], rel=1e-6, abs=1e-10), param.name
        checked += 1
    assert checked >= 4
    precision.set_precision(precision.DEFAULT)


def test_float64_training_keeps_float64_state_and_resumes_exactly(tmp_path):
    """A fine-tune in float64 (EMA, LoRA, anchor, norm clipping: the optimizer's own float64 Adam): weights,
    optimizer state and EMA are float64 in the checkpoint; a resume continues bit for bit where the uninterrupted
    run does; the exported weights load in a float32 calculator and predict what the float64 model predicts, to
    float32 rounding."""
    from test_training import make_cfg, params_of, trainer_for

    from orb.inference.calculator import ORBCalculator
    from orb.io.checkpoint import load_checkpoint

    common = dict(max_epochs=2, ema_decay=0.99, lora=dict(rank=2, groups=["layers"], train_others=True),
                  anchor=dict(weight=0.1, groups=["heads"]), gradient_clip_mode="norm", gradient_clip_val=1.0)
    straight = trainer_for(make_cfg(tmp_path / "a", precision="float64", **common))
    history = straight.fit()["history"]
    assert all(np.isfinite(h["val"]["loss"]) for h in history)
    weights, state, _ = load_checkpoint(str(tmp_path / "a" / "run" / "checkpoints" / "last.ckpt"))
    assert {v.dtype for k, v in weights.items()} <= {np.dtype(np.float64), np.dtype(np.int64)}
    assert any(k.startswith("ema.") for k in state) and any(k.startswith("moment1.") for k in state)
    assert all(v.dtype == np.float64 for k, v in state.items() if not k.endswith("step"))
    first = trainer_for(make_cfg(tmp_path / "b", precision="float64", **common))
    first.fit(until_epoch=1)
    resumed = trainer_for(make_cfg(tmp_path / "b", precision="float64", **common), resume=str(tmp_path / "b" / "run"))
    resumed.fit()
    for (name, a), (_, b) in zip(params_of(straight.model).items(), params_of(resumed.model).items()):
        assert a.dtype != np.float32, name
        np.testing.assert_array_equal(a, b, err_msg=name)
    exported = str(tmp_path / "a" / "run" / "checkpoints" / "best_weights.ckpt")
    forces = {}
    for mode in ("float64", "float32-highest"):
        atoms = ase.db.connect(DEMO_VAL).get(1).toatoms()
        atoms.calc = ORBCalculator.from_checkpoint(exported, device_target="CPU", precision=mode)
        forces[mode] = atoms.get_forces()
    assert np.abs(forces["float64"]).max() > 1e-3
    np.testing.assert_allclose(forces["float32-highest"], forces["float64"], rtol=0, atol=1e-5)
    assert not np.array_equal(forces["float32-highest"], forces["float64"])


def test_fp16_loss_scale_halves_on_overflow_and_doubles_after_a_run_of_finite_steps():
    """LossScale alone: an overflow halves the scale (never below the minimum, where overflows become ordinary
    non-finite steps) and counts a skipped step; growth_interval finite steps in a row double it."""
    import mindspore as ms

    from orb.training.steps import LossScale

    ms.set_context(mode=ms.PYNATIVE_MODE)
    try:
        scale = LossScale(initial=8.0, growth_interval=3, minimum=2.0)
        assert bool(scale.can_lower().asnumpy())
        scale.lower()
        scale.lower()
        assert float(scale.scale.asnumpy()) == 2.0 and int(scale.overflows.asnumpy()) == 2
        assert not bool(scale.can_lower().asnumpy())  # at the minimum: an overflow now is a non-finite step
        for _ in range(2):
            scale.after_finite()
        assert float(scale.scale.asnumpy()) == 2.0
        scale.after_finite()
        assert float(scale.scale.asnumpy()) == 4.0 and int(scale.good_steps.asnumpy()) == 0
    finally:
        ms.set_context(mode=ms.GRAPH_MODE)


def test_fp16_training_counts_overflows_as_skipped_steps_and_keeps_its_scale_on_resume(tmp_path, caplog):
    """A demo run in fp16-mixed: the initial scale's overflows are skipped and counted (nonfinite_steps), never a
    divergence; the scale is in the checkpoint, and a resume continues bit for bit where the uninterrupted run
    does; a resume given another initial_loss_scale says it continues the checkpoint's (it was dropped without a
    word)."""
    from test_training import make_cfg, params_of, trainer_for

    common = dict(precision="fp16-mixed", max_epochs=2, lr=3e-4)
    straight = trainer_for(make_cfg(tmp_path / "a", **common))
    history = straight.fit()["history"]
    assert history[0]["train"]["loss_scale"] < 2.0 ** 16  # lowered by the first overflows
    assert history[0]["train"]["nonfinite_steps"] >= 1
    assert all(np.isfinite(h["val"]["loss"]) for h in history)
    steps = [r for r in map(json.loads, open(tmp_path / "a" / "run" / "metrics.jsonl")) if r["type"] == "step"]
    first_epoch = [r for r in steps if r["epoch"] == 1]  # each interval says what it skipped, at which scale
    assert sum(r.get("nonfinite_steps", 0) for r in first_epoch) == history[0]["train"]["nonfinite_steps"]
    assert first_epoch[-1]["loss_scale"] == history[0]["train"]["loss_scale"] and all("loss_scale" in r for r in steps)
    first = trainer_for(make_cfg(tmp_path / "b", **common))
    first.fit(until_epoch=1)
    resumed = trainer_for(make_cfg(tmp_path / "b", **common), resume=str(tmp_path / "b" / "run"))
    assert resumed.engine.loss_scale_value() == history[0]["train"]["loss_scale"]
    with caplog.at_level("INFO", logger="orb"):
        changed = trainer_for(make_cfg(tmp_path / "b", **common, initial_loss_scale=1024.0),
                              resume=str(tmp_path / "b" / "run"))
    assert changed.engine.loss_scale_value() == history[0]["train"]["loss_scale"]
    assert "initial_loss_scale 65536 -> 1024 not applied: the checkpoint's loss scale" in caplog.text
    del changed
    resumed.fit()
    for (name, a), (_, b) in zip(params_of(straight.model).items(), params_of(resumed.model).items()):
        np.testing.assert_array_equal(a, b, err_msg=name)

    import os  # an epoch whose every step overflowed has no training metrics, and is never the best one: it was
    skipped = trainer_for(make_cfg(tmp_path / "c", precision="fp16-mixed", max_epochs=1, val_data_path="",  # loss 0,
                                   initial_loss_scale=2.0 ** 24))  # its best_weights.ckpt the untrained model
    record = skipped.fit()["history"][0]
    assert record["train"].get("nonfinite_steps") == skipped.data.steps_per_epoch and "loss" not in record["train"]
    assert skipped.progress.best_epoch == 0 and not os.path.exists(tmp_path / "c" / "run" / "checkpoints" /
                                                                    "best_weights.ckpt")


def test_precision_settings_and_their_refusals(monkeypatch, tmp_path):
    """The precision key (matmul_precision its old spelling, with one deprecation line), the calculator's
    precision keyword and its refusal of keywords it does not know (ASE swallowed them: a misspelt dispersion
    computed without a word), float64 refused on Ascend and for training."""
    import logging

    from orb import precision
    from orb.device import configure_mindspore
    from orb.errors import ConfigError
    from orb.inference.calculator import ORBCalculator
    from orb.training.config import load_config

    cfg = load_config("configs/demo.yaml", ["--matmul_precision", "highest"])
    assert cfg.precision == "float32-highest"
    with pytest.raises(ConfigError, match="'matmul_precision' \\(high\\) and 'precision' \\(fp16-mixed\\) disagree"):
        load_config("configs/demo.yaml", ["--matmul_precision", "high", "--precision", "fp16-mixed"])
    with pytest.raises(ConfigError, match="'precision' must be one of"):
        load_config("configs/demo.yaml", ["--precision", "float16"])
    assert load_config("configs/demo.yaml", ["--precision", "float64"]).precision == "float64"  # trains (CPU)
    from test_training import make_cfg

    from orb.training.distributed import DataParallel
    from orb.training.setup import build_trainer

    configure_mindspore("CPU")
    with pytest.raises(ConfigError, match="float64 trains on one process"):  # float32 collectives
        build_trainer(make_cfg(tmp_path, precision="float64"), data_parallel=DataParallel(rank=0, world_size=2))
    with pytest.raises(ConfigError, match="float64 cannot run on Ascend"):
        precision.check_device("float64", "Ascend")
    with pytest.raises(TypeError, match=r"unknown keyword\(s\) \['dispersoin'\]"):
        ORBCalculator.from_checkpoint("data/demo_pretrained.ckpt", device_target="CPU", dispersoin="d3bj")
    calculators = {mode: ORBCalculator.from_checkpoint("data/demo_pretrained.ckpt", device_target="CPU",
                                                       precision=mode) for mode in ("float32-highest", "float64")}
    import ase.db

    energies = {}
    for mode, calculator in calculators.items():
        atoms = ase.db.connect(DEMO_VAL).get(1).toatoms()
        atoms.calc = calculator
        energies[mode] = atoms.get_potential_energy()
    assert 0 < abs(energies["float64"] - energies["float32-highest"]) < 1e-4  # float64, not float32 again
    from orb.io.checkpoint import model_from_checkpoint
    from orb.models import is_float64_model

    assert precision.precision() == precision.DEFAULT  # the calculators above left the process's precision alone
    model = model_from_checkpoint("data/demo_pretrained.ckpt")  # a model object, built in float32
    for mode in ("float64", None):  # a copy built in float64; by default the model as it is
        atoms = ase.db.connect(DEMO_VAL).get(1).toatoms()
        atoms.calc = ORBCalculator(model, precision=mode)
        assert atoms.get_potential_energy() == energies[mode or "float32-highest"], mode
    assert not is_float64_model(model)  # the model given is left in float32
    with pytest.raises(ConfigError, match="precision must be one of"):
        ORBCalculator(model, precision="float16")
    logging.getLogger("orb")
    configure_mindspore("CPU")


def test_float64_training_data_and_replay_heads_keep_float64():
    """In float64 the training graphs carry the database's labels and loss weights unrounded (float32 labels put an
    energy of -1e3 eV up to 6e-5 eV off), and replay heads added to a float64 model are float64 (copies of float32
    cells would not compile beside it)."""
    import ase.db

    from orb import precision
    from orb.data.dataset import AseDbDataset
    from orb.models import create

    dataset = AseDbDataset(DEMO_VAL)
    dataset.float64 = True
    rows = list(ase.db.connect(DEMO_VAL).select(limit=3))
    for index, row in enumerate(rows):
        graph = dataset.get_many([index], [None])[0]
        assert graph.energy.dtype == graph.forces.dtype == graph.stress.dtype == graph.weight.dtype == np.float64
        assert graph.energy[0] == row.energy
        np.testing.assert_array_equal(graph.forces, row.forces)
    precision.set_precision("float64")
    model = create("orb_v3_direct_20_omat", latent_dim=32, mlp_hidden_dim=64, num_message_passing_steps=1)
    model.add_replay_heads()
    assert {str(p.dtype) for p in model.get_parameters()} == {"Float64", "Int64"}  # (Int64: batch counts)


@pytest.mark.parametrize("construction", ["orb_v2", "orb_v3_direct_20_omat"])
def test_float64_graphs_keep_the_float32_search_s_images(construction):
    """A float64 graph has the float32 graph's edges with float64 vectors: atoms on a cell face (an ideal lattice)
    stay in the image the search chose (wrapping float64 positions anew put some a lattice vector away: 7.2 Å
    edge vectors)."""
    from ase.build import bulk

    from orb.data.graphs import atoms_to_graph
    from orb.models.config import ModelConfig

    settings = ModelConfig.from_dict({"name": construction}).graph_settings()
    for atoms in (bulk("Cu", "fcc", a=3.6).repeat((2, 2, 2)), bulk("NaCl", "rocksalt", a=5.64, cubic=True)):
        single, double = (atoms_to_graph(atoms, settings=settings, float64=f) for f in (False, True))
        assert double.vectors.dtype == np.float64 and double.positions.dtype == np.float64
        np.testing.assert_array_equal(single.senders, double.senders)
        np.testing.assert_array_equal(single.receivers, double.receivers)
        np.testing.assert_allclose(double.vectors, single.vectors, atol=2e-6)
        np.testing.assert_allclose(double.positions, single.positions, atol=2e-6)


@pytest.mark.parametrize("name", ["orb_v2", "orb_v3_conservative_20_omat"])
def test_a_float64_batch_of_many_atoms_runs_in_parts_with_the_numbers_of_one_call(name, monkeypatch):
    """A float64 call keeps every intermediate (MindSpore's CPU graphs; 16 phonon supercells in one call filled 24
    GB): a batch past FLOAT64_ATOMS_PER_CALL atoms runs in parts of whole structures, in order, and gives every
    output (energy, forces, stress, orb-v3's confidence) the numbers one call gives (the small test model)."""
    from ase.build import bulk

    from conftest import SMALL_MODEL
    from orb import precision
    from orb.data.batching import batch_graphs
    from orb.data.graphs import atoms_to_graph
    from orb.device import configure_mindspore
    from orb.inference import predictor as predictor_module
    from orb.models import create

    configure_mindspore("CPU")
    precision.set_precision("float64")
    try:
        model = create(name, seed=3, **SMALL_MODEL)
        limit = predictor_module.float64_atoms_per_call(model.cfg)
        rng = np.random.default_rng(0)
        graphs = []
        for k in range(5):  # 108, 32, 108, 4 and 108 atoms: more than the limit together, each below it
            atoms = bulk("Cu", "fcc", a=3.6, cubic=True).repeat((3, 3, 3) if k % 2 == 0 else (2 - k // 3,) * 3)
            atoms.positions += rng.normal(0, 0.03, atoms.positions.shape)
            graphs.append(atoms_to_graph(atoms, settings=model.cfg.graph_settings(), float64=True))
        batch = batch_graphs(graphs)
        assert batch.num_nodes > limit and max(g.num_nodes for g in graphs) <= 108
        in_parts = predictor_module.Predictor(model)
        parts = in_parts(batch)
        monkeypatch.setitem(predictor_module.FLOAT64_ATOMS_PER_CALL, model.cfg.conservative, 10 ** 6)
        in_one = predictor_module.Predictor(model)
        whole = in_one(batch)
    finally:
        precision.set_precision(precision.DEFAULT)
    assert in_parts.said_parts and not in_one.said_parts  # (the log's line: parts, then one call)
    expected = {"energy", "forces", "stress"} | ({"confidence"} if name.startswith("orb_v3") else set())
    assert set(parts) == set(whole) == expected
    for key, atol in (("energy", 1e-10), ("forces", 1e-11), ("stress", 1e-12), ("confidence", 1e-12)):
        if key in expected:
            assert parts[key].shape == whole[key].shape and len(parts[key]) in (5, batch.num_nodes), key
            np.testing.assert_allclose(parts[key], whole[key], rtol=0, atol=atol, err_msg=key)


def test_float64_parts_are_whole_structures_in_order_within_the_limit():
    """The cut itself: consecutive whole structures, at most the limit past one structure, each graph's edges kept
    with its atoms, and a batch within the limit (or with padding graphs) as it is."""
    from types import SimpleNamespace

    from orb.data.batching import batch_graphs, pad_batch, split_batch
    from orb.data.graphs import graph_from_arrays
    from orb.inference.predictor import FLOAT64_ATOMS_PER_CALL, float64_parts

    rng = np.random.default_rng(1)
    graphs = []
    for n in (40, 30, 200, 70, 10, 300, 5):
        box = 3.0 * n ** (1 / 3)
        graphs.append(graph_from_arrays(rng.uniform(0, box, (n, 3)), np.full(n, 29), np.eye(3) * box,
                                        float64=True))
    batch = batch_graphs(graphs)
    cfg = SimpleNamespace(conservative=False)
    limit = FLOAT64_ATOMS_PER_CALL[False]
    parts = float64_parts(batch, cfg)
    assert [[g.num_nodes for g in split_batch(p)] for p in parts] == [[40, 30], [200], [70, 10], [300], [5]]
    assert all(p.num_nodes <= limit or p.num_graphs == 1 for p in parts)
    rebuilt = batch_graphs([g for p in parts for g in split_batch(p)])
    for field in ("positions", "numbers", "senders", "receivers", "vectors", "n_node", "n_edge", "cell"):
        np.testing.assert_array_equal(getattr(rebuilt, field), getattr(batch, field), err_msg=field)
    assert len(float64_parts(batch_graphs(graphs[:2]), cfg)) == 1
    padded = pad_batch(batch, batch.num_nodes + 8, batch.num_edges + 8, batch.num_graphs + 1)
    assert len(float64_parts(padded, cfg)) == 1
