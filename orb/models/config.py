"""Architecture hyper-parameters of orb models (no MindSpore import, so configs load before it).

A model is named as in orb-models' loaders; the name fixes the family (orb-v2 or orb-v3), how
forces are computed (direct heads, or conservative: derivatives of the energy), whether the
model takes total charge and spin (OMol) and its graph (radius, neighbours). The other fields
default to the published architecture of that name and can be overridden (smaller demo models).
"""

from dataclasses import asdict, dataclass, fields
from typing import Dict

from orb.data.graphs import GraphSettings

V3_NAMES = ("orb_v3_conservative_20_omat", "orb_v3_conservative_inf_omat", "orb_v3_direct_20_omat",
            "orb_v3_direct_inf_omat", "orb_v3_conservative_omol", "orb_v3_direct_omol",
            # the same architectures trained on MPtrj + Alexandria (orb-models 0.5.5 and later)
            "orb_v3_conservative_20_mpa", "orb_v3_conservative_inf_mpa", "orb_v3_direct_20_mpa",
            "orb_v3_direct_inf_mpa")
# orb-v2's architecture: orb-v2 itself, trained on MPtrj only, and the D3-corrected models (PBE+D3 labels: the
# dispersion is in their weights; adding D3 again would count it twice) with 15, 10 and 5 message-passing layers
V2_LAYERS = {"orb_v2": 15, "orb_mptraj_only_v2": 15, "orb_d3_v2": 15, "orb_d3_sm_v2": 10, "orb_d3_xs_v2": 5}
V2_NAMES = tuple(V2_LAYERS)
D3_TRAINED = ("orb_d3_v2", "orb_d3_sm_v2", "orb_d3_xs_v2")
MODEL_NAMES = V2_NAMES + V3_NAMES
V3_DEFAULTS = dict(latent_dim=256, mlp_hidden_dim=1024, num_mlp_layers=2, num_message_passing_steps=5, num_rbf=8,
                   rbf_radius=6.0, cutoff_rmax=6.0, polynomial_order=4, head_mlp_hidden_dim=256,
                   head_num_mlp_layers=1, num_elements=118, decoder_out_dim=3, radius=6.0)


@dataclass
class ModelConfig:
    """Architecture hyper-parameters; the defaults are orb-v2's (see :meth:`from_dict` for other names)."""

    name: str = "orb_v2"
    latent_dim: int = 256
    mlp_hidden_dim: int = 512
    num_mlp_layers: int = 2
    num_message_passing_steps: int = 15
    num_rbf: int = 20  # orb-v2: Gaussians of the edge length; orb-v3: Bessel functions
    rbf_radius: float = 10.0
    cutoff_rmax: float = 6.0
    polynomial_order: int = 4
    head_mlp_hidden_dim: int = 256
    head_num_mlp_layers: int = 1
    num_elements: int = 118
    decoder_out_dim: int = 3
    radius: float = 10.0
    max_neighbors: int = 20

    @staticmethod
    def defaults(name: str) -> Dict:
        """The published architecture of ``name``."""
        if name not in V3_NAMES:
            return asdict(ModelConfig(name=name, num_message_passing_steps=V2_LAYERS.get(name, 15)))
        return dict(V3_DEFAULTS, name=name, max_neighbors=20 if "_20_" in name else 120)

    @classmethod
    def from_dict(cls, values: Dict) -> "ModelConfig":
        """``values`` over the defaults of ``values['name']`` (orb-v2 if absent)."""
        names = {f.name for f in fields(cls)}
        unknown = set(values) - names
        if unknown:
            raise TypeError(f"unknown model settings: {sorted(unknown)}")
        return cls(**dict(cls.defaults(values.get("name", "orb_v2")), **values))

    def to_dict(self) -> Dict:
        return asdict(self)

    @property
    def family(self) -> str:
        return "orb_v3" if self.name in V3_NAMES else "orb_v2"

    @property
    def conservative(self) -> bool:
        """Forces and stress are derivatives of the energy (computed by automatic differentiation)."""
        return "conservative" in self.name

    @property
    def d3_trained(self) -> bool:
        """Trained on DFT-D3-corrected labels: its energies include dispersion already."""
        return self.name in D3_TRAINED

    @property
    def omol(self) -> bool:
        """Conditioned on total charge and spin."""
        return self.name.endswith("_omol")

    @property
    def has_stress(self) -> bool:
        """Stress predicted (and trained when the data has it): every model but the direct OMol one, whose
        architecture has no stress head; the conservative OMol model derives it from its energy, as in
        orb-models 0.7.0 (its has_stress became true, #150) -- no weights are added."""
        return not (self.omol and not self.conservative)

    def graph_settings(self) -> GraphSettings:
        return GraphSettings(self.radius, self.max_neighbors, minimal_supercell=self.family == "orb_v3")
