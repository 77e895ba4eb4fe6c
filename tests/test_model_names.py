"""Every model orb-models publishes, by its name: orb_mptraj_only_v2 and the D3 family (orb-v2's architecture with
15, 10 or 5 message-passing layers), the orb-v3 MPA models (OMat's architectures); orb-models' own loader of each
name accepts our export and predicts what we predict; D3-trained models refuse D3 added on top."""

import os
import subprocess

import numpy as np
import pytest

from conftest import ROOT, STATE_DICT_KEYS

V3_NPZ = os.path.join(ROOT, "tests", "data", "orb_v3_parity.npz")


@pytest.mark.parametrize("name, layers, layout", [
    ("orb_mptraj_only_v2", 15, "orb_v2"), ("orb_d3_v2", 15, "orb_v2"), ("orb_d3_sm_v2", 10, "orb_v2"),
    ("orb_d3_xs_v2", 5, "orb_v2"), ("orb_v3_conservative_20_mpa", 5, "orb_v3_conservative_20_omat"),
    ("orb_v3_conservative_inf_mpa", 5, "orb_v3_conservative_inf_omat"),
    ("orb_v3_direct_20_mpa", 5, "orb_v3_direct_20_omat"), ("orb_v3_direct_inf_mpa", 5, "orb_v3_direct_inf_omat"),
])
def test_each_published_name_builds_its_architecture_and_is_read_back(tmp_path, name, layers, layout):
    """The name's model holds the parameters of its layout (orb-v2's keys with its layer count; OMat's for MPA), with
    its graph settings; a checkpoint of it is read back as that name when the name is given."""
    from orb.io.checkpoint import architecture, read_weights, save_checkpoint, to_torch_state_dict
    from orb.models import create
    from orb.models.config import ModelConfig

    model = create(name)
    cfg, same = model.cfg, ModelConfig.from_dict({"name": layout})
    assert cfg.num_message_passing_steps == layers and cfg.family == same.family
    assert (cfg.radius, cfg.max_neighbors, cfg.conservative) == (same.radius, same.max_neighbors, same.conservative)
    keys = set(to_torch_state_dict(model))
    if layout == "orb_v2":
        expected = {line.split("\t")[0] for line in open(STATE_DICT_KEYS) if line.strip() and not line.startswith("#")}
        expected = {k for k in expected if not k.startswith("model.gnn_stacks.") or int(k.split(".")[2]) < layers}
        assert keys == expected
    else:
        assert keys == set(to_torch_state_dict(create(layout)))
    path = str(tmp_path / "weights.ckpt")
    save_checkpoint(path, model, exported=True)  # a plain file: the name must come from the user
    weights, _ = read_weights(path)
    assert architecture(weights, {}, name).name == name
    assert architecture(weights, {}, name).num_message_passing_steps == layers


@pytest.mark.parametrize("name, variable", [("orb_d3_sm_v2", "ORB_TORCH_PYTHON"),
                                            ("orb_v3_direct_20_mpa", "ORB_TORCH_V3_PYTHON")])
def test_orb_models_own_loader_of_the_name_predicts_what_we_predict(tmp_path, name, variable):
    """orb-models' loader of the name (0.4.2's orb_d3_sm_v2, 0.5.5's orb_v3_direct_20_mpa) accepts our export
    (load_state_dict strict) and predicts what our calculator predicts from the same file."""
    peer = os.environ.get(variable, "")
    if not peer:
        pytest.skip(f"{variable} (a python with torch and orb-models) is not set; .ci/run sets it")
    from ase import Atoms

    from orb.inference.calculator import ORBCalculator
    from orb.io.checkpoint import to_torch_state_dict
    from orb.io.torch_format import write_torch_checkpoint
    from orb.models import create

    path = str(tmp_path / "export.ckpt")
    write_torch_checkpoint(to_torch_state_dict(create(name, seed=5)), path)
    z = np.load(V3_NPZ)
    names = ["s1", "s4"]  # a cluster (13 atoms) and a periodic ionic cell (10)
    structures = {"names": np.array(names)}
    for n in names:
        structures.update({f"{n}/numbers": z[f"{n}/numbers"], f"{n}/positions": z[f"{n}/positions"],
                           f"{n}/cell": z[f"{n}/cell"]})
    np.savez(tmp_path / "structures.npz", **structures)
    result = subprocess.run([peer, os.path.join(ROOT, "tests", "torch_peer.py"), name, path,
                             str(tmp_path / "structures.npz"), str(tmp_path / "torch.npz")],
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    theirs = np.load(tmp_path / "torch.npz")
    calculator = ORBCalculator.from_checkpoint(path, device_target="CPU", model_name=name)
    assert calculator.model.cfg.name == name
    for n in names:
        cell = structures[f"{n}/cell"]
        atoms = Atoms(numbers=structures[f"{n}/numbers"], positions=structures[f"{n}/positions"], cell=cell,
                      pbc=bool(np.any(cell != 0)))
        atoms.calc = calculator
        assert np.abs(theirs[f"{n}/forces"]).max() > 1e-2
        np.testing.assert_allclose(atoms.get_potential_energy(), theirs[f"{n}/energy"][0], atol=2e-4, rtol=1e-6)
        np.testing.assert_allclose(atoms.get_forces(), theirs[f"{n}/forces"], atol=2e-5, rtol=2e-5, err_msg=n)


def test_a_d3_trained_model_refuses_d3_on_top():
    from orb.errors import OrbInputError
    from orb.inference.calculator import ORBCalculator
    from orb.models import create

    with pytest.raises(OrbInputError, match="orb_d3_xs_v2 was trained on D3-corrected energies"):
        ORBCalculator(create("orb_d3_xs_v2"), dispersion="d3bj")
