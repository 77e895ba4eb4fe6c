"""A first-hour check of a machine, for NPU users: does this device compute what PyTorch computes?

    orb-smoke-test [--device_target auto] [--skip_parallel] [--precisions float32-high,bf16-mixed,fp16-mixed]

1. the environment: MindSpore, the device and how many, the operator profile, the precision;
2. orb-v2's predictions for the 8 structures of the shipped PyTorch reference
   (``tests/data/orb_v2_parity.npz``: orb-models 0.4.2, recipe weights) within the tolerances of
   the parity tests, with strict float32 matrix products (``precision: float32-highest``);
3. one training step (full orb-v2, 8 demo structures, loss, gradient, SGD update) on this device
   against the same step on the CPU (in a separate process, ``cpu`` profile): loss, gradient norm
   and the updated weights; on a CPU-only machine, the ``portable`` profile against the ``cpu`` one;
4. a sum over 2 workers (msrun; ``AllReduce`` and ``nn.DistributedGradReducer``), the collectives
   a data-parallel run uses;
5. compile and step times, and one training step timed in each precision mode (``--precisions``; each in a
   fresh process): on an NPU, what bf16-mixed and fp16-mixed buy over float32-high there.

It prints a short report to paste into a bug report, and exits 1 if a check failed.
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from typing import Optional

import numpy as np

from orb.bundled import bundle_root
from orb.signals import STOP

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# shipped with the package (orb.bundled): the checkout's tests/data/orb_v2_parity.npz and data/demo_train.db
REFERENCE = os.path.join(bundle_root(), "tests", "data", "orb_v2_parity.npz")
DEMO = os.path.join(bundle_root(), "data", "demo_train.db")
# the parity tests' tolerances for MindSpore's built-in operators (tests/test_model.py, "portable")
TOLERANCES = {"energy": 1e-3, "forces": 3e-5, "stress": 2e-5}
# one training step on two devices or profiles: float32 sums in a different order (measured on CPU, the
# portable against the cpu profile: loss 1.7e-7 and gradient norm 2.0e-6 relative, weights 5.6e-9 after one step)
STEP_TOLERANCES = {"loss": 1e-4, "grad_norm": 1e-3, "weights": 1e-6}


def environment(target: str) -> dict:
    import mindspore as ms

    from orb.models.ops_profile import describe_profile

    try:
        devices = ms.hal.device_count(target) if target != "CPU" else os.cpu_count()
    except Exception:  # a backend that cannot count
        STOP.raise_if_raised()  # (not a stop that landed while its plug-in loaded)
        devices = "unknown"
    from orb import __version__

    return {"orb_mindspore": __version__, "mindspore": ms.__version__, "python": platform.python_version(), "numpy": np.__version__,
            "host": platform.node(), "device_target": target, "devices": devices,
            "ops_profile": describe_profile(), "ASCEND_RT_VISIBLE_DEVICES": os.environ.get("ASCEND_RT_VISIBLE_DEVICES", "")}


def reference_model(reference):
    from orb.io.checkpoint import load_torch_state_dict
    from orb.models.orb_v2 import orb_v2
    from orb.models.recipe import model_recipe_weights

    model = orb_v2()
    load_torch_state_dict(model, model_recipe_weights(model, int(reference["meta/seed"])))
    model.set_train(False)
    return model


def reference_graph(reference, i):
    from orb.data.graphs import AtomGraphs

    p = f"s{i}/"
    return AtomGraphs(positions=reference[p + "positions"], numbers=reference[p + "numbers"],
                      cell=reference[p + "cell"][None], senders=reference[p + "senders"],
                      receivers=reference[p + "receivers"], vectors=reference[p + "vectors"],
                      n_node=np.array([len(reference[p + "numbers"])]), n_edge=np.array([len(reference[p + "senders"])]))


def check_predictions(model=None) -> dict:
    """orb-v2's energies, forces and stresses against PyTorch orb-models 0.4.2's (worst error / tolerance);
    ``model``: the one to check (default: the reference weights built here, :func:`reference_model`)."""
    from orb.data.batching import batch_graphs
    from orb.inference.predictor import Predictor

    reference = np.load(REFERENCE)
    predictor = Predictor(model if model is not None else reference_model(reference))
    count = int(reference["meta/n_structures"])
    start = time.perf_counter()
    out = predictor(batch_graphs([reference_graph(reference, i) for i in range(count)]))
    first = time.perf_counter() - start
    start = time.perf_counter()
    predictor(batch_graphs([reference_graph(reference, i) for i in range(count)]))
    again = time.perf_counter() - start
    worst = {k: 0.0 for k in TOLERANCES}
    offset = 0
    for i in range(count):
        n = len(reference[f"s{i}/numbers"])
        errors = {"energy": abs(float(out["energy"][i]) - float(reference[f"s{i}/energy"].reshape(-1)[0])),
                  "forces": float(np.abs(out["forces"][offset:offset + n] - reference[f"s{i}/forces"]).max()),
                  "stress": float(np.abs(out["stress"][i] - reference[f"s{i}/stress"].reshape(-1)).max())}
        offset += n
        for key, error in errors.items():
            worst[key] = max(worst[key], error / TOLERANCES[key])
    return {"structures": count, "worst_error_over_tolerance": worst, "passed": max(worst.values()) <= 1.0,
            "compile_and_first_call_s": round(first, 2), "call_s": round(again, 3)}


def training_step(target: str, model=None, params=None) -> dict:
    """One SGD step of full orb-v2 on the first 8 demo structures (fixed weights, no augmentation): what it
    returned and changed, with its compile and step times. ``model``: another model in its place (the compile
    benchmark's: narrow ones, orb-v3's); ``params``: the parameters trained (default: all trainable ones)."""
    from orb.data.dataset import AseDbDataset
    from orb.data.batching import batch_graphs, pad_batch
    from orb.data.tensors import loss_inputs
    from orb.training.config import config_from_dict
    from orb.training.optimizer import FlatAdam
    from orb.training.schedule import constant
    from orb.training.steps import TrainStep
    from orb.training.engine import make_loss

    model = reference_model(np.load(REFERENCE)) if model is None else model
    model.set_train(True)
    cfg = config_from_dict(dict(model=dict(name=model.cfg.name), device_target=target))
    data = AseDbDataset(DEMO, settings=model.cfg.graph_settings(), charge_spin=model.cfg.omol)
    batch = batch_graphs([data[i] for i in range(8)])
    inputs = loss_inputs(pad_batch(batch, batch.num_nodes + 1, batch.num_edges, batch.num_graphs + 1))
    params = model.trainable_params() if params is None else params
    before = np.concatenate([p.asnumpy().reshape(-1) for p in params])
    step = TrainStep(make_loss(model, cfg, has_stress=True), FlatAdam(params, constant(1e-3, 2), clip_mode="none",
                                                                      algorithm="sgd"))
    start = time.perf_counter()
    step.compile(*inputs)
    compile_s = time.perf_counter() - start
    start = time.perf_counter()
    loss = float(step(*inputs).asnumpy())
    step_s = time.perf_counter() - start
    after = np.concatenate([p.asnumpy().reshape(-1) for p in params])
    change = (before - after) / 1e-3  # SGD: the gradient itself
    return {"loss": loss, "grad_norm": float(np.linalg.norm(change.astype(np.float64))),
            "weights": after[::997].tolist(), "compile_s": round(compile_s, 2), "step_s": round(step_s, 3)}


def run_child(command, timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """``command`` run to its end in a process group of its own, started with the stop signals blocked (a job's
    signal to every process is this process's to handle: 75); a stop meanwhile ends the group, then stops here."""
    import signal

    from orb.signals import children_start_blocked

    with children_start_blocked():
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   start_new_session=True, **kwargs)
    try:
        out, err = process.communicate(timeout=timeout)
    except BaseException:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        raise
    return subprocess.CompletedProcess(command, process.returncode, out, err)


