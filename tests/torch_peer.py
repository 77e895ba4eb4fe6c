"""Run by a PyTorch peer environment, never by the project itself:

    python tests/torch_peer.py MODEL EXPORTED.ckpt STRUCTURES.npz OUT.npz

MODEL ``orb_v2`` needs torch 2.13 + orb-models 0.4.2; an orb-v3 name (``orb_v3_direct_omol``, ...)
needs orb-models 0.5.5. Builds orb-models' model, loads our exported file with
load_state_dict(strict=True), and writes its predictions (energy, forces, stress) for the
structures in STRUCTURES.npz (with ``charge``/``spin`` where given, for OMol models).
"""

import sys

import numpy as np
import torch
from ase import Atoms
from orb_models.forcefield import atomic_system, pretrained


def orb_v2_model(ckpt: str):
    from orb_models.forcefield.graph_regressor import EnergyHead, GraphHead, GraphRegressor, NodeHead

    head = dict(latent_dim=256, num_mlp_layers=1, mlp_hidden_dim=256)
    model = GraphRegressor(
        graph_head=EnergyHead(**head, target="energy", node_aggregation="mean", reference_energy_name="vasp-shifted",
                              train_reference=True, predict_atom_avg=True),
        node_head=NodeHead(**head, target="forces", remove_mean=True),
        stress_head=GraphHead(**head, target="stress", compute_stress=True),
        model=pretrained.get_base())
    model.load_state_dict(torch.load(ckpt, map_location="cpu", weights_only=True), strict=True)
    return model.eval()


def predict_v2(model, atoms) -> dict:
    with torch.no_grad():
        pred = model.predict(atomic_system.ase_atoms_to_atom_graphs(atoms))
    return {"energy": pred["graph_pred"], "forces": pred["node_pred"], "stress": pred["stress_pred"]}


def orb_v3_model(name: str, ckpt: str):
    # orb-models' own loader: builds the named architecture and load_state_dict(strict=True)
    return getattr(pretrained, name)(weights_path=ckpt, device="cpu", precision="float32-highest", compile=False)


def predict_v3(model, atoms) -> dict:
    graph = atomic_system.ase_atoms_to_atom_graphs(atoms, system_config=model.system_config)
    out = model.predict(graph)  # conservative models differentiate inside predict: no torch.no_grad here
    prefix = "grad_" if hasattr(model, "grad_forces_name") else ""
    result = {"energy": out["energy"], "forces": out[prefix + "forces"]}
    if prefix + "stress" in out:
        result["stress"] = out[prefix + "stress"]
    return result


def main(name: str, ckpt: str, structures: str, out: str) -> None:
    torch.set_num_threads(2)
    model = orb_v2_model(ckpt) if name == "orb_v2" else orb_v3_model(name, ckpt)
    predict = predict_v2 if name == "orb_v2" else predict_v3
    z = np.load(structures)
    results = {}
    for structure in z["names"]:
        cell = z[f"{structure}/cell"]
        atoms = Atoms(numbers=z[f"{structure}/numbers"], positions=z[f"{structure}/positions"], cell=cell,
                      pbc=bool(np.any(cell != 0)))
        for key in ("charge", "spin"):
            if f"{structure}/{key}" in z:
                atoms.info[key] = float(z[f"{structure}/{key}"])
        for key, value in predict(model, atoms).items():
            results[f"{structure}/{key}"] = value.detach().numpy().reshape(-1 if key != "forces" else (-1, 3))
    np.savez(out, **results)


if __name__ == "__main__":
    main(*sys.argv[1:])
