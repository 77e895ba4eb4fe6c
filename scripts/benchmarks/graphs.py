"""``graphs``: graph construction (``atoms_to_graph``, and a database row to a labelled graph) on the demo and
MPtrj rows, against orb-models 0.4.2's ``ase_atoms_to_atom_graphs`` (``peer/torch_graphs.py``) and, when installed,
vesin's neighbour search."""

import importlib.util
import os

import numpy as np

from .common import DEMO, MPTRJ, median_time, run_torch


def vesin_top_k(atoms, radius: float = 10.0, k: int = 20):
    """The candidate alternative (issue: graphs): vesin's cell-list neighbour search (every pair within
    ``radius``), then each atom's ``k`` nearest by distance. Only measured (vesin is not a dependency)."""
    from vesin import NeighborList

    periodic = bool(atoms.pbc.all() and atoms.cell.rank == 3)
    i, j, shifts, d = NeighborList(cutoff=radius, full_list=True).compute(
        points=atoms.positions, box=atoms.cell.array if periodic else np.zeros((3, 3)), periodic=periodic,
        quantities="ijSd")
    order = np.lexsort((d, i))
    i = i[order].astype(np.int64)
    counts = np.bincount(i, minlength=len(atoms))
    rank = np.arange(len(i)) - np.repeat(np.cumsum(counts) - counts, counts)
    keep = order[rank < k]
    return i[rank < k], j[keep], shifts[keep]


def bench_graphs(args) -> None:
    import ase.db

    from orb.data.dataset import AseDbDataset
    from orb.data.graphs import atoms_to_graph

    rows = []
    for path in (DEMO, MPTRJ):
        atoms = [r.toatoms() for r in ase.db.connect(path).select()]
        reps = max(1, args.structures // len(atoms))
        ds = AseDbDataset(path)
        graph_rate = 1.0 / (median_time(lambda: [atoms_to_graph(a) for _ in range(reps) for a in atoms], 5)
                            / (reps * len(atoms)))
        row_rate = 1.0 / (median_time(lambda: [ds[i] for _ in range(reps) for i in range(len(ds))], 5)
                          / (reps * len(ds)))
        rows.append((path, len(atoms), float(np.mean([len(a) for a in atoms])), graph_rate, row_rate))
        if importlib.util.find_spec("vesin") is None:
            continue
        vesin_rate = 1.0 / (median_time(lambda: [vesin_top_k(a) for _ in range(reps) for a in atoms], 5)
                            / (reps * len(atoms)))
        print(f"{os.path.basename(path)}: vesin + top-20 neighbour search alone {vesin_rate:.0f} structures/s "
              f"(our whole atoms_to_graph: {graph_rate:.0f})")
    torch_rates = {}
    if args.torch_python:
        torch_rates = run_torch(args.torch_python, "torch_graphs.py",
                                ["--structures", str(args.structures), "--repeats", "5", DEMO, MPTRJ])
    print("| data | structures | mean atoms | ours: atoms_to_graph (structures/s) | ours: db row -> graph with labels "
          "(structures/s) | orb-models 0.4.2 (structures/s) | speed-up |")
    print("|---|---|---|---|---|---|---|")
    for path, n, mean_atoms, rate, row_rate in rows:
        theirs = torch_rates.get(path)
        ratio = f"{rate / theirs:.1f}x" if theirs else "-"
        print(f"| {os.path.basename(path)} | {n} | {mean_atoms:.1f} | {rate:.0f} | {row_rate:.0f} | "
              f"{f'{theirs:.0f}' if theirs else '-'} | {ratio} |")
