"""Architecture hyper-parameters of orb models (no MindSpore import, so configs load before it)."""

from dataclasses import asdict, dataclass, fields
from typing import Dict

MODEL_NAMES = ("orb_v2",)


@dataclass
class ModelConfig:
    """Architecture hyper-parameters; the defaults are orb-v2's."""

    name: str = "orb_v2"
    latent_dim: int = 256
    mlp_hidden_dim: int = 512
    num_mlp_layers: int = 2
    num_message_passing_steps: int = 15
    num_rbf: int = 20
    rbf_radius: float = 10.0
    cutoff_rmax: float = 6.0
    polynomial_order: int = 4
    head_mlp_hidden_dim: int = 256
    head_num_mlp_layers: int = 1
    num_elements: int = 118
    decoder_out_dim: int = 3
    radius: float = 10.0
    max_neighbors: int = 20

    @classmethod
    def from_dict(cls, values: Dict) -> "ModelConfig":
        names = {f.name for f in fields(cls)}
        unknown = set(values) - names
        if unknown:
            raise TypeError(f"unknown model settings: {sorted(unknown)}")
        return cls(**values)

    def to_dict(self) -> Dict:
        return asdict(self)
