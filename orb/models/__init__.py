"""orb model families: one entry point builds any of them by name.

    from orb.models import create
    model = create("orb_v2")                       # random weights, PyTorch parameter paths
    model = create("orb_v2", latent_dim=128)       # architecture overrides

MindSpore is imported only when a model is built, so configs can be checked without it.
"""

from typing import Dict

import numpy as np

from orb.errors import CheckpointError, ConfigError
from orb.models.config import MODEL_NAMES, ModelConfig


def build(cfg: ModelConfig, seed: int = 0):
    """A model of architecture ``cfg`` with random weights."""
    from orb.models.orb_v2 import GraphRegressor

    return GraphRegressor(cfg, seed=seed)


def create(name: str = "orb_v2", seed: int = 0, **overrides):
    """The model ``name`` (one of :data:`MODEL_NAMES`) with random weights; ``overrides`` change its settings."""
    if name not in MODEL_NAMES:
        raise ConfigError(f"unknown model '{name}'; valid names: {', '.join(MODEL_NAMES)}")
    return build(ModelConfig.from_dict(dict(overrides, name=name)), seed)


def _count(weights: Dict[str, np.ndarray], prefix: str) -> int:
    """Number of numbered children ``<prefix><i>.`` among the keys."""
    found = {key[len(prefix):].split(".", 1)[0] for key in weights if key.startswith(prefix)}
    return len([f for f in found if f.isdigit()])


def _mlp_layers(weights: Dict[str, np.ndarray], prefix: str) -> int:
    return len({k for k in weights if k.startswith(prefix + "NN-") and k.endswith(".weight")})


def config_from_state_dict(weights: Dict[str, np.ndarray], base: ModelConfig = None) -> ModelConfig:
    """The architecture of an orb state dict, read from its tensor shapes.

    Settings that shapes do not show (radii, neighbour count, cutoff) come from ``base`` (orb-v2's
    defaults if not given).
    """
    base = base or ModelConfig()
    try:
        if "graph_head.mlp.NN-0.weight" not in weights:
            raise KeyError("graph_head.mlp.NN-0.weight")
        embedding = weights["model.atom_emb.embeddings.weight"]
        node_mlp = "model._encoder._node_fn.mlp."
        return ModelConfig.from_dict(dict(
            base.to_dict(), name="orb_v2",
            latent_dim=int(embedding.shape[1]), num_elements=int(embedding.shape[0]) - 1,
            mlp_hidden_dim=int(weights[node_mlp + "NN-0.weight"].shape[0]),
            num_mlp_layers=_mlp_layers(weights, node_mlp) - 1,
            num_message_passing_steps=_count(weights, "model.gnn_stacks."),
            num_rbf=int(weights["model._encoder._edge_fn.mlp.NN-0.weight"].shape[1]) - 3,
            head_mlp_hidden_dim=int(weights["graph_head.mlp.NN-0.weight"].shape[0]),
            head_num_mlp_layers=_mlp_layers(weights, "graph_head.mlp.") - 1,
            decoder_out_dim=int(weights[f"model._decoder.node_fn.mlp.NN-{_mlp_layers(weights, 'model._decoder.node_fn.mlp.') - 1}.weight"].shape[0]),
        ))
    except KeyError as exc:
        raise CheckpointError(f"not an orb-v2 state dict (no {exc.args[0]})") from None
