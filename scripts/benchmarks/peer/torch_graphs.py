"""PyTorch peer of ``benchmark.py graphs`` (run with ``--torch-python``: torch and orb-models 0.4.2, nothing of the
project): orb-models' ``ase_atoms_to_atom_graphs`` on every structure of each database, structures per second (the
median over ``--repeats`` timings of about ``--structures`` graphs). Prints one JSON line {database path: rate}."""

import argparse


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__)
    parser.add_argument("paths", nargs="+", help="ASE databases")
    parser.add_argument("--structures", type=int, required=True, help="graphs per timing (at least one pass)")
    parser.add_argument("--repeats", type=int, required=True, help="timings; the median is reported")
    args = parser.parse_args()

    import json
    import time

    import ase.db
    import numpy as np
    import torch
    torch.set_num_threads(2)
    from orb_models.forcefield.atomic_system import ase_atoms_to_atom_graphs

    out = {}
    for path in args.paths:
        atoms = [r.toatoms() for r in ase.db.connect(path).select()]
        reps = max(1, args.structures // len(atoms))

        def once():
            for a in atoms:
                ase_atoms_to_atom_graphs(a, brute_force_knn=False, device=torch.device("cpu"))

        once()
        ts = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            for _ in range(reps):
                once()
            ts.append((time.perf_counter() - t) / (reps * len(atoms)))
        out[path] = 1.0 / float(np.median(ts))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
