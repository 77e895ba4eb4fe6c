"""Torch-free checkpoint reading/writing, strict state-dict mapping and the conversion script."""

import io
import os
import pickle
import subprocess
import sys
import zipfile

import numpy as np
import pytest

from conftest import ROOT, SMALL_MODEL, STATE_DICT_KEYS, TORCH_SAMPLE
from orb.errors import CheckpointError
from orb.models.recipe import recipe_weights
from orb.io.torch_format import read_torch_checkpoint, write_torch_checkpoint


def reference_keys():
    out = []
    for line in open(STATE_DICT_KEYS):
        if line.strip() and not line.startswith("#"):
            key, shape = line.split("\t")[:2]
            out.append((key, tuple(int(s) for s in shape.strip("()").split(",") if s.strip())))
    return out


@pytest.fixture(scope="module")
def recipe():
    return recipe_weights(reference_keys(), seed=0)


def test_reads_real_torch_file_bit_exact(recipe):
    sd = read_torch_checkpoint(TORCH_SAMPLE)
    for key, value in sd.items():
        if key == "extra.transposed_view":  # strides (1, 512): a transposed view of its storage
            expected = recipe["model._encoder._edge_fn.mlp.NN-0.weight"]
        elif key == "extra.shared_slice":  # storage offset 256 into the embedding's storage
            expected = recipe["model.atom_emb.embeddings.weight"][1:3]
        else:
            expected = recipe[key].reshape(value.shape)  # the sample stores the counters with shape (1,)
        assert value.dtype == expected.dtype and value.shape == expected.shape, key
        assert value.tobytes() == expected.tobytes(), key
    assert sd["graph_head.normalizer.bn.num_batches_tracked"].tolist() == [1000]


def test_refuses_arbitrary_objects(tmp_path):
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    payload = io.BytesIO()
    pickle.dump({"weight": Evil()}, payload, protocol=2)
    path = tmp_path / "evil.ckpt"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("evil/data.pkl", payload.getvalue())
    with pytest.raises(CheckpointError, match="refusing to unpickle 'posix.system'"):
        read_torch_checkpoint(str(path))
    assert not marker.exists()
    legacy = tmp_path / "legacy.ckpt"
    legacy.write_bytes(pickle.dumps({"a": 1}))
    with pytest.raises(CheckpointError, match="not a zip-format"):
        read_torch_checkpoint(str(legacy))


def test_write_then_read_bit_exact_with_aligned_storages(tmp_path, recipe):
    path = str(tmp_path / "sd.ckpt")
    write_torch_checkpoint(recipe, path)
    back = read_torch_checkpoint(path)
    assert list(back) == list(recipe)
    for key in recipe:
        assert back[key].dtype == recipe[key].dtype and back[key].shape == recipe[key].shape
        assert back[key].tobytes() == recipe[key].tobytes(), key
    with zipfile.ZipFile(path) as zf:  # storages start on 64-byte boundaries, as torch.save writes them
        for info in zf.infolist():
            if "/data/" in info.filename:
                assert (info.header_offset + 30 + len(info.filename) + len(info.extra)) % 64 == 0


def test_state_dict_round_trip_through_model(tmp_path, recipe):
    from orb.io.checkpoint import load_torch_state_dict, read_weights, save_checkpoint, to_torch_state_dict
    from orb.models.orb_v2 import orb_v2

    model = orb_v2()
    load_torch_state_dict(model, recipe)
    torch_path = str(tmp_path / "model_torch.ckpt")
    write_torch_checkpoint(to_torch_state_dict(model), torch_path)
    ms_path = str(tmp_path / "model_ms.ckpt")
    again = orb_v2(seed=5)
    load_torch_state_dict(again, read_torch_checkpoint(torch_path))
    save_checkpoint(ms_path, again, {"note": "round trip"})
    weights, meta = read_weights(ms_path)
    assert meta == {"note": "round trip"}
    for key, value in recipe.items():
        assert weights[key].tobytes() == value.tobytes(), key  # MindSpore -> torch -> MindSpore, bit exact


