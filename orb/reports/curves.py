"""Plot training and validation curves from a run's metrics.jsonl.

    orb-plot outputs/demo/metrics.jsonl -o outputs/demo/curves.png

Four panels per epoch: total loss (normalised units), energy MAE (eV), force MAE (eV/Å) and
stress MAE (eV/Å³), train and validation (epoch 0: the starting checkpoint), and with replay the
held-out replay structures (``replay_val``: what fine-tuning costs the foundation), on log scales.
Several metrics.jsonl files are drawn in one figure (one colour per run, with its label).
"""

import argparse
import os
import sys
from typing import Dict, List, Optional, Sequence, Tuple

from orb.errors import OrbInputError
from orb.files import numbered_records, write_atomically

PANELS = (("loss", "loss (normalised)"), ("energy_mae", "energy MAE (eV)"),
          ("forces_mae", "force MAE (eV/Å)"), ("stress_mae", "stress MAE (eV/Å³)"))


def read_epochs(path: str) -> List[Dict]:
    """The epoch records of a metrics.jsonl (epoch 0: the starting checkpoint, validation only). A line that is not
    complete JSON (one a kill cut short) is skipped and said, as a resume skips it; the rest is drawn."""
    skipped: List[int] = []
    try:
        records = list(numbered_records(path, skipped))
    except (OSError, ValueError) as exc:  # (a binary file: UnicodeDecodeError)
        raise OrbInputError(f"{path}: cannot read metrics ({exc})") from None
    if skipped:
        lines = ", ".join(map(str, skipped[:5])) + (" ..." if len(skipped) > 5 else "")
        print(f"note: {path}: line{'s' if len(skipped) > 1 else ''} {lines} not complete JSON (cut short?): skipped",
              file=sys.stderr)
    for number, record in records:
        if not isinstance(record, dict):
            raise OrbInputError(f"{path}, line {number}: not a metrics record (a JSON object), got "
                                f"{type(record).__name__}")
    epochs = [r for _, r in records if r.get("type") in ("initial", "epoch")]
    if not epochs:
        raise OrbInputError(f"{path}: no epoch records (is it a metrics.jsonl written by orb-finetune?)")
    return epochs


def plot(runs: Sequence[Tuple[str, List[Dict]]], output: str):
    """One figure for one or several runs ((label, epoch records)): validation solid, replay validation dotted,
    training dashed."""
    import matplotlib

    from orb.reports import figure

    fig = figure(figsize=(11, 7.5), layout="constrained")
    axes = fig.subplots(2, 2)
    colours = matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (key, title) in zip(axes.ravel(), PANELS):
        for (label, epochs), colour in zip(runs, colours * 4):
            x = [r["epoch"] for r in epochs]
            for part, style in (("val", "-s"), ("replay_val", ":^"), ("train", "--o")):
                points = [(e, r[part][key]) for e, r in zip(x, epochs) if key in r.get(part, {})]
                if points:
                    name = f"{label} {part}" if len(runs) > 1 else part
                    ax.plot(*zip(*points), style, color=colour, markersize=3, label=name,
                            alpha=0.6 if part == "train" else 1.0)
        if ax.lines:
            if all(v > 0 for line in ax.lines for v in line.get_ydata()):
                ax.set_yscale("log")
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "not trained", ha="center", va="center", transform=ax.transAxes)
        ax.set_xlabel("epoch (0: before fine-tuning)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    fmt = os.path.splitext(output)[1][1:] or "png"
    write_atomically(output, lambda tmp: fig.savefig(tmp, dpi=120, format=fmt))
    return fig


def summary_table(runs: Sequence[Tuple[str, List[Dict]]]) -> str:
    """A markdown table of validation metrics: the start (epoch 0), the worst epoch relative to the start
    for loss and force MAE, and the end with its change from the start."""
    header = ("| run | val loss: start / worst epoch vs start | force MAE (eV/Å): start / worst vs start | "
              "final energy MAE (eV) | final force MAE (eV/Å) | final stress MAE (eV/Å³) | final force cosine |")
    lines = [header, "|" + "---|" * 7]

    def change(end: float, start: float) -> str:
        return f"{100 * (end / start - 1):+.0f}%"

    for label, epochs in runs:
        start = epochs[0]["val"] if epochs[0].get("type") == "initial" else None
        vals = [r["val"] for r in epochs if r.get("type") == "epoch" and r.get("val")]
        if start is None or not vals:
            continue
        end = vals[-1]
        worst_loss = max(v["loss"] for v in vals) / start["loss"] - 1
        worst_force = max(v["forces_mae"] for v in vals) / start["forces_mae"] - 1
        cells = [label, f"{start['loss']:.4g} / {100 * worst_loss:+.0f}%",
                 f"{start['forces_mae']:.4g} / {100 * worst_force:+.0f}%"]
        for key in ("energy_mae", "forces_mae", "stress_mae"):
            cells.append(f"{end[key]:.4g} ({change(end[key], start[key])})" if key in end else "-")
        cells.append(f"{end['forces_cosine']:.4f} (start {start['forces_cosine']:.4f})")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def check_output(output: str) -> None:
    """One line for an image file ``plot`` cannot write: a folder, or a format matplotlib does not know."""
    from matplotlib.backend_bases import FigureCanvasBase

    if os.path.isdir(output):
        raise OrbInputError(f"-o {output}: is a folder; name an image file (curves.png)")
    known = FigureCanvasBase.get_supported_filetypes()
    fmt = os.path.splitext(output)[1][1:].lower() or "png"
    if fmt not in known:
        raise OrbInputError(f"-o {output}: matplotlib writes no .{fmt} images; use one of "
                            f"{', '.join('.' + k for k in sorted(known))}")


def build_parser(prog: Optional[str] = None) -> argparse.ArgumentParser:
    """orb-plot's options."""
    from orb.commands import HelpFormatter, Parser

    parser = Parser(prog=prog, allow_abbrev=False, description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("metrics", nargs="+", help="metrics.jsonl file(s) written by orb-finetune")
    parser.add_argument("-o", "--output", default="", help="PNG file (default: curves.png beside the first file)")
    parser.add_argument("--labels", nargs="*", default=None, help="one label per file (default: its folder name)")
    parser.add_argument("--table", action="store_true", help="also print a markdown table of validation metrics "
                        "(start, worst epoch, end)")
    return parser


def main(argv=None) -> int:
    from orb.signals import run_command

    return run_command(lambda: plot_command(argv))  # (a stop signal: one line and 75, whatever the phase)


def plot_command(argv) -> int:
    args = build_parser().parse_args(argv)
    labels = args.labels or [os.path.basename(os.path.dirname(os.path.abspath(m))) for m in args.metrics]
    if len(labels) != len(args.metrics):
        print(f"error: {len(args.metrics)} metrics files but {len(labels)} labels", file=sys.stderr)
        return 2
    output = args.output or os.path.join(os.path.dirname(os.path.abspath(args.metrics[0])), "curves.png")
    try:
        check_output(output)
        runs = [(label, read_epochs(path)) for label, path in zip(labels, args.metrics)]
        plot(runs, output)
    except OSError as exc:
        print(f"error: -o {output}: cannot write it ({exc.strerror or exc})", file=sys.stderr)
        return 2
    except OrbInputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {output}")
    if args.table:
        print(summary_table(runs))
    return 0


if __name__ == "__main__":
    from orb.signals import run_program

    run_program(main)
