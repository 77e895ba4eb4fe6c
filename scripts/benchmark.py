"""Benchmarks: graph construction, model inference and training step, matrix products, data parallel,
ASE calculator, data at MPtrj's size, batched relaxation.

    python scripts/benchmark.py graphs     [--torch-python PATH]
    python scripts/benchmark.py model      [--model NAME] [--profiles cpu,portable] [--torch-python PATH] [--steps 8] [--rounds 2]
    python scripts/benchmark.py parallel   [--config C] [--batch 8]
    python scripts/benchmark.py allreduce  [--steps 5]
    python scripts/benchmark.py startup    [--rounds 3]
    python scripts/benchmark.py failed-job [--rounds 3]
    python scripts/benchmark.py pipeline   [--config C] [--batch 16]
    python scripts/benchmark.py calculator [--model NAME] [--mode graph|pynative] [--torch-python PATH] [--steps 10]
                                           [--rounds 1] [--profile-phases] [--profile-ops]
    python scripts/benchmark.py gemm       [--repeats 9]
    python scripts/benchmark.py breakdown  [--model NAME] [--steps 6]
    python scripts/benchmark.py counts     [--model NAME] [--rows 20000] [--workers 2]
    python scripts/benchmark.py rows       [--rows 20000] [--reads 5000] [--rounds 3]
    python scripts/benchmark.py save       [--model orb_v2] [--repeats 5] [--dir FOLDER]
    python scripts/benchmark.py formats    [--rows 20000] [--reads 5000] [--rounds 3]
    python scripts/benchmark.py scale      [--rows 1580000] [--model orb_v2] [--batch_size 8] [--workers 2]
    python scripts/benchmark.py relax      [--structures 50] [--fmax 0.05] [--steps 100] [--batch_size 50]
    python scripts/benchmark.py precision  [--torch-python PATH] [--torch-v3-python PATH] [--finetune]
    python scripts/benchmark.py restart    [--configs demo,demo_v3] [--models orb_v2] [--calculator CKPT]
    python scripts/benchmark.py md         [--structures 32] [--steps 100] [--timestep 1] [--batch-sizes 32] [--torch-v3-python PATH]
    python scripts/benchmark.py suite      [--tests tests] [--workers 2] [--cache-dir ""]
    python scripts/benchmark.py compile-options [--options SINGLE_EVAL=1,...] [--rounds 2] [--model full] [--name orb_v2]
    python scripts/benchmark.py compile-ops [--ops "y * 1.5; ..."] [--model orb_v2] [--rounds 2]
    python scripts/benchmark.py cell-call  [--models demo,orb_v2] [--calls 200]
    python scripts/benchmark.py compile-memory [--model small] [--rounds 4]
    python scripts/benchmark.py command-gc [--rounds 5]
    python scripts/benchmark.py dynamic-shape [--model orb_v2] [--rounds 2]
    python scripts/benchmark.py call-memory [--models orb_v2,orb_v3_conservative_inf_omat] [--precisions float32-high,float64]
                                            [--sizes 2,3]

With ``--torch-python`` pointing at a Python that has torch and orb-models 0.4.2 installed (never
required), the same measurement is made with PyTorch orb-models in that interpreter right after
ours, and the ratio is printed. Times are medians; the host may be shared and noisy, so
compare figures from one run. Results go to stdout as a Markdown table (paste into docs/benchmarks.md).
"""

# The command line only: the benchmarks are in the package next to this file (scripts/benchmarks/, one module per
# subcommand or group; its docstring lists them), and the programs they run in processes of their own are files in
# it (benchmarks/children/, with this interpreter; benchmarks/peer/, with --torch-python's).

import argparse
import os

