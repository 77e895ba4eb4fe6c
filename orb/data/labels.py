"""A frame's labels as the user meant them (:mod:`orb.data.formats` indexes files through these): which of a
frame's values is its energy, forces and stress, checked, and said once per file where a file holds something a
reader could mistake (``REF_`` labels beside another calculator's results, a virial, stress in other units)."""

import logging
from typing import Callable, Optional, Sequence, Tuple

import numpy as np

from orb.data.augmentation import matrix_to_voigt
from orb.data.graphs import STRESS_LIMIT
from orb.errors import DatasetError

log = logging.getLogger("orb")
AUTO = {"energy": ("REF_energy", "energy"), "forces": ("REF_forces", "forces"), "stress": ("REF_stress", "stress")}
NO_STRESS = "none"  # stress_key: none: no frame's stress is read (a file with it on some frames then trains none)
VIRIALS = ("REF_virial", "virial", "REF_virials", "virials")  # in eV: stress = -virial / volume (ASE's, QUIP's sign)
# |stress| in eV/Å³ beyond which a label is likely in other units (1 eV/Å³ = 160 GPa; VASP's kBar numbers read as
# eV/Å³ are 1,600 times too large, GPa ones 160 times): said once per file, not refused (shock data exists)
STRESS_PLAUSIBLE = 1.0
FLOAT32_MAX = float(np.finfo(np.float32).max)


def _calculator_result(atoms, name: str):
    calc = atoms.calc
    return None if calc is None else calc.results.get(name)


def _label(atoms, name: str, keys, where: str, at: str, database: bool = False) -> Tuple[object, str]:
    """The frame's ``name`` label by the configured key (required) or the defaults (optional; an ASE database's row:
    its calculator's result only), and the key it was found under (for messages). ``at``: "frame 3" or "row 5"."""
    key = getattr(keys, name)
    table = atoms.arrays if name == "forces" else atoms.info
    if database:
        return _calculator_result(atoms, name), name
    if key:
        if name == "stress" and key.lower() == NO_STRESS:
            return None, name
        if name == "stress" and key.lower() in {v.lower() for v in VIRIALS}:
            raise DatasetError(where, f"stress_key '{key}' names a virial, not a stress: leave stress_key empty (a "
                                      f"virial under {', '.join(VIRIALS)} is read as -virial / volume)",
                               key="stress_key")
        value = table.get(key)
        if value is None:  # (ase keeps an extxyz's free_energy=, energy= among the calculator's results)
            value = _calculator_result(atoms, key)
        if value is None:
            raise DatasetError(where, f"{at} has no {name} under the configured key "
                                      f"({'arrays' if name == 'forces' else 'info'}['{key}'] or the calculator's "
                                      f"'{key}')", key=f"{name}_key")
        return value, key
    reference_key, plain_key = AUTO[name]
    reference, calculated = table.get(reference_key), _calculator_result(atoms, name)
    if reference is not None:
        if calculated is not None and not _same_values(reference, calculated):
            _say_once(where, name, logging.WARNING, "%s, %s: %s read from %s['%s'], not the calculator's %s, which "
                      "differs (said once per file: REF_ entries are the reference labels; name another with %s_key)",
                      where, at, name, "arrays" if name == "forces" else "info", reference_key, name, name)
        return reference, reference_key
    if calculated is not None:
        return calculated, name
    if table.get(plain_key) is not None:
        return table[plain_key], plain_key
    if name == "stress":
        return _stress_from_virial(atoms, where, at)
    return None, name


def _same_values(a, b) -> bool:
    """Equal to 1e-6, a stress as 3x3, 9 or Voigt values alike."""
    try:
        a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
        if a.shape != b.shape and {a.size, b.size} <= {6, 9}:
            from ase.stress import full_3x3_to_voigt_6_stress

            a, b = (full_3x3_to_voigt_6_stress(x.reshape(3, 3)) if x.size == 9 else x for x in (a, b))
        return bool(np.allclose(a, b, rtol=1e-6, atol=1e-6))
    except (TypeError, ValueError):
        return False


def _stress_from_virial(atoms, where: str, at: str) -> Tuple[object, str]:
    """(stress = -virial / volume, the virial's key) from a frame's virial (3x3, 9 or 6 Voigt values, eV), or
    (None, "stress") without one."""
    key = next((k for k in VIRIALS if atoms.info.get(k) is not None), None)
    if key is None:
        return None, "stress"
    try:
        virial = np.asarray(atoms.info[key], dtype=np.float64)
    except (TypeError, ValueError):
        raise DatasetError(where, f"{at}: {key} must be numbers, got {str(atoms.info[key])[:40]!r}", key=key) from None
    if virial.size == 6:  # (ASE's Voigt order: xx, yy, zz, yz, xz, xy)
        from ase.stress import voigt_6_to_full_3x3_stress

        virial = voigt_6_to_full_3x3_stress(virial)
    elif virial.size == 9:
        virial = virial.reshape(3, 3)
    else:
        raise DatasetError(where, f"{at}: {key} of shape {virial.shape}, expected (3, 3), (9,) or (6,)", key=key)
    volume = abs(float(np.linalg.det(np.asarray(atoms.cell, dtype=np.float64))))
    if not atoms.pbc.all() or volume < 1e-6:  # (a molecule's or a slab's virial: no stress of a volume)
        _say_once(where, "virial without a volume", logging.WARNING, "%s, %s: its %s is not read as a stress (no "
                  "periodic cell to divide by: said once per file)", where, at, key)
        return None, "stress"
    _say_once(where, "virial", logging.INFO, "%s: stress read as -%s / volume (eV/Å³)", where, key)
    return -virial / volume, key


