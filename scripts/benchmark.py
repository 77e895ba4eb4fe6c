"""Benchmarks: graph construction, model inference and training step, matrix products, data parallel,
ASE calculator, data at MPtrj's size, batched relaxation.

    python scripts/benchmark.py graphs     [--torch-python PATH]
    python scripts/benchmark.py model      [--model NAME] [--profiles cpu,portable] [--torch-python PATH] [--steps 8] [--rounds 2]
    python scripts/benchmark.py parallel   [--config C] [--batch 8]
    python scripts/benchmark.py allreduce  [--steps 5]
    python scripts/benchmark.py pipeline   [--config C] [--batch 16]
    python scripts/benchmark.py calculator [--model NAME] [--mode graph|pynative] [--torch-python PATH]
    python scripts/benchmark.py gemm       [--repeats 9]
    python scripts/benchmark.py breakdown  [--model NAME] [--steps 6]
    python scripts/benchmark.py counts     [--model NAME] [--rows 20000] [--workers 2]
    python scripts/benchmark.py rows       [--rows 20000] [--reads 5000] [--rounds 3]
    python scripts/benchmark.py save       [--model orb_v2] [--repeats 5] [--dir FOLDER]
    python scripts/benchmark.py formats    [--rows 20000] [--reads 5000] [--rounds 3]
    python scripts/benchmark.py scale      [--rows 1580000] [--model orb_v2] [--batch_size 8] [--workers 2]
    python scripts/benchmark.py relax      [--structures 50] [--fmax 0.05] [--steps 100] [--batch_size 50]

With ``--torch-python`` pointing at a Python that has torch and orb-models 0.4.2 installed (never
required), the same measurement is made with PyTorch orb-models in that interpreter right after
ours, and the ratio is printed. Times are medians; the host may be shared and noisy, so
compare figures from one run. Results go to stdout as a Markdown table (paste into docs/benchmarks.md).
"""

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Optional

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
DEMO = os.path.join(ROOT, "data", "demo_train.db")
MPTRJ = os.path.join(ROOT, "tests", "data", "10_mptraj_systems.db")


