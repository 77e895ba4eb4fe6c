"""PyTorch peer of ``benchmark.py calculator`` (run with ``--torch-python``: torch and orb-models -- 0.4.2 for
orb_v2, 0.5.5 for orb-v3 -- nothing of the project): orb-models' ORBCalculator (random weights) on fcc Cu cells of
each ``--sizes`` repetition, rattled at every one of ``--steps`` force calls; steps per second, the median after the
first call. Prints one JSON line {atoms: steps/s}."""

import argparse
import json


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__)
    parser.add_argument("--model", required=True, help="orb_v2 or an orb-v3 name")
    parser.add_argument("--sizes", type=json.loads, required=True,
                        help="repetitions of the cubic 4-atom cell, JSON: [[2, 2, 4], [4, 4, 4]]")
    parser.add_argument("--steps", type=int, required=True, help="force calls per size")
    args = parser.parse_args()

    import time

    import numpy as np
    import torch
    torch.set_num_threads(2)

    from torch_builders import orb_v2, orb_v3

    model = orb_v2() if args.model == "orb_v2" else orb_v3(args.model)[0]
    from ase.build import bulk
    from orb_models.forcefield.calculator import ORBCalculator

    model.eval()
    calc = ORBCalculator(model, device="cpu")
    out = {}
    for reps in args.sizes:
        atoms = bulk("Cu", "fcc", a=3.6, cubic=True).repeat(tuple(reps))
        atoms.calc = calc
        ts = []
        for i in range(args.steps):
            atoms.rattle(0.01, seed=i)
            t = time.perf_counter()
            atoms.get_forces()
            ts.append(time.perf_counter() - t)
        out[str(len(atoms))] = 1.0 / float(np.median(ts[1:]))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
