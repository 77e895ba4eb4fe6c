"""precision: how far each precision mode's predictions are from float64, beside PyTorch orb-models' bfloat16 autocast
on the same structures and weights; and the demos fine-tuned in each mode.

Predictions: for orb-v2 and orb-v3 direct and conservative, the parity references' weight recipe (full size) on the
orb-v3 reference structures (alloy, cluster, ions) and the shipped MPtrj frames; errors are the largest over the
structures of |E - E_ref| / atoms, |F - F_ref| and |S - S_ref|, each side against its own float64 (the same graphs:
what the precision costs): ours, and PyTorch orb-models' bfloat16 autocast (0.4.2 for orb-v2, 0.5.5 for orb-v3;
tests/torch_peer.py, with --torch-python / --torch-v3-python); and our float64 against PyTorch's float64, where
each side builds its own graphs. Fine-tuning (--finetune): configs/demo.yaml and demo_v3.yaml run in each mode with the same seed;
the validation MAEs of the last epoch and the fp16 run's skipped steps.
"""

import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from benchmarks.common import MPTRJ, ROOT

V3_NPZ = os.path.join(ROOT, "tests", "data", "orb_v3_parity.npz")
PEER = os.path.join(ROOT, "tests", "torch_peer.py")
FAMILIES = ("orb_v2", "orb_v3_direct_20_omat", "orb_v3_conservative_20_omat")
OURS = ("float32-high", "float32-highest", "bf16-mixed", "fp16-mixed", "float64")


def structures() -> dict:
    """The reference structures and MPtrj frames (positions wrapped in float64, as both sides then agree)."""
    import ase.db

    from orb.data.graphs import wrap_positions64

    z = np.load(V3_NPZ)
    out = {"names": []}
    atoms_list = [(n, z[f"{n}/numbers"], z[f"{n}/positions"], z[f"{n}/cell"]) for n in ("s0", "s1", "s4")]
    atoms_list += [(f"mptrj{row.id}", row.numbers, row.positions, np.asarray(row.cell))
                   for row in ase.db.connect(MPTRJ).select(limit=6)]
    for name, numbers, positions, cell in atoms_list:
        cell = np.asarray(cell, np.float64)
        positions = wrap_positions64(np.asarray(positions, np.float64), cell) if cell.any() else positions
        out["names"].append(name)
        out[f"{name}/numbers"], out[f"{name}/positions"], out[f"{name}/cell"] = numbers, positions, cell
    out["names"] = np.array(out["names"])
    return out


def ours(model_name: str, mode: str, data: dict, seed: int) -> dict:
    """Our predictions of ``data`` in precision ``mode`` (recipe weights), per structure."""
    from ase import Atoms

    from orb import precision
    from orb.inference.calculator import ORBCalculator
    from orb.io.checkpoint import load_torch_state_dict
    from orb.models import create
    from orb.models.recipe import model_recipe_weights

    precision.set_precision(mode)
    model = create(model_name)
    load_torch_state_dict(model, model_recipe_weights(model, seed))
    model.set_train(False)
    calculator = ORBCalculator(model)
    out = {}
    for name in data["names"]:
        cell = data[f"{name}/cell"]
        atoms = Atoms(numbers=data[f"{name}/numbers"], positions=data[f"{name}/positions"], cell=cell,
                      pbc=bool(cell.any()))
        atoms.calc = calculator
        out[f"{name}/energy"] = np.array([atoms.get_potential_energy()])
        out[f"{name}/forces"] = atoms.get_forces()
        out[f"{name}/stress"] = atoms.get_stress() if cell.any() else np.zeros(6)
    return out


