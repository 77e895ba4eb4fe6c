"""An ASE calculator for orb models: relaxations and molecular dynamics with a fine-tuned model.

    from orb.inference.calculator import ORBCalculator
    atoms.calc = ORBCalculator.from_checkpoint("outputs/run/checkpoints/best_weights.ckpt")
    BFGS(atoms).run(fmax=0.05)

Graphs are built exactly as in training. On the CPU the forward pass is compiled once for systems
of every size, and a size met more than 100 times (an MD run) gets a graph of its own; elsewhere
it is compiled once per padded system size and reused across MD steps
(:mod:`orb.inference.predictor`).
orb-v2 and orb-v3 direct models predict forces and stress directly; orb-v3 conservative models
return the derivatives of their energy (energy-conserving MD). orb-v3 models also give
``confidence``: per atom, the predicted distribution of its force error over 50 bins from 0 to
0.3 eV/Å, and ``force_error``: its expectation, the atom's predicted force error in eV/Å
(``atoms.calc.results["force_error"]``; :mod:`orb.inference.uncertainty`). OMol models read the total
charge and spin from ``atoms.info["charge"]`` and
``atoms.info["spin"]``. ``dispersion="d3bj"`` (with the ``xc`` functional of the training data,
default PBE) adds DFT-D3(BJ) energy, forces and stress from the ``dftd3`` package
(:mod:`orb.inference.dispersion`; ``pip install .[d3]``), as orb-models 0.7.0's ``D3SumModel``.
"""

import os
from typing import Dict, Optional, Tuple

import numpy as np
from ase.calculators.calculator import Calculator, all_changes

from orb.data.graphs import atoms_to_graph, model_sees_periodic
from orb.errors import OrbInputError
from orb.inference.predictor import Predictor, per_structure
from orb.inference.uncertainty import per_atom_error


ASE_KEYWORDS = ("restart", "ignore_bad_restart_file", "label", "atoms", "directory")  # ase Calculator's own


def check_keywords(kwargs: Dict, allowed, own: Tuple[str, ...]) -> None:
    """A keyword the calculator does not know is refused, naming the closest valid one and the method's own
    parameters ``own`` before ASE's (ASE's Calculator takes any keyword as a parameter and ignores it: a misspelt
    ``dispersion`` or a ``precision`` given to an older version computed without a word)."""
    import difflib

    unknown = sorted(set(kwargs) - set(allowed))
    if unknown:
        valid = list(own) + sorted(set(allowed) - set(own))
        close = difflib.get_close_matches(unknown[0], valid, n=1, cutoff=0.5) or [
            name for name in own if name.startswith(unknown[0])][:1]
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise TypeError(f"ORBCalculator got unknown keyword(s) {unknown}{hint}; valid: {', '.join(valid)}")


def same_value(a, b) -> bool:
    """Whether two ``atoms.info`` values are the same (numbers, arrays or anything else; NaN is never the same)."""
    try:
        return bool(np.array_equal(np.asarray(a), np.asarray(b)))
    except (TypeError, ValueError):
        return a is b


def model_in_precision(model, name: str):
    """A copy of ``model`` (its weights and buffers) built to compute in precision ``name`` (:mod:`orb.precision`: a
    model computes in the precision in force when it was built), checked against the device it would run on."""
    import mindspore as ms

    from orb import precision
    from orb.device import matmul_precision_in_force, set_matmul_precision
    from orb.errors import ConfigError
    from orb.io.checkpoint import model_from_state_dict, to_torch_state_dict

    precision.check_precision(name)
    target = ms.get_context("device_target")
    precision.check_device(name, target)
    wanted, in_force = precision.matmul_precision(name), matmul_precision_in_force()
    if in_force is None:
        set_matmul_precision(target, wanted)
    elif wanted != in_force:  # device-wide: changing it would change every other model of this process
        raise ConfigError(f"precision {name} needs '{wanted}' float32 matrix products on {target}, but this process "
                          f"runs with '{in_force}' (a device-wide setting): use it in a process of its own, e.g. "
                          f"ORBCalculator.from_checkpoint(path, precision={name!r}) in a new script")
    with precision.in_force(name):
        return model_from_state_dict(model.cfg, to_torch_state_dict(model), "the model given to ORBCalculator")


