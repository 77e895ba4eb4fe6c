"""``calculator``: the ASE calculator (force calls on rattled fcc Cu cells of 64 and 256 atoms, steps per second)
against orb-models' ORBCalculator (``peer/torch_calculator.py``), MindSpore in graph or PyNative mode. Graph mode goes
through the README's path, ``ORBCalculator.from_checkpoint`` (random weights saved to a checkpoint first);
PyNative mode through ``ORBCalculator(model)`` in a script that never set graph mode.

On the CPU a size's first 100 calls run through the one graph for every size and later calls through the size's own
graph (:mod:`orb.inference.predictor`): both are timed, the second by giving each size its own graph at once."""

import contextlib
import json
import os
import tempfile
import time

import numpy as np

from .common import run_torch


def forward_gflop_per_call(model, atoms) -> float:
    """Matrix-multiply work of one calculator call on ``atoms`` (GFLOP): the forward pass, and for a conservative
    model the input-gradient pass that gives forces and stress, as much again (no weight gradients)."""
    from orb.data.graphs import atoms_to_graph

    from .model import forward_matmul_flops

    graph = atoms_to_graph(atoms, settings=model.cfg.graph_settings())
    flops = forward_matmul_flops(model, graph.num_nodes, graph.num_edges, 1)
    return flops * (2 if getattr(model.cfg, "conservative", False) else 1) / 1e9


def time_calls(calc, sizes, steps: int) -> dict:
    """Steps per second of ``calc`` on each size: the median call after the first (which compiles, or runs the first
    time through the graph for every size)."""
    from ase.build import bulk

    rates = {}
    for reps in sizes:
        atoms = bulk("Cu", "fcc", a=3.6, cubic=True).repeat(reps)
        atoms.calc = calc
        times = []
        for i in range(steps):
            atoms.rattle(0.01, seed=i)
            start = time.perf_counter()
            atoms.get_forces()
            times.append(time.perf_counter() - start)
        rates[str(len(atoms))] = 1.0 / float(np.median(times[1:]))
    return rates


@contextlib.contextmanager
def own_graphs(own: bool):
    """Each size given its own graph from its first call (``own``, as after 100 calls) or never (every call through
    the graph for every size), whatever the calls before."""
    from orb.inference import predictor

    before, predictor.OWN_GRAPH_AFTER = predictor.OWN_GRAPH_AFTER, 0 if own else 10 ** 9
    try:
        yield
    finally:
        predictor.OWN_GRAPH_AFTER = before


def calls_with_own_graphs(own: bool, calc, sizes, steps: int) -> dict:
    """:func:`time_calls` under :func:`own_graphs`."""
    with own_graphs(own):
        return time_calls(calc, sizes, steps)


