"""Parameter groups of the orb models, by name: what fine-tuning strategies freeze, scale, anchor or adapt.

A group is one of :data:`GROUPS`, or ``layers:I`` / ``layers:I-J`` (message-passing layers I to J,
inclusive, counted from 0). The same names serve orb-v2 and every orb-v3 model, for the target's heads
and (``replay_heads``) the separate replay heads.
"""

import re
from typing import Dict, Iterable, List, Tuple

from orb.errors import ConfigError

# group -> the parameter-path prefixes it holds (orb-v2's and orb-v3's)
PREFIXES: Dict[str, Tuple[str, ...]] = {
    "embeddings": ("model.atom_emb.", "model.conditioner."),
    "encoder": ("model._encoder.",),
    "layers": ("model.gnn_stacks.",),
    "energy_head": ("graph_head.mlp.", "heads.energy.mlp."),
    "forces_head": ("node_head.mlp.", "heads.forces.mlp."),
    "stress_head": ("stress_head.mlp.", "heads.stress."),
    "confidence_head": ("heads.confidence.",),
    "reference_energies": ("graph_head.reference.", "heads.energy.reference."),
    "replay_heads": ("replay_heads.",),
}
GROUPS = tuple(PREFIXES)
HEADS = ("energy_head", "forces_head", "stress_head", "confidence_head")
BACKBONE = ("embeddings", "encoder", "layers")
_LAYERS = re.compile(r"^layers:(\d+)(?:-(\d+))?$")
_LAYER_OF = re.compile(r"^model\.gnn_stacks\.(\d+)\.")


def check_group(name: str, key: str, num_layers: int) -> None:
    """A group name as a config key gives it; one line naming the key and the valid names when it is not one."""
    if name in PREFIXES or name == "heads" or name == "backbone":
        return
    match = _LAYERS.match(name)
    if match:
        first, last = int(match.group(1)), int(match.group(2) or match.group(1))
        if first <= last < num_layers:
            return
        if first > last:
            raise ConfigError(f"config key '{key}': {name!r} runs backwards: write layers:{last}-{first}")
        raise ConfigError(f"config key '{key}': {name!r} names layers the model does not have (it has "
                          f"{num_layers} message-passing layers, 0 to {num_layers - 1})")
    raise ConfigError(f"config key '{key}': unknown parameter group {name!r}; valid: {', '.join(GROUPS)}, heads, "
                      f"backbone, layers:I or layers:I-J")


def in_group(parameter: str, group: str) -> bool:
    """Whether the parameter at path ``parameter`` belongs to ``group`` (``heads``: every head of the target;
    ``backbone``: embeddings, encoder and layers)."""
    if group == "heads":
        return any(in_group(parameter, g) for g in HEADS)
    if group == "backbone":
        return any(in_group(parameter, g) for g in BACKBONE)
    match = _LAYERS.match(group)
    if match:
        first, last = int(match.group(1)), int(match.group(2) or match.group(1))
        layer = _LAYER_OF.match(parameter)
        return layer is not None and first <= int(layer.group(1)) <= last
    return parameter.startswith(PREFIXES[group])


def members(names: Iterable[str], groups: Iterable[str]) -> List[str]:
    """The parameter paths among ``names`` that belong to any of ``groups``."""
    groups = list(groups)
    return [n for n in names if any(in_group(n, g) for g in groups)]


def group_of(parameter: str) -> str:
    """The finest group a parameter belongs to, for the start-up log (``layers:3``, ``encoder``, ..., ``other``)."""
    layer = _LAYER_OF.match(parameter)
    if layer:
        return f"layers:{layer.group(1)}"
    if parameter.startswith("model._decoder."):
        return "decoder (unused)"
    return next((g for g in GROUPS if in_group(parameter, g)), "other")