from benchmarks.calculator import bench_calculator
from benchmarks.call_memory import bench_call_memory
from benchmarks.cell_call import bench_cell_call
from benchmarks.command_gc import bench_command_gc
from benchmarks.compile_memory import bench_compile_memory
from benchmarks.compile_options import bench_compile_options
from benchmarks.compile_ops import OPS, bench_compile_ops
from benchmarks.dynamic_shape import bench_dynamic_shape
from benchmarks.common import ROOT
from benchmarks.formats import bench_counts, bench_formats, bench_rows
from benchmarks.graphs import bench_graphs
from benchmarks.matmul import bench_breakdown, bench_gemm
from benchmarks.model import bench_model
from benchmarks.md import bench_md
from benchmarks.parallel import bench_allreduce, bench_failed_job, bench_parallel, bench_pipeline, bench_startup
from benchmarks.precision import bench_precision
from benchmarks.relax import bench_relax
from benchmarks.restart import bench_restart
from benchmarks.save import bench_save
from benchmarks.scale import bench_scale
from benchmarks.suite import bench_suite
from orb.models.config import MODEL_NAMES


def build_parser():
    """This script's command line (the docs test parses its documented commands with it)."""
    parser = argparse.ArgumentParser(allow_abbrev=False,
                                     description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    p = sub.add_parser("startup")
    p.add_argument("--rounds", type=int, default=3, help="alternations of the two settings")
    p = sub.add_parser("failed-job")
    p.add_argument("--rounds", type=int, default=3, help="alternations of the two settings")
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
    p.add_argument("--rounds", type=int, default=1, help="rounds of both sides, alternated (medians are reported)")
    p.add_argument("--profile-phases", action="store_true", help="then --steps more calls per size, each phase of a "
                   "call timed: graph building, padding, tensors, the model call, the rest")
    p.add_argument("--profile-ops", action="store_true", help="then 3 more calls per size under MindSpore's profiler: "
                   "each operator type's share of the kernels' time")
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
    p.add_argument("--cache-dir", default="",
                   help="ORB_CACHE_DIR (and ORB_COMPILE_CACHE_DIR) of the runs (default: a new temporary folder)")
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
    p = sub.add_parser("precision")
    p.add_argument("--torch-python", default="", help="python with torch and orb-models 0.4.2 (orb-v2's reference)")
    p.add_argument("--torch-v3-python", default="", help="python with torch and orb-models 0.5.5 (orb-v3's)")
    p.add_argument("--finetune", action="store_true", help="fine-tune both demos in each mode instead")
    p.add_argument("--configs", default="demo.yaml,demo_v3.yaml", help="--finetune: the demo configs to run")
    p.add_argument("--modes", default="bf16-mixed,fp16-mixed", help="--finetune: the modes beside float32-high")
    p.add_argument("--seeds", default="", help="--finetune: every mode again with these random seeds (comma-separated)")
    p.add_argument("--perturb-start", action="store_true", help="--finetune: float32 again from the starting weights "
                   "moved by one unit in the last place, and by float16's rounding (what a perturbation alone moves)")
    p.add_argument("--perturb-seed", type=int, default=0, help="--perturb-start: the random generator's seed choosing "
                   "which way each weight moves")
    p = sub.add_parser("md")
    p.add_argument("--structures", type=int, default=32)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--timestep", type=float, default=1.0, help="fs")
    p.add_argument("--batch-sizes", default="32", help="orb-md --batch_size values, comma-separated")
    p.add_argument("--torch-v3-python", default="", help="python with torch and orb-models 0.5.5: its calculator's "
                   "NVE drift on the same structures")
    p = sub.add_parser("restart", help="compilation in first, second and requeued starts, with the compile cache")
    p.add_argument("--configs", default="demo,demo_v3", help="packaged demo configs, one epoch each")
    p.add_argument("--models", default="", help="full-size models with random weights on 10 MPtrj structures, "
                   "e.g. orb_v2,orb_v3_conservative_inf_omat")
    p.add_argument("--calculator", default="data/demo_pretrained.ckpt", help="checkpoints for the calculator "
                   "script's case (paths in the checkout; empty: none)")
    p.add_argument("--repeat", type=int, default=2, help="the calculator's Cu cell: the cubic cell repeated so")
    p.add_argument("--workers", type=int, default=1, help="data-parallel workers (msrun, run_parallel.sh) of each "
                   "fine-tuning: above 1, a first and a second start, each rank's compilations (default: 1)")
    p = sub.add_parser("gemm")
    p.add_argument("--repeats", type=int, default=9, help="alternated timings of each product")
    p = sub.add_parser("compile-options")
    p.add_argument("--options", default="SINGLE_EVAL=1,ENABLE_FIX_CODE_LINE=1,RECURSIVE_EVAL=1,"
                   "TRAVERSE_SUBSTITUTIONS_MODE=1,COMPILE_DEBUG_MODE=release,PRE_LIFT=1,GREED_PARSE=1",
                   help="NAME=VALUE options of mindspore.graph._parse.compile_config, comma-separated")
    p.add_argument("--rounds", type=int, default=2, help="alternations of the options")
    p.add_argument("--model", choices=("full", "small"), default="full",
                   help="the model full-size, or the tests' 2-layer, 32-wide one")
    p.add_argument("--name", default="orb_v2", choices=MODEL_NAMES,
                   help="the model: orb_v2 (orb-smoke-test's step) or another name, e.g. orb_v3_conservative_inf_omat "
                   "(random weights, the same demo batch and SGD step; default: orb_v2)")
    p = sub.add_parser("compile-ops")
    p.add_argument("--ops", default=OPS, help="expressions of a (50, 3) tensor y (and int32 idx), ;-separated "
                   "(default: 11 of them)")
    p.add_argument("--model", default="orb_v2",
                   help="a model name whose parts are compiled, empty: none (default: orb_v2)")
    p.add_argument("--rounds", type=int, default=2, help="fresh processes, one after the other (default: 2)")
    p = sub.add_parser("cell-call")
    p.add_argument("--models", default="demo,orb_v2",
                   help="demo (the demo checkpoint) or model names (random weights), comma-separated "
                   "(default: demo,orb_v2)")
    p.add_argument("--calls", type=int, default=200, help="timed calls of each (default: 200)")
    p = sub.add_parser("compile-memory")
    p.add_argument("--model", default="small", help="small (the tests' 2-layer orb-v2, 8 wider each round) or a "
                   "model name (full size, its hidden layers 64 wider each round) (default: small)")
    p.add_argument("--rounds", type=int, default=4, help="models compiled, run and freed one after another "
                   "(default: 4)")
    p = sub.add_parser("command-gc")
    p.add_argument("--rounds", type=int, default=5, help="alternations of the two (default: 5)")
    p = sub.add_parser("dynamic-shape")
    p.add_argument("--model", default="orb_v2", help="a model name (random weights) or demo (the demo checkpoint) "
                   "(default: orb_v2)")
    p.add_argument("--rounds", type=int, default=2, help="alternations of the five modes (default: 2)")
    p = sub.add_parser("call-memory", help="a prediction's peak memory by precision, model and structure size")
    p.add_argument("--models", default="orb_v2,orb_v3_conservative_inf_omat")
    p.add_argument("--precisions", default="float32-high,float64")
    p.add_argument("--sizes", default="2,3", help="Cu fcc conventional cells repeated n x n x n (4 n^3 atoms)")
    p = sub.add_parser("suite")
    p.add_argument("--tests", default="tests", help="what pytest runs (space-separated paths or node ids)")
    p.add_argument("--workers", type=int, default=2, help="pytest-xdist workers (-n), as the README's command")
    p.add_argument("--cache-dir", default="", help="ORB_CACHE_DIR for the run (default: a new empty folder, as CI's)")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    {"graphs": bench_graphs, "model": bench_model, "parallel": bench_parallel, "calculator": bench_calculator,
     "allreduce": bench_allreduce, "pipeline": bench_pipeline, "gemm": bench_gemm,
     "breakdown": bench_breakdown, "counts": bench_counts, "rows": bench_rows,
     "save": bench_save, "formats": bench_formats, "scale": bench_scale, "relax": bench_relax,
     "precision": bench_precision, "md": bench_md, "restart": bench_restart, "suite": bench_suite,
     "startup": bench_startup, "failed-job": bench_failed_job, "compile-options": bench_compile_options,
     "compile-ops": bench_compile_ops, "cell-call": bench_cell_call,
     "compile-memory": bench_compile_memory, "command-gc": bench_command_gc,
     "dynamic-shape": bench_dynamic_shape, "call-memory": bench_call_memory}[args.area](args)


if __name__ == "__main__":  # not in the data workers (counts), which import this file as their main module
    main()
