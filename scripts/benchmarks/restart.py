"""``benchmark.py restart``: what compilation costs a first start, a second start and a requeued resume of a
fine-tuning run, and a calculator script's first call in a first and a second process, with the compiled graphs
kept in a fresh cache (orb.graph_cache)."""

import json
import os
import re
import subprocess
import sys
import tempfile
import time

from benchmarks.common import CHILDREN, MPTRJ, ROOT, child, run_timed

FINISHED = re.compile(r"training finished in ([\d.]+) s \((\d+) compilations: (.*?); (\d+) of \d+ from the compile "
                      r"cache; ([\d.]+) s of it MindSpore compiling or loading graphs")
GRAPH = re.compile(r"([\w ]+?) (\d+x\d+) ([\d.]+)s(?: cached)?(?: \(then ([\d.]+)s\))?(?:, |$)")


def _run(command, env, output_dir, first_step_file):
    start = time.time()
    result, wall, cpu = run_timed(command, env=env, timeout=7200)
    if result.returncode not in (0, 75):
        raise RuntimeError(f"{' '.join(command)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    first = float(open(first_step_file).read()) - start if os.path.exists(first_step_file) else float("nan")
    return dict({"status": result.returncode, "wall": wall, "cpu": cpu, "first_step": first}, **_finished(result.stdout))


def _finished(text):
    """The compilations a run's closing line reports (its log or its output): each graph's first run and, where it
    ran again, its second (["eval 136x2720", first, second or None], in the line's order)."""
    found = FINISHED.search(text)
    if not found:
        return {"compile": float("nan"), "graphs": 0, "cached": 0, "mindspore": float("nan"), "each": []}
    each = [[f"{kind} {shape}", float(first), float(second) if second else None]
            for kind, shape, first, second in GRAPH.findall(found.group(3))]
    if len(each) != int(found.group(2)):
        raise ValueError(f"{len(each)} graphs read from a line that reports {found.group(2)}: {found.group(0)}")
    return {"compile": sum(first for _, first, _ in each), "graphs": len(each), "cached": int(found.group(4)),
            "mindspore": float(found.group(5)), "each": each}


def with_overheads(rows: dict) -> dict:
    """Each row with "overhead": its graphs' first runs beyond their second runs, the step's own work. A graph
    that ran once in a row (a resumed run's last steps, a first start's last bucket) takes its second run from
    another row of the same case set, which ran the same graph on the same shapes; one that ran once everywhere
    counts whole."""
    second = {graph: again for row in rows.values() for graph, _, again in row["each"] if again is not None}
    for row in rows.values():
        row["overhead"] = sum(first - (again if again is not None else second.get(graph, 0.0))
                              for graph, first, again in row["each"]) if row["each"] else float("nan")
    return rows


def compilation_cells(row, first) -> str:
    """A row's compilation columns and their ratios to the first start's, as HEADER names them."""
    return (f"{row['compile']:.1f} | {row['mindspore']:.1f} | {row['overhead']:.1f} | {row['cached']} of "
            f"{row['graphs']} | {row['compile'] / first['compile']:.2f} ({row['mindspore'] / first['mindspore']:.2f}) | "
            f"**{row['overhead'] / first['overhead']:.2f}** |")


HEADER = ("| run | case | exit | wall (s) | to 1st step (s) | compilations with first runs (s) | of which MindSpore "
          "compiling or loading (s) | first runs beyond the steps' second runs (s) | graphs from cache | compilations / "
          "first start's (MindSpore's alone) | beyond second runs / first start's |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|")


def fine_tuning_case(name, arguments, cache, work):
    """First start, second start, and a run stopped by SIGTERM at its 2nd step then resumed (the requeue), each a
    fresh process on one cache."""
    env = dict(os.environ, ORB_CACHE_DIR=cache, ORB_COMPILE_CACHE_DIR=cache, PYTHONPATH=CHILDREN + os.pathsep + ROOT)
    command = [sys.executable, os.path.join(ROOT, "finetune.py"), *arguments, "--progress_bar", "false",
               "--callbacks", "[restart_callback:FirstStep]"]
    rows = {}
    for case, extra, stop_at in (("first start", [], 0), ("second start", [], 0), ("stopped", [], 2),
                                 ("requeue (resume)", ["--resume", "auto"], 0)):
        output = os.path.join(work, name.replace(" ", "_"), "requeue" if case in ("stopped", "requeue (resume)")
                              else case.replace(" ", "_"))
        marker = os.path.join(work, f"{name}-{case}.first".replace(" ", "_"))
        env.update(ORB_BENCH_FIRST_STEP=marker, ORB_BENCH_STOP_AT=str(stop_at))
        rows[case] = _run(command + ["--output_dir", output] + extra, env, output, marker)
    return rows


def parallel_case(name, arguments, cache, work, workers):
    """A first and a second start of a data-parallel job (``run_parallel.sh``, ``workers`` ranks on this host) on one
    fresh cache: each rank's compilations, from its log."""
    from orb.files import free_port

    config, rest = arguments[1], arguments[2:]  # (--config CONFIG ...: the launcher takes the config first)
    rows = {}
    for case in ("first start", "second start"):
        output, logs = (os.path.join(work, f"{name}-x{workers}-{case}".replace(" ", "_") + suffix)
                        for suffix in ("", "-logs"))
        marker = output + ".first"
        env = dict(os.environ, ORB_CACHE_DIR=cache, ORB_COMPILE_CACHE_DIR=cache, ORB_BENCH_FIRST_STEP=marker,
                   ORB_BENCH_STOP_AT="0", PYTHONPATH=CHILDREN + os.pathsep + ROOT, WORKER_NUM=str(workers),
                   MASTER_PORT=str(free_port()), LOG_DIR=logs,
                   PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
        command = ["bash", os.path.join(ROOT, "run_parallel.sh"), config, *rest, "--output_dir", output,
                   "--progress_bar", "false", "--callbacks", "[restart_callback:FirstStep]"]
        job = _run(command, env, output, marker)
        with open(os.path.join(logs, "worker_0.log")) as f:
            job.update(_finished(f.read()))  # (rank 0 reports the run)
        job["ranks"] = []
        for rank in range(workers):
            with open(os.path.join(logs, f"worker_{rank}.log")) as f:
                text = f.read()
            graphs = len(re.findall(r"compiling the [\w ]+ step for batch shape", text))
            loaded = len(re.findall(r"the [\w ]+ step's graph came from the compile cache", text))
            job["ranks"].append(f"{graphs - loaded} compiled, {loaded} loaded")
        rows[case] = job
    return rows


def calculator_case(checkpoint, repeat, cache):
    env = dict(os.environ, ORB_CACHE_DIR=cache, ORB_COMPILE_CACHE_DIR=cache, PYTHONPATH=ROOT)
    out = []
    for _ in range(2):
        result = subprocess.run([sys.executable, child("calculator_first_call.py"), checkpoint, str(repeat)], env=env,
                                capture_output=True, text=True, timeout=3600)
        if result.returncode:
            raise RuntimeError(result.stderr[-3000:])
        out.append(json.loads(result.stdout.strip().splitlines()[-1]))
    return out


def demo_arguments(config):
    return ["--config", config, "--max_epochs", "1", "--device_target", "CPU"]


def full_size_arguments(model):
    return ["--config", "finetune_orb_v3", "--checkpoint_path", "", "--model.name", model, "--train_data_path",
            MPTRJ, "--val_data_path", MPTRJ, "--val_fraction", "0", "--batch_size", "2", "--max_epochs", "1",
            "--num_buckets", "2", "--data_workers", "0", "--device_target", "CPU"]


def bench_restart(args) -> None:
    cases = [(c, demo_arguments(c)) for c in args.configs.split(",") if c]
    cases += [(m, full_size_arguments(m)) for m in args.models.split(",") if m]
    print(HEADER)
    with tempfile.TemporaryDirectory(prefix="orb-bench-restart-") as work:
        for name, arguments in cases:
            cache = os.path.join(work, f"cache-{name}")
            if args.workers > 1:
                rows = with_overheads(parallel_case(name, arguments, cache, work, args.workers))
                first = rows["first start"]
                for case, row in rows.items():
                    print(f"| {name}, {args.workers} workers (rank 0; each rank: {'; '.join(row['ranks'])}; CPU time "
                          f"of the job {row['cpu']:.0f} s) | {case} | "
                          f"{row['status']} | {row['wall']:.1f} | {row['first_step']:.1f} | "
                          + compilation_cells(row, first))
                continue
            rows = with_overheads(fine_tuning_case(name, arguments, cache, work))
            first = rows["first start"]
            for case, row in rows.items():
                if case == "stopped":
                    continue
                print(f"| {name} | {case} | {row['status']} | {row['wall']:.1f} | {row['first_step']:.1f} | "
                      + compilation_cells(row, first))
        if args.calculator:
            cache = os.path.join(work, "cache-calculator")
            print("\n| calculator | atoms | process | start-up (s) | first call (s) | second call (s) | graphs |")
            print("|---|---|---|---|---|---|---|")
            for checkpoint in args.calculator.split(","):
                for process, row in enumerate(calculator_case(os.path.join(ROOT, checkpoint), args.repeat, cache)):
                    print(f"| {os.path.basename(checkpoint)} | {row['atoms']} | {process + 1} | {row['startup']:.1f} | "
                          f"{row['first_call']:.1f} | {row['second_call']:.2f} | {', '.join(row['sources'])} |")
