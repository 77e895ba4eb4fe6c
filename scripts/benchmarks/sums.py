"""Sums that grow with the structure (docs/numerics.md): how far a supercell's energy is from n times its cell's, and
how much the order of the atoms moves energy and stress, in float32 ulps of the result.

    python scripts/benchmarks/sums.py [--torch-python PATH] [--families orb_v2,...]

Run by path from any checkout (it imports the ``orb`` beside it, so an older checkout gives the "before" numbers).
Rows: the reduced models of tests/test_sums.py (random weights, the published reference energies) on a 16-atom hcp
CuAu cell (rattled) and its 1,024- and 8,192-atom supercells; then a full-size orb-v2 (random weights, seed 5) on
the same 1,024 atoms and on perfect hcp Cu (16 and 1,024 atoms), and with ``--torch-python`` (torch + orb-models
0.4.2) orb-models' float32 and float64 energies of the 1,024 CuAu atoms (not of perfect Cu: its neighbours tie at
the cap of 20, and the two sides -- even orb-models in float32 and float64 -- keep different ones).
"""

import argparse
import os
import subprocess
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
TINY = dict(latent_dim=16, mlp_hidden_dim=32, num_mlp_layers=1, num_message_passing_steps=1, head_mlp_hidden_dim=16,
            num_rbf=4)


def ulp(value) -> float:
    return float(np.spacing(np.float32(np.abs(value).max())))


def alloy_cell():
    from ase.build import bulk

    cell = bulk("Cu", "hcp", a=2.56, c=4.17).repeat((2, 2, 2))
    cell.numbers[::4] = 79
    cell.rattle(0.05, seed=1)
    return cell


def wrapped(atoms):
    from orb.data.graphs import wrap_positions64

    atoms = atoms.copy()
    atoms.positions = wrap_positions64(atoms.positions, atoms.cell.array)
    return atoms


def predict(calculator, atoms):
    atoms = atoms.copy()
    atoms.calc = calculator
    return atoms.get_potential_energy(), atoms.get_stress()


def reduced_rows(name: str) -> list:
    """(quantity, value, ulps) of a reduced model."""
    from orb.inference.calculator import ORBCalculator
    from orb.models import create

    model = create(name, **TINY)
    model.set_train(False)
    calculator = ORBCalculator(model)
    cell = alloy_cell()
    e_cell = predict(calculator, cell)[0]
    rows = []
    for repeat in (4, 8):
        big = cell.repeat((repeat,) * 3)
        energy, stress = predict(calculator, big)
        n = len(big) // len(cell)
        rows.append((f"E({len(big)}) - {n} E(16)", energy - n * e_cell, (energy - n * e_cell) / ulp(energy)))
    for label, order in (("random", np.random.default_rng(0).permutation(len(big))),
                         ("Cu first", np.argsort(big.numbers, kind="stable"))):
        e_order, s_order = predict(calculator, big[order])
        rows.append((f"E(8192, {label} order) - E(8192)", e_order - energy, (e_order - energy) / ulp(energy)))
        worst = float(np.abs(s_order - stress).max())
        rows.append((f"max |stress(8192, {label} order) - stress(8192)| (eV/Å³)", worst, worst / ulp(stress)))
    return rows


def full_size_rows(torch_python: str) -> list:
    from ase.build import bulk

    from orb.inference.calculator import ORBCalculator
    from orb.io.checkpoint import to_torch_state_dict
    from orb.io.torch_format import write_torch_checkpoint
    from orb.models import create

    model = create("orb_v2", seed=5)
    model.set_train(False)
    calculator = ORBCalculator(model)
    copper = bulk("Cu", "hcp", a=2.56, c=4.17)
    named = {"CuAu16": wrapped(alloy_cell()), "CuAu1024": wrapped(alloy_cell().repeat((4, 4, 4))),
             "Cu16": wrapped(copper.repeat((2, 2, 2))), "Cu1024": wrapped(copper.repeat((8, 8, 8)))}
    ours = {n: predict(calculator, a)[0] for n, a in named.items()}
    rows = [(f"full orb-v2: E({k}1024) - 64 E({k}16)", ours[f"{k}1024"] - 64 * ours[f"{k}16"],
             (ours[f"{k}1024"] - 64 * ours[f"{k}16"]) / ulp(ours[f"{k}1024"])) for k in ("CuAu", "Cu")]
    if not torch_python:
        return rows
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "weights.ckpt")
        write_torch_checkpoint(to_torch_state_dict(model), path)
        arrays = {"names": np.array(list(named))}
        for n, atoms in named.items():
            arrays[f"{n}/numbers"], arrays[f"{n}/positions"] = atoms.numbers, atoms.positions
            arrays[f"{n}/cell"] = atoms.cell.array
        np.savez(os.path.join(tmp, "structures.npz"), **arrays)
        for precision in ("float32-highest", "float64"):
            out = os.path.join(tmp, f"{precision}.npz")
            subprocess.run([torch_python, os.path.join(ROOT, "tests", "torch_peer.py"), "orb_v2", path,
                            os.path.join(tmp, "structures.npz"), out, precision], check=True, capture_output=True)
            theirs = {n: float(np.load(out)[f"{n}/energy"][0]) for n in named}
            n = "CuAu1024"  # (perfect Cu's tied neighbours make the two sides' graphs differ: no comparison)
            rows.append((f"full orb-v2: ours - orb-models {precision}, {n}", ours[n] - theirs[n],
                         (ours[n] - theirs[n]) / ulp(theirs[n])))
            if precision == "float32-highest":
                drift = theirs["CuAu1024"] - 64 * theirs["CuAu16"]
                rows.append(("orb-models float32: E(CuAu1024) - 64 E(CuAu16)", drift, drift / ulp(theirs["CuAu1024"])))
    return rows


def build_parser() -> argparse.ArgumentParser:
    """This script's command line (the docs test parses its documented commands with it)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--torch-python", default="", help="python with torch and orb-models 0.4.2 (optional)")
    parser.add_argument("--families", default="orb_v2,orb_v3_direct_20_omat,orb_v3_conservative_20_omat")
    parser.add_argument("--no-full-size", action="store_true", help="only the reduced models")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    from orb.device import configure_mindspore

    configure_mindspore("CPU")
    print(f"checkout: {ROOT}\n\n| model | quantity | value (eV) | float32 ulps |\n|---|---|---|---|")
    for name in args.families.split(","):
        for quantity, value, ulps in reduced_rows(name):
            print(f"| {name} (reduced) | {quantity} | {value:+.3g} | {ulps:+.1f} |", flush=True)
    if not args.no_full_size:
        for quantity, value, ulps in full_size_rows(args.torch_python):
            print(f"| orb_v2 (full size) | {quantity} | {value:+.3g} | {ulps:+.1f} |", flush=True)


if __name__ == "__main__":
    main()
