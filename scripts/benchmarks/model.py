"""``model``: inference and training steps of a model (each operator profile, each in a fresh process:
``children/model_ours.py``) against PyTorch orb-models (``peer/torch_steps.py``), their peak memory, and the
matrix-multiply bound at the host's GEMM rate. ``Setup`` (the batches and compiled steps) is ``breakdown``'s too."""

import json
import os
import subprocess
import sys
import time
from typing import Optional

import numpy as np

from .common import DEMO, calibration, child, gemm_rate, resident_gb, run_torch


def forward_matmul_flops(model, nodes: float, edges: float, graphs: float) -> float:
    """Matrix-multiply FLOPs (2 x multiply-adds) of one forward pass: every Linear weight (out, in)
    times the rows it acts on -- edges (edge encoder, edge MLPs, attention gates), graphs (stress
    heads) or nodes (the rest); the interaction layers' first edge layer as computed (its edge
    columns on edges, its sender/receiver columns on nodes). Embedding lookups and the unused
    decoder do no matrix products."""
    from orb.io.checkpoint import to_torch_state_dict

    macs = 0.0
    for key, w in to_torch_state_dict(model).items():
        if w.ndim != 2 or not key.endswith(".weight") or "_decoder" in key or "emb" in key:
            continue
        out_dim, in_dim = w.shape
        if "_edge_mlp.mlp.NN-0." in key:
            d = model.cfg.latent_dim
            macs += out_dim * (edges * d + nodes * (in_dim - d))
        elif "_edge_fn" in key or "_edge_mlp" in key or "_attn" in key:
            macs += out_dim * in_dim * edges
        else:
            macs += out_dim * in_dim * (graphs if "stress" in key else nodes)
    return 2.0 * macs


class Setup:
    """Model ``name``, ``steps`` batches of 8 demo structures padded to one bucket, and its compiled-to-be
    inference and training steps (the trainer's, with Adam and the EMA), as the model benchmark runs them."""

    def __init__(self, name: str, steps: int, memory: Optional[dict] = None):
        import mindspore as ms

        from orb.data.dataset import AseDbDataset
        from orb.data.batching import batch_graphs, pad_batch
        from orb.data.tensors import loss_inputs
        from orb.models import create
        from orb.training.config import config_from_dict
        from orb.training.optimizer import FlatAdam
        from orb.training.schedule import make_schedule
        from orb.training.steps import EvalStep, TrainStep
        from orb.training.engine import make_loss

        memory = {} if memory is None else memory
        ms.set_context(mode=ms.GRAPH_MODE)
        memory["runtime"] = resident_gb()  # MindSpore and the project imported
        self.model = model = create(name)
        memory["weights"] = resident_gb()
        cfg = config_from_dict(dict(model=dict(name=name), reference_energies=dict(trainable="auto")))
        ds = AseDbDataset(DEMO, settings=model.cfg.graph_settings(), charge_spin=model.cfg.omol)
        graphs = [ds[i] for i in range(steps * 8)]
        if model.cfg.omol:
            for g in graphs:
                g.charge, g.spin = np.zeros(1, np.float32), np.ones(1, np.float32)
        self.batches = [batch_graphs(graphs[i:i + 8]) for i in range(0, len(graphs), 8)]
        self.bucket = (max(b.num_nodes for b in self.batches) + 1, max(b.num_edges for b in self.batches))
        self.inputs = [loss_inputs(pad_batch(b, *self.bucket, b.num_graphs + 1)) for b in self.batches]
        loss = make_loss(model, cfg, has_stress=model.cfg.has_stress)
        params = [p for p in model.trainable_params() if not (model.cfg.family == "orb_v3" and
                                                              p is model.reference_energy_weight())]
        memory["data"] = resident_gb()
        optimizer = FlatAdam(params, make_schedule("constant", 1e-4, 10 ** 6, 0.0), ema_decay=0.99)
        memory["optimizer state"] = resident_gb()
        self.steps = {"inference": EvalStep(loss), "train": TrainStep(loss, optimizer)}
        self.atoms = float(np.mean([b.num_nodes for b in self.batches]))
        self.edges = float(np.mean([b.num_edges for b in self.batches]))
        self.compiled = set()

    def forward_gflop(self) -> float:
        """The matrix-multiply work of one forward pass on the batches' real (unpadded) sizes."""
        return forward_matmul_flops(self.model, self.atoms, self.edges, 8) / 1e9

    def run(self, kind: str, i: int) -> float:
        """One step of ``kind`` on batch ``i`` (compiled at its first call, as the trainer does); seconds."""
        from orb.graph_cache import compile_cell

        step, inputs = self.steps[kind], self.inputs[i % len(self.inputs)]
        start = time.perf_counter()
        if kind not in self.compiled:
            compile_cell(step, *inputs)  # as the trainer: compile, return the compiler's freed memory, run
            self.compiled.add(kind)
        step(*inputs).asnumpy()
        return time.perf_counter() - start