def test_strict_loading_names_the_bad_key(recipe):
    from orb.io.checkpoint import load_torch_state_dict
    from orb.models.orb_v2 import orb_v2

    model = orb_v2()
    missing = dict(recipe)
    del missing["stress_head.mlp.NN-1.bias"]
    with pytest.raises(CheckpointError, match=r"missing keys \['stress_head.mlp.NN-1.bias'\]"):
        load_torch_state_dict(model, missing)
    extra = dict(recipe, **{"model.extra.weight": np.zeros(3, np.float32)})
    with pytest.raises(CheckpointError, match="unexpected keys \\['model.extra.weight'\\]"):
        load_torch_state_dict(model, extra)
    wrong = dict(recipe, **{"node_head.mlp.NN-1.weight": np.zeros((4, 256), np.float32)})
    with pytest.raises(CheckpointError, match=r"node_head.mlp.NN-1.weight: checkpoint \(4, 256\) vs model \(3, 256\)"):
        load_torch_state_dict(model, wrong)
    small = orb_v2(**SMALL_MODEL)
    with pytest.raises(CheckpointError, match="wrong shapes"):
        load_torch_state_dict(small, recipe)


def test_convert_script_reads_the_architecture_from_the_checkpoint(tmp_path):
    """A small model (not orb-v2's size) converts both ways with the README's two-argument form: the
    architecture comes from the MindSpore file's metadata, and from the tensor shapes of a torch file."""
    from orb.io.checkpoint import read_weights, save_checkpoint, to_torch_state_dict
    from orb.models.orb_v2 import orb_v2

    model = orb_v2(seed=3, **dict(SMALL_MODEL, num_rbf=12))
    ms_path = str(tmp_path / "small_ms.ckpt")
    save_checkpoint(ms_path, model, {"model": model.cfg.to_dict()})
    script = os.path.join(ROOT, "scripts", "convert_checkpoint.py")
    to_torch = subprocess.run([sys.executable, script, ms_path, str(tmp_path / "small_torch.ckpt")],
                              capture_output=True, text=True, timeout=300)
    assert to_torch.returncode == 0, to_torch.stderr[-2000:]
    assert "latent_dim 32" in to_torch.stdout and "2 message-passing layers" in to_torch.stdout
    back = subprocess.run([sys.executable, script, str(tmp_path / "small_torch.ckpt"), str(tmp_path / "back.ckpt")],
                          capture_output=True, text=True, timeout=300)
    assert back.returncode == 0, back.stderr[-2000:]
    torch_sd = read_torch_checkpoint(str(tmp_path / "small_torch.ckpt"))
    final, meta = read_weights(str(tmp_path / "back.ckpt"))
    assert meta["model"]["num_rbf"] == 12 and meta["model"]["latent_dim"] == 32  # read from shapes
    for key, value in to_torch_state_dict(model).items():
        assert torch_sd[key].tobytes() == value.tobytes() == final[key].tobytes(), key
    assert "warning" not in to_torch.stderr  # every setting of this model is in the file or its shapes
    # MindSpore to MindSpore keeps what a best_weights.ckpt says of itself (it kept the architecture alone), and not
    # a training checkpoint's format (the target holds weights, no optimizer state to resume)
    fit = {"method": "least_squares", "shifts": {"Cu": 0.25}}
    described = dict(model=model.cfg.to_dict(), epoch=7, val_loss=0.5, ema=True, reference_energies_fit=fit,
                     format="orb-mindspore-train-2", global_step=70)
    save_checkpoint(str(tmp_path / "best.ckpt"), model, described)
    again = subprocess.run([sys.executable, script, str(tmp_path / "best.ckpt"), str(tmp_path / "again.ckpt"), "--to",
                            "mindspore"], capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    kept = read_weights(str(tmp_path / "again.ckpt"))[1]
    assert (kept["epoch"], kept["val_loss"], kept["ema"], kept["reference_energies_fit"]) == (7, 0.5, True, fit)
    assert "format" not in kept and "global_step" not in kept
    from orb.models import create

    # graphs no tensor shape shows, under a name whose tensors read as orb_v2's
    wide = create("orb_d3_sm_v2", seed=3, **dict(SMALL_MODEL, radius=8.0, max_neighbors=30))
    save_checkpoint(str(tmp_path / "wide.ckpt"), wide, {"model": wide.cfg.to_dict()})
    lossy = subprocess.run([sys.executable, script, str(tmp_path / "wide.ckpt"), str(tmp_path / "wide_torch.ckpt")],
                           capture_output=True, text=True, timeout=300)
    assert lossy.returncode == 0, lossy.stderr[-2000:]
    assert ("its readers build orb_d3_sm_v2 with radius 10.0, max_neighbors 20, but this model has radius 8.0, "
            "max_neighbors 30, which no reader of that file can know") in lossy.stderr
    assert "tensors read as orb_v2 unless its readers are given the name orb_d3_sm_v2" in lossy.stderr
    broken = dict(torch_sd)
    del broken["graph_head.mlp.NN-0.weight"]
    write_torch_checkpoint(broken, str(tmp_path / "broken.ckpt"))
    bad = subprocess.run([sys.executable, script, str(tmp_path / "broken.ckpt"), str(tmp_path / "x.ckpt")],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "not an orb state dict" in bad.stderr and "Traceback" not in bad.stderr


def test_fine_tuning_names_the_checkpoints_architecture(tmp_path):
    """A checkpoint of another size than the config's model block: the error says what the checkpoint holds."""
    from orb.io.checkpoint import load_weights_into, save_checkpoint
    from orb.models.orb_v2 import orb_v2

    path = str(tmp_path / "small.ckpt")
    save_checkpoint(path, orb_v2(**SMALL_MODEL), {})
    with pytest.raises(CheckpointError, match="holds orb_v2 \\(latent_dim 32, mlp_hidden_dim 64, 2 message-passing"):
        load_weights_into(orb_v2(**dict(SMALL_MODEL, latent_dim=64)), path)


def test_fine_tuning_warns_when_the_model_block_changes_what_no_tensor_shows(tmp_path, caplog):
    """Graph and radial-basis settings (and orb-v3's 20 or unlimited neighbours) load into any model of the same
    shapes: a model block that changes them starts the weights on graphs they were not trained on, which the start
    of the run says (it said nothing); the same settings, or a plain file read under the config's name, say nothing."""
    from orb.io.checkpoint import load_weights_into, save_checkpoint, to_torch_state_dict
    from orb.io.torch_format import write_torch_checkpoint
    from orb.models import create
    from orb.models.orb_v2 import orb_v2
    from orb.training.config import config_from_dict
    from orb.training.setup import build_model

    ours = str(tmp_path / "ours.ckpt")
    save_checkpoint(ours, orb_v2(**SMALL_MODEL), {"model": dict(SMALL_MODEL, name="orb_v2")})
    assert load_weights_into(orb_v2(**SMALL_MODEL), ours) == {}
    assert load_weights_into(orb_v2(**dict(SMALL_MODEL, radius=8.0, max_neighbors=30)), ours) == {
        "radius": (8.0, 10.0), "max_neighbors": (30, 20)}
    small_v3 = dict(SMALL_MODEL, name="orb_v3_direct_20_omat")
    plain = str(tmp_path / "plain.ckpt")  # a PyTorch state dict: no settings, read under the config's name
    write_torch_checkpoint(to_torch_state_dict(create("orb_v3_direct_20_omat", **SMALL_MODEL)), plain)
    assert load_weights_into(create("orb_v3_direct_inf_omat", **SMALL_MODEL), plain) == {}
    trained = str(tmp_path / "trained_v3.ckpt")  # this program's file knows it was the 20-neighbour model
    save_checkpoint(trained, create("orb_v3_direct_20_omat", **SMALL_MODEL), {"model": small_v3})
    assert load_weights_into(create("orb_v3_direct_inf_omat", **SMALL_MODEL), trained) == {
        "name": ("orb_v3_direct_inf_omat", "orb_v3_direct_20_omat"), "max_neighbors": (120, 20)}
    caplog.set_level("WARNING", logger="orb")
    build_model(config_from_dict({"checkpoint_path": ours, "model": dict(SMALL_MODEL, radius=8.0)}))
    assert (f"the 'model:' block differs from the model {ours} was trained as: radius 8.0 (trained: 10.0)"
            in caplog.text)


def add_random_adapters(model, rank=4, scale=0.02):
    """LoRA adapters on the model's layer and head MLPs, with B drawn at random (not the zeros training starts from),
    so that merging them changes every adapted weight."""
    from mindspore import Tensor

    from orb.models.adapters import add_adapters

    adapted = add_adapters(model, rank, 2.0 * rank, ["layers", "heads"], seed=5)
    rng = np.random.default_rng(6)
    for path, cell in model.cells_and_names():
        if path in adapted:
            cell.lora_b.set_data(Tensor(rng.normal(0, scale, cell.lora_b.shape).astype(np.float32)))
    assert adapted
    return model


def test_pytorch_orb_models_loads_our_export_and_predicts_the_same(tmp_path, reference):
    """Our exported file in the PyTorch peer environment (``ORB_TORCH_PYTHON``: torch 2.13 + orb-models
    0.4.2, set up by .ci/run): load_state_dict(strict=True) accepts it and orb-models predicts what we
    predict with the same (non-recipe, randomly initialised) weights -- here with low-rank adapters (random,
    non-zero) on every layer and head MLP, which the export merges into orb-models' plain weights."""
    peer = os.environ.get("ORB_TORCH_PYTHON", "")
    if not peer:
        pytest.skip("ORB_TORCH_PYTHON (a python with torch and orb-models 0.4.2) is not set; .ci/run sets it")
    import mindspore as ms

    from orb.data.graphs import graph_from_arrays
    from orb.inference.predictor import Predictor
    from orb.io.checkpoint import to_torch_state_dict
    from orb.models.orb_v2 import orb_v2

    ms.set_context(mode=ms.GRAPH_MODE)
    model = orb_v2(seed=11)
    add_random_adapters(model)
    model.set_train(False)
    path = str(tmp_path / "export.ckpt")
    write_torch_checkpoint(to_torch_state_dict(model), path)
    names = ["s0", "s1", "s7"]  # periodic alloy, molecule-like cluster, large oxide (no neighbour ties)
    structures = {"names": np.array(names)}
    for n in names:
        structures.update({f"{n}/numbers": reference[f"{n}/numbers"], f"{n}/positions": reference[f"{n}/positions_input"],
                           f"{n}/cell": reference[f"{n}/cell_input"]})
    np.savez(tmp_path / "structures.npz", **structures)
    result = subprocess.run([peer, os.path.join(ROOT, "tests", "torch_peer.py"), "orb_v2", path, str(tmp_path / "structures.npz"),
                             str(tmp_path / "torch.npz")], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    theirs = np.load(tmp_path / "torch.npz")
    predictor = Predictor(model)
    for n in names:
        ours = predictor(graph_from_arrays(structures[f"{n}/positions"], structures[f"{n}/numbers"],
                                           structures[f"{n}/cell"]))
        np.testing.assert_allclose(ours["energy"], theirs[f"{n}/energy"], atol=1e-4, rtol=1e-6, err_msg=n)
        np.testing.assert_allclose(ours["forces"], theirs[f"{n}/forces"], atol=2e-5, err_msg=n)
        np.testing.assert_allclose(ours["stress"][0], theirs[f"{n}/stress"], atol=1e-5, err_msg=n)


def test_convert_names_an_unwritable_target_in_one_line_and_exits_75_on_a_stop_signal(tmp_path):
    """A target it cannot write is one line and status 1 (it was a traceback); a stop signal ends it with status 75
    and leaves no temporary (it was killed by the signal; arriving while MindSpore loads, it aborted the process at
    exit)."""
    import signal
    import time

    from conftest import wait_until_handling

    target = os.path.join(ROOT, "README.md", "x.ckpt")  # a file where the folder should be
    result = subprocess.run([sys.executable, "-m", "orb.io.convert", "data/demo_pretrained.ckpt", target, "--to",
                             "torch"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1 and lines[0].startswith(f"error: cannot write {target}: "), \
        result.stderr[-2000:]
    process = subprocess.Popen([sys.executable, "-m", "orb.io.convert", "data/demo_pretrained.ckpt",
                                str(tmp_path / "out.pt"), "--to", "torch"], cwd=ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    wait_until_handling(process, signal.SIGTERM)  # listening: what comes next is importing MindSpore (seconds)
    time.sleep(0.5)
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=300)
    assert process.returncode == 75 and err.strip().splitlines()[-1].startswith("stopped by SIGTERM"), err[-2000:]
    assert os.listdir(tmp_path) == []


def test_convert_replaces_an_existing_target_only_with_overwrite(tmp_path, capsys):
    """orb-convert replaced an existing file unasked (every other command refuses an existing output unless
    --overwrite): refused in one line before any work, the file as it was; a folder is refused even with it."""
    from orb.io.checkpoint import read_weights
    from orb.io.convert import main

    source, target = os.path.join(ROOT, "data", "demo_pretrained.ckpt"), tmp_path / "kept.ckpt"
    target.write_bytes(b"an earlier conversion")
    for extra, said in (([], f"target {target} exists: pass --overwrite to replace it"),
                        (["--overwrite"], None)):
        status = main([source, str(target), "--to", "mindspore", *extra])
        err = capsys.readouterr().err.strip()
        if said:
            assert status == 2 and err == f"error: {said}" and target.read_bytes() == b"an earlier conversion"
        else:
            assert status == 0 and read_weights(str(target))[1]["converted_from"] == source, err[-2000:]
    assert main([source, str(tmp_path), "--overwrite"]) == 2
    assert capsys.readouterr().err.strip() == f"error: target {tmp_path} is a folder: name a file"
    assert os.listdir(tmp_path) == ["kept.ckpt"]


def test_weights_holding_nan_are_not_converted(tmp_path):
    """orb-convert turned a diverged run's PyTorch checkpoint (a tensor of NaN) into a MindSpore checkpoint holding
    NaN, which every tool then loaded; a checkpoint never holds NaN. Refused in one line naming the tensor."""
    from orb.io.checkpoint import read_weights
    from orb.io.torch_format import write_torch_checkpoint

    weights, _ = read_weights(os.path.join(ROOT, "data", "demo_pretrained.ckpt"))
    key = sorted(weights)[3]
    weights[key] = np.array(weights[key], np.float32)
    weights[key].flat[0] = np.nan
    source, target = str(tmp_path / "diverged.ckpt"), str(tmp_path / "converted.ckpt")
    write_torch_checkpoint(weights, source)
    result = subprocess.run([sys.executable, "-m", "orb.io.convert", source, target], cwd=ROOT, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        f"error: {source}: tensor '{key}' holds NaN or inf (weights of a diverged run): convert a checkpoint saved "
        f"before it diverged"], result.stderr[-2000:]
    assert not os.path.exists(target)


def test_a_file_that_is_no_checkpoint_and_a_name_close_to_a_published_one_are_one_line_each(tmp_path):
    """`--checkpoint my.extxyz` passed MindSpore's own text through ("the checkpoint file format must same with
    'format'"); `--checkpoint orb_v4` listed every name with orb_v2 first, as if it were the list's."""
    import ase.io
    from ase.build import bulk

    from orb.errors import CheckpointError
    from orb.io.checkpoint import check_checkpoint_file, read_weights

    structures = tmp_path / "my.extxyz"
    ase.io.write(structures, bulk("Cu"))
    with pytest.raises(CheckpointError) as refusal:
        read_weights(str(structures))
    assert str(refusal.value) == (f"{structures}: not a checkpoint (a PyTorch zip, or a MindSpore file ending in "
                                  ".ckpt); structures like these go to --data")
    with pytest.raises(CheckpointError, match=r"^--checkpoint orb_v4: checkpoint file does not exist \(did you mean "
                                              r"the published weights orb_v2\? names: orb_v2, orb_mptraj_only_v2, "):
        check_checkpoint_file("orb_v4", "--checkpoint")
    from orb.io.convert import convert

    with pytest.raises(CheckpointError, match=r"a MindSpore checkpoint must end in \.ckpt"):  # (written, then unread)
        convert(os.path.join(ROOT, "data", "demo_pretrained.ckpt"), str(tmp_path / "demo_ms.bin"), "mindspore")
    assert not (tmp_path / "demo_ms.bin").exists()


def test_a_model_name_the_checkpoint_contradicts_is_refused():
    """A tool's --model for a checkpoint that stores its model: another name is refused (orb-evaluate and orb-relax
    ran the 20-neighbour demo model with 120 neighbours, silently, and its energies were a third off); its own name
    reads the checkpoint."""
    from orb.io.checkpoint import model_from_checkpoint

    v3 = os.path.join(ROOT, "data", "demo_v3_pretrained.ckpt")
    with pytest.raises(CheckpointError, match="demo_v3_pretrained.ckpt stores the model orb_v3_conservative_20_omat, "
                                              "not orb_v3_conservative_inf_omat: leave out the model's name"):
        model_from_checkpoint(v3, "orb_v3_conservative_inf_omat")
    assert model_from_checkpoint(v3, "orb_v3_conservative_20_omat").cfg.max_neighbors == 20
