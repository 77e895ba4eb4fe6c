"""Which fine-tuning strategy keeps the foundation without its labels: a grid of strategies on a narrow target,
each measured by what it gains on the target and what it costs on the foundation's distribution.

    python scripts/compare_strategies.py --demo orb_v2 --target Al,Pt [--seed 7] [--epochs 20] [--out DIR]
                                         [--only name,name]      (~3 min per strategy on 2 cores; orb_v3 ~5)

The target: 64 rattled, strained fcc cells of two metals with EMT labels (scripts/make_demo_dataset.py,
``--target`` metals, ``--seed``; 16 more validate, 32 of another seed are the held-out test set the target's
gain is measured on), fine-tuned from the demo's pretrained model (``configs/demo.yaml`` or
``configs/demo_v3.yaml``). The foundation's distribution: the model's own pretraining validation set
(data/pretrain/pretrain_val.db, never trained on; pseudo-label replay draws from pretrain_train.db with
the starting model's labels, no DFT). Each run's best (best_weights.ckpt) and final (the last epoch's
EMA) weights are evaluated on both with orb-evaluate. Results go to ``DIR/results.json`` as each run
finishes (a killed study continues where it stopped), then a table (``DIR/table.md``) and a plot
(``DIR/strategies.png``): target gain against foundation change, in energy per atom and forces.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Dict, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
PRETRAIN_TRAIN = os.path.join(ROOT, "data", "pretrain", "pretrain_train.db")
PRETRAIN_VAL = os.path.join(ROOT, "data", "pretrain", "pretrain_val.db")
KEYS = ("energy_per_atom_mae", "forces_mae")
DEMOS = {"orb_v2": ("demo.yaml", "demo_pretrained.ckpt"), "orb_v3": ("demo_v3.yaml", "demo_v3_pretrained.ckpt")}
PSEUDO = ["--replay.data_path", PRETRAIN_TRAIN, "--replay.labels", "model", "--replay.val_samples", "0"]
FROZEN = ["--online_normalisation", "false"]
FIXED_REFERENCES = ["--reference_energies.trainable", "false"]
# pseudo-label replay with 32 replay structures held out, their loss added to the one that picks the best epoch
SELECTED = PSEUDO[:-1] + ["32", "--replay.in_selection", "true"]
STRATEGIES: Dict[str, List[str]] = {  # name -> overrides of the demo config (no foundation labels in any)
    "none": [],
    "frozen normalisers": FROZEN,
    "frozen normalisers + references": FROZEN + ["--reference_energies.trainable", "false"],
    "frozen normalisers + pseudo-label replay 0.25": FROZEN + PSEUDO + ["--replay.fraction", "0.25"],
    "frozen normalisers + anchor 10": FROZEN + ["--anchor.weight", "10"],
    "pseudo-label replay 0.25": PSEUDO + ["--replay.fraction", "0.25"],
    "pseudo-label replay 0.5": PSEUDO + ["--replay.fraction", "0.5"],
    "anchor 1": ["--anchor.weight", "1"],
    "anchor 10": ["--anchor.weight", "10"],
    "anchor 100": ["--anchor.weight", "100"],
    "freeze backbone": ["--freeze", "[backbone]"],
    "lr x0.1 backbone": ["--lr_multipliers", "{backbone: 0.1}"],
    "lora 8": ["--lora.rank", "8", "--lora.alpha", "16"],
    "lora 8 + pseudo-label replay 0.25": ["--lora.rank", "8", "--lora.alpha", "16"] + PSEUDO
    + ["--replay.fraction", "0.25"],
    "anchor 10 + pseudo-label replay 0.25": ["--anchor.weight", "10"] + PSEUDO + ["--replay.fraction", "0.25"],
    "pseudo-label replay 0.25 + fixed references": PSEUDO + ["--replay.fraction", "0.25"] + FIXED_REFERENCES,
    "pseudo-label replay 0.25 + selection": SELECTED + ["--replay.fraction", "0.25"],
    "pseudo-label replay 0.5 + selection": SELECTED + ["--replay.fraction", "0.5"],
    "pseudo-label replay 0.5 + fixed references": PSEUDO + ["--replay.fraction", "0.5"] + FIXED_REFERENCES,
    "anchor 10 + pseudo-label replay 0.5": ["--anchor.weight", "10"] + PSEUDO + ["--replay.fraction", "0.5"],
}


def narrow_target(out: str, metals: str, seed: int) -> Dict[str, str]:
    """train (64) and val (16) of the target, and a test set (32) from another seed: the target's gain is
    measured on structures that chose neither the weights nor the best epoch."""
    folder = os.path.join(out, "data")
    prefix = "narrow_" + metals.replace(",", "")
    paths = {part: os.path.join(folder, f"{prefix}_{part}.db") for part in ("train", "val")}
    paths["test"] = os.path.join(folder, f"{prefix}_test_val.db")
    make = [sys.executable, os.path.join(ROOT, "scripts", "make_demo_dataset.py"), "--out", folder, "--metals", metals,
            "--cluster_fraction", "0"]
    if not all(os.path.exists(paths[p]) for p in ("train", "val")):
        subprocess.run(make + ["--prefix", prefix, "--seed", str(seed)], check=True, stdout=subprocess.DEVNULL)
    if not os.path.exists(paths["test"]):
        subprocess.run(make + ["--prefix", prefix + "_test", "--seed", str(seed + 100), "--train", "1", "--val",
                               "32"], check=True, stdout=subprocess.DEVNULL)
    return paths


def evaluate(checkpoint: str, data: str, out: str) -> Dict:
    """orb-evaluate's summary of ``checkpoint`` on ``data``."""
    from orb.inference.evaluate import main as evaluate_main

    with open(os.devnull, "w") as quiet:
        stdout, sys.stdout = sys.stdout, quiet
        try:
            assert evaluate_main(["--checkpoint", checkpoint, "--data", data, "--output_dir", out,
                                  "--progress_bar", "false", "--device_target", "CPU"]) == 0
        finally:
            sys.stdout = stdout
    with open(os.path.join(out, "summary.json")) as f:
        return json.load(f)


