"""Benchmarks: graph construction, model inference and training step, data parallel, ASE calculator.

    python scripts/benchmark.py graphs     [--torch-python PATH]
    python scripts/benchmark.py model      [--torch-python PATH] [--steps 10]
    python scripts/benchmark.py parallel   [--steps 12]
    python scripts/benchmark.py calculator [--torch-python PATH]

With ``--torch-python`` pointing at a Python that has torch and orb-models 0.4.2 installed (never
required), the same measurement is made with PyTorch orb-models in that interpreter right after
ours, and the ratio is printed. Times are medians; the host may be shared and noisy, so
compare figures from one run. Results go to stdout as a Markdown table (paste into docs/benchmarks.md).
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

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
import json, time, resource, numpy as np, torch
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

TORCH_MODEL = TORCH_ORB_V2 + """
from orb_models.forcefield.base import batch_graphs
from orb_models.dataset.ase_dataset import AseSqliteDataset
ds = AseSqliteDataset(%(db)r, augmentation=False)
graphs = [ds[i] for i in range(len(ds))]
batches = [batch_graphs(graphs[i:i + 8]) for i in range(0, %(n)d * 8, 8)]
opt = torch.optim.Adam(model.parameters(), lr=1e-4)
out = {}
model.eval()
with torch.no_grad():
    model.predict(batches[0])
    ts = []
    for b in batches:
        t = time.perf_counter(); model.predict(b); ts.append(time.perf_counter() - t)
out["inference"] = float(np.median(ts))
model.train()
def step(b):
    opt.zero_grad(); loss = model.loss(b).loss; loss.backward(); opt.step()
step(batches[0])
ts = []
for b in batches:
    t = time.perf_counter(); step(b); ts.append(time.perf_counter() - t)
