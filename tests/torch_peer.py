"""Run by the PyTorch peer environment (torch 2.13 + orb-models 0.4.2), never by the project itself:

    python tests/torch_peer.py EXPORTED.ckpt STRUCTURES.npz OUT.npz

Builds orb-models' orb-v2 GraphRegressor, loads our exported file with load_state_dict(strict=True),
and writes its predictions (energy, forces, stress) for the structures in STRUCTURES.npz.
"""

import sys

import numpy as np
import torch
from ase import Atoms
from orb_models.forcefield import atomic_system, pretrained
from orb_models.forcefield.graph_regressor import EnergyHead, GraphHead, GraphRegressor, NodeHead


def orb_v2_model():
    head = dict(latent_dim=256, num_mlp_layers=1, mlp_hidden_dim=256)
    return GraphRegressor(
        graph_head=EnergyHead(**head, target="energy", node_aggregation="mean", reference_energy_name="vasp-shifted",
                              train_reference=True, predict_atom_avg=True),
        node_head=NodeHead(**head, target="forces", remove_mean=True),
        stress_head=GraphHead(**head, target="stress", compute_stress=True),
        model=pretrained.get_base())


def main(ckpt: str, structures: str, out: str) -> None:
    torch.set_num_threads(2)
    model = orb_v2_model()
    model.load_state_dict(torch.load(ckpt, map_location="cpu", weights_only=True), strict=True)
    model.eval()
    z = np.load(structures)
    results = {}
    with torch.no_grad():
        for name in z["names"]:
            cell = z[f"{name}/cell"]
            atoms = Atoms(numbers=z[f"{name}/numbers"], positions=z[f"{name}/positions"], cell=cell,
                          pbc=bool(np.any(cell != 0)))
            pred = model.predict(atomic_system.ase_atoms_to_atom_graphs(atoms))
            results[f"{name}/energy"] = pred["graph_pred"].numpy().reshape(-1)
            results[f"{name}/forces"] = pred["node_pred"].numpy()
            results[f"{name}/stress"] = pred["stress_pred"].numpy().reshape(-1)
    np.savez(out, **results)


if __name__ == "__main__":
    main(*sys.argv[1:])
