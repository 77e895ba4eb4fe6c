"""Write the config templates from one source: the one-line comments below, TrainConfig's defaults and the model
names. The templates are configs/finetune_orb_v3.yaml, configs/finetune_orb_v2.yaml and configs/config_parallel.yaml
(what run_parallel.sh reads when given no config: finetune_orb_v3.yaml without device_id, which msrun sets).

    python scripts/make_templates.py           # write them
    python scripts/make_templates.py --check   # exit 1, naming the files, if a checked-in template differs

tests/test_templates.py fails when a template differs from what this writes, or when a key of TrainConfig or a
model name has no line here.
"""

import argparse
import os
import sys
from typing import Any, Dict, List, NamedTuple, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from orb.models.config import MODEL_NAMES, ModelConfig  # noqa: E402
from orb.training.config import TrainConfig, flatten  # noqa: E402

COLUMN = 28  # where the comments start
WIDTH = 120  # the longest line
EDIT = "edit: "  # a placeholder's marker

# Every key of TrainConfig (dotted: the key inside its block), in the templates' order, with its one-line comment.
SECTIONS: List[Tuple[str, List[Tuple[str, str]]]] = [
    ("Data: extxyz or any file ase.io reads, ASE SQLite (.db), .aselmdb, a folder of these, or a list [a.xyz, b.db]", [
        ("train_data_path", "energies (eV), forces (eV/Å), optional stress (eV/Å³)"),
        ("val_data_path", 'validated every epoch, all of it; "" = val_fraction of the training data'),
        ("val_fraction", "no val_data_path: this seeded share of your data validates"),
        ("energy_key", 'ase.io files: the energy\'s info key; "" = REF_energy, stored results, energy'),
        ("forces_key", 'ase.io files: the forces\' arrays key; "" = REF_forces, stored results, forces'),
        ("stress_key", 'ase.io files: the stress\'s info key; "" = REF_stress, stored, stress, virial; none'),
        ("charge_key", "OMol models: each frame's total charge (info key; an ASE db's key-value pair)"),
        ("spin_key", "OMol models: each frame's spin multiplicity (as charge_key)"),
    ]),
    ("Start and outputs: a model name below fetches its published weights once (ahead: orb-download NAME)", [
        ("checkpoint_path", "a model name, its .ckpt, or one of ours"),
        ("output_dir", "train.log, metrics.jsonl, checkpoints/"),
    ]),
    ("Device and numerics", [
        ("device_target", "auto (Ascend, then GPU, then CPU) | Ascend | GPU | CPU"),
        ("device_id", "this node's device for a one-device run (run_parallel.sh ignores it: msrun assigns them)"),
        ("num_threads", "CPU kernel threads; 0 = OMP_NUM_THREADS if set, else MindSpore's default"),
        ("deterministic", "true: a rerun or resume computes the same bits (CPU: one kernel thread)"),
        ("ops_profile", "auto: cpu on CPU, portable on Ascend/GPU | portable | cpu (docs/install.md)"),
        ("precision", "float32-high: HF32/TF32 products | float32-highest | bf16-mixed | fp16-mixed | float64"),
        ("initial_loss_scale", "fp16-mixed: the dynamic loss scale's start (halved on overflow); 1 to 2^24"),
        ("data_workers", "processes preparing batches ahead of the device; 0 = in the training process"),
        ("compile_cache", "keep compiled graphs in ORB_CACHE_DIR: a restart loads them; false = compile each"),
        ("optimizer_shard", "data-parallel: each worker keeps 1/N of Adam's state (ZeRO-1)"),
    ]),
    ("Optimisation (orb-models' finetune.py: Adam, lr 3e-4, one_cycle, clip 0.5; cosine measured better here)", [
        ("batch_size", "structures per step, over all workers together"),
        ("max_epochs", "passes over the training data; the schedule advances by applied steps, not skipped ones"),
        ("lr", "peak learning rate"),
        ("lr_schedule", "cosine: warm-up to lr, decay to lr/10 | one_cycle (orb-models'): up to 10 lr | constant"),
        ("warmup_fraction", "share of all steps spent warming up"),
        ("ema_decay", "validation and best checkpoints use an EMA of the weights; 0 = off"),
        ("optimizer", "adam (PyTorch's) | sgd (plain, for comparisons)"),
        ("gradient_clip_mode", "norm: global L2 norm <= gradient_clip_val (orb-models 0.7.0) | value | none"),
        ("gradient_clip_val", "the clipping threshold"),
        ("loss_weights.energy", "losses in normalised units (orb-v2: L1; orb-v3: Huber); 0 = off"),
        ("loss_weights.forces", "forces (conservative models: the energy's derivative)"),
        ("loss_weights.stress", "stress; off by itself (a warning) when the data has none"),
        ("loss_weights.confidence", "orb-v3: the confidence head's cross-entropy (per-atom force error)"),
        ("loss_weights.equigrad", "orb-v3 conservative: the energy's rotational gradient penalty (orb-models: off)"),
        ("online_normalisation", "normalisers absorb every batch (orb-models'); false keeps the foundation's"),
        ("augmentation", "random rotations of positions, cell, forces and stress"),
        ("random_seed", "seed of the data order, augmentation and initialisation"),
        ("patience", "stop after this many epochs without a lower validation loss; 0 = every epoch"),
    ]),
    ("Per-element reference energies", [
        ("reference_energies.trainable", "auto: orb-v2 trains them, orb-v3 keeps them (as orb-models) | true | false"),
        ("reference_energies.table", 'a published table (vasp-r2scan, matpes-pbe, ...); "" = the checkpoint\'s'),
        ("reference_energies.file", 'JSON {"H": -3.4, ...} (eV/atom) on top of the checkpoint\'s or the table\'s'),
        ("reference_energies.fit", "none | residual: to DFT - the start's prediction | least_squares: to DFT"),
    ]),
    ("Keeping the foundation. Groups: embeddings, encoder, layers, layers:I-J, *_head, heads, backbone, ...", [
        ("freeze_backbone", "true: train only the heads"),
        ("freeze", "groups kept at the starting weights, e.g. [embeddings, \"layers:0-2\"]"),
        ("lr_multipliers", "group: factor on lr (0 freezes), e.g. {backbone: 0.1}"),
        ("anchor.weight", "L2-SP: weight x sum((w - w_start)^2) in the loss; 0 = off"),
        ("anchor.groups", "groups anchored; [] = every trained parameter"),
        ("lora.rank", "low-rank adapters on the groups' MLPs, merged on export; null = off"),
        ("lora.alpha", "adapter scale: alpha / rank"),
        ("lora.groups", "groups whose MLPs get adapters"),
        ("lora.train_others", "false: only the adapters train"),
    ]),
    ("Replay: structures of the foundation's own data, validated each epoch and, with fraction > 0, trained on", [
        ("replay.data_path", 'the foundation\'s distribution (e.g. some MPtrj or OMat frames); "" = no replay'),
        ("replay.val_data_path", 'held-out replay frames; "" = val_samples rows of data_path'),
        ("replay.val_samples", "rows of data_path held out for validation"),
        ("replay.labels", "data: the file's labels | model: the starting model's predictions (no DFT needed)"),
        ("replay.fraction", "share of each step's structures drawn from replay data; 0 = measure only"),
        ("replay.num_samples", "0 = every row; else this many, chosen by selection"),
        ("replay.selection", "fps: farthest-point in the start's descriptors | random"),
        ("replay.loss_weight", "replay structures' loss weight, relative to yours"),
        ("replay.head", "shared | separate: own heads for replay data of another level of theory"),
        ("replay.in_selection", "true: the best epoch minimises validation + replay validation loss"),
    ]),
    ("Batch shapes: steps are padded to a few bucket shapes, one compilation each", [
        ("buckets", "[[num_nodes, num_edges], ...]; [] = planned from the data"),
        ("num_buckets", "buckets to plan when buckets is [] (at most 16); 0 = chosen for the run"),
    ]),
    ("Checkpoints and logs", [
        ("save_every_x_epochs", "also write epoch_XXXX.ckpt (last, best and best_weights are always written)"),
        ("keep_checkpoints", "keep the newest N epoch_XXXX.ckpt; 0 = all"),
        ("save_every_n_steps", "also save last.ckpt every N steps (0 = off); a resume continues there"),
        ("save_every_minutes", "... and at least this often (0 = off): a preempted job loses at most this"),
        ("max_nonfinite_steps", "NaN/inf steps are skipped; this many in a row stop the run"),
        ("log_every_n_steps", "step metrics to metrics.jsonl"),
        ("progress_bar", "auto (on a terminal) | true | false"),
        ("record_batches", "write batches_rank<r>.jsonl: the rows each worker trained on per step"),
        ("callbacks", '["module:Name", ...]: objects called in the loop (your tracker, custom stops)'),
    ]),
]
MODEL_KEYS: List[Tuple[str, str]] = [
    ("name", "a name above; sets the architecture"),
    ("latent_dim", "width of the node and edge features"),
    ("mlp_hidden_dim", "hidden width of the message-passing MLPs"),
    ("num_mlp_layers", "hidden layers per message-passing MLP"),
    ("num_message_passing_steps", "message-passing layers"),
    ("num_rbf", "radial basis functions (orb-v2: Gaussians; orb-v3: Bessel)"),
    ("rbf_radius", "Å: the radial basis's range"),
    ("cutoff_rmax", "Å: where the envelope reaches zero"),
    ("polynomial_order", "the envelope's power"),
    ("head_mlp_hidden_dim", "hidden width of the output heads"),
    ("head_num_mlp_layers", "hidden layers per head"),
    ("num_elements", "elements embedded (Z up to this)"),
    ("decoder_out_dim", "the node decoder's output width"),
    ("radius", "Å: neighbour search radius of the graph"),
    ("max_neighbors", "neighbours kept per atom (orb-v3: 20 in _20_ models, 120 in _inf_ and OMol)"),
]
MODELS: Dict[str, str] = {
    "orb_v2": "orb-v2: MPtrj + Alexandria, 15 layers, 10 Å, 20 neighbours",
    "orb_mptraj_only_v2": "orb-v2 trained on MPtrj only (Matbench reproduction; not for general use)",
    "orb_d3_v2": "orb-v2 trained on PBE+D3 labels: dispersion is in its energies",
    "orb_d3_sm_v2": "orb_d3_v2 with 10 layers",
    "orb_d3_xs_v2": "orb_d3_v2 with 5 layers",
    "orb_v3_conservative_20_omat": "orb-v3 on OMat24; forces and stress as derivatives; 20 neighbours",
    "orb_v3_conservative_inf_omat": "orb-v3 on OMat24, conservative, 120 neighbours: the most accurate",
    "orb_v3_direct_20_omat": "orb-v3 on OMat24; forces and stress from heads (faster); 20 neighbours",
    "orb_v3_direct_inf_omat": "orb-v3 on OMat24, direct, 120 neighbours",
    "orb_v3_conservative_omol": "orb-v3 on OMol25 molecules (needs charge and spin), conservative",
    "orb_v3_direct_omol": "orb-v3 on OMol25 molecules (needs charge and spin), direct",
    "orb_v3_conservative_20_mpa": "orb-v3 on MPtrj + Alexandria (benchmark compatibility), conservative, 20",
    "orb_v3_conservative_inf_mpa": "orb-v3 on MPtrj + Alexandria, conservative, 120 neighbours",
    "orb_v3_direct_20_mpa": "orb-v3 on MPtrj + Alexandria, direct, 20 neighbours",
    "orb_v3_direct_inf_mpa": "orb-v3 on MPtrj + Alexandria, direct, 120 neighbours",
}


