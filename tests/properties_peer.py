"""Run by a PyTorch peer environment, never by the project itself:

    python tests/properties_peer.py SIZES.json EXPORTED.ckpt STRUCTURES.npz OUT.npz

SIZES.json is our model config (``name``, ``latent_dim``, ``mlp_hidden_dim``, ``num_mlp_layers``,
``num_message_passing_steps``, ``head_mlp_hidden_dim``, ``head_num_mlp_layers``): the demo models are smaller than
the published ones, so orb-models' architecture is built with these sizes -- orb-v2 with torch + orb-models 0.4.2
(its GraphRegressor), an orb-v3 conservative ``_20_`` model with orb-models 0.5.5 (its
``orb_v3_conservative_architecture`` and ``load_model``) -- our exported weights loaded with strict checks. Writes
orb-models' energy, forces and stress of every structure in STRUCTURES.npz (``names``, ``<name>/numbers``,
``<name>/positions``, ``<name>/cell``) in float64 (torch_peer.py's float64 graphs and model): tests/test_properties.py
runs phonopy and ase.eos on them as orb-properties does on ours. In float64 they are the same numbers on every
host; orb-models' float32 forces differed from ours by about 1e-4 eV/A on one CI host (5e-6 here), which
phonopy's 0.01 A displacements turned into 0.045 THz.
"""

import json
import sys
from functools import partial

import numpy as np
import torch
from ase import Atoms

from torch_peer import predict_v2, predict_v3, reference_energy_in_weight_type


def orb_v2_model(sizes: dict, ckpt: str):
    from orb_models.forcefield.featurization_utilities import gaussian_basis_function
    from orb_models.forcefield.gns import MoleculeGNS
    from orb_models.forcefield.graph_regressor import EnergyHead, GraphHead, GraphRegressor, NodeHead

    weights = torch.load(ckpt, map_location="cpu", weights_only=True)
    node_in = weights["model._encoder._node_fn.mlp.NN-0.weight"].shape[1]  # the atom embedding's width
    base = MoleculeGNS(  # pretrained.get_base with our sizes
        num_node_in_features=node_in, num_node_out_features=3, num_edge_in_features=23,
        latent_dim=sizes["latent_dim"], interactions="simple_attention",
        interaction_params={"distance_cutoff": True, "polynomial_order": 4, "cutoff_rmax": 6,
                            "attention_gate": "sigmoid"},
        num_message_passing_steps=sizes["num_message_passing_steps"], num_mlp_layers=sizes["num_mlp_layers"],
        mlp_hidden_dim=sizes["mlp_hidden_dim"], rbf_transform=partial(gaussian_basis_function, num_bases=20, radius=10.0),
        use_embedding=True, node_feature_names=["feat"], edge_feature_names=["feat"])
    head = dict(latent_dim=sizes["latent_dim"], num_mlp_layers=sizes["head_num_mlp_layers"],
                mlp_hidden_dim=sizes["head_mlp_hidden_dim"])
    model = GraphRegressor(
        graph_head=EnergyHead(**head, target="energy", node_aggregation="mean", reference_energy_name="vasp-shifted",
                              train_reference=True, predict_atom_avg=True),
        node_head=NodeHead(**head, target="forces", remove_mean=True),
        stress_head=GraphHead(**head, target="stress", compute_stress=True), model=base)
    model.load_state_dict(weights, strict=True)
    reference_energy_in_weight_type()
    return model.eval().double()


def orb_v3_conservative_20_model(sizes: dict, ckpt: str):
    from orb_models.forcefield.atomic_system import SystemConfig
    from orb_models.forcefield.pretrained import load_model, orb_v3_conservative_architecture

    model = orb_v3_conservative_architecture(
        latent_dim=sizes["latent_dim"], base_mlp_hidden_dim=sizes["mlp_hidden_dim"],
        base_mlp_depth=sizes["num_mlp_layers"], head_mlp_hidden_dim=sizes["head_mlp_hidden_dim"],
        head_mlp_depth=sizes["head_num_mlp_layers"], num_message_passing_steps=sizes["num_message_passing_steps"],
        device="cpu", system_config=SystemConfig(radius=6.0, max_num_neighbors=20))
    return load_model(model, ckpt, "cpu", precision="float64", compile=False)


def main(sizes: str, ckpt: str, structures: str, out: str) -> None:
    torch.set_num_threads(2)
    with open(sizes) as f:
        sizes = json.load(f)
    if sizes["name"] == "orb_v2":
        model, predict = orb_v2_model(sizes, ckpt), predict_v2
    elif sizes["name"] == "orb_v3_conservative_20_omat":
        model, predict = orb_v3_conservative_20_model(sizes, ckpt), predict_v3
    else:
        raise SystemExit(f"no peer for {sizes['name']}")
    z = np.load(structures)
    results = {}
    for name in z["names"]:
        atoms = Atoms(numbers=z[f"{name}/numbers"], positions=z[f"{name}/positions"], cell=z[f"{name}/cell"], pbc=True)
        for key, value in predict(model, atoms, "float64").items():
            shape = {"energy": (), "forces": (-1, 3)}.get(key, -1)
            results[f"{name}/{key}"] = value.detach().double().numpy().reshape(shape)
    np.savez(out, **results)


if __name__ == "__main__":
    main(*sys.argv[1:])
