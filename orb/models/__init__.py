"""orb model families: one entry point builds any of them by name.

    from orb.models import create
    model = create("orb_v3_conservative_inf_omat")   # random weights, PyTorch parameter paths
    model = create("orb_v2", latent_dim=128)        # architecture overrides

Names (:data:`MODEL_NAMES`) are orb-models' loaders: ``orb_v2`` with ``orb_mptraj_only_v2`` and the D3 family
(``orb_d3_v2``, ``orb_d3_sm_v2``, ``orb_d3_xs_v2``), and the ten orb-v3 models (conservative/direct, 20/inf
neighbours, OMat or MPA; conservative/direct OMol). MindSpore is imported
only when a model is built, so configs can be checked without it.
"""

from typing import Dict, Optional

import numpy as np

from orb.errors import CheckpointError, ConfigError
from orb.models.config import MODEL_NAMES, V2_NAMES, ModelConfig


def build(cfg: ModelConfig, seed: int = 0):
    """A model of architecture ``cfg`` with random weights, in the precision in force (:mod:`orb.precision`)."""
    from orb.precision import is_float64

    if cfg.family == "orb_v3":
        from orb.models.orb_v3 import ConservativeRegressor, DirectRegressor

        model = (ConservativeRegressor if cfg.conservative else DirectRegressor)(cfg, seed)
    else:
        from orb.models.orb_v2 import GraphRegressor

        model = GraphRegressor(cfg, seed=seed)
    if is_float64():
        to_float64(model)
    return model


def is_float64_model(model) -> bool:
    """Whether ``model`` was built in precision float64 (its inputs must then be float64 graphs)."""
    import mindspore as ms

    return next(p for _, p in model.parameters_and_names()).dtype == ms.float64


def to_float64(model) -> None:
    """Every float32 parameter and constant tensor of ``model`` in float64, as PyTorch's ``model.double()``: the
    values are those of float32 (a buffer computed in float32 stays that number), then every operation on them
    is float64."""
    import mindspore as ms
    from mindspore import Parameter, Tensor

    for _, param in model.parameters_and_names():
        if param.dtype == ms.float32:
            param.set_dtype(ms.float64)  # (set_data keeps a parameter's type)
    for _, cell in model.cells_and_names():
        for name, value in list(vars(cell).items()):
            if isinstance(value, Tensor) and not isinstance(value, Parameter) and value.dtype == ms.float32:
                setattr(cell, name, Tensor(value.asnumpy().astype(np.float64)))


def create(name: str = "orb_v2", seed: int = 0, **overrides):
    """The model ``name`` (one of :data:`MODEL_NAMES`) with random weights; ``overrides`` change its settings."""
    if name not in MODEL_NAMES:
        raise ConfigError(f"unknown model '{name}'; valid names: {', '.join(MODEL_NAMES)}")
    return build(ModelConfig.from_dict(dict(overrides, name=name)), seed)


def weights_digest(model) -> str:
    """The model's weights and buffers, hashed by value: a float64 model holding a float32 checkpoint's weights
    hashes as the float32 model does (its resume with another precision was refused, "weights differ");
    values float32 cannot hold are hashed as they are."""
    import hashlib

    digest = hashlib.sha256()
    for name, param in model.parameters_and_names():
        values = param.asnumpy()
        if values.dtype == np.float64 and np.array_equal(values.astype(np.float32), values, equal_nan=True):
            values = values.astype(np.float32)
        digest.update(name.encode())
        digest.update(np.ascontiguousarray(values).tobytes())
    return digest.hexdigest()


# what a prediction runs: the networks, their graphs (the native search and how it is compiled), the precision
MODEL_CODE = ("orb.models", "orb.data.graphs", "orb.data.batching", "orb.data.neighbours", "orb.data.tensors",
              "orb.precision", "orb.native")


def model_identity(model, digest: Optional[str] = None) -> tuple:
    """Everything that determines what ``model`` computes on a structure: its architecture and graph settings, its
    weights (``digest``, else hashed now), the operator profile, the numeric precision, the form of its long sums
    (:mod:`orb.models.sums`, the device's) and the code that builds its graphs and runs it. The key of every cached
    model output."""
    import mindspore as ms

    from orb.cache import library_versions, source_digest
    from orb.device import matmul_precision_in_force, ops_profile
    from orb.precision import precision

    return (tuple(sorted(model.cfg.to_dict().items())), repr(model.cfg.graph_settings()),
            digest or weights_digest(model), ops_profile(), precision(), getattr(model, "sum_form", ""),
            source_digest(*MODEL_CODE),
            library_versions("mindspore"),  # (its kernels: another release computes other last bits)
            ms.get_context("device_target"), matmul_precision_in_force())  # (TF32/HF32 or float32 products)


