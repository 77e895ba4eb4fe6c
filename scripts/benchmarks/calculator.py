"""``calculator``: the ASE calculator (force calls on rattled fcc Cu cells of 64 and 256 atoms, steps per second)
against orb-models' ORBCalculator (``peer/torch_calculator.py``), MindSpore in graph or PyNative mode. Graph mode goes
through the README's path, ``ORBCalculator.from_checkpoint`` (random weights saved to a checkpoint first);
PyNative mode through ``ORBCalculator(model)`` in a script that never set graph mode."""

import json
import os
import tempfile
import time

import numpy as np

from .common import run_torch


def bench_calculator(args) -> None:
    import mindspore as ms
    from ase.build import bulk

    from orb.inference.calculator import ORBCalculator
    from orb.io.checkpoint import save_checkpoint
    from orb.models import create

    if args.mode == "pynative":  # a script that builds a model object and never sets graph mode (it compiles anyway)
        ms.set_context(mode=ms.PYNATIVE_MODE)
        calc = ORBCalculator(create(args.model))
    else:
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "model.ckpt")
            save_checkpoint(path, create(args.model))
            calc = ORBCalculator.from_checkpoint(path, device_target="CPU", model_name=args.model)
    sizes = [(2, 2, 4), (4, 4, 4)]  # 64 and 256 atoms
    ours = {}
    for reps in sizes:
        atoms = bulk("Cu", "fcc", a=3.6, cubic=True).repeat(reps)
        atoms.calc = calc
        times = []
        for i in range(args.steps):
            atoms.rattle(0.01, seed=i)
            start = time.perf_counter()
            atoms.get_forces()
            times.append(time.perf_counter() - start)
        ours[str(len(atoms))] = 1.0 / float(np.median(times[1:]))
    v2 = args.model == "orb_v2"
    theirs = {}
    if args.torch_python:
        theirs = run_torch(args.torch_python, "torch_calculator.py",
                           ["--model", args.model, "--sizes", json.dumps(sizes), "--steps", str(args.steps)])
    print(f"{args.model}, MindSpore in {args.mode} mode")
    print(f"| atoms | MindSpore steps/s | orb-models {'0.4.2' if v2 else '0.5.5'} ORBCalculator steps/s | ratio |")
    print("|---|---|---|---|")
    for n, rate in ours.items():
        t = theirs.get(n)
        print(f"| {n} | {rate:.2f} | {f'{t:.2f}' if t else '-'} | {f'{rate / t:.2f}x' if t else '-'} |")
