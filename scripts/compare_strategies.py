"""Which fine-tuning setting keeps the foundation without its labels: a grid of settings on a narrow target,
each measured by what it gains on the target and what it costs on the foundation's distribution, with the
frontier of the two and the setting to use.

    python scripts/compare_strategies.py --demo orb_v2 --target Al,Pt [--kind fcc] [--seed 7] [--epochs 20]
    python scripts/compare_strategies.py --train my_train.xyz --val my_val.xyz --test my_test.xyz \\
        --config my.yaml --checkpoint orb_v3_conservative_inf_omat --replay omat_sample.xyz \\
        --foundation omat_labelled.xyz --epochs 5 --out runs/my_frontier

Demo targets (``--target``, ``--kind``, ``--seed``): 64 structures with EMT labels made by
scripts/make_demo_dataset.py (``fcc``: rattled, strained cells of two metals; ``alloy``: every site from all of
``--target``; ``rocksalt``: oxides MO; ``molecules``: C/H/N/O molecules), 16 more validate, 32 of another seed are
the held-out test set the target's gain is measured on, fine-tuned from the demo's pretrained model
(``configs/demo.yaml`` or ``configs/demo_v3.yaml``). The foundation's distribution: the model's own pretraining
validation set (data/pretrain/pretrain_val.db, never trained on); pseudo-label replay draws from
pretrain_train.db with the starting model's labels, no DFT.

Your target (``--train``): your data and config, your foundation checkpoint (``--checkpoint``), structures of its
distribution to replay (``--replay``: no labels needed, the starting model labels them) and labelled held-out ones
to measure the drift on (``--foundation``: e.g. MPtrj or OMat frames with their DFT labels, not in ``--replay``);
both default to the demo's. Short runs (``--epochs``) rank the settings as long ones do only roughly: rerun the
recommended one at full length.

Each run is finetune.py; its best (best_weights.ckpt) and final (the last epoch's EMA) weights are evaluated on
the target's test set and the foundation's with orb-evaluate. Results go to ``DIR/results.json`` as each run
finishes (a killed study continues where it stopped); then ``DIR/table.md`` (every run), the frontier of
foundation drift against target gain with the recommended setting (``DIR/frontier.json``, ``DIR/frontier.md``,
``DIR/frontier.png``, printed with the YAML block to paste into your config); orb/reports/frontier.py says how
the settings are judged.
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
if __name__ == "__main__":  # (before the imports start threads: orb.signals.program_starts)
    from orb.signals import program_starts

    program_starts()
from orb.errors import RunError  # noqa: E402  (after the checkout is on the path)
from orb.reports import frontier as fr  # noqa: E402

PRETRAIN_TRAIN = os.path.join(ROOT, "data", "pretrain", "pretrain_train.db")
PRETRAIN_VAL = os.path.join(ROOT, "data", "pretrain", "pretrain_val.db")
KEYS = fr.KEYS
DEMOS = {"orb_v2": ("demo.yaml", "demo_pretrained.ckpt"), "orb_v3": ("demo_v3.yaml", "demo_v3_pretrained.ckpt")}
REPLAY = "<replay>"  # stands for the study's replay structures (--replay) in the settings below
# every run starts from these (a config with replay of its own would otherwise make "none" a replay run)
RESET = {"replay.data_path": "", "replay.fraction": 0.0, "replay.in_selection": False}


def pseudo(fraction: float, selection: bool = False) -> Dict[str, object]:
    """Pseudo-label replay in a share ``fraction`` of every step; with ``selection``, 32 replay structures held
    out and their loss (the drift from the foundation) added to the one that picks the best epoch."""
    setting = {"replay.data_path": REPLAY, "replay.labels": "model", "replay.fraction": fraction,
               "replay.val_samples": 32 if selection else 0}
    return dict(setting, **{"replay.in_selection": True}) if selection else setting


FROZEN = {"online_normalisation": False}
FIXED_REFERENCES = {"reference_energies.trainable": "false"}  # (auto, true or false)
LORA = {"lora.rank": 8, "lora.alpha": 16}
ANCHOR = {"anchor.weight": 10}
STRATEGIES: Dict[str, Dict[str, object]] = {  # name -> config overrides (no foundation labels in any)
    "none": {},
    "frozen normalisers": FROZEN,
    "frozen normalisers + references": {**FROZEN, **FIXED_REFERENCES},
    "frozen normalisers + pseudo-label replay 0.25": {**FROZEN, **pseudo(0.25)},
    "frozen normalisers + anchor 10": {**FROZEN, **ANCHOR},
    "pseudo-label replay 0.1": pseudo(0.1),
    "pseudo-label replay 0.25": pseudo(0.25),
    "pseudo-label replay 0.5": pseudo(0.5),
    "anchor 1": {"anchor.weight": 1},
    "anchor 10": ANCHOR,
    "anchor 100": {"anchor.weight": 100},
    "freeze backbone": {"freeze": ["backbone"]},
    "lr x0.1 backbone": {"lr_multipliers": {"backbone": 0.1}},
    "lora 8": LORA,
    "lora 8 + pseudo-label replay 0.25": {**LORA, **pseudo(0.25)},
    "anchor 10 + pseudo-label replay 0.25": {**ANCHOR, **pseudo(0.25)},
    "pseudo-label replay 0.25 + fixed references": {**pseudo(0.25), **FIXED_REFERENCES},
    "pseudo-label replay 0.1 + selection": pseudo(0.1, True),
    "pseudo-label replay 0.25 + selection": pseudo(0.25, True),
    "pseudo-label replay 0.5 + selection": pseudo(0.5, True),
    "pseudo-label replay 0.5 + fixed references": {**pseudo(0.5), **FIXED_REFERENCES},
    "anchor 10 + pseudo-label replay 0.5": {**ANCHOR, **pseudo(0.5)},
    "frozen normalisers + pseudo-label replay 0.25 + selection": {**FROZEN, **pseudo(0.25, True)},
    "frozen normalisers + pseudo-label replay 0.5 + selection": {**FROZEN, **pseudo(0.5, True)},
    "pseudo-label replay 0.75 + selection": pseudo(0.75, True),
    "anchor 10 + pseudo-label replay 0.5 + selection": {**ANCHOR, **pseudo(0.5, True)},
    "pseudo-label replay 0.5 + selection + fixed references": {**pseudo(0.5, True), **FIXED_REFERENCES},
    "frozen normalisers + pseudo-label replay 0.5 + selection + fixed references": {
        **FROZEN, **pseudo(0.5, True), **FIXED_REFERENCES},
    "frozen normalisers + pseudo-label replay 0.75 + selection": {**FROZEN, **pseudo(0.75, True)},
    "frozen normalisers + pseudo-label replay 0.9 + selection": {**FROZEN, **pseudo(0.9, True)},
}
# the default grid: spans the frontier from plain fine-tuning to the strongest protection
GRID = ["none", "pseudo-label replay 0.1", "pseudo-label replay 0.1 + selection", "pseudo-label replay 0.25",
        "pseudo-label replay 0.25 + selection", "pseudo-label replay 0.5", "pseudo-label replay 0.5 + selection",
        "frozen normalisers + pseudo-label replay 0.5 + selection",
        "frozen normalisers + pseudo-label replay 0.75 + selection", "anchor 10", "lora 8", "lr x0.1 backbone"]


def overrides(name: str, replay: str) -> Dict[str, object]:
    """Setting ``name``'s config keys, the replay structures filled in."""
    return {k: replay if v == REPLAY else v for k, v in STRATEGIES[name].items()}


