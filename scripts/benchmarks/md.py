"""``md``: orb-md (batched dynamics) against ASE's VelocityVerlet driving ORBCalculator one structure after another,
on the same starting structures and model: wall time, steps per second, NVE total-energy drift, peak memory."""

import json
import os
import tempfile
import time

import numpy as np

from .common import DEMO, ROOT, calibration, gemm_rate, mindspore_gemm_rate, peak_memory_gb, run_torch

V3_DEMO = os.path.join(ROOT, "data", "demo_v3_pretrained.ckpt")


def starting_structures(count: int, seed: int = 0):
    """``count`` cells of 20-64 atoms: the demo's structures repeated along their shortest axes, at 300 K."""
    import ase.db
    from ase.md.velocitydistribution import MaxwellBoltzmannDistribution

    rows = [row.toatoms() for row in ase.db.connect(DEMO).select() if row.pbc.all()]
    out = []
    for k in range(count):
        atoms = rows[k % len(rows)].copy()
        atoms.calc = None
        for axis in np.argsort(atoms.cell.lengths()):
            if len(atoms) >= 20:
                break
            atoms = atoms.repeat([2 if a == axis else 1 for a in range(3)])
        MaxwellBoltzmannDistribution(atoms, temperature_K=300, rng=np.random.default_rng([seed, k]))
        out.append(atoms)
    return out


def drift(energies) -> float:
    return float(energies[-1] - energies[0])


def bench_md(args) -> None:
    import ase.io
    from ase import units
    from ase.md.verlet import VelocityVerlet

    from orb.device import configure_mindspore
    from orb.inference import md
    from orb.inference.calculator import ORBCalculator

    configure_mindspore("CPU")
    structures = starting_structures(args.structures)
    sizes = [len(a) for a in structures]
    rate_before = gemm_rate()
    print(f"{len(structures)} cells ({min(sizes)}-{max(sizes)} atoms, mean {np.mean(sizes):.0f}), demo orb-v3 "
          f"conservative model, NVE, {args.steps} steps of {args.timestep} fs\n")
    print("| run | batch | wall time (s) | structure-steps/s | model calls | NVE drift, median / max (meV/atom) |")
    print("|---|---|---|---|---|---|")
    calc = ORBCalculator.from_checkpoint(V3_DEMO, device_target="CPU")
    from orb.io.checkpoint import model_from_checkpoint

    from .calculator import forward_gflop_per_call

    demo = model_from_checkpoint(V3_DEMO)
    gflop = float(np.mean([forward_gflop_per_call(demo, a) for a in structures]))  # per structure-step
    start = time.perf_counter()
    loop_drift = []
    for atoms in structures:
        a = atoms.copy()
        a.calc = calc
        energies = []
        dynamics = VelocityVerlet(a, timestep=args.timestep * units.fs)
        dynamics.attach(lambda: energies.append(a.get_total_energy() / len(a)), interval=1)
        dynamics.run(args.steps)
        loop_drift.append(drift(energies))
    loop_time = time.perf_counter() - start
    loop_rate = len(structures) * args.steps / loop_time
    loop_compile = sum(calc.predictor.compiled.values())
    compile_note = [f"ASE's loop compiled {len(calc.predictor.compiled)} graph(s) in {loop_compile:.0f} s"]
    print(f"| ASE VelocityVerlet, one structure after another | 1 | {loop_time:.1f} | {loop_rate:.1f} | "
          f"{len(structures) * (args.steps + 1)} | {1e3 * np.median(np.abs(loop_drift)):.3f} / "
          f"{1e3 * np.max(np.abs(loop_drift)):.3f} |", flush=True)
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "start.extxyz")
            ase.io.write(path, structures, format="extxyz")
            run_args = md.parse_arguments(["--checkpoint", V3_DEMO, "--data", path, "--output",
                                           os.path.join(folder, "md"), "--ensemble", "nve", "--timestep",
                                           str(args.timestep), "--steps", str(args.steps), "--write_every",
                                           str(args.steps),  # the first and last frames: the drift, little I/O
                                           "--batch_size", str(batch), "--device_target", "CPU",
                                           "--progress_bar", "false"])
            start = time.perf_counter()
            summary = md.md(run_args)
            seconds = time.perf_counter() - start
        drifts = [s["total_energy_drift_eV_per_atom"] for s in summary["structures"]]
        rate = len(structures) * args.steps / seconds
        compile_note.append(f"orb-md at {batch} compiled in {summary['compile_seconds']:.0f} s (without it "
                            f"{len(structures) * args.steps / (seconds - summary['compile_seconds']):.1f} "
                            f"structure-steps/s against the loop's "
                            f"{len(structures) * args.steps / (loop_time - loop_compile):.1f})")
        print(f"| orb-md | {batch} | {seconds:.1f} | {rate:.1f} ({rate / loop_rate:.1f}x) | "
              f"{summary['model_calls']} | {1e3 * np.median(np.abs(drifts)):.3f} / {1e3 * np.max(np.abs(drifts)):.3f} "
              f"|", flush=True)
    if args.torch_v3_python:  # the same structures, model and integrator with PyTorch orb-models' calculator
        from orb.io.checkpoint import model_from_checkpoint, to_torch_state_dict
        from orb.io.torch_format import write_torch_checkpoint

        model = model_from_checkpoint(V3_DEMO)
        cfg = model.cfg
        with tempfile.TemporaryDirectory() as folder:
            weights, path = os.path.join(folder, "demo_v3.ckpt"), os.path.join(folder, "start.extxyz")
            write_torch_checkpoint(to_torch_state_dict(model), weights)
            ase.io.write(path, structures, format="extxyz")
            architecture = dict(latent_dim=cfg.latent_dim, base_mlp_hidden_dim=cfg.mlp_hidden_dim,
                                base_mlp_depth=cfg.num_mlp_layers, head_mlp_hidden_dim=cfg.head_mlp_hidden_dim,
                                head_mlp_depth=cfg.head_num_mlp_layers,
                                num_message_passing_steps=cfg.num_message_passing_steps)
            theirs = run_torch(args.torch_v3_python, "torch_md.py", [
                "--weights", weights, "--architecture", json.dumps(architecture), "--structures", path,
                "--steps", str(args.steps), "--timestep", str(args.timestep)])
        drifts = np.abs(theirs["drift"])
        print(f"| PyTorch orb-models 0.5.5 ORBCalculator, one structure after another | 1 | {theirs['seconds']:.1f} | "
              f"{len(structures) * args.steps / theirs['seconds']:.1f} | {len(structures) * (args.steps + 1)} | "
              f"{1e3 * np.median(drifts):.3f} / {1e3 * np.max(drifts):.3f} |")
    rate_after = gemm_rate()
    print("\ncompilation: " + "; ".join(compile_note))
    bound = (rate_before + rate_after) / 2 / gflop
    print(f"\nmatrix-multiply work: {gflop:.2f} GFLOP per structure-step (forward and force/stress derivative, at "
          f"the starting positions); at the host's GEMM rate no implementation exceeds {bound:.1f} structure-steps/s "
          f"({bound / loop_rate:.1f}x ASE's loop here)")
    print(f"peak memory of this process (both runs): {peak_memory_gb():.2f} GB; host calibration (numpy's BLAS, "
          f"1024^3): {calibration(rate_before, rate_after)}; MindSpore's MatMul (1024^3) {mindspore_gemm_rate():.0f} "
          "GFLOP/s")
