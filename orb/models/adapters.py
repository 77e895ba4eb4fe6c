"""Low-rank adapters (LoRA) on the MLPs of an orb model, and the plain weights they merge into.

During training an adapted layer computes with ``W + (alpha / rank) B A`` and keeps ``W``, ``A`` and
``B`` apart (``<layer>.weight``, ``<layer>.lora_a``, ``<layer>.lora_b``): a training checkpoint holds
all three, so a resume continues exactly. Everything a user takes away -- exported checkpoints
(``best_weights.ckpt``, conversions to PyTorch), and the weights read for the calculator, evaluation
and relaxation -- holds the merged ``W`` under orb-models' own keys, so orb-models loads a plain model.
"""

from collections import OrderedDict
from typing import Dict, Iterable, List, Optional

import numpy as np

from orb.models.groups import in_group

LORA_KEYS = (".lora_a", ".lora_b")


def add_adapters(model, rank: int, alpha: float, groups: Iterable[str], seed: int) -> List[str]:
    """Rank-``rank`` adapters on every linear layer of the MLPs of ``groups``; returns the adapted layers' paths."""
    from orb.models.blocks import Linear

    groups = list(groups)
    rng = np.random.default_rng([seed, 0x10A])
    adapted = []
    layers = [(path, cell) for path, cell in model.cells_and_names() if isinstance(cell, Linear) and ".mlp.NN-" in path]
    for path, cell in layers:
        if any(in_group(path + ".weight", g) for g in groups):
            cell.add_adapter(rank, alpha, rng, path)
            adapted.append(path)
    if any(".gnn_stacks." in path for path in adapted):
        # MindSpore 2.10's graph mode mixed up message-passing layers of different structure (some with adapters,
        # some without: wrong shapes, or silently another layer's cells), so every layer gets adapters; those of
        # the layers not asked for start at zero and are never trained (orb.training.engine.is_frozen)
        for path, cell in layers:
            if ".gnn_stacks." in path and not cell.adapted:
                cell.add_adapter(rank, alpha, rng, path)
    return adapted


def merged_state(model, include) -> "OrderedDict[str, np.ndarray]":
    """Every parameter ``include(name)`` keeps, with each adapted layer's weight merged and its adapter left out."""
    from orb.models.blocks import Linear

    merged = {path + ".weight": cell.merged_weight() for path, cell in model.cells_and_names()
              if isinstance(cell, Linear) and cell.adapted}
    return OrderedDict((name, merged.get(name, p.asnumpy()).copy()) for name, p in model.parameters_and_names()
                       if include(name) and not name.endswith(LORA_KEYS))


def merge_arrays(weights: Dict[str, np.ndarray], alpha: Optional[float]) -> Dict[str, np.ndarray]:
    """A state dict with adapters (a training checkpoint's) as plain weights: ``W + (alpha / rank) B A``."""
    adapters = [k[:-len(".lora_a")] for k in weights if k.endswith(".lora_a")]
    if not adapters:
        return weights
    if alpha is None:
        from orb.errors import CheckpointError

        raise CheckpointError("the checkpoint holds low-rank adapters but no lora.alpha in its config: it was not "
                              "written by this program's training")
    out = {k: v for k, v in weights.items() if not k.endswith(LORA_KEYS)}
    for layer in adapters:
        a, b = np.asarray(weights[layer + ".lora_a"], np.float64), np.asarray(weights[layer + ".lora_b"], np.float64)
        scale = float(alpha) / a.shape[0]
        weight = np.asarray(weights[layer + ".weight"])
        out[layer + ".weight"] = (weight.astype(np.float64) + scale * (b @ a)).astype(weight.dtype)
    return out
