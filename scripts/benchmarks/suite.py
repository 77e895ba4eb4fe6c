"""``benchmark.py suite``: the README's test command, timed as CI runs it (an empty cache folder), with where its
time goes: each graph compiled, loaded from the compile cache or compiled outside it (in every process that keeps
``PYTHONPATH``), and the host's idle core-seconds with the tests that ran meanwhile."""

import collections
import glob
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from typing import Dict, List

from benchmarks.common import HERE, ROOT

TRACER = os.path.join(HERE, "children", "suite_trace")  # sitecustomize.py and the pytest plugin suite_timeline.py


def bench_suite(args) -> None:
    folder = tempfile.mkdtemp(prefix="orb-suite-trace-")
    cache = args.cache_dir or os.path.join(folder, "cache")  # empty, as on CI's fresh machine
    env = dict(os.environ, ORB_SUITE_TRACE=folder, ORB_CACHE_DIR=cache,
               PYTHONPATH=os.pathsep.join([TRACER] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    env.pop("ORB_COMPILE_CACHE_DIR", None)  # (tests/conftest.py puts it in ORB_CACHE_DIR's folder)
    command = [sys.executable, "-m", "pytest", "-q", "-n", str(args.workers), "--dist", "loadfile",
               "--no-loadscope-reorder", "-p", "suite_timeline", *args.tests.split()]
    print("$", " ".join(command[1:]), f"  (ORB_NO_SKIP={env.get('ORB_NO_SKIP', '')!r}, "
          f"PyTorch peers: {'set' if env.get('ORB_TORCH_PYTHON') and env.get('ORB_TORCH_V3_PYTHON') else 'not set'})")
    start = time.time()
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.time() - start
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    with open(os.path.join(folder, "pytest.log"), "w") as f:
        f.write(result.stdout + result.stderr)
    lines = result.stdout.strip().splitlines()
    print(f"pytest: {lines[-1] if lines else '(no output)'} (exit status {result.returncode})")
    print(f"trace and pytest's output: {folder}\n")
    print(report(load_trace(folder), wall, usage.ru_utime, usage.ru_stime, os.cpu_count() or 1))


def load_trace(folder: str) -> Dict[str, List[dict]]:
    records = {"compile": [], "timeline": []}
    for path in glob.glob(os.path.join(folder, "compile-*.jsonl")):
        records["compile"] += _lines(path)
    timeline = os.path.join(folder, "timeline.jsonl")
    if os.path.exists(timeline):
        records["timeline"] = _lines(timeline)
    return records


def _lines(path: str) -> List[dict]:
    out = []
    with open(path) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except ValueError:  # a process killed while writing its last line
                pass
    return out


def graph_use(compile_records: List[dict]) -> Dict[str, list]:
    """[count, seconds] of the graphs the compile cache compiled, loaded (and of those, loaded again in a process
    that had loaded or compiled the same graph before), and of MindSpore's compilations outside it: a cell compiled
    by a test itself, or a graph the cache was asked for but could not keep (``uncached``)."""
    use = {name: [0, 0.0] for name in ("compiled", "loaded", "loaded again in the process", "outside the cache")}
    seen = set()
    for r in compile_records:
        if r["event"] == "graph":
            name = {"cache": "loaded", "compiled": "compiled"}.get(r["source"], "outside the cache")
            if name == "loaded" and (r["pid"], r["key"]) in seen:
                use["loaded again in the process"][0] += 1
                use["loaded again in the process"][1] += r["seconds"]
            seen.add((r["pid"], r["key"]))
        elif r["event"] == "cell" and not r.get("in_cache", False):
            name = "outside the cache"
        else:
            continue  # (the cache's own Cell.compile: its graph event counts it; a process's exit)
        use[name][0] += 1
        use[name][1] += r["seconds"]
    return use


def shape_only_compilations(compile_records: List[dict]) -> list:
    """[count, seconds] of the compiled graphs beyond one per group of graphs that differ in their input shapes only
    (the tracer's digest of each part of a graph's identity: same kind, model, parameters, settings, precision...):
    what one shape per group would save, the costliest compilation of each group kept. A graph compiled again with
    the same shapes (a test that compiles afresh on purpose) is no other shape: counted once."""
    groups = collections.defaultdict(dict)
    for r in compile_records:
        if r["event"] == "graph" and r["source"] == "compiled" and r.get("parts"):
            shapes = groups[tuple(sorted((k, v) for k, v in r["parts"].items() if k != "specs"))]
            shapes[r["parts"]["specs"]] = max(shapes.get(r["parts"]["specs"], 0.0), r["seconds"])
    extra = [sorted(shapes.values())[:-1] for shapes in groups.values()]
    return [sum(map(len, extra)), sum(map(sum, extra))]


def test_runs(timeline: List[dict]) -> Dict[str, list]:
    """worker -> [(start, end, test)] of every test that ended."""
    runs = collections.defaultdict(list)
    open_runs = {}
    for r in timeline:
        if r["event"] == "start":
            open_runs[(r["worker"], r["test"])] = r["t"]
        elif r["event"] == "end" and (r["worker"], r["test"]) in open_runs:
            runs[r["worker"]].append((open_runs.pop((r["worker"], r["test"])), r["t"], r["test"]))
    return runs


def running_at(runs: Dict[str, list], t: float) -> list:
    """The test each worker ran at time ``t`` (its name), or None, by worker."""
    return [next((test.split("::")[-1] for s, e, test in runs[w] if s <= t < e), None) for w in sorted(runs)]


def idle_by_tests(timeline: List[dict], cores: int) -> (float, list):
    """The host's idle core-seconds, and the pairs of tests running on the workers meanwhile, most idle first."""
    runs = test_runs(timeline)
    by_pair = collections.defaultdict(float)
    total = 0.0
    for r in timeline:
        if r["event"] != "cpu":
            continue
        idle = (1.0 - r["busy"]) * cores * r["seconds"]
        total += idle
        by_pair[" | ".join(name or "(waiting or done)" for name in running_at(runs, r["t"]))] += idle
    return total, sorted(by_pair.items(), key=lambda item: -item[1])


def processes_by_program(compile_records: List[dict]) -> list:
    """(program, [processes, of them importing MindSpore, CPU seconds]) for every process whose exit the tracer saw,
    most CPU first (``-c``: ``python -c``; the test workers under their own name)."""
    by = collections.defaultdict(lambda: [0, 0, 0.0])
    for r in compile_records:
        if r["event"] == "process":
            row = by[r["program"] or "(none)"]
            row[0] += 1
            row[1] += bool(r.get("mindspore"))
            row[2] += r["cpu"]
    return sorted(by.items(), key=lambda item: -item[1][2])


def memory_peaks_by_tests(timeline: List[dict], count: int = 3) -> list:
    """[(GB, the tests on the workers then)]: the largest sample of the host's memory in use above the run's start
    for each set of tests running at once, the ``count`` largest: a peak's runner-up pairs (the peak alone hides
    what else comes close)."""
    runs = test_runs(timeline)
    best = {}
    for r in timeline:
        if r["event"] == "cpu" and "memory_gb" in r:
            names = " | ".join(name for name in running_at(runs, r["t"]) if name) or "(none)"
            best[names] = max(best.get(names, 0.0), r["memory_gb"])
    return sorted(((gb, names) for names, gb in best.items()), reverse=True)[:count]


def peak_memory(timeline: List[dict]):
    """(GB, the tests on the workers then) at the largest sample of the host's memory in use above the run's start
    (sampled every 2 s: a shorter peak can be missed), or None without samples."""
    peaks = memory_peaks_by_tests(timeline, 1)
    return peaks[0] if peaks else None


def kept_by_workers(timeline: List[dict]) -> Dict[str, list]:
    """worker -> [resident GB after its first file, after its last file, the largest after any file]: what a worker
    keeps between files, after handing memory back (tests/conftest.py's release_memory at a file's end)."""
    ends = collections.defaultdict(list)
    last = {}
    for r in timeline:
        if r["event"] == "end" and "resident_gb" in r:
            name = r["test"].split("::")[0]
            if last.get(r["worker"], (None,))[0] not in (None, name):
                ends[r["worker"]].append(last[r["worker"]][1])  # the previous file's last test
            last[r["worker"]] = (name, r["resident_gb"])
    for worker, (_, gb) in last.items():
        ends[worker].append(gb)
    return {w: [gbs[0], gbs[-1], max(gbs)] for w, gbs in sorted(ends.items())}


def test_seconds_by_file(timeline: List[dict]) -> list:
    starts, seconds = {}, collections.defaultdict(float)
    for r in timeline:
        if r["event"] == "start":
            starts[(r["worker"], r["test"])] = r["t"]
        elif r["event"] == "end" and (r["worker"], r["test"]) in starts:
            seconds[r["test"].split("::")[0]] += r["t"] - starts.pop((r["worker"], r["test"]))
    return sorted(seconds.items(), key=lambda item: -item[1])


def report(trace: Dict[str, List[dict]], wall: float, user: float, system: float, cores: int) -> str:
    cpu = user + system
    rows = [f"wall time {wall / 60:.1f} min; CPU time {cpu:.0f} s (user {user:.0f}, system {system:.0f}), "
            f"{100 * cpu / wall:.0f} % of one core ({cores} cores)", "",
            "| graphs | count | seconds |", "|---|---|---|"]
    rows += [f"| {name} | {count} | {seconds:.0f} |" for name, (count, seconds) in graph_use(trace["compile"]).items()]
    same = shape_only_compilations(trace["compile"])
    rows += ["", f"graphs compiled that one shape per group of graphs differing in input shapes only would save: "
                 f"{same[0]} ({same[1]:.0f} s)"]
    processes = processes_by_program(trace["compile"])
    if processes:
        rows += ["", "| Python processes started (their exit recorded) | count | with MindSpore | CPU s |",
                 "|---|---|---|---|"]
        rows += [f"| {name} | {n} | {with_ms} | {cpu:.0f} |" for name, (n, with_ms, cpu) in processes[:12]]
        totals = [sum(row[k] for _, row in processes) for k in range(3)]
        rows += [f"| all {len(processes)} programs | {totals[0]} | {totals[1]} | {totals[2]:.0f} |"]
    idle, pairs = idle_by_tests(trace["timeline"], cores)
    peaks = memory_peaks_by_tests(trace["timeline"])
    if peaks:
        rows += ["", f"memory in use above the start, at its peak: {peaks[0][0]:.1f} GB (tests running then: "
                     f"{peaks[0][1]}); the largest with other tests: "
                     + "; ".join(f"{gb:.1f} GB ({names})" for gb, names in peaks[1:])]
    kept = kept_by_workers(trace["timeline"])
    if kept:
        rows += ["", "each worker's resident memory after a file (GB): " + "; ".join(
            f"{w} {first:.1f} after its first, {final:.1f} after its last, at most {top:.1f}"
            for w, (first, final, top) in kept.items())]
    rows += ["", f"idle core-seconds: {idle:.0f} (the tests running meanwhile, most idle first)", "",
             "| idle core-s | tests on the workers |", "|---|---|"]
    rows += [f"| {seconds:.0f} | {pair} |" for pair, seconds in pairs[:12]]
    rows += ["", "| test file | test seconds |", "|---|---|"]
    rows += [f"| {name} | {seconds:.0f} |" for name, seconds in test_seconds_by_file(trace["timeline"])]
    return "\n".join(rows)
