"""``relax``: batched relaxation (orb-relax's BatchRelaxer) against ASE's FIRE driving ORBCalculator one structure
after another, on the same rattled MPtrj-like cells."""

import time

import numpy as np

from .common import calibration, gemm_rate
from .mptrj import mptrj_like_rows


def bench_relax(args) -> None:
    """Batched relaxation (orb-relax's BatchRelaxer) against ASE's FIRE driving ORBCalculator one structure after
    another, on the same MPtrj-like cells (rattled) and the same model: structures per second of each (alternated,
    wall time including compilation), model calls, and the largest difference in final energy per atom."""
    from ase.optimize import FIRE

    from orb.device import configure_mindspore
    from orb.inference.calculator import ORBCalculator
    from orb.inference.relax import BatchRelaxer
    from orb.io.checkpoint import load_torch_state_dict
    from orb.models import create
    from orb.models.recipe import model_recipe_weights

    configure_mindspore("CPU")
    model = create(args.model)
    load_torch_state_dict(model, model_recipe_weights(model, 0))
    model.set_train(False)
    rng = np.random.default_rng(1)
    structures, previous = [], None
    for atoms in mptrj_like_rows(10 ** 9, seed=2):  # one frame of each trajectory
        if previous is None or len(atoms) != previous:
            atoms.calc = None
            atoms.positions += rng.normal(0, 0.05, atoms.positions.shape)
            structures.append(atoms)
        previous = len(atoms)
        if len(structures) == args.structures:
            break
    rate_before = gemm_rate()
    times = {"ASE FIRE loop": [], "orb-relax (batched)": []}
    energies, calls, converged = {}, {}, {}
    for _ in range(args.rounds):
        start = time.perf_counter()
        calc = ORBCalculator(model)
        loop, done = [], 0
        for atoms in structures:
            a = atoms.copy()
            a.calc = calc
            done += bool(FIRE(a, logfile=None).run(fmax=args.fmax, steps=args.steps))
            loop.append(a.get_potential_energy() / len(a))
        converged["ASE FIRE loop"] = done
        times["ASE FIRE loop"].append(time.perf_counter() - start)
        energies["ASE FIRE loop"], calls["ASE FIRE loop"] = loop, "one per step"
        start = time.perf_counter()
        relaxer = BatchRelaxer(model, args.fmax, args.steps, batch_size=args.batch_size)
        batched, done = {}, []

        def finished(r, ok):
            batched[r.source_row] = r.atoms.get_potential_energy() / len(r.atoms)
            done.append(ok)

        relaxer.run(((k, a.copy()) for k, a in enumerate(structures)), finished)
        converged["orb-relax (batched)"] = sum(done)
        times["orb-relax (batched)"].append(time.perf_counter() - start)
        energies["orb-relax (batched)"] = [batched[k] for k in range(len(structures))]
        calls["orb-relax (batched)"] = relaxer.calls
    print(f"host calibration: {calibration(rate_before, gemm_rate())}")
    sizes = [len(a) for a in structures]
    print(f"{len(structures)} MPtrj-like cells ({min(sizes)}-{max(sizes)} atoms, mean {np.mean(sizes):.0f}), rattled "
          f"0.05 Å; {args.model} (recipe weights), FIRE to fmax {args.fmax} or {args.steps} steps, batches of "
          f"{args.batch_size}; {args.rounds} alternated rounds\n")
    print("| | wall time (s, median) | structures/s | model calls | converged |")
    print("|---|---|---|---|---|")
    for name, values in times.items():
        print(f"| {name} | {np.median(values):.1f} ({', '.join(f'{v:.1f}' for v in values)}) | "
              f"{len(structures) / np.median(values):.2f} | {calls[name]} | {converged[name]} |")
    gaps = np.abs(np.array(energies["ASE FIRE loop"]) - np.array(energies["orb-relax (batched)"]))
    ratio = np.median(times["ASE FIRE loop"]) / np.median(times["orb-relax (batched)"])
    print(f"\nbatched: {ratio:.1f}x the structures per second; final energies differ by at most {gaps.max():.1e} "
          f"eV/atom (median {np.median(gaps):.1e})")