class Template(NamedTuple):
    """One template: its header, its values that differ from the defaults (value, why) and the keys it leaves out."""

    header: str
    values: Dict[str, Tuple[Any, str]]
    left_out: Tuple[str, ...] = ()


RUN = """# Run it as it is once train_data_path and output_dir name yours:
#   orb-finetune --config my.yaml               one device       (a checkout: python finetune.py --config my.yaml)
#   orb-finetune-parallel my.yaml               data-parallel    (a checkout: bash run_parallel.sh my.yaml)
# Every key the config takes is here, with its one-line comment; a value that is not the built-in default says
# so: (default: X; why). Relative paths are relative to the folder you run from. Any key can also be given on the
# command line: --max_epochs 20 --batch_size 16. (Written by scripts/make_templates.py.)
"""


def family(name: str, run: str, lr: Tuple[Any, str] = None) -> Dict[str, Tuple[Any, str]]:
    """A published model's template values: weights by name, placeholders for your data and run folder."""
    values = {
        "train_data_path": ("my_train.extxyz", EDIT + "yours"),
        "checkpoint_path": (name, "random weights"),
        "output_dir": (f"outputs/{run}", EDIT + "a folder per run"),
        "val_fraction": (0.05, "one file splits"),
        "model.name": (name, "this template's model"),
    }
    if lr:
        values["lr"] = lr
    return values