def measure_theirs(name: str, steps: int, torch_python: str) -> dict:
    return run_torch(torch_python, "torch_steps.py", ["--model", name, "--db", DEMO, "--steps", str(steps)])


def print_bound(name: str, forward_gflop: float, ours: list, theirs: list, rate: float) -> None:
    """Each step's matrix-multiply work and the time it takes at the host's measured GEMM rate: the
    bound no implementation of this model can beat on this CPU (backward = 2 x forward; a
    conservative model's inference is a forward and a backward pass, its training step thrice that)."""
    per_inference = forward_gflop * (2 if "conservative" in name else 1)
    work = {"inference": per_inference, "train": 3 * per_inference}
    print("\n| step | matrix-multiply work (GFLOP) | bound at the measured GEMM rate (s) | MindSpore at | PyTorch at |")
    print("|---|---|---|---|---|")
    for kind, gflop in work.items():
        bound = gflop / rate
        ratio = lambda runs: f"{float(np.median([r[kind] for r in runs])) / bound:.2f}x the bound" if runs else "-"  # noqa: E731
        print(f"| {kind} | {gflop:.1f} | {bound:.3f} | {ratio(ours)} | {ratio(theirs)} |")


def bench_model(args) -> None:
    """Ours (in each operator profile of ``--profiles``) and PyTorch's, each in a fresh process (own peak memory),
    alternated over ``--rounds``."""
    profiles = args.profiles.split(",")
    ours, theirs = {p: [] for p in profiles}, []
    rate_before = gemm_rate()
    for _ in range(args.rounds):
        for profile in profiles:
            result = subprocess.run([sys.executable, child("model_ours.py"), args.model, str(args.steps)],
                                    capture_output=True, text=True, timeout=7200,
                                    env=dict(os.environ, ORB_OPS_PROFILE=profile))
            if result.returncode != 0:
                raise RuntimeError(result.stderr[-3000:])
            ours[profile].append(json.loads(result.stdout.strip().splitlines()[-1]))
        if args.torch_python:
            theirs.append(measure_theirs(args.model, args.steps, args.torch_python))
    rate_after = gemm_rate()
    first = ours[profiles[0]][0]
    peer = "orb-models 0.4.2" if args.model == "orb_v2" else "orb-models 0.5.5"
    print(f"{args.model}, batches of 8 demo structures: {first['atoms']:.0f} atoms, {first['edges']:.0f} edges on "
          f"average, padded to one bucket {tuple(first['bucket'])}; {args.rounds} rounds, ours and PyTorch "
          f"alternated, each in a fresh process; medians over {args.steps - 1} steps, median over rounds\n")
    print(f"| step | ops profile | MindSpore (s) | structures/s | compile (s) | peak memory (GB) | PyTorch {peer} (s) | "
          "MindSpore / PyTorch time |")
    print("|---|---|---|---|---|---|---|---|")
    p_peak = max(o["peak_gb"] for o in theirs) if theirs else None
    for kind in ("inference", "train"):
        p = float(np.median([o[kind] for o in theirs])) if theirs else None
        for profile in profiles:
            runs = ours[profile]
            t = float(np.median([o[kind] for o in runs]))
            c = float(np.median([o[kind + "_compile"] for o in runs])) - t
            print(f"| {kind} | {profile} | {t:.3f} | {8 / t:.1f} | {c:.0f} | {max(o['peak_gb'] for o in runs):.2f} | "
                  f"{f'{p:.3f}' if p else '-'} | {f'{t / p:.2f}x' if p else '-'} |")
    for profile in profiles:
        print(f"\n{profile}:")
        print_bound(args.model, first["forward_gflop"], ours[profile], theirs, (rate_before + rate_after) / 2)
    print("\npeak memory (VmHWM, whole process, training included): " +
          ", ".join(f"MindSpore {p} {max(o['peak_gb'] for o in ours[p]):.2f} GB" for p in profiles) +
          (f", PyTorch {p_peak:.2f} GB" if theirs else ""))
    print("MindSpore's resident memory by stage (what each added, GB): " +
          ", ".join(f"{k} {v:+.2f}" for k, v in first["memory_gb"].items()))
    print(f"host matrix-multiply calibration: {calibration(rate_before, rate_after)}")