def final_weights(run: str) -> str:
    """The weights the last epoch validated (the EMA in last.ckpt, adapters merged) as a plain checkpoint."""
    from orb.io.checkpoint import load_checkpoint, load_torch_state_dict, model_from_checkpoint, save_checkpoint

    path = os.path.join(run, "checkpoints", "last.ckpt")
    weights, optimizer, meta = load_checkpoint(path)
    weights.update({name[len("ema."):]: value for name, value in optimizer.items() if name.startswith("ema.")})
    if any(k.endswith(".lora_a") for k in weights):
        from orb.models.adapters import merge_arrays

        weights = merge_arrays(weights, meta["config"]["lora"]["alpha"])
    weights = {k: v for k, v in weights.items() if not k.startswith("replay_heads.")}
    model = model_from_checkpoint(path)
    load_torch_state_dict(model, weights, source=path)
    out = os.path.join(run, "final_ema.ckpt")
    save_checkpoint(out, model, {"model": meta["model"]}, exported=True)
    return out


def fine_tune(demo: str, args: List[str], data: Dict[str, str], run: str, epochs: int) -> float:
    """One fine-tuning run of the demo config into ``run``; its wall time."""
    config, checkpoint = DEMOS[demo]
    command = [sys.executable, os.path.join(ROOT, "finetune.py"), "--config", os.path.join(ROOT, "configs", config),
               "--checkpoint_path", os.path.join(ROOT, "data", checkpoint), "--train_data_path", data["train"],
               "--val_data_path", data["val"], "--max_epochs", str(epochs), "--output_dir", run, "--overwrite",
               "--progress_bar", "false", "--device_target", "CPU", *args]
    start = time.perf_counter()
    with open(run + ".log", "w") as log:
        subprocess.run(command, check=True, stdout=log, stderr=subprocess.STDOUT)
    return time.perf_counter() - start


def measure(checkpoint: str, data: Dict[str, str], out: str) -> Dict:
    return {"target": {k: evaluate(checkpoint, data["test"], out + "_target")[k] for k in KEYS},
            "foundation": {k: evaluate(checkpoint, PRETRAIN_VAL, out + "_foundation")[k] for k in KEYS}}


def change(now: float, start: float) -> float:
    return 100.0 * (now - start) / start