def _count(weights: Dict[str, np.ndarray], prefix: str) -> int:
    """Number of numbered children ``<prefix><i>.`` among the keys."""
    found = {key[len(prefix):].split(".", 1)[0] for key in weights if key.startswith(prefix)}
    return len([f for f in found if f.isdigit()])


def _mlp_layers(weights: Dict[str, np.ndarray], prefix: str) -> int:
    return len({k for k in weights if k.startswith(prefix + "NN-") and k.endswith(".weight")})


def _common_sizes(weights: Dict[str, np.ndarray], head: str) -> Dict:
    """Sizes every orb family shows in its tensor shapes (``head``: the energy head's path)."""
    embedding = weights["model.atom_emb.embeddings.weight"]
    node_mlp = "model._encoder._node_fn.mlp."
    decoder = "model._decoder.node_fn.mlp."
    return dict(latent_dim=int(embedding.shape[1]), num_elements=int(embedding.shape[0]) - 1,
                mlp_hidden_dim=int(weights[node_mlp + "NN-0.weight"].shape[0]),
                num_mlp_layers=_mlp_layers(weights, node_mlp) - 1,
                num_message_passing_steps=_count(weights, "model.gnn_stacks."),
                head_mlp_hidden_dim=int(weights[head + "mlp.NN-0.weight"].shape[0]),
                head_num_mlp_layers=_mlp_layers(weights, head + "mlp.") - 1,
                decoder_out_dim=int(weights[f"{decoder}NN-{_mlp_layers(weights, decoder) - 1}.weight"].shape[0]))


def v3_name(weights: Dict[str, np.ndarray], neighbours: str = "inf") -> str:
    """The orb-v3 model name of a state dict's layout (20 or inf neighbours cannot be read from weights)."""
    kind = "direct" if "heads.forces.mlp.NN-0.weight" in weights else "conservative"
    if "model.conditioner.charge_embedding.W" in weights:
        return f"orb_v3_{kind}_omol"
    return f"orb_v3_{kind}_{neighbours}_omat"


def config_from_state_dict(weights: Dict[str, np.ndarray], base: ModelConfig = None,
                           name: Optional[str] = None) -> ModelConfig:
    """The architecture of an orb state dict, read from its tensor shapes.

    Settings that shapes do not show come from ``name`` (an orb-v3 checkpoint does not say whether
    it is a 20- or an unlimited-neighbour model: without a name it is taken as unlimited) or from
    ``base`` for orb-v2 (orb-v2's defaults if not given).
    """
    try:
        if "heads.energy.mlp.NN-0.weight" in weights:
            found = v3_name(weights)
            if name is not None and name not in MODEL_NAMES:
                raise ConfigError(f"unknown model '{name}'; valid names: {', '.join(MODEL_NAMES)}")
            layout = None if name is None else name.replace("_mpa", "_omat")  # MPA models: OMat's architectures
            if name is not None and v3_name(weights, "20" if "_20_" in name else "inf") != layout:
                raise CheckpointError(f"the checkpoint holds an {found.replace('_inf', '_20/inf')} model, not {name}")
            cfg = dict(ModelConfig.defaults(name or found), **_common_sizes(weights, "heads.energy."))
            cfg["num_rbf"] = int(weights["model.rbf_transform.bessel_weights"].shape[0])
            return ModelConfig.from_dict(cfg)
        if "graph_head.mlp.NN-0.weight" not in weights:
            raise KeyError("graph_head.mlp.NN-0.weight or heads.energy.mlp.NN-0.weight")
        if name is not None and name not in V2_NAMES:
            if name not in MODEL_NAMES:
                raise ConfigError(f"unknown model '{name}'; valid names: {', '.join(MODEL_NAMES)}")
            raise CheckpointError(f"the checkpoint holds an orb-v2 model, not {name} (orb-v2 names: "
                                  f"{', '.join(V2_NAMES)})")
        base = base or ModelConfig()
        return ModelConfig.from_dict(dict(
            base.to_dict(), name=name or "orb_v2", **_common_sizes(weights, "graph_head."),
            num_rbf=int(weights["model._encoder._edge_fn.mlp.NN-0.weight"].shape[1]) - 3))
    except KeyError as exc:
        raise CheckpointError(f"not an orb state dict (no {exc.args[0]})") from None
