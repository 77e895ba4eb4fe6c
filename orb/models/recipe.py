"""Deterministic numpy weights for any orb model size (the parity references' weight recipe).

The references (``../shared/reference/README.md`` section 2 for orb-v2, ``orb_v3/README.md``
section 2 for orb-v3) specify it: one ``np.random.default_rng(seed)`` visits the state_dict keys in
order and draws each float array with a single ``uniform`` call: running means U(-1, 1), running
variances U(0.5, 2), the atom embedding U(-sqrt 3, sqrt 3), reference energies U(-10, 0),
charge/spin frequencies U(-1, 1), norm weights 1 + 0.1 U(-1, 1) (LayerNorm biases 0.1 U(-1, 1)), and
Linear weights and biases U(-b, b) with b = 1/sqrt(fan_in). Not drawn: batch counters (the
energy normaliser's 1000, others 0) and orb-v3's constant buffers (Bessel weights, r_max,
prefactor, confidence bin edges), which take their defining values. Cast to float32 last.
"""

import hashlib
import math
from collections import OrderedDict
from typing import Dict, Optional, Sequence, Tuple

import numpy as np

ENERGY_COUNTERS = ("graph_head.normalizer.bn.num_batches_tracked", "heads.energy.normalizer.bn.num_batches_tracked")
REFERENCE_ENERGIES = ("graph_head.reference.linear.weight", "heads.energy.reference.linear.weight")


def _constant(key: str, shape: Tuple[int, ...]) -> Optional[np.ndarray]:
    """The value of a buffer the recipe does not draw, or None."""
    leaf = key.rsplit(".", 1)[-1]
    if leaf == "num_batches_tracked":
        return np.full(shape, 1000 if key in ENERGY_COUNTERS else 0, dtype=np.int64)
    if key.endswith("rbf_transform.bessel_weights"):
        return np.float32(np.pi / 6.0) * np.arange(1, shape[0] + 1, dtype=np.float32)
    if key.endswith("rbf_transform.r_max"):
        return np.array(6.0, dtype=np.float32)
    if key.endswith("rbf_transform.prefactor"):
        return np.array(math.sqrt(2.0 / 6.0), dtype=np.float32)
    if key.endswith("bin_edges"):
        return np.linspace(0.0, 0.3, shape[0]).astype(np.float32)
    return None


def _uniform_bounds(key: str, shapes: Dict[str, Tuple[int, ...]]) -> Tuple[float, float, float, float]:
    """(low, high, scale, shift) of the draw for ``key``: value = shift + scale * U(low, high)."""
    prefix, leaf = key.rsplit(".", 1)
    if leaf == "running_mean":
        return -1.0, 1.0, 1.0, 0.0
    if leaf == "running_var":
        return 0.5, 2.0, 1.0, 0.0
    if key == "model.atom_emb.embeddings.weight":
        return -np.sqrt(3.0), np.sqrt(3.0), 1.0, 0.0
    if key in REFERENCE_ENERGIES:
        return -10.0, 0.0, 1.0, 0.0
    if key.startswith("model.conditioner.") and leaf == "W":
        return -1.0, 1.0, 1.0, 0.0
    if prefix.endswith("layer_norm"):
        return -1.0, 1.0, 0.1, 1.0 if leaf == "weight" else 0.0
    if leaf in ("weight", "bias"):
        bound = 1.0 / np.sqrt(shapes[prefix + ".weight"][1])
        return -bound, bound, 1.0, 0.0
    raise KeyError(f"no recipe rule for state_dict key {key!r}")


def recipe_weights(keys_and_shapes: Sequence[Tuple[str, Tuple[int, ...]]], seed: int = 0) -> "OrderedDict[str, np.ndarray]":
    """Recipe weights for state_dict ``keys_and_shapes`` (in state_dict order)."""
    rng = np.random.default_rng(seed)
    shapes = dict(keys_and_shapes)
    out = OrderedDict()
    for key, shape in keys_and_shapes:
        constant = _constant(key, shape)
        if constant is not None:
            out[key] = constant
            continue
        low, high, scale, shift = _uniform_bounds(key, shapes)
        draw = rng.uniform(low, high, size=shape)
        if scale != 1.0:
            draw = scale * draw
        if shift != 0.0:
            draw = shift + draw
        out[key] = np.asarray(draw, dtype=np.float64).astype(np.float32)
    return out


def model_recipe_weights(model, seed: int = 0) -> "OrderedDict[str, np.ndarray]":
    """Recipe weights for a MindSpore orb model (any family or size), keyed like its PyTorch state dict."""
    return recipe_weights([(name, tuple(p.shape)) for name, p in model.parameters_and_names()], seed)


def weights_sha256(weights: Dict[str, np.ndarray]) -> str:
    """sha256 over the little-endian bytes of every array, in order."""
    digest = hashlib.sha256()
    for value in weights.values():
        digest.update(np.ascontiguousarray(value).astype(value.dtype.newbyteorder("<")).tobytes())
    return digest.hexdigest()