def write_report(results: Dict, out: str, title: str) -> None:
    """table.md and strategies.png from the results so far."""
    start = results["starting model"]
    none = {kind: results.get(f"none, {kind}") for kind in ("best", "final")}
    lines = [f"{title}\n", "| strategy | weights | target E/atom | target F | foundation E/atom | foundation F | "
             "kept of the unprotected F gain | wall time (s) |", "|---|---|---|---|---|---|---|---|"]
    for name, row in results.items():
        if name == "starting model":
            lines.append(f"| starting model | | {start['target']['energy_per_atom_mae']:.4g} | "
                         f"{start['target']['forces_mae']:.4g} | {start['foundation']['energy_per_atom_mae']:.4g} | "
                         f"{start['foundation']['forces_mae']:.4g} | | |")
            continue
        strategy, kind = name.rsplit(", ", 1)
        cells = [f"{change(row[part][k], start[part][k]):+.1f} %" for part in ("target", "foundation") for k in KEYS]
        plain = none[kind]
        kept = ""
        if plain is not None and plain is not row:
            gain = start["target"]["forces_mae"] - plain["target"]["forces_mae"]
            kept = f"{100 * (start['target']['forces_mae'] - row['target']['forces_mae']) / gain:.0f} %" if gain else ""
        lines.append(f"| {strategy} | {kind} | " + " | ".join(cells) + f" | {kept} | {row.get('seconds', 0):.0f} |")
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 5))
    for ax, key, label in zip(axes, KEYS, ("energy per atom", "forces")):
        for name, row in results.items():
            if name == "starting model":
                continue
            strategy, kind = name.rsplit(", ", 1)
            x = -change(row["target"][key], start["target"][key])
            y = change(row["foundation"][key], start["foundation"][key])
            ax.scatter(x, y, marker="o" if kind == "best" else "x")
            ax.annotate(f"{strategy} ({kind})", (x, y), fontsize=7)
        ax.axhline(5, color="grey", linestyle=":")
        ax.axhline(0, color="black", linewidth=0.5)
        ax.set_xlabel(f"target {label} MAE improvement (%)")
        ax.set_ylabel(f"foundation {label} MAE change (%)")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "strategies.png"), dpi=120)


def build_parser():
    """This script's command line (the docs test parses its documented commands with it)."""
    from orb.commands import HelpFormatter

    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0],
                                     formatter_class=HelpFormatter)
    parser.add_argument("--demo", choices=tuple(DEMOS), default="orb_v2", help="the demo model to fine-tune")
    parser.add_argument("--target", default="Al,Pt", help="the narrow target's two metals")
    parser.add_argument("--seed", type=int, default=7, help="seed of the narrow target")
    parser.add_argument("--epochs", type=int, default=20, help="epochs of each run")
    parser.add_argument("--out", default="", help="folder of the runs (default: runs/strategies_<demo>_<target>)")
    parser.add_argument("--only", default="", help="comma-separated strategy names (default: all)")
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    out = args.out or os.path.join(ROOT, "runs", f"strategies_{args.demo}_{args.target.replace(',', '')}")
    os.makedirs(out, exist_ok=True)
    from orb.device import configure_mindspore
    from orb.io.files import write_json

    configure_mindspore("CPU")
    data = narrow_target(out, args.target, args.seed)
    record = os.path.join(out, "results.json")
    results = json.load(open(record)) if os.path.exists(record) else {}
    if "starting model" not in results:
        results["starting model"] = measure(os.path.join(ROOT, "data", DEMOS[args.demo][1]), data,
                                            os.path.join(out, "eval", "start"))
        write_json(record, results)
    names = [n.strip() for n in args.only.split(",") if n.strip()] or list(STRATEGIES)
    unknown = [n for n in names if n not in STRATEGIES]
    if unknown:
        parser.error(f"--only: unknown strategies {unknown}; valid: {'; '.join(STRATEGIES)}")
    for name in names:
        if f"{name}, final" in results:
            continue  # measured by an earlier (killed) study
        run = os.path.join(out, name.replace(" ", "_").replace(",", "").replace("+", "and"))
        seconds = fine_tune(args.demo, STRATEGIES[name], data, run, args.epochs)
        for kind, weights in (("best", os.path.join(run, "checkpoints", "best_weights.ckpt")),
                              ("final", final_weights(run))):
            results[f"{name}, {kind}"] = dict(measure(weights, data, os.path.join(run, f"eval_{kind}")),
                                              seconds=seconds)
        write_json(record, results)
        print(f"{name}: done in {seconds:.0f} s", file=sys.stderr)
    write_report(results, out, f"{args.demo} demo model, narrow target {args.target} (seed {args.seed}), "
                               f"{args.epochs} epochs; changes against the starting model")
    return 0


if __name__ == "__main__":
    sys.exit(main())