def measured(name: str, replay: str) -> Dict[str, object]:
    """Every key a run of setting ``name`` set over the user's config (the replay reset included: a block without it,
    pasted into a config with replay of its own, would be another setting than the one measured)."""
    return {**RESET, **overrides(name, replay)}


def command_line(settings: Dict[str, object]) -> List[str]:
    """Config overrides as finetune.py arguments (lists and mappings in YAML's flow style)."""
    import yaml

    args = []
    for key, value in settings.items():
        text = str(value).lower() if isinstance(value, bool) else \
            yaml.safe_dump(value, default_flow_style=True).strip() if isinstance(value, (list, dict)) else str(value)
        args += [f"--{key}", text]
    return args


def narrow_target(out: str, metals: str, seed: int, kind: str = "fcc") -> Dict[str, str]:
    """train (64) and val (16) of the target, and a test set (32) from another seed: the target's gain is
    measured on structures that chose neither the weights nor the best epoch."""
    folder = os.path.join(out, "data")
    prefix = "narrow_" + ("" if kind == "fcc" else kind + "_") + metals.replace(",", "")
    paths = {part: os.path.join(folder, f"{prefix}_{part}.db") for part in ("train", "val")}
    paths["test"] = os.path.join(folder, f"{prefix}_test_val.db")
    make = [sys.executable, os.path.join(ROOT, "scripts", "make_demo_dataset.py"), "--out", folder, "--metals", metals,
            "--cluster_fraction", "0", "--kind", kind]
    if not all(os.path.exists(paths[p]) for p in ("train", "val")):
        made(make + ["--prefix", prefix, "--seed", str(seed)])
    if not os.path.exists(paths["test"]):
        made(make + ["--prefix", prefix + "_test", "--seed", str(seed + 100), "--train", "1", "--val", "32"])
    return paths


