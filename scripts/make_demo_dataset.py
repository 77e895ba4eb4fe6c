"""Write EMT-labelled train/val ASE databases for the demo and the tests.

Structures (``--kind``): ``fcc``, the demo's: fcc Cu/Al/Ni/Pd/Ag/Pt/Au in primitive and conventional
supercells, random binary alloys, rattled and strained cells, and a few non-periodic clusters (zero cell, zero
stress); ``alloy``: fcc cells in which every site draws from all of ``--metals`` (a ternary target);
``rocksalt``: rattled, strained rock-salt oxides MO of ``--metals``; ``molecules``: C/H/N/O molecules of ASE's
g2 set, relaxed with EMT then rattled, without a cell. The last three are narrow fine-tuning targets of another
chemistry than the demo foundation's (scripts/compare_strategies.py): EMT's H, C, N and O parameters are not
physical, so they are targets for the method, not materials. Labels (energy, forces, stress) come from ASE's
EMT calculator and are stored as calculator results, as MPtrj-style databases store them. Deterministic for a
given seed.

    python scripts/make_demo_dataset.py --out data --train 64 --val 16 --seed 0
    python scripts/make_demo_dataset.py --out narrow --prefix narrow --metals Cu,Ni --cluster_fraction 0 --seed 31
    python scripts/make_demo_dataset.py --out narrow --prefix oxide --kind rocksalt --metals Ni,Cu --seed 5
"""

import argparse
import functools
import math
import os
import sys
from typing import List, Sequence, Tuple

import numpy as np
from ase import Atoms
from ase.build import bulk
from ase.calculators.emt import EMT
from ase.calculators.singlepoint import SinglePointCalculator
from ase.cluster import Icosahedron, Octahedron
from ase.data import atomic_numbers, reference_states

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # orb, for its atomic writes

METALS = ["Cu", "Al", "Ni", "Pd", "Ag", "Pt", "Au"]
KINDS = ("fcc", "alloy", "rocksalt", "molecules")


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
    return _strain_and_rattle(atoms, rng, max_rattle)


def random_cluster(rng: np.random.Generator, metals: Sequence[str] = METALS) -> Atoms:
    """A rattled non-periodic cluster (all-zero cell)."""
    metal = str(rng.choice(list(metals)))
    a = _lattice_constant([metal])
    atoms = Icosahedron(metal, 2, latticeconstant=a) if rng.random() < 0.5 else Octahedron(metal, 3, 1, latticeconstant=a)
    atoms.rattle(stdev=0.05, seed=int(rng.integers(2**31)))
    atoms.set_cell(np.zeros((3, 3)))
    atoms.pbc = False
    return atoms


def random_alloy(rng: np.random.Generator, max_rattle: float, metals: Sequence[str]) -> Atoms:
    """A rattled, strained fcc supercell whose sites draw from all ``metals`` at random shares."""
    atoms = bulk(metals[0], "fcc", a=_lattice_constant(list(metals)), cubic=True).repeat((2, int(rng.integers(1, 3)), 1))
    shares = rng.dirichlet(np.ones(len(metals)) * 2)
    atoms.set_chemical_symbols(list(rng.choice(list(metals), size=len(atoms), p=shares)))
    return _strain_and_rattle(atoms, rng, max_rattle)


def _strain_and_rattle(atoms: Atoms, rng: np.random.Generator, max_rattle: float, most: float = 0.03) -> Atoms:
    strain = np.eye(3) + rng.uniform(-most, most, (3, 3))
    atoms.set_cell(atoms.cell.array @ (0.5 * (strain + strain.T)), scale_atoms=True)
    atoms.rattle(stdev=float(rng.uniform(0.02, max_rattle)), seed=int(rng.integers(2**31)))
    return atoms


def emt_rocksalt_constant(metal: str) -> float:
    """The lattice constant at which EMT's rock-salt MO has zero pressure (bisection): EMT's oxygen is not
    physical, so experimental constants would sit far from its minimum."""
    low, high = 3.4, 5.4
    for _ in range(30):
        middle = 0.5 * (low + high)
        atoms = bulk(f"{metal}O", "rocksalt", a=middle)
        atoms.calc = EMT()
        low, high = (middle, high) if atoms.get_stress()[0] < 0 else (low, middle)
    return 0.5 * (low + high)


def random_rocksalt(rng: np.random.Generator, max_rattle: float, metals: Sequence[str]) -> Atoms:
    """A rattled, strained rock-salt oxide cell of one of ``metals`` (8 or 16 atoms), at EMT's own constant."""
    metal = str(rng.choice(list(metals)))
    atoms = bulk(f"{metal}O", "rocksalt", a=emt_rocksalt_constant(metal), cubic=True)
    return _strain_and_rattle(atoms.repeat((int(rng.integers(1, 3)), 1, 1)), rng, max_rattle)


@functools.lru_cache(maxsize=1)
def molecule_names() -> Tuple[str, ...]:
    """ASE's g2 molecules of C, H, N and O with at least three atoms."""
    from ase.build import molecule
    from ase.collections import g2

    return tuple(sorted(n for n in g2.names if set(molecule(n).get_chemical_symbols()) <= {"C", "H", "N", "O"}
                  and len(molecule(n)) >= 3))


def random_molecule(rng: np.random.Generator, max_rattle: float) -> Atoms:
    """A g2 C/H/N/O molecule relaxed with EMT, rattled (at most 0.05 Å: EMT's molecules are stiff), without a
    cell (a non-periodic structure)."""
    from ase.build import molecule
    from ase.optimize import BFGS

    atoms = molecule(str(rng.choice(molecule_names())))
    atoms.calc = EMT()
    BFGS(atoms, logfile=None).run(fmax=0.05, steps=200)
    atoms.calc = None
    atoms.rattle(stdev=float(rng.uniform(0.01, min(max_rattle, 0.05))), seed=int(rng.integers(2**31)))
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
                    metals: Sequence[str] = METALS, kind: str = "fcc") -> List[Atoms]:
    rng = np.random.default_rng(seed)
    if kind == "alloy":
        return [label(random_alloy(rng, max_rattle, metals)) for _ in range(count)]
    if kind == "rocksalt":
        return [label(random_rocksalt(rng, max_rattle, metals)) for _ in range(count)]
    if kind == "molecules":
        return [label(random_molecule(rng, max_rattle)) for _ in range(count)]
    return [label(random_cluster(rng, metals) if rng.random() < cluster_fraction
                  else random_bulk(rng, max_rattle, metals))
            for _ in range(count)]


def write_db(path: str, structures: List[Atoms]) -> None:
    """The database written aside and renamed into place: an earlier one stays whole until then."""
    import ase.db

    from orb.files import write_atomically

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
    parser.add_argument("--cluster_fraction", type=float, default=0.1, help="share of non-periodic clusters (fcc)")
    parser.add_argument("--kind", choices=KINDS, default="fcc", help="which structures (see above)")
    return parser


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    metals = [m.strip() for m in args.metals.split(",") if m.strip()]
    unknown = [m for m in metals if m not in METALS]
    least = 1 if args.kind in ("rocksalt", "molecules") else 2
    if len(metals) < least or unknown:
        parser.error(f"--metals needs at least {least} of {','.join(METALS)}" +
                     (f" (unknown: {unknown})" if unknown else ""))
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
        write_db(path, make_structures(count, seed, args.cluster_fraction, args.max_rattle, metals, args.kind))
        print(f"wrote {count} EMT-labelled structures to {path}")


if __name__ == "__main__":
    main()