_SAID: set = set()  # (file, what) said once: REF_ beside another calculator's result, a virial, stress units


def _say_once(where: str, what: str, level: int, message: str, *args) -> None:
    if (where, what) not in _SAID:
        _SAID.add((where, what))
        log.log(level, message, *args)


def missing_label(name: str, indexed: bool, held: Sequence[str]) -> str:
    """Why a structure has no ``name`` label, for a message: in an ASE database, how to store it; in a file indexed
    from another format, where it was looked for, the frame's other values (``held``: its key-value pairs, where an
    energy under another name is) and the key that names it (MACE's ``energy_key``)."""
    if not indexed:
        return "row has no label (store it with a SinglePointCalculator)"
    table = "arrays" if name == "forces" else "info"
    looked = ", ".join([f"the calculator's {name}"] + [f"{table}['{key}']" for key in AUTO[name]])
    others = f"; its info holds {', '.join(sorted(held)[:8])}" if held and name != "forces" else ""
    return f"row has no {name} (looked for {looked}{others}): name the {table} entry holding it with {name}_key"


def _checked(value, shape_ok, name: str, where: str, at: str, expected: str):
    """``value`` as float64 numbers of an expected shape, all finite; ``at``: "frame 3" or "row 5"."""
    try:
        array = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError):
        raise DatasetError(where, f"{at}: {name} must be numbers, got {str(value)[:40]!r}", key=name) from None
    if not shape_ok(array.shape):
        raise DatasetError(where, f"{at}: {name} of shape {array.shape}, expected {expected}", key=name)
    if not np.all(np.isfinite(array)):
        raise DatasetError(where, f"{at}: {name} contains NaN or inf", key=name)
    return array


def said_if_too_close(closest: Optional[tuple], data: str, at: str, structures: int = 1) -> None:
    """Two atoms nearer than any bond (``closest``: atom, atom, Å; positions in nm, or fractional coordinates read as
    Å) in ``structures`` structures of data set ``data``, said once naming the first, ``at`` (its file and frame or
    row): a model's energies of such a structure are meaningless, and training on it diverges. ``closest`` None: the
    pair is not named (a check read from a cache that another machine's rounding put just across the limit)."""
    pair = "atoms %d and %d are %.2f Å apart" % closest if closest else "two atoms are about 0.5 Å apart"
    _say_once(data, "distances", logging.WARNING, "%s: %s, closer than any chemical "
              "bond (H2's is 0.74 Å; %d structure(s) of this data like it). Positions are read in Å: values in nm or "
              "fractional coordinates must be converted (a deliberate short-range set, such as a dimer curve, is "
              "trained as it is)", at, pair, structures)


def stress_implausible(stress: np.ndarray) -> bool:
    """Whether a finite stress label is beyond :data:`STRESS_PLAUSIBLE` (likely in kBar or GPa)."""
    return bool(np.all(np.isfinite(stress)) and np.max(np.abs(stress)) > STRESS_PLAUSIBLE)


def said_if_implausible(stress: np.ndarray, key: str, where: str, at: str) -> None:
    """Stress labels beyond :data:`STRESS_PLAUSIBLE` (a kBar or GPa file read as eV/Å³), said once per file."""
    largest = float(np.max(np.abs(stress)))
    if largest > STRESS_PLAUSIBLE:
        _say_once(where, "units", logging.WARNING, "%s, %s, key '%s': a stress of %.3g eV/Å³ (%.0f GPa): stress "
                  "labels are read in eV/Å³ (ASE's units and sign); values in kBar or GPa must be converted (x "
                  "1/1602.18 or 1/160.218; VASP's sign is the opposite). Said once per file", where, at, key,
                  largest, largest * 160.21766)


def checked_labels(row, energy, forces, stress, error_at: Callable[..., Exception]):
    """A row's labels as float64 (stress in Voigt form), checked: shapes, finite, within float32's range, stress below
    STRESS_LIMIT; ``error_at(message, row id, key)`` makes the error that names the row."""
    n = row.natoms
    if energy is not None:
        energy = np.asarray(energy, dtype=np.float64)
        if energy.size != 1:
            raise error_at(f"energy must be a scalar, got shape {energy.shape}", row.id, "energy")
        energy = float(energy)
    if forces is not None:
        forces = np.asarray(forces, dtype=np.float64)
        if forces.shape != (n, 3):
            raise error_at(f"forces of shape {forces.shape} for {n} atoms", row.id, "forces")
    if stress is not None:
        stress = np.asarray(stress, dtype=np.float64)
        if stress.shape in ((3, 3), (9,)):  # a full tensor (ASE reads one back flat)
            stress = matrix_to_voigt(stress.reshape(3, 3))
        if stress.shape != (6,):
            raise error_at(f"stress of shape {stress.shape}, expected (6,) or (3, 3)", row.id, "stress")
    for key, value in (("energy", energy), ("forces", forces), ("stress", stress)):
        if value is not None and not np.all(np.isfinite(value)):
            raise error_at("label contains NaN or inf", row.id, key)
        if value is not None and np.max(np.abs(value)) > FLOAT32_MAX:  # inf in the float32 loss: NaN steps
            raise error_at(f"label {np.max(np.abs(value)):.3g} is beyond float32's range (3.4e38): wrong units or a "
                           "corrupted value", row.id, key)
    if stress is not None and np.max(np.abs(stress)) >= STRESS_LIMIT:  # (MISSING_STRESS is above it)
        raise error_at(f"stress {np.max(np.abs(stress)):.3g} eV/Å³ is beyond any stress (over {STRESS_LIMIT:g}): "
                       "wrong units or a corrupted value", row.id, "stress")
    return energy, forces, stress