def _step_in_subprocess(target: str, profile: str, precision: str = "float32-highest") -> dict:
    result = run_child([sys.executable, "-m", "orb.smoke_test", "_step", target, precision], 1800, cwd=ROOT,
                       env=dict(os.environ, ORB_OPS_PROFILE=profile))
    if result.returncode != 0:
        raise RuntimeError(result.stderr.strip().splitlines()[-1] if result.stderr.strip() else "no output")
    return json.loads(result.stdout.strip().splitlines()[-1])


def compare_steps(target: str) -> dict:
    """This device's training step (auto profile) against the CPU's (cpu profile); on a CPU, portable against cpu."""
    here_profile = "portable" if target == "CPU" else "auto"
    here, cpu = _step_in_subprocess(target, here_profile), _step_in_subprocess("CPU", "cpu")
    weights_here, weights_cpu = np.array(here["weights"]), np.array(cpu["weights"])
    errors = {"loss": abs(here["loss"] - cpu["loss"]) / max(abs(cpu["loss"]), 1e-12),
              "grad_norm": abs(here["grad_norm"] - cpu["grad_norm"]) / max(cpu["grad_norm"], 1e-12),
              "weights": float(np.abs(weights_here - weights_cpu).max())}
    return {"compared": f"{target} ({here_profile} profile) against CPU (cpu profile)",
            "relative_or_absolute_error": errors,
            "passed": all(errors[k] <= STEP_TOLERANCES[k] for k in errors),
            "this_device": {k: here[k] for k in ("loss", "grad_norm", "compile_s", "step_s")},
            "cpu": {k: cpu[k] for k in ("loss", "grad_norm", "compile_s", "step_s")}}


