"""Write EMT-labelled train/val ASE databases for the demo and the tests.

Structures: fcc Cu/Al/Ni/Pd/Ag/Pt/Au in primitive and conventional supercells, random binary
alloys, rattled and strained cells, and a few non-periodic clusters (zero cell, zero stress).
Labels (energy, forces, stress) come from ASE's EMT calculator and are stored as calculator
results, as MPtrj-style databases store them. Deterministic for a given seed.

    python scripts/make_demo_dataset.py --out data --train 64 --val 16 --seed 0
    python scripts/make_demo_dataset.py --out narrow --prefix narrow --metals Cu,Ni --cluster_fraction 0 --seed 31
"""

import argparse
import math
import os
import sys
from typing import List, Sequence

import numpy as np
from ase import Atoms
from ase.build import bulk
from ase.calculators.emt import EMT
from ase.calculators.singlepoint import SinglePointCalculator
from ase.cluster import Icosahedron, Octahedron
from ase.data import atomic_numbers, reference_states

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # orb, for its atomic writes

METALS = ["Cu", "Al", "Ni", "Pd", "Ag", "Pt", "Au"]


def _lattice_constant(symbols: List[str]) -> float:
    return float(np.mean([reference_states[atomic_numbers[s]]["a"] for s in symbols]))


def random_bulk(rng: np.random.Generator, max_rattle: float = 0.12, metals: Sequence[str] = METALS) -> Atoms:
    """A rattled, strained fcc supercell of one metal or a random binary alloy of ``metals``."""
    metals = list(rng.choice(list(metals), size=2, replace=False))
    alloy = rng.random() < 0.4
    a = _lattice_constant(metals if alloy else metals[:1])
    kind = rng.integers(4)
    if kind == 0:
        atoms = bulk(metals[0], "fcc", a=a).repeat((2, 2, 2))  # 8 atoms
    elif kind == 1:
        atoms = bulk(metals[0], "fcc", a=a, cubic=True).repeat((2, 1, 1))  # 8 atoms
    elif kind == 2:
        atoms = bulk(metals[0], "fcc", a=a, cubic=True).repeat((2, 2, 1))  # 16 atoms
    else:
        atoms = bulk(metals[0], "fcc", a=a).repeat((3, 2, 2))  # 12 atoms
    if alloy:
        symbols = np.array(atoms.get_chemical_symbols())
        symbols[rng.random(len(atoms)) < rng.uniform(0.2, 0.6)] = metals[1]
        atoms.set_chemical_symbols(symbols.tolist())
    strain = np.eye(3) + rng.uniform(-0.03, 0.03, (3, 3))
    atoms.set_cell(atoms.cell.array @ (0.5 * (strain + strain.T)), scale_atoms=True)
    atoms.rattle(stdev=float(rng.uniform(0.02, max_rattle)), seed=int(rng.integers(2**31)))
    return atoms


def random_cluster(rng: np.random.Generator, metals: Sequence[str] = METALS) -> Atoms:
    """A rattled non-periodic cluster (all-zero cell)."""
    metal = str(rng.choice(list(metals)))
    a = _lattice_constant([metal])
    atoms = Icosahedron(metal, 2, latticeconstant=a) if rng.random() < 0.5 else Octahedron(metal, 3, 1, latticeconstant=a)
    atoms.rattle(stdev=0.05, seed=int(rng.integers(2**31)))
    atoms.set_cell(np.zeros((3, 3)))
    atoms.pbc = False
    return atoms


def label(atoms: Atoms) -> Atoms:
    """Attach EMT energy, forces and stress (zero for non-periodic clusters) as stored results."""
    atoms.calc = EMT()
    energy = atoms.get_potential_energy()
    forces = atoms.get_forces()
    stress = atoms.get_stress() if atoms.pbc.any() else np.zeros(6)
    atoms.calc = SinglePointCalculator(atoms, energy=energy, forces=forces, stress=stress)
    return atoms


def make_structures(count: int, seed: int, cluster_fraction: float = 0.1, max_rattle: float = 0.12,
                    metals: Sequence[str] = METALS) -> List[Atoms]:
    rng = np.random.default_rng(seed)
    return [label(random_cluster(rng, metals) if rng.random() < cluster_fraction
                  else random_bulk(rng, max_rattle, metals))
            for _ in range(count)]


def write_db(path: str, structures: List[Atoms]) -> None:
    """The database written aside and renamed into place: an earlier one stays whole until then."""
    import ase.db

    from orb.io.files import write_atomically

    def write(tmp: str) -> None:
        with ase.db.connect(tmp, type="db") as db:
            for atoms in structures:
                db.write(atoms)

    write_atomically(path, write, suffix=".db")


def build_parser():
    """This script's command line (the docs test parses its documented commands with it)."""
    from orb.commands import HelpFormatter

    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--out", default="data", help="output folder")
    parser.add_argument("--train", type=int, default=64, help="training structures")
    parser.add_argument("--val", type=int, default=16, help="validation structures")
    parser.add_argument("--seed", type=int, default=0, help="random seed of the structures")
    parser.add_argument("--prefix", default="demo", help="file names <prefix>_train.db, <prefix>_val.db")
    parser.add_argument("--max_rattle", type=float, default=0.12, help="largest rattle stdev (Å)")
    parser.add_argument("--metals", default=",".join(METALS),
                        help=f"comma-separated fcc metals to draw from (default: {','.join(METALS)})")
    parser.add_argument("--cluster_fraction", type=float, default=0.1, help="share of non-periodic clusters")
    return parser


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    metals = [m.strip() for m in args.metals.split(",") if m.strip()]
    unknown = [m for m in metals if m not in METALS]
    if len(metals) < 2 or unknown:
        parser.error(f"--metals needs at least two of {','.join(METALS)}" + (f" (unknown: {unknown})" if unknown else ""))
    for name, ok in (("--train and --val must be >= 1", args.train >= 1 and args.val >= 1),
                     ("--seed must be 0 to 2^32 - 2", 0 <= args.seed < 2 ** 32 - 1),
                     ("--max_rattle must be a finite number >= 0", math.isfinite(args.max_rattle)
                      and args.max_rattle >= 0),
                     ("--cluster_fraction must be from 0 to 1", 0 <= args.cluster_fraction <= 1)):
        if not ok:
            parser.error(name)
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        parser.error(f"--out {args.out} is a file; name a folder")
    os.makedirs(args.out, exist_ok=True)
    for name, count, seed in ((f"{args.prefix}_train.db", args.train, args.seed),
                              (f"{args.prefix}_val.db", args.val, args.seed + 1)):
        path = os.path.join(args.out, name)
        write_db(path, make_structures(count, seed, args.cluster_fraction, args.max_rattle, metals))
        print(f"wrote {count} EMT-labelled structures to {path}")


if __name__ == "__main__":
    main()
