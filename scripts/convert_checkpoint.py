"""Convert orb checkpoints between PyTorch (orb-models) and MindSpore, without needing torch.

    # PyTorch orb-v2 state dict -> MindSpore checkpoint (for checkpoint_path, evaluation, the calculator)
    python scripts/convert_checkpoint.py orb-v2-20241011.ckpt orb_v2_mindspore.ckpt

    # fine-tuned MindSpore checkpoint (e.g. outputs/run/checkpoints/best.ckpt) -> PyTorch state dict
    python scripts/convert_checkpoint.py outputs/run/checkpoints/best.ckpt finetuned_torch.ckpt --to torch

The PyTorch file is written in torch.save's zip format by this program itself (torch is not
imported), and loads with ``torch.load`` + ``model.load_state_dict(state_dict, strict=True)`` in
orb-models. Both directions check all 345 orb-v2 keys and shapes against the model described by
``--config`` (its ``model:`` block; orb-v2 by default). Optimizer state in training checkpoints is
dropped.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", help="PyTorch .ckpt (zip) or MindSpore checkpoint")
    parser.add_argument("target", help="output file")
    parser.add_argument("--to", choices=("mindspore", "torch"), default=None,
                        help="output format (default: the other one of the source's)")
    parser.add_argument("--config", default="", help="YAML config whose 'model:' block gives the architecture")
    args = parser.parse_args(argv)

    from orb.training.config import load_config
    from orb.errors import OrbInputError

    try:
        cfg = load_config(args.config or None)
        import mindspore as ms

        from orb.io.checkpoint import load_torch_state_dict, read_weights, save_checkpoint, to_torch_state_dict
        from orb.models.orb_v2 import GraphRegressor
        from orb.io.torch_format import is_torch_zip, write_torch_checkpoint

        ms.set_context(mode=ms.GRAPH_MODE)
        source_is_torch = os.path.isfile(args.source) and is_torch_zip(args.source)
        to = args.to or ("mindspore" if source_is_torch else "torch")
        weights, meta = read_weights(args.source)
        model = GraphRegressor(cfg.model)
        load_torch_state_dict(model, weights, source=args.source)  # strict: keys and shapes
        if to == "torch":
            write_torch_checkpoint(to_torch_state_dict(model), args.target)
        else:
            save_checkpoint(args.target, model, {"converted_from": os.path.abspath(args.source),
                                                 "model": cfg.model.to_dict()})
    except OrbInputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {to} checkpoint {args.target} ({len(weights)} tensors, {model.num_parameters():,} parameters)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
