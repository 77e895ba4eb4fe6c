"""The crystals orb-properties checks, and what a neighbour-capped model's graph of them depends on.

Built-in structures are each element's ASE reference state (``ase.data.reference_states``: fcc, bcc, hcp or
diamond with ASE's lattice constants; cubic ones as their conventional cell, so that ``a`` and the elastic
constants are in the cubic axes). A user's structures are read by the readers of every other command.

A model that keeps each atom's ``max_neighbors`` nearest neighbours (orb-v2; orb-v3 ``_20_`` models) must choose
among neighbours at equal distance when the cap falls inside a shell: perfect fcc, bcc and diamond crystals tie
their 20th and 21st neighbours (orb-models too), so the graph, hence the model's numbers, depend on how the tie is
broken, and a displacement or a strain can change which neighbours are kept. :func:`cap_ties` finds such atoms;
:func:`neighbour_key` fingerprints a graph's neighbour sets, so that a distorted cell's graph can be compared with
the undistorted one's. orb-v3 ``_inf_`` models (120 neighbours within 6 Å) do not reach the cap in crystals.
"""

import hashlib
import os
import sqlite3
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from orb.errors import OrbInputError

CUBIC = ("fcc", "bcc", "diamond")
BUILT_IN = CUBIC + ("hcp",)


@dataclass
class Structure:
    """One crystal to check: its name in the report, its atoms, and where it came from."""

    name: str
    atoms: object  # ase.Atoms
    source: str  # "built-in" or the input file (and frame)
    repeat: Tuple[int, int, int] = (1, 1, 1)  # the cell is this repetition of its unit (lattice parameters per unit)


def element_crystals(symbols: Sequence[str]) -> Tuple[List[Structure], List[str]]:
    """Each element's reference crystal (ASE's structure and lattice constant), and a note for each element ASE
    gives none of fcc, bcc, hcp or diamond."""
    from ase.build import bulk
    from ase.data import atomic_numbers, reference_states

    crystals, notes = [], []
    for symbol in symbols:
        if symbol not in atomic_numbers:
            raise OrbInputError(f"--elements: {symbol!r} is not an element symbol")
        state = reference_states[atomic_numbers[symbol]] or {}
        kind = state.get("symmetry")
        if kind not in BUILT_IN:
            notes.append(f"{symbol}: ASE's reference state is {kind or 'unknown'}, not a built-in crystal "
                         "(fcc, bcc, hcp, diamond): give it with --structures")
            continue
        atoms = bulk(symbol, kind, cubic=kind in CUBIC)
        crystals.append(Structure(f"{symbol}_{kind}", atoms, "built-in"))
    return crystals, notes


def trained_elements(checkpoint: str) -> List[str]:
    """The elements of the training data a checkpoint records (its config's ``train_data_path``, when that data is
    still there), sorted by atomic number."""
    from ase.data import chemical_symbols

    from orb.data.formats import readable_database
    from orb.io.checkpoint import read_weights

    _, meta = read_weights(checkpoint)
    path = ((meta or {}).get("config") or {}).get("train_data_path") or ""
    paths = [path] if isinstance(path, str) else list(path)
    if not paths or not all(os.path.exists(p) for p in paths):
        raise OrbInputError(f"--checkpoint {checkpoint} does not record training data that is still there "
                            f"({path or 'none'}): name the elements (--elements Cu Ni) or give --structures")
    database = readable_database(paths[0] if len(paths) == 1 else paths)
    with sqlite3.connect(f"file:{database}?mode=ro", uri=True) as connection:
        numbers = sorted(z for (z,) in connection.execute("SELECT DISTINCT Z FROM species"))
    return [chemical_symbols[z] for z in numbers]


def read_structures(paths: Sequence[str]) -> List[Structure]:
    """The periodic structures of ``paths`` (any format the other commands read, through their reader), named by
    formula and position; a structure without a cell is refused (no equation of state, elastic constants or
    phonons)."""
    from orb.data.dataset import AseDbDataset
    from orb.data.formats import LabelKeys, describe_path, readable_database
    from orb.data.graphs import check_no_overlap_before_graphs
    from orb.errors import StructureError

    data = AseDbDataset(readable_database(list(paths) if len(paths) > 1 else paths[0], LabelKeys(labels=False)),
                        require_labels=False, labels=False)
    data.check_structures()
    where = describe_path(list(paths))
    structures = []
    for i in range(len(data)):
        atoms = data.get_atoms(i)
        atoms.calc = None
        name = atoms.info.get("name") or f"{atoms.get_chemical_formula()}_{int(data.ids[i])}"
        if not atoms.cell.rank == 3 or not atoms.pbc.all():
            raise data.error_at(f"{atoms.info.get('name') or atoms.get_chemical_formula()} is not a 3D periodic "
                                "crystal (cell and pbc on all three axes); orb-properties needs crystals",
                                int(data.ids[i]), "pbc")
        try:  # (atoms on top of each other were found relaxing, after others' work, named by formula only)
            check_no_overlap_before_graphs(atoms.positions, atoms.cell.array, True)
        except StructureError as exc:
            raise data.error_at(str(exc), int(data.ids[i]), "positions") from None
        atoms.info = {}
        row = int(data.ids[i])  # (of several files: its own file and frame, not every file's names and a row number)
        structures.append(Structure(str(name), atoms, data.where(row) if data.sources else f"{where} #{row}"))
    names = [s.name for s in structures]
    for s, row in zip(structures, data.ids):  # names are file names of the plots: unique
        if names.count(s.name) > 1:
            s.name = f"{s.name}_{int(row)}"
    return structures