out["train"] = float(np.median(ts))
out["rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
print(json.dumps(out))
"""


def bench_model(args) -> None:
    import mindspore as ms
    from mindspore import Tensor, nn

    from orb.data.buckets import plan_buckets, select_bucket
    from orb.data.dataset import AseDbDataset
    from orb.data.graphs import batch_graphs, pad_batch
    from orb.training.loss import OrbLoss
    from orb.models.orb_v2 import orb_v2
    from orb.data.tensors import loss_inputs
    from orb.training.steps import EvalStep, TrainStep

    ms.set_context(mode=ms.GRAPH_MODE)
    ds = AseDbDataset(DEMO)
    graphs = [ds[i] for i in range(len(ds))]
    batches = [batch_graphs(graphs[i:i + 8]) for i in range(0, args.steps * 8, 8)]
    buckets = plan_buckets(ds.natoms, 8, max_buckets=3)
    model = orb_v2()
    cell = OrbLoss(model)
    train = TrainStep(cell, nn.Adam(model.trainable_params(), learning_rate=Tensor(np.float32(1e-4))))
    evaluate = EvalStep(cell)
    results, compile_times = {}, {}
    real = np.mean([b.num_nodes for b in batches]), np.mean([b.num_edges for b in batches])
    for name, step in (("inference", evaluate), ("train", train)):
        times = []
        for b in batches:
            bucket = select_bucket(b, buckets)
            inputs = loss_inputs(pad_batch(b, bucket.num_nodes, bucket.num_edges, bucket.num_graphs))
            start = time.perf_counter()
            step(*inputs).asnumpy()
            elapsed = time.perf_counter() - start
            if (name, bucket) not in compile_times:
                compile_times[(name, bucket)] = elapsed
            else:
                times.append(elapsed)
        results[name] = float(np.median(times))
    if args.dynamic:
        results["train (dynamic shapes)"], compile_times[("train (dynamic shapes)", None)] = _dynamic_train(batches)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
    theirs = {}
    if args.torch_python:
        theirs = run_torch(args.torch_python, TORCH_MODEL % dict(db=DEMO, n=args.steps))
    print(f"orb-v2 (25.2 M parameters), batches of 8 demo structures: {real[0]:.0f} atoms, {real[1]:.0f} edges on "
          f"average, padded to buckets {[(b.num_nodes, b.num_edges) for b in buckets]}; "
          f"{os.environ.get('OMP_NUM_THREADS', 'default')} threads")
    print("| step | MindSpore median (s) | structures/s | compile (s, per bucket) | PyTorch 0.4.2 median (s) | ratio |")
    print("|---|---|---|---|---|---|")
    for name in results:
        compiles = [t for (n, _), t in compile_times.items() if n == name]
        torch_t = theirs.get(name)
        print(f"| {name} | {results[name]:.3f} | {8 / results[name]:.1f} | {np.mean(compiles):.0f} "
              f"({len(compiles)} buckets) | {f'{torch_t:.3f}' if torch_t else '-'} | "
              f"{f'{results[name] / torch_t:.2f}x' if torch_t else '-'} |")
    print(f"peak RSS: MindSpore {rss:.1f} GB" + (f", PyTorch {theirs['rss_gb']:.1f} GB" if theirs else ""))


def _dynamic_train(batches):
    """The training step compiled once for dynamic shapes (``set_inputs``), run on unpadded batches.

    The custom CPU kernels (AOT ops) need static shapes, so this model uses MindSpore's built-in ones.
    """
    import mindspore as ms
    from mindspore import Tensor, nn

    from orb import kernels
    from orb.data.graphs import pad_batch
    from orb.training.loss import OrbLoss
    from orb.models.orb_v2 import orb_v2
    from orb.data.tensors import loss_inputs
    from orb.training.steps import TrainStep

    os.environ["ORB_KERNELS"] = "builtin"
    kernels.library_path.cache_clear()
    model = orb_v2()
    step = TrainStep(OrbLoss(model), nn.Adam(model.trainable_params(), learning_rate=Tensor(np.float32(1e-4))))
    f32, i32 = ms.float32, ms.int32
    shapes = [([None], i32), ([None, 3], f32), ([None, 3], f32), ([None], i32), ([None], i32), ([None], i32),
              ([None], f32), ([None], f32), ([None], f32), ([None], f32), ([None], f32), ([None, 3], f32),
              ([None, 6], f32)]
    step.set_inputs(*[Tensor(shape=s, dtype=d) for s, d in shapes])
    times = []
    for b in batches:
        inputs = loss_inputs(pad_batch(b, b.num_nodes + 1, b.num_edges, b.num_graphs + 1))
        start = time.perf_counter()
        step(*inputs).asnumpy()
        times.append(time.perf_counter() - start)
    return float(np.median(times[1:])), times[0]


# ---------------------------------------------------------------------------------------- parallel
def bench_parallel(args) -> None:
    """Weak scaling: 2 workers x 1 thread vs 1 worker x 1 thread, same per-worker batch."""
    import socket

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
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
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


# -------------------------------------------------------------------------------------- calculator
TORCH_CALC = TORCH_ORB_V2 + """
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


def bench_calculator(args) -> None:
    import mindspore as ms
    from ase.build import bulk

    from orb.inference.calculator import ORBCalculator
    from orb.models.orb_v2 import orb_v2

    ms.set_context(mode=ms.GRAPH_MODE)
    calc = ORBCalculator(orb_v2())
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
    theirs = run_torch(args.torch_python, TORCH_CALC % dict(sizes=sizes, steps=args.steps)) if args.torch_python else {}
    print("| atoms | MindSpore steps/s | orb-models 0.4.2 ORBCalculator steps/s | ratio |")
    print("|---|---|---|---|")
    for n, rate in ours.items():
        t = theirs.get(n)
        print(f"| {n} | {rate:.2f} | {f'{t:.2f}' if t else '-'} | {f'{rate / t:.2f}x' if t else '-'} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="area", required=True)
    p = sub.add_parser("graphs")
    p.add_argument("--structures", type=int, default=2000)
    p.add_argument("--torch-python", default="")
    p = sub.add_parser("model")
    p.add_argument("--steps", type=int, default=8, help="batches of 8 demo structures per measurement")
    p.add_argument("--torch-python", default="")
    p.add_argument("--dynamic", action="store_true", help="also time a dynamic-shape (set_inputs) train step")
    p = sub.add_parser("parallel")
    p.add_argument("--config", default="configs/demo.yaml")
    p.add_argument("--batch", type=int, default=8, help="structures per worker per step")
    p = sub.add_parser("calculator")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--torch-python", default="")
    args = parser.parse_args()
    {"graphs": bench_graphs, "model": bench_model, "parallel": bench_parallel, "calculator": bench_calculator}[
        args.area](args)


if __name__ == "__main__":
    main()