def theirs(python: str, model_name: str, data: dict, seed: int, mode: str, folder: str) -> dict:
    """PyTorch orb-models' predictions (``mode``: float64 or bf16-autocast) with the same weights."""
    from orb.io.checkpoint import load_torch_state_dict, to_torch_state_dict
    from orb.io.torch_format import write_torch_checkpoint
    from orb.models import create
    from orb.models.recipe import model_recipe_weights
    from orb import precision

    precision.set_precision("float32-highest")
    model = create(model_name)
    load_torch_state_dict(model, model_recipe_weights(model, seed))
    weights = os.path.join(folder, f"{model_name}.ckpt")
    write_torch_checkpoint(to_torch_state_dict(model), weights)
    inputs, outputs = os.path.join(folder, "structures.npz"), os.path.join(folder, f"{model_name}_{mode}.npz")
    np.savez(inputs, **data)
    result = subprocess.run([python, PEER, model_name, weights, inputs, outputs, mode], capture_output=True, text=True,
                            timeout=3600)
    if result.returncode != 0:
        raise RuntimeError(f"PyTorch peer failed:\n{result.stderr[-3000:]}")
    found = dict(np.load(outputs))
    for name in data["names"]:  # orb-models' direct models give a molecule a stress; ours are zero there
        if f"{name}/energy" not in found:
            continue
        found.setdefault(f"{name}/stress", np.zeros(6))
        if not data[f"{name}/cell"].any():
            found[f"{name}/stress"] = np.zeros(6)
    return found


def errors(pred: dict, reference: dict, data: dict) -> tuple:
    """Largest |dE|/atom (eV/atom), |dF| (eV/Å), |dS| (eV/Å³) over the structures ``pred`` has (PyTorch's bf16
    autocast fails on molecules), and how many it has."""
    e = f = s = 0.0
    names = [n for n in data["names"] if f"{n}/energy" in pred]
    for name in names:
        atoms = len(data[f"{name}/numbers"])
        e = max(e, abs(float(pred[f"{name}/energy"][0] - reference[f"{name}/energy"][0])) / atoms)
        f = max(f, float(np.abs(pred[f"{name}/forces"] - reference[f"{name}/forces"]).max()))
        s = max(s, float(np.abs(np.asarray(pred[f"{name}/stress"]).reshape(-1)
                                - np.asarray(reference[f"{name}/stress"]).reshape(-1)).max()))
    return e, f, s, len(names)