V3 = "orb_v3_conservative_inf_omat"
V3_LR = (1.0e-4, "orb-models' guide for orb-v3; docs/benchmarks.md")
TEMPLATES: Dict[str, Template] = {
    "finetune_orb_v3": Template(
        f"# Fine-tune orb-v3 ({V3}) on your DFT data.\n"
        "# Get a copy to edit: orb-finetune --print-config finetune_orb_v3 > my.yaml\n" + RUN,
        family(V3, "my_orb_v3", V3_LR)),
    "finetune_orb_v2": Template(
        "# Fine-tune orb-v2 (orb_v2) on your DFT data.\n"
        "# Get a copy to edit: orb-finetune --print-config finetune_orb_v2 > my.yaml\n" + RUN,
        family("orb_v2", "my_orb_v2")),
    "config_parallel": Template(
        "# Data-parallel fine-tuning, what run_parallel.sh reads when given no config: finetune_orb_v3.yaml\n"
        "# without device_id (msrun gives each worker its device). For orb-v2: run_parallel.sh finetune_orb_v2.\n"
        "#   bash run_parallel.sh [--key value ...]     (installed: orb-finetune-parallel [--key value ...])\n"
        "# Workers: WORKER_NUM, LOCAL_WORKER_NUM, MASTER_ADDR, MASTER_PORT, NODE_RANK (run_parallel.sh --help).\n"
        "# Get a copy to edit: orb-finetune --print-config config_parallel > my.yaml\n" + RUN,
        family(V3, "my_orb_v3", V3_LR), left_out=("device_id",)),
}


