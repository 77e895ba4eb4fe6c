"""Run by the PyTorch peer environment (torch + orb-models 0.4.2), never by the project itself:

    python tests/properties_peer.py SIZES.json EXPORTED.ckpt STRUCTURES.npz OUT.npz

Builds orb-models 0.4.2's orb-v2 GraphRegressor with the sizes of SIZES.json (our model config's latent_dim,
mlp_hidden_dim, num_message_passing_steps, head_mlp_hidden_dim: the demo model is smaller than orb-v2), loads our
exported weights with load_state_dict(strict=True), and writes orb-models' own ASE calculator's energy, forces and
stress of every structure in STRUCTURES.npz (``names``, ``<name>/numbers``, ``<name>/positions``, ``<name>/cell``):
tests/test_properties.py runs phonopy and ase.eos on them as orb-properties does on ours.
"""

import json
import sys
from functools import partial

import numpy as np
import torch
from ase import Atoms
from orb_models.forcefield.calculator import ORBCalculator
from orb_models.forcefield.featurization_utilities import gaussian_basis_function
from orb_models.forcefield.gns import MoleculeGNS
from orb_models.forcefield.graph_regressor import EnergyHead, GraphHead, GraphRegressor, NodeHead


def base_of(sizes: dict, node_in: int) -> MoleculeGNS:
    """pretrained.get_base's MoleculeGNS with our sizes (its atom embedding ``node_in`` wide)."""
    return MoleculeGNS(
        num_node_in_features=node_in, num_node_out_features=3, num_edge_in_features=23,
        latent_dim=sizes["latent_dim"], interactions="simple_attention",
        interaction_params={"distance_cutoff": True, "polynomial_order": 4, "cutoff_rmax": 6,
                            "attention_gate": "sigmoid"},
        num_message_passing_steps=sizes["num_message_passing_steps"], num_mlp_layers=2,
        mlp_hidden_dim=sizes["mlp_hidden_dim"], rbf_transform=partial(gaussian_basis_function, num_bases=20, radius=10.0),
        use_embedding=True, node_feature_names=["feat"], edge_feature_names=["feat"])


def model_of(sizes: dict, ckpt: str) -> GraphRegressor:
    weights = torch.load(ckpt, map_location="cpu", weights_only=True)
    node_in = weights["model._encoder._node_fn.mlp.NN-0.weight"].shape[1]
    head = dict(latent_dim=sizes["latent_dim"], num_mlp_layers=sizes["head_num_mlp_layers"],
                mlp_hidden_dim=sizes["head_mlp_hidden_dim"])
    model = GraphRegressor(
        graph_head=EnergyHead(**head, target="energy", node_aggregation="mean", reference_energy_name="vasp-shifted",
                              train_reference=True, predict_atom_avg=True),
        node_head=NodeHead(**head, target="forces", remove_mean=True),
        stress_head=GraphHead(**head, target="stress", compute_stress=True),
        model=base_of(sizes, node_in))
    model.load_state_dict(weights, strict=True)
    return model.eval()


def main(sizes: str, ckpt: str, structures: str, out: str) -> None:
    torch.set_num_threads(2)
    with open(sizes) as f:
        calculator = ORBCalculator(model_of(json.load(f), ckpt), device="cpu")
    z = np.load(structures)
    results = {}
    for name in z["names"]:
        atoms = Atoms(numbers=z[f"{name}/numbers"], positions=z[f"{name}/positions"], cell=z[f"{name}/cell"], pbc=True)
        atoms.calc = calculator
        results[f"{name}/energy"] = np.array(atoms.get_potential_energy())
        results[f"{name}/forces"] = np.asarray(atoms.get_forces(), np.float64)
        results[f"{name}/stress"] = np.asarray(atoms.get_stress(), np.float64)
    np.savez(out, **results)


if __name__ == "__main__":
    main(*sys.argv[1:])