def bench_precision(args) -> None:
    from orb.device import configure_mindspore

    configure_mindspore("CPU")
    if args.finetune:
        finetune_in_each_mode(args)
        return
    seed = int(np.load(V3_NPZ)["meta/seed"])
    data = structures()
    print(f"{len(data['names'])} structures ({', '.join(data['names'])}); errors against the same side's float64 "
          f"(and our float64 against PyTorch orb-models' float64): the largest over structures")
    print("\n| model | computed by | precision | E (eV/atom) | F (eV/Å) | S (eV/Å³) |\n|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as folder:
        for model_name in FAMILIES:
            python = args.torch_python if model_name == "orb_v2" else args.torch_v3_python
            mine = {mode: ours(model_name, mode, data, seed) for mode in OURS}
            # each side against its own float64 (the same graphs: what the precision costs); ours in float64 against
            # PyTorch's float64 (graphs built by each side: at max_neighbors, near-ties may keep other neighbours)
            rows = [("ours", mode, mine[mode], mine["float64"]) for mode in OURS if mode != "float64"]
            if python:
                their64 = theirs(python, model_name, data, seed, "float64", folder)
                rows.append(("PyTorch", "bf16 autocast",
                             theirs(python, model_name, data, seed, "bf16-autocast", folder), their64))
                rows.append(("ours vs PyTorch", "float64", mine["float64"], their64))
            for who, mode, pred, reference in rows:
                e, f, s, count = errors(pred, reference, data)
                failed = f" (fails on {len(data['names']) - count} molecule(s))" if count < len(data["names"]) else ""
                print(f"| {model_name} | {who} | {mode}{failed} | {e:.2e} | {f:.2e} | {s:.2e} |", flush=True)


def finetune_in_each_mode(args) -> None:
    """The demos fine-tuned in each mode: the last epoch's validation MAEs against float32's with the same seed;
    with ``--seeds``, every mode again with each of those seeds, and float32's change from the config's seed
    beside (what the seed alone moves, the scale for a mode's distance)."""
    print("\n| demo | precision | seed | val E/atom (eV) | val F (eV/Å) | val S (eV/Å³) | vs float32-high, same seed "
          "| float32-high vs the config's seed | skipped steps | train time (s) |\n"
          "|---|---|---|---|---|---|---|---|---|---|")
    modes = [m.strip() for m in args.modes.split(",") if m.strip() and m.strip() != "float32-high"]
    seeds = [None] + [int(s) for s in args.seeds.split(",") if s.strip()]
    change = lambda maes, base: " / ".join(f"{100 * (m / b - 1):+.1f} %" for m, b in zip(maes, base))  # noqa: E731
    for config in [c.strip() for c in args.configs.split(",") if c.strip()]:
        first = None
        for seed in seeds:
            base = None
            runs = [("float32-high", None)] + [(mode, None) for mode in modes]
            if args.perturb_start:
                runs += [("float32-high", NUDGES[0]), ("float32-high", NUDGES[1])]
            for mode, nudge in runs:
                with tempfile.TemporaryDirectory() as folder:
                    checkpoint = nudged_start(config, folder, nudge[1], args.perturb_seed) if nudge else None
                    maes, skipped, steps, seconds = finetune_once(config, mode, seed, checkpoint)
                base = base or maes
                first = first or maes
                spread = change(maes, first) if mode == "float32-high" and not nudge else ""
                label = mode + (f", start nudged {nudge[0]}" if nudge else "")
                print(f"| {config} | {label} | {'config' if seed is None else seed} | {maes[0]:.4g} | {maes[1]:.4g} | "
                      f"{maes[2]:.4g} | {change(maes, base)} | {spread} | {skipped:.0f} of {steps} | {seconds:.0f} |",
                      flush=True)


# (label, relative size): one unit in float32's last place, and float16's unit roundoff (what one rounding to it moves)
NUDGES = (("1 ulp", None), ("2^-11 (fp16's rounding)", 2.0 ** -11))


def nudged_start(config: str, folder: str, relative=None, seed: int = 0) -> str:
    """The config's starting checkpoint with every weight moved up or down at random, by one unit in the last place
    (float32) or by ``relative`` of itself: a float32 run from it shows how far a perturbation of that size, once, at
    the start, moves the demo's last-epoch MAEs (the scale against which a mode's distance from float32 can be
    read)."""
    import mindspore as ms
    import yaml

    from orb import precision
    from orb.io.checkpoint import model_from_checkpoint, named_parameters, read_weights, save_checkpoint

    with open(os.path.join(ROOT, "configs", config)) as f:
        source = os.path.join(ROOT, yaml.safe_load(f)["checkpoint_path"])
    precision.set_precision("float32-high")
    meta = read_weights(source)[1]
    model = model_from_checkpoint(source)
    rng = np.random.default_rng(seed)  # (which way each weight moves)
    for parameter in named_parameters(model).values():
        value = parameter.asnumpy()
        if value.dtype == np.float32:
            up = rng.random(value.shape) < 0.5
            if relative is None:
                moved = np.nextafter(value, np.where(up, np.inf, -np.inf).astype(np.float32))
            else:
                moved = (value * (1.0 + np.where(up, relative, -relative))).astype(np.float32)
            parameter.set_data(ms.Tensor(moved))
    target = os.path.join(folder, "nudged.ckpt")
    save_checkpoint(target, model, meta)
    return target


def finetune_once(config: str, mode: str, seed=None, checkpoint=None):
    """(validation MAEs [E/atom, F, S] of the last epoch, skipped steps, steps, seconds) of one demo fine-tune
    (``checkpoint``: another start than the config's)."""
    with tempfile.TemporaryDirectory() as out:
        start = time.perf_counter()
        seed_args = ["--random_seed", str(seed)] if seed is not None else []
        seed_args += ["--checkpoint_path", checkpoint] if checkpoint else []
        subprocess.run([sys.executable, os.path.join(ROOT, "finetune.py"), "--config",
                        os.path.join(ROOT, "configs", config), "--output_dir", out, "--precision", mode,
                        "--progress_bar", "false", "--device_target", "CPU", *seed_args], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
        seconds = time.perf_counter() - start
        epochs = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl")) if '"type": "epoch"' in line]
    val = epochs[-1]["val"]
    maes = [val["energy_per_atom_mae"], val["forces_mae"], val.get("stress_mae", float("nan"))]
    return maes, sum(e["train"].get("nonfinite_steps", 0) for e in epochs), epochs[-1]["step"], seconds
