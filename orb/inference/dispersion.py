"""DFT-D3 dispersion added to a model's energy, forces and stress (as orb-models 0.7.0's ``D3SumModel``).

Models trained on PBE data (MPtrj, OMat24) miss most of the van der Waals attraction; a D3
correction restores it. The terms come from the ``dftd3`` package (the Python API of
simple-dftd3, an optional extra: ``pip install .[d3]``) with its own parameters for the
exchange-correlation functional ``xc`` the training data used, so results equal ``dftd3``'s own
ASE calculator. One dispersion model is kept per structure size and updated in place, as an MD
run or a relaxation calls it thousands of times.
"""

import os
import tomllib
from functools import lru_cache
from typing import Dict, List, Optional

import numpy as np
from ase.units import Bohr, Hartree

from orb.data.graphs import model_sees_periodic
from orb.errors import OrbInputError

DAMPING = {"d3bj": ("bj", "RationalDampingParam"), "d3zero": ("zero", "ZeroDampingParam")}
# dftd3 1.x has parameters up to Lr: above it it returns 0 eV (Rf-Nh, Ts), raises (Mc) or crashes the process
# (Fl, Lv, Og), measured with dftd3 1.7.0
D3_MAX_Z = 103
NO_D3 = f"has no DFT-D3 parameters (dftd3 covers H to Lr, Z <= {D3_MAX_Z}): run without --dispersion"
EXTRA = "dispersion needs the dftd3 package: pip install '.[d3]' (or pip install dftd3)"


def _dftd3():
    try:
        import dftd3.interface as interface
    except ImportError:
        raise OrbInputError(EXTRA) from None
    return interface


@lru_cache(maxsize=None)
def functionals(dispersion: str) -> List[str]:
    """The exchange-correlation functionals ``dftd3`` has parameters for with this damping (lower case)."""
    interface = _dftd3()
    path = os.path.join(os.path.dirname(interface.__file__), "parameters.toml")
    with open(path, "rb") as f:
        table = tomllib.load(f)["parameter"]
    key = DAMPING[dispersion][0]
    return sorted(name for name, entry in table.items() if key in entry.get("d3", {}))


def check_dispersion(dispersion: Optional[str], xc: str) -> None:
    """Refuse an unknown damping or functional (listing the valid ones) and a missing ``dftd3``, in one line."""
    if not dispersion:
        if dispersion not in (None, ""):
            raise OrbInputError(f"dispersion must be a name ({', '.join(DAMPING)}) or None, got {dispersion!r}")
        if xc not in (None, "") and str(xc).lower() != "pbe":  # the default; another says D3 was meant
            raise OrbInputError(f"xc {xc!r} chooses DFT-D3's parameters and does nothing without dispersion "
                                f"({', '.join(DAMPING)})")
        return
    if dispersion not in DAMPING:
        raise OrbInputError(f"unknown dispersion {dispersion!r}; valid: {', '.join(DAMPING)}")
    names = functionals(dispersion)
    if not isinstance(xc, str) or xc.lower() not in names:
        raise OrbInputError(f"dispersion {dispersion}: unknown xc {xc!r}; valid: {', '.join(names)}")


def check_dispersion_for(model_cfg, dispersion: Optional[str]) -> None:
    """A model trained on D3-corrected labels (orb_d3_v2, orb_d3_sm_v2, orb_d3_xs_v2) already predicts the
    dispersion: adding D3 would count it twice."""
    if dispersion and model_cfg.d3_trained:
        raise OrbInputError(f"{model_cfg.name} was trained on D3-corrected energies and predicts dispersion itself: "
                            "use it without --dispersion (or a model trained without D3, such as orb_v2)")


def check_dispersion_elements(data, dispersion: Optional[str]) -> None:
    """Before a run with ``dispersion``: every structure of ``data`` (an AseDbDataset) within dftd3's elements, else
    one line naming the first that is not."""
    if dispersion:
        data.check_elements_up_to(D3_MAX_Z, NO_D3)


class D3Dispersion:
    """DFT-D3 energy (eV), forces (eV/Å) and, for periodic structures, stress (eV/Å³, ASE's Voigt order and
    sign) of a structure, with ``dftd3``'s parameters for ``xc``."""

    def __init__(self, dispersion: str, xc: str, settings):
        """``settings``: the model's graph settings (``model.cfg.graph_settings()``), so that D3 sees a structure as
        periodic exactly when the model does (orb-v2 ignores ``pbc``: D3 took a boxed crystal with ``pbc=False``
        as a cluster while the model took it as a crystal)."""
        check_dispersion(dispersion, xc)
        interface = _dftd3()
        self.dispersion, self.xc, self.settings = dispersion, xc.lower(), settings
        self.param = getattr(interface, DAMPING[dispersion][1])(method=self.xc)
        self._model = None
        self._key = None

    def _model_for(self, atoms):
        if len(atoms) and int(np.max(atoms.numbers)) > D3_MAX_Z:  # before dftd3 sees it (it may crash)
            raise OrbInputError(f"{atoms.get_chemical_formula()}: element {int(np.max(atoms.numbers))} {NO_D3}")
        key = (tuple(atoms.numbers), tuple(bool(p) for p in atoms.pbc))
        positions, lattice = atoms.positions / Bohr, np.asarray(atoms.cell[:]) / Bohr
        if key != self._key:
            self._model = _dftd3().DispersionModel(atoms.numbers, positions, lattice, atoms.pbc)
            self._key = key
        else:
            self._model.update(positions, lattice)
        return self._model

    def __call__(self, atoms) -> Dict[str, np.ndarray]:
        periodic = model_sees_periodic(atoms, self.settings)
        if list(atoms.pbc) != [periodic] * 3:
            atoms = atoms.copy()
            atoms.pbc = periodic
        result = self._model_for(atoms).get_dispersion(param=self.param, grad=True)
        out = {"energy": float(result["energy"]) * Hartree,
               "forces": -np.asarray(result["gradient"]) * (Hartree / Bohr)}
        if atoms.pbc.any():
            virial = np.asarray(result["virial"]) * (Hartree / atoms.get_volume())
            out["stress"] = virial.flat[[0, 4, 8, 5, 2, 1]]
        else:
            out["stress"] = np.zeros(6)
        return out