def made(command: List[str]) -> None:
    """A demo target's databases written by ``command`` (a stop meanwhile ends the study, 75; a failure is one line)."""
    from orb.signals import run_to_its_end

    status = run_to_its_end(command, "making the demo target", stdout=subprocess.DEVNULL)
    if status:
        raise RunError(f"{' '.join(command[1:3])} failed (exit status {status}; its error is above)")


def evaluate(checkpoint: str, data: str, out: str) -> Dict:
    """orb-evaluate's summary of ``checkpoint`` on ``data``."""
    from orb.inference.evaluate import main as evaluate_main

    with open(os.devnull, "w") as quiet:
        stdout, sys.stdout = sys.stdout, quiet
        try:
            status = evaluate_main(["--checkpoint", checkpoint, "--data", data, "--output_dir", out,
                                    "--progress_bar", "false", "--device_target", "CPU"])
        finally:
            sys.stdout = stdout
    if status:
        raise RunError(f"orb-evaluate of {checkpoint} on {data} failed (exit status {status}; its error is above)")
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


def fine_tune(study: Dict[str, str], args: List[str], run: str, epochs: int) -> float:
    """One run of finetune.py (the study's config, checkpoint and data, ``args`` on top) into ``run``; its wall
    time."""
    command = [sys.executable, os.path.join(ROOT, "finetune.py"), "--config", study["config"],
               "--checkpoint_path", study["checkpoint"], "--train_data_path", study["train"],
               "--val_data_path", study["val"], "--max_epochs", str(epochs), "--output_dir", run, "--overwrite",
               "--progress_bar", "false", "--device_target", "CPU", *args]
    from orb.signals import run_to_its_end

    start = time.perf_counter()
    with open(run + ".log", "a") as log:  # (a continued study's earlier attempts stay in it)
        status = run_to_its_end(command, f"the fine-tuning into {run}", stdout=log, stderr=subprocess.STDOUT)
    if status:
        raise RunError(f"finetune.py into {run} failed (exit status {status}): its log is {run}.log")
    return time.perf_counter() - start


def measure(checkpoint: str, study: Dict[str, str], out: str) -> Dict:
    return {"target": {k: evaluate(checkpoint, study["test"], out + "_target")[k] for k in KEYS},
            "foundation": {k: evaluate(checkpoint, study["foundation"], out + "_foundation")[k] for k in KEYS}}


def write_table(results: Dict, out: str, title: str) -> None:
    """table.md: every run's weights, their changes against the starting model."""
    change = fr.change
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
    from orb.files import write_text

    write_text(os.path.join(out, "table.md"), "\n".join(lines) + "\n")  # (whole, or the earlier one kept)
    print("\n".join(lines))


def write_frontier(results: Dict, out: str, title: str, replay: str, tolerance: float, min_kept: float) -> Dict:
    """frontier.json, frontier.md and frontier.png: the settings' foundation drift against target gain, the
    frontier and the recommended setting with its config block (printed too)."""
    from orb.files import write_json, write_text

    settings = fr.summarise(results)
    chosen, reason = fr.recommend(settings, tolerance, min_kept)
    block = fr.config_block(measured(chosen.name, replay)) if chosen else ""
    report = fr.as_json(settings, chosen, reason, tolerance, min_kept, block)
    write_json(os.path.join(out, "frontier.json"), report)
    lines = [f"{title}\n", *fr.table(settings, chosen, tolerance, min_kept), "",
             f"Recommended: {chosen.name if chosen else '-'}: {reason}.", "", "```yaml", block.rstrip(), "```"]
    write_text(os.path.join(out, "frontier.md"), "\n".join(lines) + "\n")
    print("\n".join(lines))
    plot_frontier(settings, chosen, tolerance, title, os.path.join(out, "frontier.png"))
    return report


