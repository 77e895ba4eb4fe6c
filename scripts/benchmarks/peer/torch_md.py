"""PyTorch peer of ``benchmark.py md`` (run with ``--torch-v3-python``: torch and orb-models 0.5.5, nothing of the
project): orb-models' ORBCalculator with the demo's orb-v3 conservative weights (exported by the project to
orb-models' state dict) drives ASE's VelocityVerlet on each structure; per structure the NVE total-energy drift
(eV/atom). Prints one JSON line {"drift": [...], "seconds": s}."""

import argparse
import json


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__)
    parser.add_argument("--weights", required=True, help="orb-models state dict of an orb-v3 conservative model")
    parser.add_argument("--architecture", type=json.loads, required=True,
                        help="orb_v3_conservative_architecture's sizes, JSON")
    parser.add_argument("--structures", required=True, help="extxyz with momenta")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--timestep", type=float, required=True, help="fs")
    args = parser.parse_args()

    import time

    import ase.io
    import torch
    from ase import units
    from ase.md.verlet import VelocityVerlet
    from orb_models.forcefield import atomic_system, pretrained
    from orb_models.forcefield.calculator import ORBCalculator

    torch.set_num_threads(2)
    config = atomic_system.SystemConfig(radius=6.0, max_num_neighbors=20)
    model = pretrained.orb_v3_conservative_architecture(**args.architecture, system_config=config)
    model = pretrained.load_model(model, args.weights, device="cpu", precision="float32-highest", compile=False)
    calculator = ORBCalculator(model, system_config=config, device="cpu")
    drifts, start = [], time.perf_counter()
    for atoms in ase.io.read(args.structures, index=":"):
        atoms.calc = calculator
        energies = []
        dynamics = VelocityVerlet(atoms, timestep=args.timestep * units.fs)
        dynamics.attach(lambda: energies.append(atoms.get_total_energy() / len(atoms)), interval=1)
        dynamics.run(args.steps)
        drifts.append(energies[-1] - energies[0])
    print(json.dumps({"drift": drifts, "seconds": time.perf_counter() - start}))


if __name__ == "__main__":
    main()
