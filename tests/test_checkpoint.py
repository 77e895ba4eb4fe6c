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


def test_convert_script_both_ways(tmp_path):
    from orb.io.checkpoint import save_checkpoint, to_torch_state_dict
    from orb.models.orb_v2 import orb_v2

    config = tmp_path / "small.yaml"
    config.write_text("model:\n" + "".join(f"  {k}: {v}\n" for k, v in SMALL_MODEL.items()))
    model = orb_v2(seed=3, **SMALL_MODEL)
    ms_path = str(tmp_path / "small_ms.ckpt")
    save_checkpoint(ms_path, model, {})
    script = os.path.join(ROOT, "scripts", "convert_checkpoint.py")
    to_torch = subprocess.run([sys.executable, script, ms_path, str(tmp_path / "small_torch.ckpt"), "--config",
                               str(config)], capture_output=True, text=True, timeout=300)
    assert to_torch.returncode == 0, to_torch.stderr[-2000:]
    back = subprocess.run([sys.executable, script, str(tmp_path / "small_torch.ckpt"), str(tmp_path / "back.ckpt"),
                           "--config", str(config)], capture_output=True, text=True, timeout=300)
    assert back.returncode == 0, back.stderr[-2000:]
    torch_sd = read_torch_checkpoint(str(tmp_path / "small_torch.ckpt"))
    from orb.io.checkpoint import read_weights

    final, _ = read_weights(str(tmp_path / "back.ckpt"))
    for key, value in to_torch_state_dict(model).items():
        assert torch_sd[key].tobytes() == value.tobytes() == final[key].tobytes(), key
    wrong_arch = subprocess.run([sys.executable, script, ms_path, str(tmp_path / "x.ckpt")], capture_output=True,
                                text=True, timeout=300)
    assert wrong_arch.returncode == 2 and "does not fit the model" in wrong_arch.stderr


def test_pytorch_loads_our_file_if_installed(tmp_path, recipe):
    """Optional: with torch and orb-models 0.4.2 installed, load_state_dict(strict=True) accepts our file."""
    torch = pytest.importorskip("torch")
    pretrained = pytest.importorskip("orb_models.forcefield.pretrained")
    path = str(tmp_path / "for_torch.ckpt")
    write_torch_checkpoint(recipe, path)
    state = torch.load(path, map_location="cpu", weights_only=True)
    from orb_models.forcefield.graph_regressor import EnergyHead, GraphHead, GraphRegressor, NodeHead

    model = GraphRegressor(
        graph_head=EnergyHead(latent_dim=256, num_mlp_layers=1, mlp_hidden_dim=256, target="energy",
                              node_aggregation="mean", reference_energy_name="vasp-shifted", train_reference=True,
                              predict_atom_avg=True),
        node_head=NodeHead(latent_dim=256, num_mlp_layers=1, mlp_hidden_dim=256, target="forces", remove_mean=True),
        stress_head=GraphHead(latent_dim=256, num_mlp_layers=1, mlp_hidden_dim=256, target="stress",
                              compute_stress=True),
        model=pretrained.get_base())
    model.load_state_dict(state, strict=True)
    for key, value in model.state_dict().items():
        assert np.array_equal(value.numpy(), recipe[key]), key
