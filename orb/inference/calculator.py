"""An ASE calculator for orb models: relaxations and molecular dynamics with a fine-tuned model.

    from orb.inference.calculator import ORBCalculator
    atoms.calc = ORBCalculator.from_checkpoint("outputs/run/checkpoints/best_weights.ckpt")
    BFGS(atoms).run(fmax=0.05)

Graphs are built exactly as in training. The forward pass is compiled once per padded system
size and reused across MD steps; a structure that outgrows it gets a larger size (logged).
orb-v2's energies, forces and stresses are direct predictions: its forces are not derivatives of
its energy.
"""

from typing import Dict

import numpy as np
from ase.calculators.calculator import Calculator, all_changes

from orb.data.graphs import atoms_to_graph
from orb.inference.predictor import Predictor


class ORBCalculator(Calculator):
    """ASE calculator: energy, free_energy (= energy), forces and stress from an orb model."""

    implemented_properties = ["energy", "free_energy", "forces", "stress"]

    def __init__(self, model, **kwargs):
        super().__init__(**kwargs)
        self.model = model
        self.predictor = Predictor(model)

    @classmethod
    def from_checkpoint(cls, path: str, device_target: str = "auto", **kwargs) -> "ORBCalculator":
        """A calculator for a PyTorch or MindSpore checkpoint (its architecture is read from the file)."""
        from orb.io.checkpoint import model_from_checkpoint
        from orb.device import configure_mindspore

        configure_mindspore(device_target)
        return cls(model_from_checkpoint(path), **kwargs)

    def calculate(self, atoms=None, properties=("energy",), system_changes=all_changes):
        super().calculate(atoms, properties, system_changes)
        cfg = self.model.cfg
        graph = atoms_to_graph(self.atoms, cfg.radius, cfg.max_neighbors)
        out: Dict[str, np.ndarray] = self.predictor(graph)
        energy = float(out["energy"][0])
        self.results = {"energy": energy, "free_energy": energy, "forces": out["forces"],
                        "stress": out["stress"][0]}
