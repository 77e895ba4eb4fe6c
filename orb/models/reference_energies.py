"""Per-element reference energies (eV) for the energy head's linear reference model.

orb-v2 was trained with the "vasp-shifted" reference: single-atom VASP energies of elements
1-88 (0 beyond), all shifted by one constant. The residual statistics initialise the energy
normaliser (per-atom residual mean and standard deviation over MPtrj). A pretrained checkpoint
overrides all of these with its stored values.
"""

import json
import os
from functools import lru_cache
from typing import Dict, Tuple

import numpy as np
from ase.data import atomic_numbers

from orb.errors import ConfigError

NUM_REFERENCE_ELEMENTS = 118  # index = atomic number; the weight has no entry for Z = 118
VASP_SHIFT = -4.9073374088488535
RESIDUAL_MEAN_PER_ATOM = 0.17320099403091083
RESIDUAL_STD_PER_ATOM = 1.3603868419157275

# Single-atom VASP energies, Z = 1..88.
_VASP_SINGLE_ATOM = np.array([
    -1.11725225e+00, 7.69290000e-04, -3.22788480e-01, -4.47021900e-02, -2.90627280e-01, -1.26297013e+00,  # Z 1-6 (H..C)
    -3.12415058e+00, -1.54795922e+00, -4.39757050e-01, -1.25673900e-02, -2.63927430e-01, -1.92670300e-02,  # Z 7-12 (N..Mg)
    -2.11267040e-01, -8.24799500e-01, -1.88734631e+00, -8.91048980e-01, -2.58371430e-01, -2.50008000e-02,  # Z 13-18 (Al..Ar)
    -2.71936150e-01, -7.11147600e-02, -2.06076796e+00, -2.42753196e+00, -3.57144559e+00, -5.45540047e+00,  # Z 19-24 (K..Cr)
    -5.15708214e+00, -3.31393675e+00, -1.84639284e+00, -6.32812480e-01, -2.38017450e-01, -1.41047600e-02,  # Z 25-30 (Mn..Zn)
    -2.06349980e-01, -7.77477960e-01, -1.70160351e+00, -7.84231510e-01, -2.27541260e-01, -2.26104900e-02,  # Z 31-36 (Ga..Kr)
    -2.79760570e-01, -9.92851900e-02, -2.18560872e+00, -2.26603086e+00, -3.14842282e+00, -4.61199158e+00,  # Z 37-42 (Rb..Mo)
    -3.34329762e+00, -2.48233722e+00, -1.27872811e+00, -1.47784242e+00, -2.04068960e-01, -1.89639300e-02,  # Z 43-48 (Tc..Cd)
    -1.88520140e-01, -6.76700640e-01, -1.42966694e+00, -6.57608340e-01, -1.89308030e-01, -1.20491300e-02,  # Z 49-54 (In..Xe)
    -3.07991050e-01, -1.58601400e-01, -4.89728600e-01, -1.35031403e+00, -3.31509450e-01, -3.23660410e-01,  # Z 55-60 (Cs..Nd)
    -3.15316610e-01, -3.11184530e-01, -8.44684689e+00, -1.04408371e+01, -2.30922790e-01, -2.26295040e-01,  # Z 61-66 (Pm..Dy)
    -2.92747580e-01, -2.92191740e-01, -2.91465170e-01, -3.80611000e-02, -2.87691040e-01, -3.51528971e+00,  # Z 67-72 (Ho..Hf)
    -3.51343142e+00, -4.64232388e+00, -2.88816624e+00, -1.46089612e+00, -5.36042350e-01, -1.87182020e-01,  # Z 73-78 (Ta..Pt)
    -1.33549100e-02, -1.68142250e-01, -6.25378750e-01, -1.32291753e+00, -3.26246040e-01, -1.10239294e+00,  # Z 79-84 (Au..Po)
    -2.30839543e+00, -4.61968511e+00, -7.30638139e+00, -1.04613411e+01,  # Z 85-88 (At..Ra)
])


def vasp_shifted() -> np.ndarray:
    """The (118,) float64 "vasp-shifted" coefficients; index 0 is unused and 0."""
    coefficients = np.full(NUM_REFERENCE_ELEMENTS, VASP_SHIFT)
    coefficients[0] = 0.0
    coefficients[1:1 + len(_VASP_SINGLE_ATOM)] += _VASP_SINGLE_ATOM
    return coefficients


TABLES_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "reference_tables.json")


@lru_cache(maxsize=None)
def _tables() -> Dict[str, dict]:
    with open(TABLES_FILE) as f:
        return json.load(f)["tables"]


def table_names() -> Tuple[str, ...]:
    """The published reference-energy tables of orb-models 0.7.0 (``reference_tables.json``, with its source)."""
    return tuple(_tables())


def reference_table(name: str) -> np.ndarray:
    """The (118,) float64 coefficients of a published table, by orb-models' name (e.g. ``vasp-r2scan``,
    ``matpes-pbe``, ``omol25-hof-lin``): the per-element energies of another DFT setup's fits."""
    tables = _tables()
    if name not in tables:
        raise ConfigError(f"config key 'reference_energies.table': unknown table '{name}'; valid names: "
                          f"{', '.join(tables)}")
    return np.asarray(tables[name]["coefficients"], dtype=np.float64)


# eV per atom: above any atom's total energy (an all-electron uranium atom's is about 8e5 eV), and far enough below
# float32's range that a structure's sum of them stays finite (1e300 made every step's loss NaN after an epoch)
REFERENCE_LIMIT = 1e7


def load_reference_file(path: str, base: np.ndarray) -> np.ndarray:
    """Override entries of ``base`` from a JSON file ``{"H": -3.4, "O": -4.9, ...}`` (eV per atom)."""
    try:
        with open(path) as f:
            table: Dict[str, float] = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"reference_energies.file {path}: cannot read JSON ({exc})") from None
    if not isinstance(table, dict):
        raise ConfigError(f"reference_energies.file {path}: expected an object mapping element symbols to eV")
    out = np.array(base, dtype=np.float64)
    for symbol, value in table.items():
        z = atomic_numbers.get(symbol)
        if z is None or not 0 < z < NUM_REFERENCE_ELEMENTS:
            raise ConfigError(f"reference_energies.file {path}: unknown or unsupported element '{symbol}'")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not abs(value) < REFERENCE_LIMIT:
            raise ConfigError(f"reference_energies.file {path}: energy of '{symbol}' must be a number of eV per atom "
                              f"below {REFERENCE_LIMIT:g} in size, got {value!r}")
        out[z] = float(value)
    return out
