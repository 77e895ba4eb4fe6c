"""``save``: what a training checkpoint (weights, Adam's moments, the EMA) costs to write at a model's full size."""

import os
import tempfile
import time

import numpy as np


def bench_save(args) -> None:
    """What a training checkpoint costs at a model's full size: weights, Adam's moments and the EMA, written as
    the trainer writes last.ckpt (temporary file, fsync, rename), median of several saves."""
    from orb.io.checkpoint import save_checkpoint
    from orb.models import create
    from orb.training import state as training_state
    from orb.training.distributed import DataParallel
    from orb.training.optimizer import FlatAdam
    from orb.training.schedule import constant

    model = create(args.model)
    params = model.trainable_params()
    optimizer = FlatAdam(params, constant(1e-4, 10), ema_decay=0.99)
    names = [name for name, _ in model.parameters_and_names() if any(name == p.name for p in params)]
    with tempfile.TemporaryDirectory(dir=args.dir or None) as tmp:
        path = os.path.join(tmp, "last.ckpt")
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            state = training_state.optimizer_state(optimizer, names, DataParallel())
            save_checkpoint(path, model, {"epoch": 1}, state)
            times.append(time.perf_counter() - start)
        size = os.path.getsize(path) / 1e6
    seconds = float(np.median(times))
    print(f"| model | checkpoint (MB) | save (s, median of {args.repeats}) | every 30 min: share of training time |")
    print("|---|---|---|---|")
    print(f"| {args.model} | {size:.0f} | {seconds:.2f} ({', '.join(f'{t:.2f}' for t in times)}) | "
          f"{100 * seconds / 1800:.2f} % |")