def time_precisions(target: str, modes, cpu_step=None) -> dict:
    """One training step of full orb-v2 in each precision mode (compile and step times, and the step's speed-up over
    float32-high), each in a fresh process: what a lower precision buys on this device. ``cpu_step``: the cpu
    profile's step of :func:`compare_steps`, which on a CPU is the float32 modes' step (the CPU has one float32
    precision and ``auto`` is its cpu profile), so it is not run again."""
    from orb.precision import describe

    out = {}
    for mode in modes:
        try:
            if target == "CPU" and cpu_step is not None and mode in ("float32-high", "float32-highest"):
                step = cpu_step
            else:
                step = _step_in_subprocess(target, "auto", mode)
            out[mode] = {"compile_s": step["compile_s"], "step_s": step["step_s"], "loss": step["loss"],
                         "note": describe(mode, target)}
        except RuntimeError as exc:  # a mode this device cannot run: its one line, not a traceback
            out[mode] = {"error": str(exc)}
    base = out.get("float32-high", {}).get("step_s")
    for mode, result in out.items():
        if base and "step_s" in result:
            result["speed_up_over_float32_high"] = round(base / result["step_s"], 2)
    return out


def _sum_over_workers() -> None:
    """One msrun worker: rank r contributes r + 1; AllReduce and DistributedGradReducer must both give 3."""
    import mindspore as ms
    from mindspore import Parameter, Tensor, nn, ops
    from mindspore.communication import get_group_size, get_rank, init

    from orb.device import configure_mindspore

    configure_mindspore(os.environ.get("ORB_SMOKE_TARGET", "auto"), parallel=True)
    init()
    rank, world = get_rank(), get_group_size()
    params = [Parameter(Tensor(np.zeros((3, 2), np.float32)), name="a"), Parameter(Tensor(np.zeros(5, np.float32)), name="b")]

    class Sums(nn.Cell):
        def __init__(self):
            super().__init__()
            self.all_reduce = ops.AllReduce(ops.ReduceOp.SUM)
            self.reducer = nn.DistributedGradReducer(params, mean=False, degree=world)

        def construct(self, a, b):
            return self.all_reduce(a), self.reducer((a, b))

    value = float(rank + 1)
    start = time.perf_counter()
    summed, (ra, rb) = Sums()(Tensor(np.full((3, 2), value, np.float32)), Tensor(np.full(5, value, np.float32)))
    expected = world * (world + 1) / 2
    ok = bool(np.all(summed.asnumpy() == expected) and np.all(ra.asnumpy() == expected)
              and np.all(rb.asnumpy() == expected))
    print("SUM " + json.dumps({"rank": rank, "world": world, "passed": ok, "seconds": time.perf_counter() - start}))


