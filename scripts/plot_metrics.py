"""Plot training and validation curves from a run's metrics.jsonl.

    python scripts/plot_metrics.py outputs/demo/metrics.jsonl -o outputs/demo/curves.png

Four panels per epoch: total loss (normalised units), energy MAE (eV), force MAE (eV/Å) and
stress MAE (eV/Å³), train and validation (epoch 0: the starting checkpoint), on log scales.
"""

import argparse
import json
import os
import sys

PANELS = (("loss", "loss (normalised)"), ("energy_mae_raw", "energy MAE (eV)"),
          ("node_mae_raw", "force MAE (eV/Å)"), ("stress_mae_raw", "stress MAE (eV/Å³)"))


def read_epochs(path):
    with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    epochs = [r for r in records if r.get("type") in ("initial", "epoch")]  # initial: epoch 0, validation only
    if not epochs:
        raise SystemExit(f"error: {path} has no epoch records")
    return epochs


def plot(epochs, output: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(10, 7), constrained_layout=True)
    x = [r["epoch"] for r in epochs]
    for ax, (key, label) in zip(axes.ravel(), PANELS):
        for part, style in (("train", "-o"), ("val", "-s")):
            values = [r.get(part, {}).get(key) for r in epochs]
            points = [(e, v) for e, v in zip(x, values) if v is not None]
            if points:
                ax.plot(*zip(*points), style, markersize=3, label=part)
        if ax.lines:
            if all(v > 0 for line in ax.lines for v in line.get_ydata()):
                ax.set_yscale("log")
            ax.legend()
        else:
            ax.text(0.5, 0.5, "not trained", ha="center", va="center", transform=ax.transAxes)
        ax.set_xlabel("epoch")
        ax.set_title(label)
        ax.grid(alpha=0.3)
    fig.savefig(output, dpi=120)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("metrics", help="metrics.jsonl written by finetune.py")
    parser.add_argument("-o", "--output", default="", help="PNG file (default: curves.png beside metrics.jsonl)")
    args = parser.parse_args(argv)
    output = args.output or os.path.join(os.path.dirname(os.path.abspath(args.metrics)), "curves.png")
    plot(read_epochs(args.metrics), output)
    print(f"wrote {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