def bench_calculator(args) -> None:
    import mindspore as ms
    from ase.build import bulk

    from orb.inference.calculator import ORBCalculator
    from orb.io.checkpoint import save_checkpoint
    from orb.models import create

    from .common import calibration, gemm_rate, mindspore_gemm_rate

    rate_before = gemm_rate()
    model = create(args.model)
    if args.mode == "pynative":  # a script that builds a model object and never sets graph mode (it compiles anyway)
        ms.set_context(mode=ms.PYNATIVE_MODE)
        calc, calc_own = ORBCalculator(model), ORBCalculator(model)
    else:
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "model.ckpt")
            save_checkpoint(path, model)
            calc, calc_own = (ORBCalculator.from_checkpoint(path, device_target="CPU", model_name=args.model)
                              for _ in range(2))  # (two: the first never gets a size's own graph)
    sizes = [(2, 2, 4), (4, 4, 4)]  # 64 and 256 atoms
    gflop = {str(4 * int(np.prod(r))): forward_gflop_per_call(model, bulk("Cu", "fcc", a=3.6, cubic=True).repeat(r))
             for r in sizes}
    ours, own, theirs = [], [], []
    every_size = calc.predictor.every_size
    for _ in range(args.rounds):  # alternated: each side's rounds see the same host
        ours.append(calls_with_own_graphs(False, calc, sizes, args.steps))
        if every_size:
            own.append(calls_with_own_graphs(True, calc_own, sizes, args.steps))
        if args.torch_python:
            theirs.append(run_torch(args.torch_python, "torch_calculator.py",
                                    ["--model", args.model, "--sizes", json.dumps(sizes), "--steps", str(args.steps)]))
    rate_after = gemm_rate()
    rate = (rate_before + rate_after) / 2
    v2 = args.model == "orb_v2"
    print(f"{args.model}, MindSpore in {args.mode} mode, {args.rounds} alternated round(s), medians; host "
          f"calibration (numpy's BLAS, 1024^3) {calibration(rate_before, rate_after)}; MindSpore's MatMul (1024^3) "
          f"{mindspore_gemm_rate():.0f} GFLOP/s")
    first = "first calls: the graph for every size" if every_size else "a graph per size"
    print(f"| atoms | MindSpore steps/s ({first}) | orb-models {'0.4.2' if v2 else '0.5.5'} ORBCalculator steps/s | "
          f"ratio | MindSpore steps/s (later calls: the size's own graph) | ratio | matrix-multiply work per call "
          f"(GFLOP) | bound at the GEMM rate (steps/s) | MindSpore / PyTorch at |")
    print("|---|---|---|---|---|---|---|---|---|")
    for n in gflop:
        mine = float(np.median([r[n] for r in ours]))
        later = float(np.median([r[n] for r in own])) if own else mine
        t = float(np.median([r[n] for r in theirs])) if theirs else None
        bound = rate / gflop[n]
        ratio = lambda x: f"{x / t:.2f}x" if t else "-"  # noqa: E731
        print(f"| {n} | {mine:.2f} | {f'{t:.2f}' if t else '-'} | {ratio(mine)} | {later:.2f} | {ratio(later)} | "
              f"{gflop[n]:.1f} | {bound:.2f} | {later / bound:.2f} / {f'{t / bound:.2f}' if t else '-'} of it |")
    if args.profile_phases:
        print_phases({"the graph for every size": (calc, False), "the size's own graph": (calc_own, True)}
                     if every_size else {"a graph per size": (calc, False)}, sizes, args.steps)
    if args.profile_ops:
        print_op_shares(calc_own if every_size else calc, sizes, rate, gflop)  # (the graph most calls run)


def op_type_times(calc, reps, calls: int = 3) -> dict:
    """Milliseconds per call of each MindSpore operator type over ``calls`` calls on a Cu cell of ``reps`` (after one
    call outside the profiler: its graph is compiled), from the profiler's CPU kernel records."""
    import csv
    import glob

    from ase.build import bulk
    from mindspore import Profiler

    atoms = bulk("Cu", "fcc", a=3.6, cubic=True).repeat(reps)
    atoms.calc = calc
    atoms.get_forces()
    with tempfile.TemporaryDirectory() as folder:
        profiler = Profiler(output_path=folder)
        for i in range(calls):
            atoms.rattle(0.01, seed=100 + i)
            atoms.get_forces()
        profiler.analyse()
        tables = glob.glob(os.path.join(folder, "**", "cpu_op_type_info_*.csv"), recursive=True)
        if len(tables) != 1:  # (MindSpore's profiler swallows its own errors: a failed analysis leaves no table)
            raise SystemExit(f"--profile-ops: MindSpore's profiler left {len(tables)} operator tables under {folder}, "
                             "expected 1 (its analysis failed, or this MindSpore writes another layout)")
        with open(tables[0]) as f:
            return {row["op_type"]: float(row["total_compute_time"]) / calls for row in csv.DictReader(f)}


def print_op_shares(calc, sizes, rate: float, gflop: dict) -> None:
    """Where a call's kernel time goes, per operator type (the largest first), and the matrix products' rate."""
    for reps in sizes:
        n = str(4 * int(np.prod(reps)))
        times = op_type_times(calc, reps)
        total = sum(times.values())
        top = sorted(times.items(), key=lambda kv: -kv[1])[:9]
        matmul = times.get("MatMul", 0.0) + times.get("BatchMatMul", 0.0)
        matmul_rate = gflop[n] / max(matmul / 1e3, 1e-9)
        print(f"{n} atoms: kernels {total:.0f} ms per call; matrix products at {matmul_rate:.0f} GFLOP/s (numpy: "
              f"{rate:.0f})")
        print("| operator | ms per call | share |\n|---|---|---|")
        for name, ms in top:
            print(f"| {name} | {ms:.1f} | {ms / total:.1%} |")


