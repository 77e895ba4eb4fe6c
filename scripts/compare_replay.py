"""What fine-tuning costs the foundation, and what replay and fitted reference energies win back (docs/benchmarks.md,
"Replay" and "Reference energies fitted to another DFT setup").

    python scripts/compare_replay.py replay [--out DIR] [--seed 31] [--epochs 20]   (~5 min on 2 cores)
    python scripts/compare_replay.py reference_fit [--out DIR] [--seed 31]           (~2 min)

``replay``: a narrow target (64 rattled, strained Cu-Ni fcc cells with EMT labels, built by
scripts/make_demo_dataset.py with ``--seed``; the tests use other data) fine-tuned from the demo's
pretrained model (configs/demo.yaml) without replay, and with replay of the model's own
pretraining data (data/pretrain/pretrain_train.db) labelled by the data or by the model. Every
run's best_weights.ckpt (what a user takes away) is evaluated on the target's validation set and
on the pretraining distribution's (data/pretrain/pretrain_val.db, DFT labels).

``reference_fit``: the same target with energies shifted per element as another DFT code would
give them (+0.7 eV/atom Cu, -0.4 eV/atom Ni); the epoch-0 validation energy error of the orb-v3
demo model (frozen reference energies) without and with ``reference_energies.fit``.
"""

import argparse
import json
import os
import subprocess
import sys
from typing import Dict, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
PRETRAIN_TRAIN = os.path.join(ROOT, "data", "pretrain", "pretrain_train.db")
PRETRAIN_VAL = os.path.join(ROOT, "data", "pretrain", "pretrain_val.db")
REPLAY = ["--replay.data_path", PRETRAIN_TRAIN, "--replay.val_data_path", PRETRAIN_VAL]
RUNS = {
    "no replay (measured only)": REPLAY + ["--replay.fraction", "0"],
    "replay, DFT labels": REPLAY + ["--replay.fraction", "0.5"],
    "replay, DFT labels, weight 3": REPLAY + ["--replay.fraction", "0.5", "--replay.loss_weight", "3"],
    "replay, model labels": REPLAY + ["--replay.fraction", "0.5", "--replay.labels", "model"],
    "replay, model labels, weight 3": REPLAY + ["--replay.fraction", "0.5", "--replay.labels", "model",
                                                "--replay.loss_weight", "3"],
}
KEYS = ("energy_per_atom_mae", "forces_mae")
SHIFTS = {"Cu": 0.7, "Ni": -0.4}


def narrow_target(out: str, seed: int) -> Dict[str, str]:
    folder = os.path.join(out, "data")
    run_step([sys.executable, os.path.join(ROOT, "scripts", "make_demo_dataset.py"), "--out", folder, "--prefix",
              "narrow", "--metals", "Cu,Ni", "--cluster_fraction", "0", "--seed", str(seed)], "making the target",
             stdout=subprocess.DEVNULL)
    return {"train": os.path.join(folder, "narrow_train.db"), "val": os.path.join(folder, "narrow_val.db")}


def evaluate(checkpoint: str, data: str, out: str) -> Dict:
    from orb.inference.evaluate import main as evaluate_main

    with open(os.devnull, "w") as quiet:
        stdout, sys.stdout = sys.stdout, quiet
        try:
            status = evaluate_main(["--checkpoint", checkpoint, "--data", data, "--output_dir", out,
                                    "--progress_bar", "false"])
        finally:
            sys.stdout = stdout
    if status:
        from orb.errors import RunError

        raise RunError(f"orb-evaluate of {checkpoint} on {data} failed (exit status {status}; its error is above)")
    with open(os.path.join(out, "summary.json")) as f:
        return json.load(f)


def final_weights(run: str) -> str:
    """The weights the last epoch validated (the EMA in last.ckpt) as a plain checkpoint."""
    from orb.io.checkpoint import load_checkpoint, load_torch_state_dict, model_from_checkpoint, save_checkpoint

    path = os.path.join(run, "checkpoints", "last.ckpt")
    weights, optimizer, meta = load_checkpoint(path)
    weights.update({name[len("ema."):]: value for name, value in optimizer.items() if name.startswith("ema.")})
    model = model_from_checkpoint(path)
    load_torch_state_dict(model, weights, source=path)
    out = os.path.join(run, "final_ema.ckpt")
    save_checkpoint(out, model, {"model": meta["model"]})
    return out


def fine_tune(name: str, args: List[str], data: Dict[str, str], out: str, epochs: int) -> str:
    run = os.path.join(out, name.replace(" ", "_").replace(",", ""))
    config = os.path.join(ROOT, "configs", "demo.yaml")
    command = [sys.executable, os.path.join(ROOT, "finetune.py"), "--config", config,
               "--checkpoint_path", os.path.join(ROOT, "data", "demo_pretrained.ckpt"),
               "--train_data_path", data["train"], "--val_data_path", data["val"], "--max_epochs", str(epochs),
               "--output_dir", run, "--overwrite", "--progress_bar", "false", *args]
    with open(run + ".log", "w") as log:
        run_step(command, f"the fine-tuning into {run} (its log: {run}.log)", stdout=log, stderr=subprocess.STDOUT)
    return run


def run_step(command: List[str], what: str, **popen) -> None:
    """``command`` run to its end (a stop reaches it, then ends this script with 75); a failure is one line."""
    from orb.errors import RunError
    from orb.signals import run_to_its_end

    status = run_to_its_end(command, what, **popen)
    if status:
        raise RunError(f"{what} failed (exit status {status})")


