"""An ASE calculator for orb models: relaxations and molecular dynamics with a fine-tuned model.

    from orb.inference.calculator import ORBCalculator
    atoms.calc = ORBCalculator.from_checkpoint("outputs/run/checkpoints/best_weights.ckpt")
    BFGS(atoms).run(fmax=0.05)

Graphs are built exactly as in training (periodic iff the cell is non-zero, 20 neighbours within
10 Å by default). The forward pass is compiled once per padded system size and reused across MD
steps; a structure that outgrows it gets a larger size (logged). Energies, forces and stresses are
orb's direct predictions: the forces are not derivatives of the energy.
"""

import os
from typing import Dict, Optional

import numpy as np
from ase.calculators.calculator import Calculator, all_changes

from orb.data.graphs import atoms_to_graph
from orb.inference.predictor import Predictor


def model_from_checkpoint(path: str, config_path: str = ""):
    """An orb model with the weights of a PyTorch or MindSpore checkpoint.

    The architecture comes from ``config_path`` (its ``model:`` block) if given, else from the
    checkpoint's own metadata (written by this program), else orb-v2's.
    """
    from orb.io.checkpoint import load_torch_state_dict, read_weights
    from orb.training.config import load_config
    from orb.models.config import ModelConfig
    from orb.models.orb_v2 import GraphRegressor

    weights, meta = read_weights(path)
    if config_path:
        cfg = load_config(config_path).model
    elif "config" in meta:
        cfg = ModelConfig.from_dict(meta["config"]["model"])
    elif "model" in meta:
        cfg = ModelConfig.from_dict(meta["model"])
    else:
        cfg = ModelConfig()
    model = GraphRegressor(cfg)
    load_torch_state_dict(model, weights, source=path)
    model.set_train(False)
    return model


class ORBCalculator(Calculator):
    """ASE calculator: energy, free_energy (= energy), forces and stress from an orb model."""

    implemented_properties = ["energy", "free_energy", "forces", "stress"]

    def __init__(self, model, **kwargs):
        super().__init__(**kwargs)
        self.model = model
        self.predictor = Predictor(model)

    @classmethod
    def from_checkpoint(cls, path: str, config_path: str = "", **kwargs) -> "ORBCalculator":
        import mindspore as ms

        ms.set_context(mode=ms.GRAPH_MODE)
        return cls(model_from_checkpoint(path, config_path), **kwargs)

    def calculate(self, atoms=None, properties=("energy",), system_changes=all_changes):
        super().calculate(atoms, properties, system_changes)
        cfg = self.model.cfg
        graph = atoms_to_graph(self.atoms, cfg.radius, cfg.max_neighbors)
        out: Dict[str, np.ndarray] = self.predictor(graph)
        energy = float(out["energy"][0])
        self.results = {"energy": energy, "free_energy": energy, "forces": out["forces"],
                        "stress": out["stress"][0]}