def neighbour_distances(atoms, settings, extra: int = 1) -> Tuple[np.ndarray, np.ndarray]:
    """Each atom's neighbour distances (Å, nearest first) in the model's own graph construction allowed ``extra``
    more neighbours than its cap: (distances of every edge, each atom's count)."""
    from orb.data.graphs import GraphSettings, atoms_to_graph

    wider = GraphSettings(settings.radius, settings.max_neighbors + extra, settings.minimal_supercell)
    graph = atoms_to_graph(atoms, settings=wider, float64=True)
    lengths = np.linalg.norm(np.asarray(graph.vectors, np.float64), axis=1)
    return lengths, np.bincount(graph.senders, minlength=len(atoms))


def cap_ties(atoms, settings, tolerance: float) -> Dict:
    """Atoms whose last kept neighbour (the ``max_neighbors``-th) and first dropped one are within ``tolerance`` Å:
    the model's graph of this structure depends on how that tie is broken. ``at_cap``: atoms with more neighbours in
    range than the cap (whose graph the cap limits at all); ``smallest_gap``: over those, Å."""
    k = settings.max_neighbors
    lengths, counts = neighbour_distances(atoms, settings)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    capped = counts > k
    gaps = lengths[starts[capped] + k] - lengths[starts[capped] + k - 1]
    return {"cap": int(k), "at_cap": int(capped.sum()), "tied": int((gaps <= tolerance).sum()),
            "smallest_gap": float(gaps.min()) if len(gaps) else None, "tolerance": tolerance}


def neighbour_key(atoms, graph) -> str:
    """A fingerprint of the neighbour sets of ``graph`` (the model's graph of ``atoms``): each edge as (sender,
    receiver, the receiver's image counted from the atoms' unwrapped positions), so that a displacement that wraps an
    atom across the cell does not count as a change, and a strained cell of the same neighbours has the same key."""
    cell = np.asarray(atoms.cell.array, np.float64)
    unwrapped = np.linalg.solve(cell.T, np.asarray(atoms.positions, np.float64).T).T
    wrapped = np.linalg.solve(cell.T, np.asarray(graph.positions, np.float64).T).T
    moved = np.rint(wrapped - unwrapped).astype(np.int64)
    s, r = np.asarray(graph.senders, np.int64), np.asarray(graph.receivers, np.int64)
    images = np.rint(np.asarray(graph.unit_shifts, np.float64)).astype(np.int64) + moved[r] - moved[s]
    edges = np.column_stack([s, r, images])
    edges = edges[np.lexsort(edges.T[::-1])]
    return hashlib.sha256(np.ascontiguousarray(edges).tobytes()).hexdigest()


def whole_neighbourhood_repeat(atoms, settings) -> Tuple[int, int, int]:
    """The repetition of a built-in cell whose graph holds every atom's nearest neighbours of the crystal: orb-v2
    searches only the 27 cells around the home cell, so a small cell misses neighbours (its energy is not the
    crystal's); each cell width must reach past the farthest neighbour the graph keeps, plus one (the tie check's).
    orb-v3 searches the exact supercell: no repetition."""
    if settings.minimal_supercell:
        return (1, 1, 1)
    cell = np.asarray(atoms.cell.array, np.float64)
    volume = abs(np.linalg.det(cell))
    widths = np.array([volume / np.linalg.norm(np.cross(cell[(j + 1) % 3], cell[(j + 2) % 3])) for j in range(3)])
    big = atoms.repeat([int(np.ceil(settings.radius / w)) for w in widths])  # every neighbour within the radius
    lengths, _ = neighbour_distances(big, settings)
    reach = float(lengths.max()) + 1e-3
    return tuple(int(max(1, np.ceil(reach / w))) for w in widths)


def repeat_of(*repeats: Sequence[int]) -> Tuple[int, int, int]:
    """The repetition that satisfies every model's."""
    return tuple(int(max(r[j] for r in repeats)) for j in range(3))


def unit_of(atoms, repeat: Sequence[int], count: Optional[int] = None):
    """The unit cell of a repeated cell (``atoms.repeat`` order: the first ``count`` atoms are the unit's), its
    cell divided by ``repeat``, its masses kept (a structure's own, as orb-md's): what phonopy takes as its unit
    cell."""
    from ase import Atoms

    n = count if count is not None else len(atoms) // int(np.prod(repeat))
    cell = np.asarray(atoms.cell.array, np.float64) / np.asarray(repeat, np.float64)[:, None]
    return Atoms(numbers=atoms.numbers[:n], positions=atoms.positions[:n], cell=cell, pbc=True,
                 masses=atoms.get_masses()[:n])


def close_packed_companion(structure: Structure) -> Structure:
    """The element's hcp crystal (ideal c/a) at the volume per atom of ``structure``: close-packed, 12 + 6 + 2
    neighbours before a gap of 6 %, so a 20-neighbour model's graph of it ties nothing; added where the element's own
    crystal ties at the cap, so that each element has numbers that do not depend on tie-breaking."""
    from ase.build import bulk

    symbol = structure.atoms.get_chemical_symbols()[0]
    volume = structure.atoms.get_volume() / len(structure.atoms)
    a = (np.sqrt(2.0) * volume) ** (1.0 / 3.0)  # ideal hcp: volume per atom a^3 / sqrt(2)
    return Structure(f"{symbol}_hcp", bulk(symbol, "hcp", a=a, covera=np.sqrt(8.0 / 3.0)), "built-in")