class ORBCalculator(Calculator):
    """ASE calculator: energy, free_energy (= energy), forces and stress from an orb model."""

    implemented_properties = ["energy", "free_energy", "forces", "stress", "confidence", "force_error"]

    def __init__(self, model, dispersion: Optional[str] = None, xc: str = "pbe", precision: Optional[str] = None,
                 **kwargs):
        """``precision`` (as the config key): compute in that mode with a copy of ``model`` built in it (the model
        given is left as it is); by default the model computes in the precision it was built in."""
        from orb.inference.dispersion import D3Dispersion, check_dispersion, check_dispersion_for

        check_keywords(kwargs, ASE_KEYWORDS, ("dispersion", "xc", "precision"))
        if not hasattr(model, "cfg") or not hasattr(model, "predictions"):
            raise TypeError(f"ORBCalculator takes an orb model (orb.models.create, model_from_checkpoint), got "
                            f"{type(model).__name__}; for a checkpoint file use ORBCalculator.from_checkpoint(path)")
        check_dispersion(dispersion, xc)
        check_dispersion_for(model.cfg, dispersion)
        if precision is not None:
            model = model_in_precision(model, precision)
        super().__init__(**kwargs)
        self.model = model
        self.dispersion = D3Dispersion(dispersion, xc, model.cfg.graph_settings()) if dispersion else None
        self.predictor = Predictor(model)  # structures of many sizes: one graph, or few shapes (reused buckets)
        # what this model predicts: a model without a stress head raises ASE's PropertyNotImplementedError for stress
        # (it returned zeros, which an NPT run or a cell relaxation took for zero pressure), orb-v2 for confidence
        self.implemented_properties = [p for p in type(self).implemented_properties
                                       if (p != "stress" or model.cfg.has_stress)
                                       and (p not in ("confidence", "force_error") or model.cfg.family == "orb_v3")]

    def check_state(self, atoms, tol: float = 1e-15):
        """ASE's changes, and a changed total charge or spin (``atoms.info``, which ASE does not compare: an OMol
        model gave the previous charge's energy for a new one on the same geometry)."""
        changes = super().check_state(atoms, tol)
        if self.atoms is not None and not changes:
            for key in ("charge", "spin"):
                if not same_value(self.atoms.info.get(key), atoms.info.get(key)):
                    changes.append(key)
        return changes

    @classmethod
    def from_pretrained(cls, name: str, **kwargs) -> "ORBCalculator":
        """A calculator for orb-models' published weights ``name`` (``orb_v3_conservative_inf_omat``, ``orb_v2``, ...;
        :mod:`orb.pretrained`: downloaded once into the cache, verified at every use); keywords as
        :meth:`from_checkpoint`'s (``precision``, ``device_target``, ``dispersion``, ...)."""
        from orb.pretrained import require_name

        return cls.from_checkpoint(require_name(name), **kwargs)

    @classmethod
    def from_checkpoint(cls, path: str, device_target: str = "auto", model_name: Optional[str] = None,
                        precision: str = "float32-high", ops_profile: str = "auto", **kwargs) -> "ORBCalculator":
        """A calculator for a PyTorch or MindSpore checkpoint, or published weights by name (its architecture is read
        from the file;
        ``model_name`` tells a published orb-v3 file's 20- from its unlimited-neighbour variant;
        ``precision`` and ``ops_profile`` as the training config's keys of those names (``matmul_precision`` high |
        highest: the old spelling of precision float32-high | float32-highest); ``dispersion`` and ``xc`` as the
        constructor's)."""
        from orb.device import configure_mindspore, set_ops_profile
        from orb.inference.dispersion import check_dispersion
        from orb.io.checkpoint import model_from_checkpoint

        if "matmul_precision" in kwargs:  # the old spelling
            given = kwargs.pop("matmul_precision")
            if given not in ("high", "highest"):
                raise OrbInputError(f"matmul_precision must be 'high' or 'highest', got {given!r} (it is deprecated: "
                                    "use precision='float32-high' or 'float32-highest')")
            old = f"float32-{given}"
            if precision not in ("float32-high", old):
                raise OrbInputError(f"matmul_precision ({old}) and precision ({precision}) disagree: keep precision")
            import warnings

            warnings.warn(f"matmul_precision is deprecated: use precision={old!r}", DeprecationWarning, stacklevel=2)
            precision = old
        check_keywords(kwargs, ASE_KEYWORDS + ("dispersion", "xc"), ("device_target", "model_name", "precision",
                                                                     "ops_profile", "dispersion", "xc"))
        path = os.fspath(path)  # a pathlib.Path too
        check_dispersion(kwargs.get("dispersion"), kwargs.get("xc", "pbe"))  # before loading any weights
        from orb import precision as numerics

        with numerics.in_force(numerics.precision()):  # models built later keep the precision they would have had
            # (the accelerator's float32 product setting and the operator profile stay: process-wide; the user's
            # numpy keeps its BLAS threads)
            configure_mindspore(device_target, precision=precision, host_blas=False)
            set_ops_profile(ops_profile)
            model = model_from_checkpoint(path, model_name)
        return cls(model, **kwargs)

    def calculate(self, atoms=None, properties=("energy",), system_changes=all_changes):
        super().calculate(atoms, properties, system_changes)
        cfg = self.model.cfg
        if cfg.omol and not {"charge", "spin"} <= set(self.atoms.info):
            raise ValueError(f"{cfg.name} needs the total charge and spin: set atoms.info['charge'] and "
                             "atoms.info['spin']")
        graph = atoms_to_graph(self.atoms, settings=cfg.graph_settings(), float64=self.predictor.float64)
        periodic = model_sees_periodic(self.atoms, cfg.graph_settings())  # a molecule has no stress (ASE's rule)
        one = per_structure(self.predictor(graph), [len(self.atoms)], [periodic])[0]
        confidence = one.pop("confidence", None)
        if self.dispersion is not None:
            d3 = self.dispersion(self.atoms)
            one = {key: one[key] + d3[key] for key in one}
        self.results = dict(one, free_energy=one["energy"])
        if confidence is not None:
            self.results["confidence"] = confidence
            self.results["force_error"] = per_atom_error(confidence)  # eV/Å, orb.inference.uncertainty