def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def run_torch(torch_python: str, code: str, timeout: int = 3600) -> dict:
    """Run ``code`` (prints one JSON line) with the PyTorch interpreter."""
    result = subprocess.run([torch_python, "-c", code], capture_output=True, text=True, timeout=timeout,
                            env=dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2")))
    if result.returncode != 0:
        raise RuntimeError(f"PyTorch benchmark failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------------------ graphs
TORCH_GRAPHS = """
import json, time, numpy as np, ase.db, torch
torch.set_num_threads(2)
from orb_models.forcefield.atomic_system import ase_atoms_to_atom_graphs
out = {}
for path in %(paths)r:
    atoms = [r.toatoms() for r in ase.db.connect(path).select()]
    reps = max(1, %(n)d // len(atoms))
    def once():
        for a in atoms:
            ase_atoms_to_atom_graphs(a, brute_force_knn=False, device=torch.device("cpu"))
    once()
    ts = []
    for _ in range(%(repeats)d):
        t = time.perf_counter()
        for _ in range(reps): once()
        ts.append((time.perf_counter() - t) / (reps * len(atoms)))
    out[path] = 1.0 / float(np.median(ts))
print(json.dumps(out))
"""


def vesin_top_k(atoms, radius: float = 10.0, k: int = 20):
    """The candidate alternative (issue: graphs): vesin's cell-list neighbour search (every pair within
    ``radius``), then each atom's ``k`` nearest by distance. Only measured (vesin is not a dependency)."""
    from vesin import NeighborList

    periodic = bool(atoms.pbc.all() and atoms.cell.rank == 3)
    i, j, shifts, d = NeighborList(cutoff=radius, full_list=True).compute(
        points=atoms.positions, box=atoms.cell.array if periodic else np.zeros((3, 3)), periodic=periodic,
        quantities="ijSd")
    order = np.lexsort((d, i))
    i = i[order].astype(np.int64)
    counts = np.bincount(i, minlength=len(atoms))
    rank = np.arange(len(i)) - np.repeat(np.cumsum(counts) - counts, counts)
    keep = order[rank < k]
    return i[rank < k], j[keep], shifts[keep]


def bench_graphs(args) -> None:
    import ase.db

    from orb.data.dataset import AseDbDataset
    from orb.data.graphs import atoms_to_graph

    rows = []
    for path in (DEMO, MPTRJ):
        atoms = [r.toatoms() for r in ase.db.connect(path).select()]
        reps = max(1, args.structures // len(atoms))
        ds = AseDbDataset(path)
        graph_rate = 1.0 / (median_time(lambda: [atoms_to_graph(a) for _ in range(reps) for a in atoms], 5)
                            / (reps * len(atoms)))
        row_rate = 1.0 / (median_time(lambda: [ds[i] for _ in range(reps) for i in range(len(ds))], 5)
                          / (reps * len(ds)))
        rows.append((path, len(atoms), float(np.mean([len(a) for a in atoms])), graph_rate, row_rate))
        if importlib.util.find_spec("vesin") is None:
            continue
        vesin_rate = 1.0 / (median_time(lambda: [vesin_top_k(a) for _ in range(reps) for a in atoms], 5)
                            / (reps * len(atoms)))
        print(f"{os.path.basename(path)}: vesin + top-20 neighbour search alone {vesin_rate:.0f} structures/s "
              f"(our whole atoms_to_graph: {graph_rate:.0f})")
    torch_rates = {}
    if args.torch_python:
        torch_rates = run_torch(args.torch_python, TORCH_GRAPHS % dict(paths=[DEMO, MPTRJ], n=args.structures,
                                                                      repeats=5))
    print("| data | structures | mean atoms | ours: atoms_to_graph (structures/s) | ours: db row -> graph with labels "
          "(structures/s) | orb-models 0.4.2 (structures/s) | speed-up |")
    print("|---|---|---|---|---|---|---|")
    for path, n, mean_atoms, rate, row_rate in rows:
        theirs = torch_rates.get(path)
        ratio = f"{rate / theirs:.1f}x" if theirs else "-"
        print(f"| {os.path.basename(path)} | {n} | {mean_atoms:.1f} | {rate:.0f} | {row_rate:.0f} | "
              f"{f'{theirs:.0f}' if theirs else '-'} | {ratio} |")


# ------------------------------------------------------------------------------------------- model
# orb-v2 in PyTorch orb-models 0.4.2, built as pretrained.orb_v2() does (random weights, no download).
TORCH_ORB_V2 = """
import json, time, re, numpy as np, torch
torch.set_num_threads(2)
from orb_models.forcefield import pretrained
from orb_models.forcefield.graph_regressor import GraphRegressor, EnergyHead, NodeHead, GraphHead
model = GraphRegressor(
    graph_head=EnergyHead(latent_dim=256, num_mlp_layers=1, mlp_hidden_dim=256, target="energy",
        node_aggregation="mean", reference_energy_name="vasp-shifted", train_reference=True, predict_atom_avg=True),
    node_head=NodeHead(latent_dim=256, num_mlp_layers=1, mlp_hidden_dim=256, target="forces", remove_mean=True),
    stress_head=GraphHead(latent_dim=256, num_mlp_layers=1, mlp_hidden_dim=256, target="stress", compute_stress=True),
    model=pretrained.get_base())
"""

TORCH_V2_BATCHES = """
from orb_models.forcefield.base import batch_graphs
from orb_models.dataset.ase_dataset import AseSqliteDataset
ds = AseSqliteDataset(%(db)r, augmentation=False)
graphs = [ds[i] for i in range(%(n)d * 8)]
"""

# orb-v3 in PyTorch orb-models 0.5.5, built as its pretrained loaders do (random weights, no download).
TORCH_V3 = """
import json, time, re, numpy as np, torch, ase.db
torch.set_num_threads(2)
from orb_models.forcefield.pretrained import orb_v3_conservative_architecture, orb_v3_direct_architecture
from orb_models.forcefield.atomic_system import SystemConfig, ase_atoms_to_atom_graphs
from orb_models.forcefield.base import batch_graphs
name = %(name)r
sc = SystemConfig(radius=6.0, max_num_neighbors=20 if "_20_" in name else 120)
extra = dict(has_charge_spin_cond=True, has_stress=False) if name.endswith("omol") else {}
model = (orb_v3_conservative_architecture if "conservative" in name else orb_v3_direct_architecture)(
    device="cpu", system_config=sc, **extra)
graphs = []
for row in list(ase.db.connect(%(db)r).select())[:%(n)d * 8]:
    atoms = row.toatoms()
    atoms.info["graph_targets"] = {"energy": torch.tensor([row.energy], dtype=torch.float32)}
    atoms.info["node_targets"] = {"forces": torch.tensor(row.forces, dtype=torch.float32)}
    if extra:
        atoms.info["charge"], atoms.info["spin"] = 0.0, 1.0
    else:
        atoms.info["graph_targets"]["stress"] = torch.tensor(row.stress, dtype=torch.float32)
    graphs.append(ase_atoms_to_atom_graphs(atoms, system_config=sc))
"""

TORCH_STEPS = """
batches = [batch_graphs(graphs[i:i + 8]) for i in range(0, len(graphs), 8)]
opt = torch.optim.Adam(model.parameters(), lr=1e-4)
out = {}
def timed(fn):
    fn(batches[0])
    ts = []
    for b in batches:
        t = time.perf_counter(); fn(b); ts.append(time.perf_counter() - t)
    return float(np.median(ts))
def predict(b):
    if %(conservative)r:  # forces are derivatives: autograd stays on
        model.predict(b)
    else:
        with torch.no_grad():
            model.predict(b)
def step(b):
    opt.zero_grad(); loss = model.loss(b).loss; loss.backward(); opt.step()
model.eval()
out["inference"] = timed(predict)
model.train()
out["train"] = timed(step)
out["peak_gb"] = int(re.search(r"VmHWM:\\s+(\\d+)", open("/proc/self/status").read()).group(1)) / 1e6
print(json.dumps(out))
"""


def resident_gb() -> float:
    """This process's resident memory now (VmRSS)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1e6 for line in f if line.startswith("VmRSS:"))


def peak_memory_gb() -> float:
    """This process's peak resident memory (VmHWM: unlike ru_maxrss, not inherited across fork/exec)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1e6
    return float("nan")


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
        from orb.data.graphs import batch_graphs, pad_batch
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
        from orb.device import compile_cell

        step, inputs = self.steps[kind], self.inputs[i % len(self.inputs)]
        start = time.perf_counter()
        if kind not in self.compiled:
            compile_cell(step, *inputs)  # as the trainer: compile, return the compiler's freed memory, run
            self.compiled.add(kind)
        step(*inputs).asnumpy()
        return time.perf_counter() - start


def measure_ours(name: str, steps: int) -> dict:
    """Median inference and training-step times (and first-call compile times) of model ``name`` on
    batches of 8 demo structures, all padded to one bucket (one compilation per step kind)."""
    memory = {}
    setup = Setup(name, steps, memory)
    out = {"atoms": setup.atoms, "edges": setup.edges, "bucket": list(setup.bucket),
           "forward_gflop": setup.forward_gflop()}
    for kind in setup.steps:
        times = [setup.run(kind, i) for i in range(steps)]
        out[kind], out[kind + "_compile"] = float(np.median(times[1:])), times[0]
        memory[f"{kind} graph and activations"] = resident_gb()
    out["peak_gb"] = peak_memory_gb()
    stages = list(memory.items())  # resident memory after each stage -> what each stage added
    out["memory_gb"] = {k: v - (stages[i - 1][1] if i else 0.0) for i, (k, v) in enumerate(stages)}
    return out


def measure_theirs(name: str, steps: int, torch_python: str) -> dict:
    setup = (TORCH_ORB_V2 + TORCH_V2_BATCHES) if name == "orb_v2" else TORCH_V3
    code = (setup + TORCH_STEPS) % dict(db=DEMO, n=steps, name=name, conservative="conservative" in name)
    return run_torch(torch_python, code)


def gemm_rate() -> float:
    """The host's float32 matrix-multiply rate (GFLOP/s, 2 threads' worth via numpy's BLAS): recorded
    before and after a benchmark, so a run during which the shared host's speed moved shows it."""
    a = np.random.default_rng(0).random((1024, 1024), np.float32)
    return 2 * 1024 ** 3 / median_time(lambda: a @ a, 9) / 1e9


def calibration(before: float, after: float) -> str:
    """The host's GEMM rate before and after a run, flagging a run during which it moved by over 20 %."""
    change = after / before - 1
    steady = "; over 20 %: the host was not steady, repeat the run" if abs(change) > 0.2 else ""
    return f"{before:.0f} GFLOP/s before, {after:.0f} after ({change:+.0%}{steady})"


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
            result = subprocess.run([sys.executable, __file__, "_ours", args.model, str(args.steps)],
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


# ------------------------------------------------------------------------------------------- gemm
# The interaction layers' edge products (rows = edges of a batch of 8 demo structures): the first
# layer's edge columns, the hidden layer and the output layer of the edge MLP.
GEMM_SHAPES = {"orb_v2": (1772, [(256, 512), (512, 512), (512, 256)]),
               "orb-v3, 20 neighbours": (1856, [(256, 1024), (1024, 1024), (1024, 256)])}


def bench_gemm(args) -> None:
    """MindSpore's CPU MatMul against numpy's BLAS on the products a training step makes of each layer
    y = x W^T: the forward, the input gradient dY W and the weight gradient dY^T x, alternated."""
    import mindspore as ms
    from mindspore import Tensor, nn, ops

    from orb.device import configure_mindspore

    configure_mindspore("CPU", num_threads=int(os.environ.get("OMP_NUM_THREADS", "2")))
    rng = np.random.default_rng(0)

    class Products(nn.Cell):
        """Four independent products per call, so the call's fixed cost is shared."""

        def __init__(self, transpose_a: bool, transpose_b: bool):
            super().__init__()
            self.matmul = ops.MatMul(transpose_a=transpose_a, transpose_b=transpose_b)

        def construct(self, a, b):
            return [self.matmul(a[i], b[i]) for i in range(len(a))]

    print("| model | rows | in -> out | product | MindSpore MatMul (GFLOP/s) | numpy BLAS (GFLOP/s) | MindSpore / BLAS |")
    print("|---|---|---|---|---|---|---|")
    for model, (rows, layers) in GEMM_SHAPES.items():
        for d_in, d_out in layers:
            x, w, dy = ([rng.standard_normal(shape, np.float32) for _ in range(4)]
                        for shape in ((rows, d_in), (d_out, d_in), (rows, d_out)))
            cases = {"forward x W^T": (Products(False, True), x, w, lambda i: x[i] @ w[i].T),
                     "input grad dY W": (Products(False, False), dy, w, lambda i: dy[i] @ w[i]),
                     "weight grad dY^T x": (Products(True, False), dy, x, lambda i: dy[i].T @ x[i])}
            for name, (cell, a, b, reference) in cases.items():
                a_ms, b_ms = tuple(Tensor(v) for v in a), tuple(Tensor(v) for v in b)
                cell(a_ms, b_ms)  # compile
                ours, blas = [], []
                for _ in range(args.repeats):  # alternated, so a change of the host's speed hits both
                    ours.append(median_time(lambda: cell(a_ms, b_ms)[-1].asnumpy(), 1))
                    blas.append(median_time(lambda: [reference(i) for i in range(4)], 1))
                gflop = 4 * 2 * rows * d_in * d_out / 1e9
                r_ours, r_blas = gflop / np.median(ours), gflop / np.median(blas)
                print(f"| {model} | {rows} | {d_in} -> {d_out} | {name} | {r_ours:.0f} | {r_blas:.0f} | "
                      f"{r_ours / r_blas:.2f} |")
    print(f"\nhost matrix-multiply calibration (numpy, 1024^3): {gemm_rate():.0f} GFLOP/s; MindSpore {ms.__version__}")


# --------------------------------------------------------------------------------------- breakdown
PRODUCT_KINDS = ("forward and input-gradient products", "weight gradients (transposed first operand, dY^T x)",
                 "ones-vector products (row/column expansions and sums)")


class OneDnnLog:
    """The matrix products MindSpore's CPU backend runs through oneDNN, each with its kernel time, as
    oneDNN's verbose mode reports them (``dnnl_set_verbose`` of the library MindSpore loaded; the
    report goes to file descriptor 1, captured here while the log is on)."""

    def __init__(self):
        import ctypes

        import mindspore as ms

        self.libc = ctypes.CDLL(None)
        self.dnnl = ctypes.CDLL(os.path.join(os.path.dirname(ms.__file__), "lib", "libdnnl.so.3"))

    def run(self, fn) -> list:
        """Call ``fn`` with the log on; returns (kind, GFLOP, milliseconds) per matrix product it ran."""
        sys.stdout.flush()
        self.libc.fflush(None)
        saved = os.dup(1)
        with tempfile.TemporaryFile("w+") as capture:
            os.dup2(capture.fileno(), 1)
            self.dnnl.dnnl_set_verbose(1)
            try:
                fn()
            finally:
                self.libc.fflush(None)
                self.dnnl.dnnl_set_verbose(0)
                os.dup2(saved, 1)
                os.close(saved)
            capture.seek(0)
            return [p for p in map(self.parse, capture) if p]

    @staticmethod
    def parse(line: str):
        """``onednn_verbose,v1,primitive,exec,cpu,matmul,impl,prop,src:f32::blocked:ba::f0 wei:... dst:...,
        attrs,aux,MxK:KxN,ms`` -> (kind, GFLOP, ms); None for other lines."""
        fields = line.strip().split(",")
        if len(fields) < 8 or fields[0] != "onednn_verbose" or "exec" not in fields or "matmul" not in fields:
            return None
        src = next(f for f in fields if f.startswith("src:")).split()[0]
        layout = src.split("::")[1].split(":")[1]
        a, b = (list(map(int, side.split("x"))) for side in fields[-2].split(":"))
        m, k, n = int(np.prod(a[:-1])), a[-1], b[-1]
        if min(m, k, n) == 1:
            kind = PRODUCT_KINDS[2]
        elif layout != "".join(sorted(layout)):
            kind = PRODUCT_KINDS[1]
        else:
            kind = PRODUCT_KINDS[0]
        return kind, 2.0 * m * k * n / 1e9, float(fields[-1])


def bench_breakdown(args) -> None:
    """Where a step's time goes: matrix-product kernel time by kind (from oneDNN's own timing, in
    steps alternated with uninstrumented ones) and everything else (the step's median time minus it)."""
    from orb.device import configure_mindspore

    configure_mindspore("CPU", num_threads=int(os.environ.get("OMP_NUM_THREADS", "2")))
    rate_before = gemm_rate()
    setup = Setup(args.model, args.steps)
    log = OneDnnLog()
    print(f"{args.model}, batches of 8 demo structures ({setup.atoms:.0f} atoms, {setup.edges:.0f} edges on average), "
          f"padded to {setup.bucket}; medians over {args.steps} steps of each kind, instrumented (oneDNN's "
          "verbose log) and plain steps alternated\n")
    print("| step | part | time per step (ms) | share of the step | GFLOP per step | GFLOP/s |")
    print("|---|---|---|---|---|---|")
    work_by_step = {}
    for kind in setup.steps:
        setup.run(kind, 0)  # compile
        plain, products = [], []
        for i in range(args.steps):
            products.append(log.run(lambda: setup.run(kind, i)))
            plain.append(setup.run(kind, i))
        step_ms = 1e3 * float(np.median(plain))
        per_kind = {k: [sum(ms for kk, _, ms in p if kk == k) for p in products] for k in PRODUCT_KINDS}
        work = {k: sum(g for kk, g, _ in products[0] if kk == k) for k in PRODUCT_KINDS}
        total_ms = float(np.median([sum(ms for _, _, ms in p) for p in products]))
        for k in (k for k in PRODUCT_KINDS if work[k]):
            t = float(np.median(per_kind[k]))
            print(f"| {kind} | {k} | {t:.0f} | {t / step_ms:.0%} | {work[k]:.1f} | {work[k] / t * 1e3:.0f} |")
        print(f"| {kind} | all matrix products | {total_ms:.0f} | {total_ms / step_ms:.0%} | "
              f"{sum(work.values()):.1f} | {sum(work.values()) / total_ms * 1e3:.0f} |")
        print(f"| {kind} | everything else | {step_ms - total_ms:.0f} | {1 - total_ms / step_ms:.0%} | | |")
        print(f"| {kind} | whole step (uninstrumented) | {step_ms:.0f} | 100% | | |")
        work_by_step[kind] = work
    rate_after = gemm_rate()
    rate = (rate_before + rate_after) / 2
    print(f"\nGFLOP per step: as run, on the padded bucket; the model benchmark's bound counts the real "
          f"(unpadded) work, {setup.forward_gflop():.1f} GFLOP per forward pass. Host matrix-multiply "
          f"calibration (numpy, 1024^3): {calibration(rate_before, rate_after)}; matrix products at that rate "
          "would take: " + ", ".join(f"{kind} {sum(w.values()) / rate * 1e3:.0f} ms"
                                     for kind, w in work_by_step.items()))


# ---------------------------------------------------------------------------------------- parallel
def bench_parallel(args) -> None:
    """Weak scaling: 2 workers x 1 thread vs 1 worker x 1 thread, same per-worker batch."""
    from orb.io.files import free_port

    per_worker = args.batch
    common = ["--max_epochs", "3", "--val_data_path", "", "--progress_bar", "false", "--num_buckets", "1",
              "--log_every_n_steps", "1000", "--augmentation", "false"]

    def steps_per_second(out_dir: str) -> float:
        """Over epochs 2.. (no compilation): steps / training time."""
        records = [json.loads(line) for line in open(os.path.join(out_dir, "metrics.jsonl"))]
        epochs = [r for r in records if r["type"] == "epoch"]
        steps = epochs[-1]["step"] - epochs[0]["step"]
        return steps / sum(r["train"]["train_time"] for r in epochs[1:])

    with tempfile.TemporaryDirectory() as tmp:
        single = os.path.join(tmp, "single")
        env = dict(os.environ, OMP_NUM_THREADS="1")
        subprocess.run([sys.executable, os.path.join(ROOT, "finetune.py"), "--config", args.config,
                        "--output_dir", single, "--batch_size", str(per_worker), *common], check=True, env=env,
                       capture_output=True, timeout=3600)
        single_rate = steps_per_second(single)
        par = os.path.join(tmp, "par")
        port = free_port()
        start, launched = time.perf_counter(), time.time()
        subprocess.run(["bash", os.path.join(ROOT, "run_parallel.sh"), args.config, "--output_dir", par,
                        "--batch_size", str(2 * per_worker), *common], check=True, capture_output=True,
                       timeout=3600, env=dict(env, WORKER_NUM="2", MASTER_PORT=str(port),
                                              LOG_DIR=os.path.join(tmp, "logs")))
        wall = time.perf_counter() - start
        par_rate = steps_per_second(par)
        first = open(os.path.join(par, "train.log")).readline().split(" [")[0]
        startup = time.mktime(time.strptime(first, "%Y-%m-%d %H:%M:%S")) - launched
    print(f"per-worker batch {per_worker} structures, {args.config}")
    print("| setup | steps/s | structures/s | weak-scaling efficiency |")
    print("|---|---|---|---|")
    print(f"| 1 worker x 1 thread | {single_rate:.3f} | {single_rate * per_worker:.2f} | - |")
    eff = par_rate * 2 * per_worker / (2 * single_rate * per_worker)
    print(f"| 2 workers x 1 thread (msrun) | {par_rate:.3f} | {par_rate * 2 * per_worker:.2f} | {eff:.2f} |")
    print(f"msrun start-up (launch to rank 0's first log line, 1 s resolution): {startup:.0f} s; job wall time "
          f"{wall:.0f} s. Steps/s are over epochs 2-3 (no compilation).")


def allreduce_worker(name: str, repeats: int) -> None:
    """One msrun worker: sums model ``name``'s gradient-shaped tensors over the ranks with MindSpore's
    ``nn.DistributedGradReducer`` (what the trainer does), one AllReduce per tensor, one flat buffer and
    a flat buffer in 16 MB buckets, alternated; rank 0 prints the medians."""
    import mindspore as ms
    from mindspore import Tensor, nn, ops
    from mindspore.communication import get_rank, init
    from mindspore.ops.auto_generate.gen_ops_prim import SplitWithSize

    from orb.models import create

    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    init()
    params = create(name).trainable_params()
    shapes = [tuple(p.shape) for p in params]
    ms.set_recursion_limit(4 * len(shapes) + 1000)  # the compiler walks the tuple of tensors element by element

    def values(rank):
        rng = np.random.default_rng(rank)
        return [rng.random(s).astype(np.float32) for s in shapes]

    grads = tuple(Tensor(v) for v in values(get_rank()))

    class PerTensor(nn.Cell):
        def __init__(self):
            super().__init__()
            self.reduce = ops.AllReduce(ops.ReduceOp.SUM)
            self.hyper_map = ops.HyperMap()

        def construct(self, grads):
            return self.hyper_map(self.reduce, grads)

    class Flat(nn.Cell):
        def __init__(self):
            super().__init__()
            self.reduce = ops.AllReduce(ops.ReduceOp.SUM)
            self.sizes = tuple(int(np.prod(s)) for s in shapes)
            self.split = SplitWithSize()

        def construct(self, grads):
            flat = self.reduce(ops.concat([g.reshape(-1) for g in grads]))
            return self.split(flat, self.sizes, 0)

    class Buckets(nn.Cell):  # the flat buffer summed in pieces of 2^22 floats (16 MB)
        def __init__(self):
            super().__init__()
            self.reduce = ops.AllReduce(ops.ReduceOp.SUM)
            self.hyper_map = ops.HyperMap()
            self.sizes = tuple(int(np.prod(s)) for s in shapes)
            total, piece = sum(self.sizes), 1 << 22
            self.pieces = tuple([piece] * (total // piece) + ([total % piece] if total % piece else []))
            self.split = SplitWithSize()

        def construct(self, grads):
            flat = ops.concat([g.reshape(-1) for g in grads])
            flat = ops.concat(self.hyper_map(self.reduce, self.split(flat, self.pieces, 0)))
            return self.split(flat, self.sizes, 0)

    class Reducer(nn.Cell):  # what finetune_parallel.py hands the compiled step
        def __init__(self):
            super().__init__()
            self.reducer = nn.DistributedGradReducer(params, mean=False, degree=2)

        def construct(self, grads):
            return self.reducer(grads)

    expected = [a + b for a, b in zip(values(0)[:3], values(1)[:3])]
    times = {}
    cells = {"reducer": Reducer(), "per tensor": PerTensor(), "flat": Flat(), "buckets": Buckets()}
    for kind, cell in cells.items():
        for i in range(repeats + 1):  # the first call compiles
            start = time.perf_counter()
            out = cell(grads)
            ms.runtime.synchronize()
            times.setdefault(kind, []).append(time.perf_counter() - start)
        for got, want in zip(out[:3], expected):  # a sum over both ranks, not a no-op
            np.testing.assert_allclose(got.asnumpy().reshape(want.shape), want, rtol=1e-6)
        times[kind] = times[kind][1:]
    if get_rank() == 0:
        floats = sum(int(np.prod(s)) for s in shapes)
        print("RESULT " + json.dumps({"tensors": len(shapes), "floats": floats,
                                      **{k: float(np.median(v)) for k, v in times.items()}}))


def bench_allreduce(args) -> None:
    """Gradient all-reduce on 2 CPU workers (msrun): one call per tensor vs one flat buffer."""
    from orb.io.files import free_port
    from orb.training.launch import find_msrun

    rows = []
    for name, label in (("orb_v2", "full orb-v2"), ("orb_v3_direct_20_omat", "full orb-v3 direct")):
        port = free_port()
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run([find_msrun(), "--worker_num=2", "--local_worker_num=2", f"--master_port={port}",
                            f"--log_dir={tmp}", "--join=True", __file__, "_allreduce", name, str(args.steps)],
                           check=True, capture_output=True, timeout=1800,
                           env=dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep +
                                    os.environ.get("PATH", "")))  # msrun starts `python` from PATH
            log = open(os.path.join(tmp, "worker_0.log")).read()
        result = json.loads(log.split("RESULT ")[1].splitlines()[0])
        rows.append((label, result))
    print("| model | gradient tensors | floats | nn.DistributedGradReducer (s) | one AllReduce per tensor (s) | "
          "one flat AllReduce (s) | flat buffer in 16 MB buckets (s) |")
    print("|---|---|---|---|---|---|---|")
    for label, r in rows:
        print(f"| {label} | {r['tensors']} | {r['floats'] / 1e6:.1f} M | {r['reducer']:.3f} | {r['per tensor']:.3f} | "
              f"{r['flat']:.3f} | {r['buckets']:.3f} |")


def bench_pipeline(args) -> None:
    """Host pipeline: how long the training loop waits for batches, with a model so small that its
    step is as short as a full model's on an NPU, batches prepared in the loop vs by workers."""
    small = ["--model.latent_dim", "32", "--model.mlp_hidden_dim", "64", "--model.num_message_passing_steps", "2",
             "--model.head_mlp_hidden_dim", "32"]
    common = ["--config", args.config, "--train_data_path", args.data, "--max_epochs", "3", "--val_data_path", "",
              "--progress_bar", "false",
              "--log_every_n_steps", "1000", "--checkpoint_path", "", "--batch_size", str(args.batch), *small]
    print("| batches prepared | step (ms) | data wait (fraction of the training time) |")
    print("|---|---|---|")
    for workers in (0, 2):
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run([sys.executable, os.path.join(ROOT, "finetune.py"), *common, "--output_dir", tmp,
                            "--data_workers", str(workers)], check=True, capture_output=True, timeout=3600)
            epochs = [r for r in map(json.loads, open(os.path.join(tmp, "metrics.jsonl"))) if r["type"] == "epoch"]
        later = epochs[1:]  # the first epoch compiles
        steps = later[-1]["step"] - epochs[0]["step"]
        step_ms = 1e3 * sum(r["train"]["train_time"] for r in later) / steps
        wait = sum(r["train"]["data_wait"] * r["train"]["train_time"] for r in later) / sum(
            r["train"]["train_time"] for r in later)
        label = "in the training loop" if workers == 0 else f"by {workers} worker processes, ahead"
        print(f"| {label} | {step_ms:.1f} | {100 * wait:.1f} % |")


# -------------------------------------------------------------------------------------- calculator
CALC_LOOP = """
from ase.build import bulk
from orb_models.forcefield.calculator import ORBCalculator
model.eval()
calc = ORBCalculator(model, device="cpu")
out = {}
for reps in %(sizes)r:
    atoms = bulk("Cu", "fcc", a=3.6, cubic=True).repeat(tuple(reps))
    atoms.calc = calc
    ts = []
    for i in range(%(steps)d):
        atoms.rattle(0.01, seed=i)
        t = time.perf_counter(); atoms.get_forces(); ts.append(time.perf_counter() - t)
    out[str(len(atoms))] = 1.0 / float(np.median(ts[1:]))
print(json.dumps(out))
"""
TORCH_CALC = TORCH_ORB_V2 + CALC_LOOP
# orb-v3 in orb-models 0.5.5 (random weights): TORCH_V3's model, no data
TORCH_V3_CALC = TORCH_V3.split("graphs = []")[0] + CALC_LOOP


def bench_calculator(args) -> None:
    import mindspore as ms
    from ase.build import bulk

    from orb.inference.calculator import ORBCalculator
    from orb.models import create

    # --mode pynative: a script that builds a model object and never sets graph mode (the calculator compiles anyway)
    ms.set_context(mode=ms.PYNATIVE_MODE if args.mode == "pynative" else ms.GRAPH_MODE)
    calc = ORBCalculator(create(args.model))
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
    code = (TORCH_CALC if v2 else TORCH_V3_CALC) % dict(sizes=sizes, steps=args.steps, name=args.model)
    theirs = run_torch(args.torch_python, code) if args.torch_python else {}
    print(f"{args.model}, MindSpore in {args.mode} mode")
    print(f"| atoms | MindSpore steps/s | orb-models {'0.4.2' if v2 else '0.5.5'} ORBCalculator steps/s | ratio |")
    print("|---|---|---|---|")
    for n, rate in ours.items():
        t = theirs.get(n)
        print(f"| {n} | {rate:.2f} | {f'{t:.2f}' if t else '-'} | {f'{rate / t:.2f}x' if t else '-'} |")


# ------------------------------------------------------------------------------- neighbour counts
MPTRJ_FRAMES = 1_580_395  # structures in MPtrj


def bench_counts(args) -> None:
    """orb-v3's neighbour counts for the batch shapes, as a training start makes them: counted by the
    data workers the first time, read from the cache at every later start. Rows: the MPtrj test rows,
    each copy randomly rotated (a distinct structure for the search)."""
    import ase.db

    from orb.data.dataset import AseDbDataset, random_rotation
    from orb.data.loader import BatchLoader
    from orb.models.config import ModelConfig

    settings = ModelConfig.from_dict(dict(name=args.model)).graph_settings()
    rng = np.random.default_rng(0)
    rate_before = gemm_rate()
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["ORB_CACHE_DIR"] = os.path.join(tmp, "cache")
        path = os.path.join(tmp, "rows.db")
        with ase.db.connect(MPTRJ) as src, ase.db.connect(path) as dst:
            sources = [row.toatoms() for row in src.select()]
            for i in range(args.rows):
                atoms = sources[i % len(sources)].copy()
                rotation = random_rotation(rng)
                atoms.set_cell(atoms.cell.array @ rotation)
                atoms.positions = atoms.positions @ rotation
                dst.write(atoms)

        def start():
            dataset = AseDbDataset(path, settings=settings, require_labels=False)
            loader = BatchLoader({"train": dataset}, args.workers)
            began = time.perf_counter()
            loader.edge_capacities("train")
            return time.perf_counter() - began, dataset

        first, counted = start()
        later, read = start()
        assert counted.capacities_kept_in and read.capacities_read_from == counted.capacities_kept_in
    print(f"host calibration: {calibration(rate_before, gemm_rate())}")
    rate = args.rows / first
    print(f"| graphs | rows | data workers | first start: counted (s) | structures/s | later starts: read | "
          f"MPtrj's {MPTRJ_FRAMES:,} frames at this rate (min) |")
    print("|---|---|---|---|---|---|---|")
    print(f"| {args.model} | {args.rows} | {args.workers} | {first:.1f} | {rate:.0f} | {later * 1e3:.1f} ms | "
          f"{MPTRJ_FRAMES / rate / 60:.0f} |")


def mptrj_copies(path: str, rows: int, seed: int = 0) -> None:
    """An MPtrj-like database: the shipped MPtrj rows, each copy randomly rotated, with their labels."""
    import ase.db

    from orb.data.dataset import random_rotation

    rng = np.random.default_rng(seed)
    with ase.db.connect(MPTRJ) as src, ase.db.connect(path) as dst:
        sources = [row.toatoms() for row in src.select()]
        for i in range(rows):
            atoms = sources[i % len(sources)].copy()
            rotation = random_rotation(rng)
            atoms.set_cell(atoms.cell.array @ rotation)
            atoms.positions = atoms.positions @ rotation
            dst.write(atoms)


ROW_READERS = {  # read(ids) -> rows; a step reads its structures' rows (8 here) together
    "ase.db (before)": "import ase.db\ndb = ase.db.connect(PATH, type='db', serial=True)\ndb.__enter__()\n"
                       "read = lambda ids: [db._get_row(int(i)) for i in ids]\n",
    "RowReader": "from orb.data.sqlite_rows import RowReader\nread = RowReader(PATH).read_many\n",
}
READ_ROWS = """
import sys, time
sys.path.insert(0, ROOT)
{setup}
import numpy as np
ids = np.random.default_rng(0).permutation(np.arange(1, ROWS + 1))[:COUNT]
start = time.perf_counter()
for step in range(0, len(ids), 8):
    for row in read(ids[step:step + 8]):
        row.positions, row.numbers, row.cell, row.get("forces"), row.get("stress"), row.get("energy")
print((time.perf_counter() - start) / len(ids) * 1e6)
"""


def bench_rows(args) -> None:
    """Row reads in random order, 8 per step (as a shuffled epoch reads them), from an MPtrj-like database, each
    reader in its own process: microseconds per row, alternated rounds, and the file-lock system calls one
    process makes (strace), as data workers on a shared file system would."""
    rate_before = gemm_rate()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "rows.db")
        mptrj_copies(path, args.rows)
        size = os.path.getsize(path) / 1e6
        times = {name: [] for name in ROW_READERS}

        def script(name, count):
            return READ_ROWS.format(setup=ROW_READERS[name]).replace("PATH", repr(path)).replace(
                "ROOT", repr(ROOT)).replace("ROWS", str(args.rows)).replace("COUNT", str(count))

        for _ in range(args.rounds):
            for name in ROW_READERS:
                out = subprocess.run([sys.executable, "-c", script(name, args.reads)], capture_output=True, text=True,
                                     check=True).stdout
                times[name].append(float(out.split()[-1]))
        locks = {}
        for name in ROW_READERS:
            if shutil.which("strace"):
                subprocess.run(["strace", "-f", "-e", "trace=fcntl,flock", "-o", os.path.join(tmp, "trace"),
                                sys.executable, "-c", script(name, 1000)], capture_output=True, text=True, check=True)
                with open(os.path.join(tmp, "trace")) as f:
                    locks[name] = sum(1 for line in f if "F_SETLK" in line or "F_GETLK" in line or "flock(" in line)
    print(f"host calibration: {calibration(rate_before, gemm_rate())}")
    print(f"{args.rows:,} MPtrj-like rows ({size:.0f} MB), {args.reads:,} reads in random order per round, "
          f"{args.rounds} alternated rounds\n")
    print("| reader | µs per row (median) | rounds | lock calls per 1,000 rows |")
    print("|---|---|---|---|")
    for name, values in times.items():
        print(f"| {name} | {np.median(values):.1f} | {', '.join(f'{v:.1f}' for v in values)} | "
              f"{locks.get(name, 'no strace')} |")
    first, second = (np.median(v) for v in times.values())
    print(f"\nRowReader: {first / second:.1f}x the rows per second of ase.db's reader")


def bench_formats(args) -> None:
    """Other formats (orb.data.formats): an extxyz file of MPtrj-like frames indexed once (frames per second; a
    second start finds the index), then rows of the index read in random order against the same rows in the
    ASE SQLite database they were written from (RowReader, each reader in its own process, alternated)."""
    import ase.db
    import ase.io

    from orb.data.formats import readable_database

    with tempfile.TemporaryDirectory() as tmp:
        os.environ["ORB_CACHE_DIR"] = os.path.join(tmp, "cache")
        database, text = os.path.join(tmp, "rows.db"), os.path.join(tmp, "rows.extxyz")
        mptrj_copies(database, args.rows)
        with ase.db.connect(database) as src:
            ase.io.write(text, [row.toatoms() for row in src.select()], format="extxyz")
        start = time.perf_counter()
        indexed = readable_database(text, progress=False)
        first = time.perf_counter() - start
        start = time.perf_counter()
        readable_database(text, progress=False)
        again = time.perf_counter() - start
        times = {"ASE SQLite": [], "extxyz (its index)": []}
        for _ in range(args.rounds):
            for name, path in (("ASE SQLite", database), ("extxyz (its index)", indexed)):
                code = READ_ROWS.format(setup=ROW_READERS["RowReader"]).replace("PATH", repr(path)).replace(
                    "ROOT", repr(ROOT)).replace("ROWS", str(args.rows)).replace("COUNT", str(args.reads))
                out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
                times[name].append(float(out.split()[-1]))
        size = os.path.getsize(text) / 1e6
    print(f"{args.rows:,} MPtrj-like frames in extxyz ({size:.0f} MB): indexed in {first:.1f} s "
          f"({args.rows / first:,.0f} frames/s); second start {again * 1000:.0f} ms\n")
    print("| rows read from | µs per row (median) | rounds |")
    print("|---|---|---|")
    for name, values in times.items():
        print(f"| {name} | {np.median(values):.1f} | {', '.join(f'{v:.1f}' for v in values)} |")
    sqlite, extxyz = (np.median(v) for v in times.values())
    print(f"\nextxyz rows at {sqlite / extxyz:.2f}x SQLite's rate")


MPTRJ_SIZES = (np.log(20), 0.86, 444)  # log-normal atom counts (median 20, mean ~29), MPtrj's largest cell 444
TRAJECTORY = 11  # MPtrj: 1.58 M frames of 146 k materials, the frames of a relaxation stored together


def mptrj_like_rows(count: int, seed: int):
    """``count`` structures of MPtrj's size distribution in trajectories of ~11 jittered frames, each cut from a
    supercell of a shipped MPtrj frame (energy per atom and forces kept, stress copied)."""
    import ase.db
    from ase.calculators.singlepoint import SinglePointCalculator

    rng = np.random.default_rng(seed)
    with ase.db.connect(MPTRJ) as src:
        frames = [(row.toatoms(), row.energy / row.natoms, row.forces, row.stress) for row in src.select()]
    made = 0
    while made < count:
        mu, sigma, largest = MPTRJ_SIZES
        natoms = int(np.clip(np.rint(np.exp(rng.normal(mu, sigma))), 1, largest))
        atoms, per_atom, forces, stress = frames[int(rng.integers(len(frames)))]
        repeat = 1
        while len(atoms) * repeat ** 3 < natoms:
            repeat += 1
        big = atoms.repeat(repeat)
        base_forces = np.tile(forces, (repeat ** 3, 1))
        keep = np.arange(natoms)
        for _ in range(min(int(rng.geometric(1 / TRAJECTORY)), count - made)):
            frame = big[keep]
            frame.positions += rng.normal(0, 0.02, frame.positions.shape)
            frame.calc = SinglePointCalculator(frame, energy=per_atom * natoms + rng.normal(0, 0.01),
                                               forces=base_forces[keep] + rng.normal(0, 0.01, (natoms, 3)),
                                               stress=stress)
            made += 1
            yield frame


def mptrj_sized_database(rows: int, seed: int = 0, distinct: int = 20000) -> str:
    """An MPtrj-sized ASE database, built once and kept in the project's cache (``benchmark_data``): ``distinct``
    structures written by ase.db, then copied as whole trajectories by SQL until it holds ``rows`` rows."""
    from orb import cache

    entry = cache.CacheEntry("benchmark_data", 1, ("mptrj_like", rows, seed, distinct), ".db")
    found = entry.read(lambda path: path)
    if found:
        return found
    start = time.perf_counter()
    entry.write(lambda temporary: _fill_mptrj_sized(temporary, rows, seed, distinct), "MPtrj-sized database")
    print(f"\nbuilt {entry.kept_in} in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    return entry.kept_in


def _fill_mptrj_sized(temporary: str, rows: int, seed: int, distinct: int) -> None:
    import sqlite3

    import ase.db

    with ase.db.connect(temporary, type="db") as db:
        for atoms in mptrj_like_rows(min(rows, distinct), seed):
            db.write(atoms)
    connection = sqlite3.connect(temporary)
    columns = [c[1] for c in connection.execute("PRAGMA table_info(systems)") if c[1] not in ("id", "unique_id")]
    base = min(rows, distinct)
    while True:
        (have,) = connection.execute("SELECT COUNT(*) FROM systems").fetchone()
        if have >= rows:
            break
        take = min(base, rows - have)
        cols = ", ".join(columns)
        connection.execute(f"INSERT INTO systems (unique_id, {cols}) SELECT lower(hex(randomblob(16))), {cols} "
                           f"FROM systems WHERE id <= {take} ORDER BY id")
        connection.execute(f"INSERT INTO species (Z, n, id) SELECT Z, n, id + {have} FROM species WHERE id <= {take}")
        connection.commit()
        print(f"\rbuilding an MPtrj-sized database: {have + take:,} / {rows:,} rows", end="", file=sys.stderr,
              flush=True)
    connection.close()


SCALE_CHILD = """
import json, os, sys, time
sys.path.insert(0, ROOT)
os.chdir(ROOT)


def peak_gb():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmHWM")) / 1e6


class FirstStep:
    \"\"\"A callback (config key ``callbacks``): at the first training step, measure and leave.\"\"\"

    def on_train_step(self, trainer, epoch, step_in_epoch, global_step):
        from orb.data.loader import prepare

        validation = sum(m.get("val_time", 0.0) for m in trainer.progress.initial.values())
        at_first_step = time.time() - validation  # the pass before fine-tuning is not start-up
        data = trainer.data
        timings = []
        for e in (1, 2, 3):
            start = time.perf_counter()
            steps = data.train_steps(e)
            timings.append(time.perf_counter() - start)
        take = [s for s in steps[:REPLAY_STEPS]]
        source = data.train_set.sources[0].dataset
        start, rows = time.perf_counter(), 0
        for step in take:
            rows += len(source.rows.read_many([data.train_set.row_id(i) for i in step.indices]))
        read = rows / (time.perf_counter() - start)
        start = time.perf_counter()
        for step in take:
            prepare(data.train_set, step, 0, data.has_stress)
        prepared = rows / (time.perf_counter() - start)
        print("RESULT " + json.dumps({
            "first_step": at_first_step, "plan_s": timings, "peak_gb": peak_gb(), "rows_per_s": read,
            "prepared_per_s": prepared, "train_padding": data.train_padding,
            "val_padding": {k: p.padding for k, p in data.val_plans.items()},
            "buckets": [[b.num_nodes, b.num_edges, b.spare] for b in data.train_buckets],
            "val_buckets": {k: [[b.num_nodes, b.num_edges] for b in p.buckets] for k, p in data.val_plans.items()},
            "compile_s": trainer.engine.compiled.total(), "steps_per_epoch": data.steps_per_epoch}), flush=True)
        data.loader.close()
        os._exit(0)


if __name__ == "__main__":  # not in the data workers, which import this file as their main module
    import finetune
    finetune.main(ARGS + ["--callbacks", "[child:FirstStep]"])
"""


def bench_scale(args) -> None:
    """Start-up at MPtrj's size: an MPtrj-sized database (built once), then ``finetune.py`` launched twice (the first
    start checks every row and keeps the result in the cache; the second reads it) and stopped after its first
    training step: seconds from launch to that step, planning time per epoch, peak host memory, rows read per
    second by one process, padded / real atoms and edges of the planned training and validation steps."""
    train = mptrj_sized_database(args.rows, seed=0)
    val = mptrj_sized_database(max(args.rows // 100, 100), seed=1)
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, ORB_CACHE_DIR=os.path.join(tmp, "cache"))
        if args.cache_dir:
            env["ORB_CACHE_DIR"] = args.cache_dir
        results = []
        for start in ("first", "second"):
            argv = ["--config", "configs/config.yaml", "--train_data_path", train, "--val_data_path", val,
                    "--model.name", args.model, "--checkpoint_path", "", "--batch_size", str(args.batch_size),
                    "--data_workers", str(args.workers), "--output_dir", os.path.join(tmp, f"run_{start}"),
                    "--progress_bar", "false"]
            code = SCALE_CHILD.replace("ROOT", repr(ROOT)).replace("ARGS", repr(argv)).replace("REPLAY_STEPS", "200")
            script = os.path.join(tmp, "child.py")
            with open(script, "w") as f:
                f.write(code)
            launched = time.time()
            out = subprocess.run([sys.executable, script], capture_output=True, text=True, env=env)
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


def bench_relax(args) -> None:
    """Batched relaxation (orb-relax's BatchRelaxer) against ASE's FIRE driving ORBCalculator one structure after
    another, on the same MPtrj-like cells (rattled) and the same model: structures per second of each (alternated,
    wall time including compilation), model calls, and the largest difference in final energy per atom."""
    from ase.optimize import FIRE

    from orb.device import configure_mindspore
    from orb.inference.calculator import ORBCalculator
    from orb.inference.relax import BatchRelaxer
    from orb.io.checkpoint import load_torch_state_dict
    from orb.models import create
    from orb.models.recipe import model_recipe_weights

    configure_mindspore("CPU")
    model = create(args.model)
    load_torch_state_dict(model, model_recipe_weights(model, 0))
    model.set_train(False)
    rng = np.random.default_rng(1)
    structures, previous = [], None
    for atoms in mptrj_like_rows(10 ** 9, seed=2):  # one frame of each trajectory
        if previous is None or len(atoms) != previous:
            atoms.calc = None
            atoms.positions += rng.normal(0, 0.05, atoms.positions.shape)
            structures.append(atoms)
        previous = len(atoms)
        if len(structures) == args.structures:
            break
    rate_before = gemm_rate()
    times = {"ASE FIRE loop": [], "orb-relax (batched)": []}
    energies, calls, converged = {}, {}, {}
    for _ in range(args.rounds):
        start = time.perf_counter()
        calc = ORBCalculator(model)
        loop, done = [], 0
        for atoms in structures:
            a = atoms.copy()
            a.calc = calc
            done += bool(FIRE(a, logfile=None).run(fmax=args.fmax, steps=args.steps))
            loop.append(a.get_potential_energy() / len(a))
        converged["ASE FIRE loop"] = done
        times["ASE FIRE loop"].append(time.perf_counter() - start)
        energies["ASE FIRE loop"], calls["ASE FIRE loop"] = loop, "one per step"
        start = time.perf_counter()
        relaxer = BatchRelaxer(model, args.fmax, args.steps, batch_size=args.batch_size)
        batched, done = {}, []

        def finished(r, ok):
            batched[r.source_row] = r.atoms.get_potential_energy() / len(r.atoms)
            done.append(ok)

        relaxer.run(((k, a.copy()) for k, a in enumerate(structures)), finished)
        converged["orb-relax (batched)"] = sum(done)
        times["orb-relax (batched)"].append(time.perf_counter() - start)
        energies["orb-relax (batched)"] = [batched[k] for k in range(len(structures))]
        calls["orb-relax (batched)"] = relaxer.calls
    print(f"host calibration: {calibration(rate_before, gemm_rate())}")
    sizes = [len(a) for a in structures]
    print(f"{len(structures)} MPtrj-like cells ({min(sizes)}-{max(sizes)} atoms, mean {np.mean(sizes):.0f}), rattled "
          f"0.05 Å; {args.model} (recipe weights), FIRE to fmax {args.fmax} or {args.steps} steps, batches of "
          f"{args.batch_size}; {args.rounds} alternated rounds\n")
    print("| | wall time (s, median) | structures/s | model calls | converged |")
    print("|---|---|---|---|---|")
    for name, values in times.items():
        print(f"| {name} | {np.median(values):.1f} ({', '.join(f'{v:.1f}' for v in values)}) | "
              f"{len(structures) / np.median(values):.2f} | {calls[name]} | {converged[name]} |")
    gaps = np.abs(np.array(energies["ASE FIRE loop"]) - np.array(energies["orb-relax (batched)"]))
    ratio = np.median(times["ASE FIRE loop"]) / np.median(times["orb-relax (batched)"])
    print(f"\nbatched: {ratio:.1f}x the structures per second; final energies differ by at most {gaps.max():.1e} "
          f"eV/atom (median {np.median(gaps):.1e})")


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


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "_ours":  # one measurement in a fresh process (bench_model)
        print(json.dumps(measure_ours(sys.argv[2], int(sys.argv[3]))))
        return
    if len(sys.argv) == 4 and sys.argv[1] == "_allreduce":  # one msrun worker (bench_allreduce)
        allreduce_worker(sys.argv[2], int(sys.argv[3]))
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="area", required=True)
    p = sub.add_parser("graphs")
    p.add_argument("--structures", type=int, default=2000)
    p.add_argument("--torch-python", default="")
    p = sub.add_parser("model")
    p.add_argument("--model", default="orb_v2", help="orb_v2 or an orb-v3 name (orb.models.MODEL_NAMES)")
    p.add_argument("--steps", type=int, default=8, help="batches of 8 demo structures per measurement")
    p.add_argument("--rounds", type=int, default=2, help="ours/PyTorch alternations")
    p.add_argument("--profiles", default="cpu", help="operator profiles to measure, comma-separated (cpu,portable)")
    p.add_argument("--torch-python", default="", help="python with torch and orb-models (0.4.2 for orb_v2, "
                   "0.5.5 for orb-v3)")
    p = sub.add_parser("parallel")
    p.add_argument("--config", default="configs/demo.yaml")
    p.add_argument("--batch", type=int, default=8, help="structures per worker per step")
    p = sub.add_parser("pipeline")
    p.add_argument("--config", default="configs/demo.yaml")
    p.add_argument("--batch", type=int, default=16, help="structures per step")
    p.add_argument("--data", default=os.path.join(ROOT, "data", "pretrain", "pretrain_train.db"),
                   help="training rows (the default 512 give 32 steps per epoch)")
    p = sub.add_parser("allreduce")
    p.add_argument("--steps", type=int, default=5, help="all-reduces of each kind (after one to compile)")
    p = sub.add_parser("formats")
    p.add_argument("--rows", type=int, default=20000)
    p.add_argument("--reads", type=int, default=5000)
    p.add_argument("--rounds", type=int, default=3)
    p = sub.add_parser("calculator")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--mode", choices=("graph", "pynative"), default="graph",
                   help="the execution mode the calling script left MindSpore in")
    p.add_argument("--model", default="orb_v2", help="orb_v2 or an orb-v3 name (with --torch-python: orb-models "
                   "0.5.5's python for orb-v3)")
    p.add_argument("--torch-python", default="")
    p = sub.add_parser("breakdown")
    p.add_argument("--model", default="orb_v2", help="orb_v2 or an orb-v3 name (orb.models.MODEL_NAMES)")
    p.add_argument("--steps", type=int, default=6, help="instrumented and plain steps of each kind")
    p = sub.add_parser("counts")
    p.add_argument("--model", default="orb_v3_conservative_inf_omat", help="an orb-v3 name")
    p.add_argument("--rows", type=int, default=20000)
    p.add_argument("--workers", type=int, default=2)
    p = sub.add_parser("rows")
    p.add_argument("--rows", type=int, default=20000)
    p.add_argument("--reads", type=int, default=5000, help="rows read per round")
    p.add_argument("--rounds", type=int, default=3)
    p = sub.add_parser("scale")
    p.add_argument("--rows", type=int, default=1580000)
    p.add_argument("--model", default="orb_v2")
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--cache-dir", default="", help="ORB_CACHE_DIR of the runs (default: a new temporary folder)")
    p = sub.add_parser("relax")
    p.add_argument("--model", default="orb_v2")
    p.add_argument("--structures", type=int, default=50)
    p.add_argument("--fmax", type=float, default=0.05)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch_size", type=int, default=50)
    p.add_argument("--rounds", type=int, default=1)
    p = sub.add_parser("save")
    p.add_argument("--model", default="orb_v2")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dir", default="", help="folder to write in (default: the system's temporary folder)")
    p = sub.add_parser("gemm")
    p.add_argument("--repeats", type=int, default=9, help="alternated timings of each product")
    args = parser.parse_args()
    {"graphs": bench_graphs, "model": bench_model, "parallel": bench_parallel, "calculator": bench_calculator,
     "allreduce": bench_allreduce, "pipeline": bench_pipeline, "gemm": bench_gemm,
     "breakdown": bench_breakdown, "counts": bench_counts, "rows": bench_rows,
     "save": bench_save, "formats": bench_formats, "scale": bench_scale, "relax": bench_relax}[args.area](args)


if __name__ == "__main__":
    main()
