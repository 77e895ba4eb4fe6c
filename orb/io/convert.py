"""Convert orb checkpoints between PyTorch (orb-models) and MindSpore, without needing torch.

    # PyTorch orb state dict -> MindSpore checkpoint (for checkpoint_path, evaluation, the calculator)
    orb-convert orb-v2-20241011.ckpt orb_v2_mindspore.ckpt

    # fine-tuned MindSpore checkpoint (e.g. outputs/run/checkpoints/best_weights.ckpt) -> PyTorch state dict
    orb-convert outputs/run/checkpoints/best_weights.ckpt finetuned_torch.ckpt --to torch

The architecture is read from the checkpoint (stored by this program, else from the tensor shapes),
and every key and shape is checked against it. The PyTorch file is written in torch.save's zip
format by this program itself (torch is not imported) and loads with ``torch.load`` +
``model.load_state_dict(state_dict, strict=True)`` in orb-models. Optimizer state in training
checkpoints is dropped.
"""

import argparse
import os
import sys
from typing import Optional


# the metadata a MindSpore target keeps from its source: which epoch, its loss, EMA weights or not, the run's config
# and the reference energies its fit moved (not a training checkpoint's format or progress: the target is weights)
DESCRIPTIVE = ("epoch", "val_loss", "ema", "config", "reference_energies_fit")


def main(argv=None) -> int:
    from orb.signals import run_command

    return run_command(lambda: parse_and_convert(argv))  # a stop: 75, a half-written target's temporaries removed


def parse_and_convert(argv) -> int:
    args = build_parser().parse_args(argv)
    return convert(args.source, args.target, args.to, args.model, args.overwrite)


def build_parser(prog: Optional[str] = None) -> argparse.ArgumentParser:
    """orb-convert's options."""
    from orb.bundled import command_path
    from orb.commands import HelpFormatter, Parser

    parser = Parser(prog=prog, allow_abbrev=False, description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("source", type=command_path, help="PyTorch .ckpt (zip) or MindSpore checkpoint")
    parser.add_argument("target", help="output file")
    parser.add_argument("--to", choices=("mindspore", "torch"), default=None,
                        help="output format (default: the other one of the source's)")
    parser.add_argument("--model", default=None, help="model name, when the checkpoint cannot tell (a published "
                        "orb-v3 file: orb_v3_conservative_20_omat or ..._inf_omat) (default: the checkpoint's)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing target file (never the source)")
    return parser


def check_target(source: str, target: str, overwrite: bool) -> None:
    """Before any work: the target is never the source however spelt (it replaced its own source), nor a folder, and
    an existing file is replaced only with ``overwrite`` (it was replaced unasked, as no other command does)."""
    from orb.errors import OrbInputError
    from orb.files import refuse_overwriting_inputs

    refuse_overwriting_inputs([("target", target, None)], [("source", source)])
    if os.path.isdir(target):
        raise OrbInputError(f"target {target} is a folder: name a file")
    if os.path.lexists(target) and not overwrite:
        raise OrbInputError(f"target {target} exists: pass --overwrite to replace it")


def convert(source: str, target: str, to=None, name=None, overwrite: bool = False) -> int:
    from orb.device import import_mindspore

    check_target(source, target, overwrite)
    import_mindspore()  # a stop signal meanwhile is honoured after it
    from orb.io.checkpoint import (architecture, describe, load_torch_state_dict, read_weights, save_checkpoint,
                                   settings_a_state_dict_loses, stored_architecture, to_torch_state_dict)
    import numpy as np

    from orb.errors import CheckpointError, RunError
    from orb.io.torch_format import is_torch_zip, write_torch_checkpoint
    from orb.models import build
    from orb.models.config import ModelConfig

    weights, meta = read_weights(source)
    not_finite = next((key for key, value in weights.items() if np.issubdtype(np.asarray(value).dtype, np.floating)
                       and not np.isfinite(value).all()), None)
    if not_finite is not None:  # (a diverged run's weights: a checkpoint never holds NaN)
        raise CheckpointError(f"{source}: tensor '{not_finite}' holds NaN or inf (weights of a diverged run): convert "
                              f"a checkpoint saved before it diverged")
    to = to or ("mindspore" if is_torch_zip(source) else "torch")
    if to == "mindspore" and not target.endswith(".ckpt"):  # (MindSpore reads .ckpt files only: unreadable after)
        raise CheckpointError(f"target {target}: a MindSpore checkpoint must end in .ckpt (MindSpore reads no other)")
    cfg = architecture(weights, meta, name)
    stored = stored_architecture(meta)
    trained = ModelConfig.from_dict(dict(stored, name=cfg.name)) if stored else cfg  # (--model renames, keeps these)
    model = build(cfg)
    load_torch_state_dict(model, weights, source=source)  # strict: keys and shapes
    lost, read_as = {}, cfg.name
    try:
        if to == "torch":
            state = to_torch_state_dict(model)
            lost, read_as = settings_a_state_dict_loses(trained, state)
            write_torch_checkpoint(state, target)
        else:
            kept = {k: meta[k] for k in DESCRIPTIVE if k in meta}  # what a best_weights.ckpt says of itself
            save_checkpoint(target, model, {**kept, "converted_from": os.path.abspath(source), "model": cfg.to_dict()})
    except OSError as exc:
        raise RunError(f"cannot write {target}: {exc.strerror or exc}") from None
    print(f"wrote {to} checkpoint {target}: {describe(cfg)}, {len(weights)} tensors, "
          f"{model.num_parameters():,} parameters")
    if lost:  # a PyTorch state dict holds tensors only: its readers build the name's model
        print(f"warning: {target} holds tensors only: its readers build {cfg.name} with "
              + ", ".join(f"{k} {theirs}" for k, (_, theirs) in lost.items()) + ", but this model has "
              + ", ".join(f"{k} {ours}" for k, (ours, _) in lost.items())
              + f", which no reader of that file can know; keep using {source} with this project's tools",
              file=sys.stderr)
    if read_as != cfg.name:
        print(f"warning: {target}'s tensors read as {read_as} unless its readers are given the name {cfg.name}: "
              f"orb-convert and orb-evaluate --model {cfg.name}, ORBCalculator.from_checkpoint(..., "
              f"model_name='{cfg.name}'), orb-models' {cfg.name} loader", file=sys.stderr)
    return 0


if __name__ == "__main__":
    from orb.signals import run_program

    run_program(main)
