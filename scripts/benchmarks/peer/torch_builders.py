"""The PyTorch models and graphs the peer programs share (imported by them from this folder; like them, it
imports neither the project's ``orb`` nor the ``benchmarks`` package). Models get random weights, no download."""


def orb_v2():
    """orb-v2 in PyTorch orb-models 0.4.2, built as ``pretrained.orb_v2()`` does."""
    from orb_models.forcefield import pretrained
    from orb_models.forcefield.graph_regressor import EnergyHead, GraphHead, GraphRegressor, NodeHead

    return GraphRegressor(
        graph_head=EnergyHead(latent_dim=256, num_mlp_layers=1, mlp_hidden_dim=256, target="energy",
                              node_aggregation="mean", reference_energy_name="vasp-shifted", train_reference=True,
                              predict_atom_avg=True),
        node_head=NodeHead(latent_dim=256, num_mlp_layers=1, mlp_hidden_dim=256, target="forces", remove_mean=True),
        stress_head=GraphHead(latent_dim=256, num_mlp_layers=1, mlp_hidden_dim=256, target="stress",
                              compute_stress=True),
        model=pretrained.get_base())


def orb_v2_graphs(db: str, n: int) -> list:
    """The first ``n`` x 8 rows of ASE database ``db`` as orb-models 0.4.2's dataset makes them (no augmentation)."""
    from orb_models.dataset.ase_dataset import AseSqliteDataset

    ds = AseSqliteDataset(db, augmentation=False)
    return [ds[i] for i in range(n * 8)]


def orb_v3(name: str):
    """orb-v3 ``name`` in PyTorch orb-models 0.5.5, built as its pretrained loaders do: (model, its SystemConfig,
    the extra architecture arguments of an omol model)."""
    from orb_models.forcefield.atomic_system import SystemConfig
    from orb_models.forcefield.pretrained import orb_v3_conservative_architecture, orb_v3_direct_architecture

    sc = SystemConfig(radius=6.0, max_num_neighbors=20 if "_20_" in name else 120)
    extra = dict(has_charge_spin_cond=True, has_stress=False) if name.endswith("omol") else {}
    model = (orb_v3_conservative_architecture if "conservative" in name else orb_v3_direct_architecture)(
        device="cpu", system_config=sc, **extra)
    return model, sc, extra


def orb_v3_graphs(db: str, n: int, sc, extra: dict) -> list:
    """The first ``n`` x 8 rows of ASE database ``db`` as orb-models 0.5.5 graphs with their labels (charge 0 and
    spin 1 for an omol model, which has no stress)."""
    import ase.db
    import torch
    from orb_models.forcefield.atomic_system import ase_atoms_to_atom_graphs

    graphs = []
    for row in list(ase.db.connect(db).select())[:n * 8]:
        atoms = row.toatoms()
        atoms.info["graph_targets"] = {"energy": torch.tensor([row.energy], dtype=torch.float32)}
        atoms.info["node_targets"] = {"forces": torch.tensor(row.forces, dtype=torch.float32)}
        if extra:
            atoms.info["charge"], atoms.info["spin"] = 0.0, 1.0
        else:
            atoms.info["graph_targets"]["stress"] = torch.tensor(row.stress, dtype=torch.float32)
        graphs.append(ase_atoms_to_atom_graphs(atoms, system_config=sc))
    return graphs