def plot_frontier(settings: List[fr.Setting], chosen, tolerance: float, title: str, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5))
    for s in settings:
        ax.scatter(s.gain, s.drift, color="tab:red" if s is chosen else "tab:blue", zorder=3)
        ax.annotate(s.name + (" (recommended)" if s is chosen else ""), (s.gain, s.drift), fontsize=7,
                    xytext=(3, 3), textcoords="offset points")
    line = fr.frontier(settings)
    ax.plot([s.gain for s in line], [s.drift for s in line], color="grey", linestyle="--", label="frontier")
    ax.axhline(tolerance, color="tab:orange", linestyle=":", label=f"tolerance {tolerance:g} %")
    ax.axhline(0, color="black", linewidth=0.5)
    ax.set_xlabel("target force MAE improvement, worst of best and final weights (%)")
    ax.set_ylabel("foundation MAE change, worst of E/atom and F, best and final (%)")
    ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    from orb.files import write_atomically

    write_atomically(path, lambda tmp: fig.savefig(tmp, dpi=120, format="png"))
    plt.close(fig)


def build_parser():
    """This script's command line (the docs test parses its documented commands with it)."""
    from orb.commands import HelpFormatter

    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0],
                                     formatter_class=HelpFormatter)
    parser.add_argument("--demo", choices=tuple(DEMOS), default="orb_v2",
                        help="the demo model to fine-tune (its config and checkpoint unless given)")
    parser.add_argument("--target", default="Al,Pt", help="a demo target's metals (--kind molecules: ignored)")
    parser.add_argument("--kind", choices=("fcc", "alloy", "rocksalt", "molecules"), default="fcc",
                        help="a demo target's structures (scripts/make_demo_dataset.py --kind)")
    parser.add_argument("--seed", type=int, default=7, help="seed of a demo target")
    parser.add_argument("--train", default="", help="your target's training data: runs the study on it")
    parser.add_argument("--val", default="", help="your target's validation data (picks the best epoch)")
    parser.add_argument("--test", default="", help="your target's held-out data the gain is measured on "
                        "(default: --val, which also chose the best epoch)")
    parser.add_argument("--config", default="", help="the config of every run (default: the demo's)")
    parser.add_argument("--checkpoint", default="", help="the foundation to start from (default: the demo's)")
    parser.add_argument("--replay", default=PRETRAIN_TRAIN, help="structures of the foundation's distribution "
                        "to replay with pseudo-labels (no labels needed)")
    parser.add_argument("--foundation", default=PRETRAIN_VAL, help="labelled held-out structures of the "
                        "foundation's distribution the drift is measured on (not in --replay)")
    parser.add_argument("--epochs", type=int, default=20, help="epochs of each run")
    parser.add_argument("--run_seed", type=int, default=None, help="random_seed of every run (default: the "
                        "config's): a second seed shows how much of a difference is the runs' own noise")
    parser.add_argument("--out", default="", help="folder of the runs (default: runs/strategies_<demo>_<target>)")
    parser.add_argument("--only", default="", help="comma-separated setting names (default: the frontier grid; "
                        "'all': every setting)")
    parser.add_argument("--tolerance", type=float, default=5.0,
                        help="the foundation's largest acceptable MAE change (%%) for the recommendation")
    parser.add_argument("--min_kept", type=float, default=80.0, help="share of plain fine-tuning's target gain "
                        "(%%) a compromise must keep when no setting is within the tolerance")
    return parser


def study_of(args, out: str) -> Dict[str, str]:
    """The study's config, checkpoint, target data (train, val, test) and foundation data, as paths."""
    config, checkpoint = DEMOS[args.demo]
    study = {"config": args.config or os.path.join(ROOT, "configs", config),
             "checkpoint": args.checkpoint or os.path.join(ROOT, "data", checkpoint),
             "replay": os.path.abspath(args.replay), "foundation": os.path.abspath(args.foundation),
             "run_seed": args.run_seed}
    if args.train:
        return dict(study, train=args.train, val=args.val, test=args.test or args.val)
    return dict(study, **narrow_target(out, args.target, args.seed, args.kind))


def run_setting(name: str, study: Dict[str, str], out: str, epochs: int) -> Dict[str, Dict]:
    """Fine-tune with setting ``name`` (continuing a killed run of it) and measure its best and final weights."""
    run = os.path.join(out, name.replace(" ", "_").replace(",", "").replace("+", "and"))
    seed = {"random_seed": study["run_seed"]} if study.get("run_seed") is not None else {}
    args = command_line({**seed, **measured(name, study["replay"])}) + ["--resume", "auto"]
    seconds = fine_tune(study, args, run, epochs)
    return {f"{name}, {kind}": dict(measure(weights, study, os.path.join(run, f"eval_{kind}")), seconds=seconds)
            for kind, weights in (("best", os.path.join(run, "checkpoints", "best_weights.ckpt")),
                                  ("final", final_weights(run)))}