def check_collectives(target: str) -> dict:
    from orb.training.launch import find_msrun, msrun_environment

    msrun = find_msrun()
    if msrun is None:
        return {"passed": False, "error": "msrun not found (is MindSpore installed in this environment?)"}
    from orb.files import free_port

    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        result = run_child([msrun, "--worker_num=2", "--local_worker_num=2", f"--master_port={port}",
                            f"--log_dir={tmp}", "--join=True", os.path.abspath(__file__), "_sum"], 600, cwd=ROOT,
                           env=dict(msrun_environment(os.environ), ORB_SMOKE_TARGET=target, PYTHONPATH=ROOT))
        lines = []
        for rank in range(2):
            try:
                log = open(os.path.join(tmp, f"worker_{rank}.log")).read()
            except OSError:
                log = ""
            lines += [json.loads(line[4:]) for line in log.splitlines() if line.startswith("SUM ")]
    passed = result.returncode == 0 and len(lines) == 2 and all(line["passed"] for line in lines)
    return {"passed": passed, "workers": len(lines),
            "seconds": round(max((line["seconds"] for line in lines), default=0.0), 2)}


def build_parser(prog: Optional[str] = None) -> argparse.ArgumentParser:
    """orb-smoke-test's options."""
    from orb.commands import HelpFormatter, Parser
    from orb.device import add_device_argument

    parser = Parser(prog=prog, allow_abbrev=False, description=__doc__, formatter_class=HelpFormatter)
    add_device_argument(parser)
    parser.add_argument("--skip_parallel", action="store_true", help="leave out the 2-worker sum")
    parser.add_argument("--precisions", default="float32-high,bf16-mixed,fp16-mixed",
                        help="time one training step in each of these precision modes (comma-separated; '' = none)")
    return parser


def main(argv=None) -> int:
    if argv is None and len(sys.argv) == 4 and sys.argv[1] == "_step":
        from orb.device import configure_mindspore
        from orb.errors import OrbInputError

        try:
            configure_mindspore(sys.argv[2], precision=sys.argv[3])
        except OrbInputError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        print(json.dumps(training_step(sys.argv[2])))
        return 0
    if argv is None and len(sys.argv) == 2 and sys.argv[1] == "_sum":
        _sum_over_workers()
        return 0
    from orb.signals import run_command

    return run_command(lambda: smoke_test(argv))  # (a stop signal in any phase: one line and 75)


def smoke_test(argv) -> int:
    """The checks of :func:`main`, their report, and the exit status (1 if one failed)."""
    from orb.errors import OrbInputError
    from orb.precision import PRECISIONS

    args = build_parser().parse_args(argv)
    modes = [m.strip() for m in args.precisions.split(",") if m.strip()]
    unknown = [m for m in modes if m not in PRECISIONS]
    if unknown:  # (a misspelt mode was reported as not run, and every check passed)
        raise OrbInputError(f"--precisions: {', '.join(unknown)} not among {', '.join(PRECISIONS)}")
    from orb.device import configure_mindspore

    target = configure_mindspore(args.device_target, precision="float32-highest")
    report = {"environment": environment(target)}
    print(f"orb smoke test on {target}: predictions, a training step, collectives (a few minutes)", flush=True)
    report["predictions_vs_pytorch"] = check_predictions()
    print("  predictions: " + ("ok" if report["predictions_vs_pytorch"]["passed"] else "FAILED"), flush=True)
    report["training_step_vs_cpu"] = compare_steps(target)
    print("  training step: " + ("ok" if report["training_step_vs_cpu"]["passed"] else "FAILED"), flush=True)
    if modes:
        report["training_step_by_precision"] = time_precisions(target, modes, report["training_step_vs_cpu"]["cpu"])
        print("  training step by precision: " + ", ".join(
            f"{m} {r['step_s']:.2f} s" if "step_s" in r else f"{m} not run" for m, r in
            report["training_step_by_precision"].items()), flush=True)
    if not args.skip_parallel:
        report["two_worker_sum"] = check_collectives(target)
        print("  2-worker sum: " + ("ok" if report["two_worker_sum"]["passed"] else "FAILED"), flush=True)
    passed = all(v.get("passed", True) for k, v in report.items() if k != "environment")
    print("\n--- paste from here into a bug report ---")
    print(json.dumps(report, indent=2))
    print("--- end ---")
    print("all checks passed" if passed else "SOME CHECKS FAILED")
    return 0 if passed else 1


if __name__ == "__main__":
    from orb.signals import run_program

    run_program(main)
