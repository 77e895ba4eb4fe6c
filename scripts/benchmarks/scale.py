"""``scale``: start-up at MPtrj's size -- ``finetune.py`` on an MPtrj-sized database, stopped at its first training
step (``children/scale_first_step.py``), twice (the second start reads the checks the first kept in the cache)."""

import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from .common import child
from .mptrj import mptrj_sized_database


def bench_scale(args) -> None:
    """Start-up at MPtrj's size: an MPtrj-sized database (built once), then ``finetune.py`` launched twice (the first
    start checks every row and keeps the result in the cache; the second reads it) and stopped after its first
    training step: seconds from launch to that step, planning time per epoch, peak host memory, rows read per
    second by one process, padded / real atoms and edges of the planned training and validation steps."""
    train = mptrj_sized_database(args.rows, seed=0)
    val = mptrj_sized_database(max(args.rows // 100, 100), seed=1)
    with tempfile.TemporaryDirectory() as tmp:
        cache = args.cache_dir or os.path.join(tmp, "cache")
        env = dict(os.environ, ORB_CACHE_DIR=cache, ORB_COMPILE_CACHE_DIR=cache)
        results = []
        for start in ("first", "second"):
            argv = ["--config", "finetune_orb_v2", "--max_epochs", "20",  # (the old configs/config.yaml's epochs)
                    "--train_data_path", train, "--val_data_path", val,
                    "--model.name", args.model, "--checkpoint_path", "", "--batch_size", str(args.batch_size),
                    "--data_workers", str(args.workers), "--output_dir", os.path.join(tmp, f"run_{start}"),
                    "--progress_bar", "false"]
            launched = time.time()
            out = subprocess.run([sys.executable, child("scale_first_step.py"), *argv], capture_output=True, text=True,
                                 env=env)
            line = next((l for l in out.stdout.splitlines() if l.startswith("RESULT ")), None)
            if line is None:
                raise SystemExit(f"the {start} start failed:\n{out.stderr[-3000:]}")
            result = json.loads(line[len("RESULT "):])
            result["startup_s"] = result["first_step"] - launched
            results.append(result)
            print(f"{start} start: {result['startup_s']:.1f} s to the first training step", file=sys.stderr)
    first, second = results
    print(f"{args.rows:,} MPtrj-like rows (log-normal sizes, median 20 atoms, mean ~29, at most 444), {args.model}, "
          f"{args.batch_size} structures per step, {args.workers} data workers, one device; validation "
          f"{max(args.rows // 100, 100):,} rows stored by trajectory\n")
    print("| | first start | second start (checks cached) |")
    print("|---|---|---|")
    print(f"| launch to the first training step (s) | {first['startup_s']:.1f} | {second['startup_s']:.1f} |")
    print(f"| of which compiling that step (s) | {first['compile_s']:.1f} | {second['compile_s']:.1f} |")
    print(f"| peak host memory (GB) | {first['peak_gb']:.2f} | {second['peak_gb']:.2f} |")
    print(f"| planning an epoch of {second['steps_per_epoch']:,} steps (s) | "
          f"{np.median(first['plan_s']):.2f} | {np.median(second['plan_s']):.2f} |")
    print(f"| rows read per second (one process) | {first['rows_per_s']:,.0f} | {second['rows_per_s']:,.0f} |")
    print(f"| batches prepared: structures per second (one process) | {first['prepared_per_s']:,.0f} | "
          f"{second['prepared_per_s']:,.0f} |")
    atoms, edges = second["train_padding"]
    print(f"\ntraining buckets (nodes, edges, spare): {second['buckets']}; padded / real atoms {atoms:.2f}x, "
          f"edges {edges:.2f}x")
    for name, (atoms, edges) in second["val_padding"].items():
        print(f"{name} buckets (nodes, edges): {second['val_buckets'][name]}; padded / real atoms {atoms:.2f}x, "
              f"edges {edges:.2f}x")