STUDY_KEYS = ("demo", "kind", "target", "seed", "train", "val", "test", "config", "checkpoint", "replay",
              "foundation", "epochs", "run_seed")


def same_study_or_refusal(args, out: str) -> str:
    """Keep what decides the study's numbers in ``out/study.json`` (a killed study continues only with the same),
    and return the refusal of another study in the same folder (its results would be reported as this one's);
    "" when it may go on."""
    from orb.files import write_json

    paths = ("train", "val", "test", "config", "checkpoint", "replay", "foundation")
    identity = {k: os.path.abspath(getattr(args, k)) if k in paths and getattr(args, k) else getattr(args, k)
                for k in STUDY_KEYS}
    record = os.path.join(out, "study.json")
    if os.path.exists(record):
        from orb.records import read_json

        kept = read_json(record, "; remove that folder to start the study again")
        if not isinstance(kept, dict):
            raise RunError(f"{record} holds no study's record: remove that folder to start the study again")
        changed = [f"{k} {kept.get(k)!r} -> {identity[k]!r}" for k in STUDY_KEYS if kept.get(k) != identity[k]]
        if changed:
            return (f"{out} holds the results of another study ({'; '.join(changed)}): choose another --out, or "
                    f"remove that folder to start again")
        return ""
    write_json(record, identity)
    return ""


def main(argv=None) -> int:
    """A command (orb.signals.run_command): a stop ends it with 75 after the running fine-tuning saved; the same
    command continues the study. Its evaluations run inside it as commands of their own."""
    from orb.signals import run_command

    return run_command(lambda: study(argv))


def study(argv) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.train and not args.val:
        parser.error("--train needs --val (the validation set picks each run's best epoch)")
    names = list(STRATEGIES) if args.only == "all" else [n.strip() for n in args.only.split(",") if n.strip()] or GRID
    unknown = [n for n in names if n not in STRATEGIES]
    if unknown:
        parser.error(f"--only: unknown settings {unknown}; valid: {'; '.join(STRATEGIES)}")
    target = "your target" if args.train else "molecules" if args.kind == "molecules" else \
        f"{args.kind} {args.target}".replace("fcc ", "")
    out = args.out or os.path.join(ROOT, "runs", f"strategies_{args.demo}_{target.replace(',', '').replace(' ', '_')}")
    os.makedirs(out, exist_ok=True)
    from orb.files import sole_writer

    with sole_writer(out, "--out"):  # (the same study started twice: the second is refused)
        return run_study(args, out, names, target)


def run_study(args, out: str, names: List[str], target: str) -> int:
    from orb.files import write_json

    refusal = same_study_or_refusal(args, out)
    if refusal:
        print(f"error: {refusal}", file=sys.stderr)
        return 2
    from orb.device import configure_mindspore

    configure_mindspore("CPU")
    study = study_of(args, out)
    record = os.path.join(out, "results.json")
    from orb.records import read_json

    results = read_json(record, "; remove it to measure every setting again") if os.path.exists(record) else {}
    if not isinstance(results, dict):
        raise RunError(f"{record} holds no study's results: remove it to measure every setting again")
    if "starting model" not in results:
        results["starting model"] = measure(study["checkpoint"], study, os.path.join(out, "eval", "start"))
        write_json(record, results)
    for name in names:
        if f"{name}, final" in results:
            continue  # measured by an earlier (killed) study
        results.update(run_setting(name, study, out, args.epochs))
        write_json(record, results)
        print(f"{name}: done in {results[name + ', final']['seconds']:.0f} s", file=sys.stderr)
    title = (f"{os.path.basename(study['checkpoint'])} on {target}" +
             ("" if args.train else f" (seed {args.seed})") + f", {args.epochs} epochs" +
             ("" if args.run_seed is None else f", runs' random_seed {args.run_seed}") + "; changes against the "
             "starting model")
    write_table(results, out, title)
    write_frontier(results, out, title, study["replay"], args.tolerance, args.min_kept)
    return 0


if __name__ == "__main__":
    from orb.signals import run_program

    run_program(main)