PHASES = (("building the graph (neighbour search)", "orb.inference.calculator", "", "atoms_to_graph"),
          ("choosing its shape", "orb.inference.predictor", "Predictor", "_graph_for"),
          ("padding it", "orb.inference.predictor", "", "pad_batch"),
          ("host arrays to tensors", "orb.inference.predictor", "", "model_inputs"),
          ("the model call and its outputs read", "orb.inference.predictor", "Predictor", "__call__"),
          ("the call's results per structure", "orb.inference.calculator", "", "per_structure"))


def phase_times(calc, reps, calls: int) -> dict:
    """Milliseconds (wall, and CPU time of the whole process) per calculator call in each phase of :data:`PHASES`
    (the model call's row is the predictor's call less the phases inside it), and the whole call's, over ``calls``
    calls on a rattled Cu cell of ``reps`` after one untimed call ("the rest" holds the rattle between calls too).
    Each phase's function is wrapped where it is looked up, so the timing adds two clock reads per phase."""
    import time as clock

    from ase.build import bulk

    spent = {name: [0.0, 0.0] for name, *_ in PHASES}
    originals = []
    try:
        wrap_phases(spent, originals)
        atoms = bulk("Cu", "fcc", a=3.6, cubic=True).repeat(reps)
        atoms.calc = calc
        atoms.get_forces()
        for value in spent.values():
            value[:] = [0.0, 0.0]
        wall, cpu = clock.perf_counter(), clock.process_time()
        for i in range(calls):
            atoms.rattle(0.01, seed=200 + i)
            atoms.get_forces()
        total = (clock.perf_counter() - wall, clock.process_time() - cpu)
    finally:
        for holder, attribute, original in originals:
            setattr(holder, attribute, original)
    model = "the model call and its outputs read"
    for name in ("choosing its shape", "padding it", "host arrays to tensors"):
        spent[model] = [m - x for m, x in zip(spent[model], spent[name])]
    spent["the rest (ASE, the calculator's own code)"] = [t - sum(v[i] for k, v in spent.items()) for i, t in
                                                          enumerate(total)]
    spent["whole call"] = list(total)
    return {name: (1e3 * w / calls, 1e3 * c / calls) for name, (w, c) in spent.items()}


def wrap_phases(spent: dict, originals: list) -> None:
    """Each function of :data:`PHASES` replaced where it is looked up by one adding its wall and CPU time to
    ``spent[phase]``; each original appended to ``originals`` as it is replaced (for the caller to put back)."""
    import importlib
    import time as clock

    for name, module, owner, attribute in PHASES:  # (a class's method, or a module's name where it is looked up)
        holder = importlib.import_module(module)
        holder = getattr(holder, owner) if owner else holder
        original = getattr(holder, attribute)

        def timed(*a, _original=original, _name=name, **k):
            wall, cpu = clock.perf_counter(), clock.process_time()
            try:
                return _original(*a, **k)
            finally:
                spent[_name][0] += clock.perf_counter() - wall
                spent[_name][1] += clock.process_time() - cpu

        originals.append((holder, attribute, original))
        setattr(holder, attribute, timed)


def print_phases(calculators: dict, sizes, steps: int) -> None:
    """Where a calculator call's time goes, by phase, for each calculator (``{label: (calculator, own)}``: ``own`` as
    in :func:`own_graphs`) and size: ms per call, its share, and the cores it kept busy (process CPU time over wall time: the kernel pool's threads at work)."""
    for label, (calc, own) in calculators.items():
        for reps in sizes:
            with own_graphs(own):
                times = phase_times(calc, reps, max(steps, 3))
            whole = times["whole call"][0]
            print(f"{4 * int(np.prod(reps))} atoms, {label}: {whole:.1f} ms per call")
            print("| phase | ms per call | share | cores busy |\n|---|---|---|---|")
            for name, (wall, cpu) in times.items():
                share = "" if name == "whole call" else f"{wall / whole:.1%}"
                print(f"| {name} | {wall:.1f} | {share} | {cpu / wall if wall > 0.05 else float('nan'):.2f} |")
