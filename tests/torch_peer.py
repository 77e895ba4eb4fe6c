"""Run by a PyTorch peer environment, never by the project itself:

    python tests/torch_peer.py MODEL EXPORTED.ckpt STRUCTURES.npz OUT.npz [PRECISION]

MODEL ``orb_v2`` (or another orb-v2 architecture: ``orb_mptraj_only_v2``, ``orb_d3_v2``, ``orb_d3_sm_v2``,
``orb_d3_xs_v2``) needs torch 2.13 + orb-models 0.4.2; an orb-v3 name (``orb_v3_direct_omol``,
``orb_v3_conservative_20_mpa``, ...) needs orb-models 0.5.5. Builds orb-models' model, loads our exported file with
load_state_dict(strict=True), and writes its predictions (energy, forces, stress) for the
structures in STRUCTURES.npz (with ``charge``/``spin`` where given, for OMol models).

PRECISION (default float32-highest): ``float64`` runs orb-models in float64 -- 0.5.5's own
``precision="float64"`` and float64 graphs; 0.4.2, which has no float64 mode, as ``model.double()``
with its graphs' positions, cell and edge vectors rebuilt in float64 from the same edges and its
reference energy's float32 one-hot cast to the weights' type (it fails otherwise). ``bf16-autocast``
runs the float32 model under ``torch.autocast("cpu", dtype=torch.bfloat16)`` (PyTorch's mixed
precision, for the fidelity comparison).
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


def v2_graph_float64(graph, atoms):
    """0.4.2's graph of ``atoms`` with positions, cell and vectors in float64. The positions are ``atoms``' moved by
    the lattice vectors 0.4.2's float32 wrap moved them (an atom at a fractional 0 can land on 1)."""
    pos32, vec32 = graph.node_features["positions"].double(), graph.edge_features["vectors"].double()
    s, r = graph.senders, graph.receivers
    cell = torch.tensor(atoms.cell.array, dtype=torch.float64)
    positions = torch.tensor(atoms.positions, dtype=torch.float64)
    shift = 0.0  # each edge's lattice vector, as 0.4.2's float32 vectors hold it
    if atoms.cell.any():
        inverse = torch.linalg.inv(cell)
        positions = positions + torch.round((pos32 - positions) @ inverse) @ cell
        shift = torch.round((vec32 - (pos32[r] - pos32[s])) @ inverse) @ cell
    vectors = positions[r] - positions[s] + shift
    nodes = dict(graph.node_features, positions=positions,
                 atomic_numbers_embedding=graph.node_features["atomic_numbers_embedding"].double())
    edges = dict(graph.edge_features, vectors=vectors, r=vectors.norm(dim=1))
    return graph._replace(node_features=nodes, edge_features=edges,
                          system_features=dict(graph.system_features, cell=cell[None]))


def reference_energy_in_weight_type():
    """0.4.2's LinearReferenceEnergy casts its one-hot to float32, which a float64 model cannot multiply."""
    from orb_models.forcefield import graph_regressor

    def forward(self, atom_types, n_node):
        one_hot = torch.nn.functional.one_hot(atom_types, num_classes=118).type(self.linear.weight.dtype)
        return self.linear(graph_regressor.segment_ops.aggregate_nodes(one_hot, n_node, reduction="sum"))

    graph_regressor.LinearReferenceEnergy.forward = forward


def predict_v2(model, atoms, precision="float32-highest") -> dict:
    graph = atomic_system.ase_atoms_to_atom_graphs(atoms)
    if precision == "float64":
        graph = v2_graph_float64(graph, atoms)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-autocast"):
        pred = model.predict(graph)
    return {"energy": pred["graph_pred"], "forces": pred["node_pred"], "stress": pred["stress_pred"]}


def orb_v3_model(name: str, ckpt: str, precision: str = "float32-highest"):
    # orb-models' own loader: builds the named architecture and load_state_dict(strict=True)
    return getattr(pretrained, name)(weights_path=ckpt, device="cpu", compile=False,
                                     precision="float64" if precision == "float64" else "float32-highest")


def predict_v3(model, atoms, precision="float32-highest") -> dict:
    dtype = {"output_dtype": torch.float64} if precision == "float64" else {}
    graph = atomic_system.ase_atoms_to_atom_graphs(atoms, system_config=model.system_config, **dtype)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-autocast"):
        out = model.predict(graph)  # conservative models differentiate inside predict: no torch.no_grad here
    prefix = "grad_" if hasattr(model, "grad_forces_name") else ""
    result = {"energy": out["energy"], "forces": out[prefix + "forces"]}
    if prefix + "stress" in out:
        result["stress"] = out[prefix + "stress"]
    return result


def main(name: str, ckpt: str, structures: str, out: str, precision: str = "float32-highest") -> None:
    torch.set_num_threads(2)
    v2 = not name.startswith("orb_v3")
    if v2:  # orb_v2 built here (0.4.2's loader moves it to a device); its relatives by their 0.4.2 loaders
        model = orb_v2_model(ckpt) if name == "orb_v2" else getattr(pretrained, name)(weights_path=ckpt,
                                                                                        device="cpu").eval()
        if precision == "float64":
            reference_energy_in_weight_type()
            model = model.double()
    else:
        model = orb_v3_model(name, ckpt, precision)
    predict = predict_v2 if v2 else predict_v3
    z = np.load(structures)
    results = {}
    for structure in z["names"]:
        cell = z[f"{structure}/cell"]
        atoms = Atoms(numbers=z[f"{structure}/numbers"], positions=z[f"{structure}/positions"], cell=cell,
                      pbc=bool(np.any(cell != 0)))
        for key in ("charge", "spin"):
            if f"{structure}/{key}" in z:
                atoms.info[key] = float(z[f"{structure}/{key}"])
        try:
            predicted = predict(model, atoms, precision)
        except RuntimeError as exc:  # bf16 autocast: 0.4.2's torque removal of molecules mixes dtypes and fails
            if precision != "bf16-autocast":
                raise
            results[f"{structure}/failed"] = np.array(str(exc).splitlines()[0])
            continue
        for key, value in predicted.items():
            results[f"{structure}/{key}"] = value.detach().double().numpy().reshape(-1 if key != "forces" else (-1, 3))
    np.savez(out, **results)


if __name__ == "__main__":
    main(*sys.argv[1:])