def yaml_value(value: Any) -> str:
    """``value`` as YAML that orb.training.config_files reads back as it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        text = repr(value)
        if value and abs(value) < 1e-3:  # 1.0e-4, not 0.0001
            mantissa, exponent = f"{value:e}".split("e")
            mantissa = mantissa.rstrip("0")
            text = f"{mantissa}{'0' if mantissa.endswith('.') else ''}e{int(exponent)}"
        assert float(text) == value, (value, text)
        return text
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        plain = value and all(c.isalnum() or c in "_-./:" for c in value) and not value[0].isdigit()
        return value if plain else '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(yaml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {yaml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"no YAML form for {value!r}")


def line(key: str, value: Any, comment: str, indent: str = "", commented_out: bool = False) -> str:
    text = f"{indent}{'# ' if commented_out else ''}{key}: {yaml_value(value)}"
    text = f"{text.ljust(COLUMN - 1)} # {comment}"
    if len(text) > WIDTH:
        raise ValueError(f"{len(text)} characters, more than {WIDTH}: {text}")
    return text


def comment_for(key: str, comment: str, template: Template, default: Any) -> str:
    """The key's comment, with ``(default: X; why)`` when the template's value is not the default."""
    if key not in template.values or template.values[key][0] == default:
        return comment
    return f"{comment} (default: {yaml_value(default)}; {template.values[key][1]})"


def render(name: str) -> str:
    """The text of template ``name``."""
    template = TEMPLATES[name]
    defaults = flatten(TrainConfig().to_dict())
    out = [template.header.rstrip("\n")]
    for title, keys in SECTIONS:
        out.append(f"\n# --- {title}")
        block = ""
        for key, comment in keys:
            if key in template.left_out:
                continue
            parent, _, leaf = key.rpartition(".")
            if parent != block:
                if parent:
                    out.append(f"{parent}:")
                block = parent
            value = template.values.get(key, (defaults[key], ""))[0]
            out.append(line(leaf, value, comment_for(key, comment, template, defaults[key]), "  " if parent else ""))
    out.append(model_block(template, defaults))
    return "\n".join(out) + "\n"


def model_block(template: Template, defaults: Dict[str, Any]) -> str:
    """The model names, one line each, and the model: block: its name, and every architecture key commented out
    with that name's value (setting one trains another architecture, which a published checkpoint refuses)."""
    name = template.values.get("model.name", (defaults["model.name"], ""))[0]
    architecture = ModelConfig.defaults(name)
    width = max(len(n) for n in MODELS)
    lines = ["\n# --- Model: one of orb-models' published models (checkpoint_path by name fetches its weights)"]
    lines += [f"#   {n.ljust(width)}  {MODELS[n]}" for n in MODEL_NAMES]
    lines.append("# The name sets the architecture, which checkpoint_path must hold; uncomment a key below only to")
    lines.append("# train another architecture from scratch.")
    lines.append("model:")
    for key, comment in MODEL_KEYS:
        dotted = f"model.{key}"
        if key == "name":
            lines.append(line(key, name, comment_for(dotted, comment, template, defaults[dotted]), "  "))
        else:
            lines.append(line(key, architecture[key], comment, "  ", commented_out=True))
    return "\n".join(lines)


def template_file(name: str) -> str:
    return os.path.join(ROOT, "configs", f"{name}.yaml")


def build_parser() -> argparse.ArgumentParser:
    """This script's command line (the docs test parses its documented commands with it)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--check", action="store_true", help="compare the checked-in templates, write nothing")
    return parser


def write_generated(texts: Dict[str, str], check: bool, source: str) -> int:
    """Write each file of ``texts`` (path -> text) that differs; with ``check``, write nothing and exit 1 naming the
    files that differ from what ``source`` writes."""
    stale = [path for path, text in texts.items()
             if not os.path.exists(path) or open(path, encoding="utf-8").read() != text]
    if check:
        if stale:
            print(f"files differ from {source}: {', '.join(stale)}", file=sys.stderr)
        return 1 if stale else 0
    for path in stale:
        with open(path, "w", encoding="utf-8") as f:
            f.write(texts[path])
        print(f"wrote {path}")
    return 0


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return write_generated({template_file(name): render(name) for name in TEMPLATES}, args.check,
                           "scripts/make_templates.py")


if __name__ == "__main__":
    sys.exit(main())