def gain(start: Dict, run: Dict, plain: Dict, key: str) -> float:
    """The target's improvement of ``run`` as a fraction of the run without replay's."""
    return (start["target"][key] - run["target"][key]) / (start["target"][key] - plain["target"][key])


def compare_replay(args) -> None:
    data = narrow_target(args.out, args.seed)
    start = os.path.join(ROOT, "data", "demo_pretrained.ckpt")
    rows = {"starting model": {"target": evaluate(start, data["val"], os.path.join(args.out, "eval", "start_t")),
                               "foundation": evaluate(start, PRETRAIN_VAL, os.path.join(args.out, "eval", "start_f"))}}
    for name, extra in RUNS.items():
        run = fine_tune(name, extra, data, args.out, args.epochs)
        for kind, weights in (("best", os.path.join(run, "checkpoints", "best_weights.ckpt")),
                              ("final", final_weights(run))):
            rows[f"{name}, {kind}"] = {
                "target": evaluate(weights, data["val"], os.path.join(run, f"eval_{kind}_target")),
                "foundation": evaluate(weights, PRETRAIN_VAL, os.path.join(run, f"eval_{kind}_foundation"))}
    base = rows["starting model"]
    print(f"narrow target: seed {args.seed}, {args.epochs} epochs; best: best_weights.ckpt (lowest validation "
          "loss), final: the last epoch's EMA weights\n")
    print("| run | target E MAE (eV/atom) | target F MAE (eV/Å) | foundation E MAE (eV/atom) | foundation F MAE "
          "(eV/Å) "
          "| target gain vs no replay (E / F) |")
    print("|---|---|---|---|---|---|")
    for name, row in rows.items():
        cells = []
        for part in ("target", "foundation"):
            for key in KEYS:
                value, start_value = row[part][key], base[part][key]
                cells.append(f"{value:.4g}" + ("" if row is base else f" ({100 * (value / start_value - 1):+.0f}%)"))
        kind = name.rsplit(", ", 1)[-1]
        plain = rows.get(f"no replay (measured only), {kind}")
        gains = ""
        if row is not base and row is not plain:
            gains = " / ".join(f"{100 * gain(base, row, plain, k):.0f}%" for k in KEYS)
        print(f"| {name} | " + " | ".join(cells) + f" | {gains} |")


def compare_reference_fit(args) -> None:
    import numpy as np
    from ase.calculators.singlepoint import SinglePointCalculator
    import ase.db

    from orb.device import configure_mindspore
    from orb.training.config import load_config
    from orb.training.setup import build_trainer

    data = narrow_target(args.out, args.seed)
    shifted = {}
    for part, path in data.items():
        shifted[part] = os.path.join(args.out, "data", f"shifted_{part}.db")
        with ase.db.connect(path) as src, ase.db.connect(shifted[part], append=False) as dst:
            for row in src.select():
                atoms = row.toatoms()
                results = dict(atoms.calc.results)
                results["energy"] += sum(SHIFTS.get(s, 0.0) for s in atoms.get_chemical_symbols())
                atoms.calc = SinglePointCalculator(atoms, **results)
                dst.write(atoms)
    configure_mindspore("CPU")
    results = {}
    for name, (sets, fit) in {"target's own energies": (data, "none"), "shifted, no fit": (shifted, "none"),
                              "shifted, fit: least_squares": (shifted, "least_squares"),
                              "shifted, fit: residual": (shifted, "residual")}.items():
        cfg = load_config(os.path.join(ROOT, "configs", "demo_v3.yaml"),
                          ["--train_data_path", sets["train"], "--val_data_path", sets["val"], "--device_target", "CPU",
                           "--output_dir", os.path.join(args.out, "fit"), "--reference_energies.fit", fit])
        trainer = build_trainer(cfg)
        val = trainer.validate_all()["val"]
        results[name] = (val, trainer.progress.reference_fit)
        trainer.data.loader.close()
    own = results["target's own energies"][0]
    print(f"narrow target (seed {args.seed}) with energies +{SHIFTS['Cu']} eV/atom for Cu and {SHIFTS['Ni']} for Ni; "
          "orb-v3 demo model, epoch 0 (before any step)\n")
    print("| validation energies | energy MAE (eV) | vs own energies | energy per atom MAE (eV/atom) | fitted change "
          "(eV/atom) |")
    print("|---|---|---|---|---|")
    for name, (val, fit) in results.items():
        change = ", ".join(f"{s} {v:+.3f}" for s, v in fit["change"].items()) if fit else ""
        print(f"| {name} | {val['energy_mae']:.4g} | {val['energy_mae'] / own['energy_mae']:.2f}x | "
              f"{val['energy_per_atom_mae']:.4g} | {change} |")
    assert np.isfinite(own["energy_mae"])


def build_parser():
    """This script's command line (the docs test parses its documented commands with it)."""
    from orb.commands import HelpFormatter

    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("what", choices=("replay", "reference_fit"), help="the comparison to run")
    parser.add_argument("--out", default=os.path.join("outputs", "compare_replay"), help="folder of the runs")
    parser.add_argument("--seed", type=int, default=31, help="seed of the narrow target")
    parser.add_argument("--epochs", type=int, default=20, help="epochs of each run")
    return parser


def main() -> int:
    """A command (orb.signals.run_command: a stop is one line and 75); its evaluations run inside it."""
    from orb.signals import run_command

    def body() -> int:
        args = build_parser().parse_args()
        os.makedirs(args.out, exist_ok=True)
        {"replay": compare_replay, "reference_fit": compare_reference_fit}[args.what](args)
        return 0

    return run_command(body)


if __name__ == "__main__":
    from orb.signals import run_program

    run_program(main)
