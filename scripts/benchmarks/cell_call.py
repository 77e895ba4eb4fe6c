"""``cell-call``: what MindSpore's ``Cell.compile`` does at every call of a compiled prediction besides running it --
handing the cell's phase to every sub-cell (``Cell.compile_phase``'s setter) -- against the whole call."""

import os
import time

import numpy as np

from .common import DEMO, ROOT


def bench_cell_call(args) -> None:
    """For each model: its cells, the time of MindSpore's phase hand-down (its own setter, on the compiled prediction
    cell), the time of a whole calculator call on a rattled copy of one structure (the phase is handed down only
    when a compilation may follow: orb.graph_cache.CompiledThroughCache), medians of ``--calls``."""
    from ase.build import bulk
    from mindspore import nn

    from orb.device import configure_mindspore
    from orb.inference.calculator import ORBCalculator
    from orb.models import create

    configure_mindspore("CPU")
    print("| model | cells (the top one included) | phase handed down (ms) | calculator call (ms) | atoms |")
    print("|---|---|---|---|---|")
    for name in args.models.split(","):
        if name == "demo":
            calc = ORBCalculator.from_checkpoint(os.path.join(ROOT, "data", "demo_pretrained.ckpt"))
            from ase.db import connect

            atoms = next(connect(DEMO).select(limit=1)).toatoms()
        else:
            calc = ORBCalculator(create(name))
            atoms = bulk("Cu", "fcc", a=3.6, cubic=True) * (2, 2, 4)
        atoms.calc = calc
        rng = np.random.default_rng(0)
        base = atoms.positions.copy()

        def call():
            atoms.positions = base + rng.normal(0, 0.02, base.shape)
            atoms.get_forces()

        call()
        cell = calc.predictor.cell
        phase = cell.compile_phase
        hand_down = nn.Cell.compile_phase.fset
        walks, calls = [], []
        for _ in range(args.calls):
            start = time.perf_counter()
            hand_down(cell, phase)
            walks.append(time.perf_counter() - start)
            start = time.perf_counter()
            call()
            calls.append(time.perf_counter() - start)
        cells = sum(1 for _ in cell.cells_and_names())
        print(f"| {name} | {cells} | {np.median(walks) * 1e3:.2f} | {np.median(calls) * 1e3:.1f} | {len(atoms)} |")
