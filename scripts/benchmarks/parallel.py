"""``parallel``: weak scaling of data-parallel training (msrun, 2 workers); ``allreduce``: the gradient all-reduce
on 2 CPU workers (each an msrun worker running ``children/allreduce_worker.py``); ``pipeline``: how long the
training loop waits for batches, prepared in the loop or by worker processes."""

import json
import os
import subprocess
import sys
import tempfile
import time

from .common import ROOT, child


def bench_parallel(args) -> None:
    """Weak scaling: 2 workers x 1 thread vs 1 worker x 1 thread, same per-worker batch."""
    from orb.files import free_port

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


def bench_allreduce(args) -> None:
    """Gradient all-reduce on 2 CPU workers (msrun): one call per tensor vs one flat buffer."""
    from orb.files import free_port
    from orb.training.launch import find_msrun

    rows = []
    for name, label in (("orb_v2", "full orb-v2"), ("orb_v3_direct_20_omat", "full orb-v3 direct")):
        port = free_port()
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run([find_msrun(), "--worker_num=2", "--local_worker_num=2", f"--master_port={port}",
                            f"--log_dir={tmp}", "--join=True", child("allreduce_worker.py"), name, str(args.steps)],
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


def bench_startup(args) -> None:
    """A 2-worker msrun job that sums one tensor over the workers (``orb-smoke-test``'s check), timed from msrun's
    start to its end, with MindSpore's cluster retry intervals unset, at 3 and 5 s, and at the launcher's
    (alternated)."""
    import statistics

    from orb.smoke_test import check_collectives
    from orb.training import launch

    ours = dict(launch.RETRY_INTERVALS)
    settings = {"unset (MindSpore's own)": {}, "3 and 5 s": {"MS_RETRY_INTERVAL_LOWER": "3",
                                                              "MS_RETRY_INTERVAL_UPPER": "5"},
                "the launcher's ({} and {} s)".format(*ours.values()): ours}
    times = {name: [] for name in settings}
    saved = {key: os.environ.pop(key) for key in ours if key in os.environ}
    try:
        for _ in range(args.rounds):
            for name, values in settings.items():
                os.environ.update(values)  # (msrun_environment keeps a pair already set)
                launch.RETRY_INTERVALS = values  # ({}: msrun_environment adds none)
                try:
                    start = time.perf_counter()
                    assert check_collectives("CPU")["passed"]
                    times[name].append(time.perf_counter() - start)
                finally:
                    launch.RETRY_INTERVALS = ours
                    for key in values:
                        os.environ.pop(key)
    finally:
        os.environ.update(saved)
    print("| retry intervals | job wall time (s), median | each run (s) |\n|---|---|---|")
    for name, values in times.items():
        print(f"| {name} | {statistics.median(values):.1f} | {', '.join(f'{v:.1f}' for v in values)} |")


def bench_failed_job(args) -> None:
    """A 2-worker job whose every rank refuses a setting (a global batch smaller than the workers), timed from the
    launcher's start to its end, with the launcher ending msrun's scheduler after the failure (FailedJobEnd) and
    without (the scheduler waits MS_NODE_TIMEOUT for each worker msrun killed), alternated."""
    import contextlib
    import io
    import statistics

    from orb.files import free_port
    from orb.training import launch

    class Waiting(launch.FailedJobEnd):  # the launcher before FailedJobEnd: the scheduler ends when it ends
        def follow(self, root: int) -> None:
            pass

    ours = launch.FailedJobEnd
    times = {"ended by the launcher": [], "left to MindSpore": []}
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(args.rounds):
            for name, watcher in (("ended by the launcher", ours), ("left to MindSpore", Waiting)):
                run = os.path.join(tmp, f"{k}-{watcher.__name__}")
                env = {"WORKER_NUM": "2", "MASTER_PORT": str(free_port()), "LOG_DIR": os.path.join(run, "logs")}
                argv = [os.path.join(ROOT, "configs", "config_parallel.yaml"), "--output_dir", run,
                        "--checkpoint_path", "", "--batch_size", "1", "--device_target", "CPU", "--train_data_path",
                        os.path.join(ROOT, "data", "demo_train.db"), "--val_data_path", ""]
                saved = {key: os.environ.get(key) for key in env}
                os.environ.update(env)
                launch.FailedJobEnd = watcher
                try:
                    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                        start = time.perf_counter()
                        status = launch.launch(argv)
                    times[name].append(time.perf_counter() - start)
                finally:
                    launch.FailedJobEnd = ours
                    for key, value in saved.items():
                        if value is None:
                            os.environ.pop(key)
                        else:
                            os.environ[key] = value
                assert status == 2, f"{name}: exit status {status}, expected 2 (the refused setting)"
    print(f"MS_NODE_TIMEOUT: {os.environ.get('MS_NODE_TIMEOUT', '30 (unset)')}\n")
    print("| scheduler after the failure | job wall time (s), median | each run (s) |\n|---|---|---|")
    for name, values in times.items():
        print(f"| {name} | {statistics.median(values):.1f} | {', '.join(f'{v:.1f}' for v in values)} |")
