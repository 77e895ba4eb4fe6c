"""The suite benchmark's accounting (scripts/benchmark.py suite): what it reports is what the processes did."""

import os
import subprocess
import sys

import pytest

from conftest import ROOT


@pytest.fixture(autouse=True)
def _scripts_importable(monkeypatch):
    """``benchmarks`` (scripts/benchmarks) importable within these tests only: scripts/ also holds md.py,
    relax.py, ..., which must not shadow other modules for the tests after them."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "scripts"))


def test_graphs_are_counted_by_where_they_came_from_and_idle_time_by_the_tests_running():
    from benchmarks.suite import (graph_use, idle_by_tests, kept_by_workers, memory_peaks_by_tests, peak_memory,
                                  processes_by_program, shape_only_compilations)

    def graph(pid, test, key, source, seconds):
        return dict(event="graph", pid=pid, test=test, key=key, source=source, seconds=seconds)

    def cell(pid, test, seconds, in_cache):
        return dict(event="cell", pid=pid, test=test, cell="C", seconds=seconds, in_cache=in_cache)

    records = [cell(1, "a", 2.0, True), graph(1, "a", "k", "compiled", 2.1),  # compiled, then loaded again in pid 1
               cell(1, "b", 0.5, True), graph(1, "b", "k", "cache", 0.6),
               cell(2, "c", 0.6, True), graph(2, "c", "k", "cache", 0.7),  # loaded in another process: not again
               cell(2, "d", 3.0, False),  # a test's own compilation
               cell(2, "e", 1.5, True), graph(2, "e", None, "uncached", 1.6),  # asked, but not to be kept
               dict(event="process", pid=2, test="e", program="finetune.py", cpu=7.0, mindspore=True),
               dict(event="process", pid=3, test="e", program="finetune.py", cpu=0.5, mindspore=False)]
    use = graph_use(records)
    assert use["compiled"] == [1, 2.1] and use["loaded"] == [2, pytest.approx(1.3)]
    assert use["loaded again in the process"] == [1, 0.6]
    assert use["outside the cache"] == [2, pytest.approx(4.6)]  # (a process's exit is no compilation)
    assert processes_by_program(records) == [("finetune.py", [2, 1, 7.5])]

    # graphs that differ in their input shapes only: all but one of each group (the costliest kept) could be saved
    parts = dict(kind="k1", specs="s1", parameters="p", structure="c", settings="x")
    shaped = [dict(graph(5, "f", f"k{n}", "compiled", seconds), parts=dict(parts, **change))
              for n, (seconds, change) in enumerate([(4.0, {}), (3.0, dict(specs="s2")), (2.0, dict(specs="s3")),
                                                      (5.0, dict(settings="y")),
                                                      (1.0, dict(settings="y", specs="s2"))])]
    shaped.append(graph(5, "f", "k9", "compiled", 9.0))  # (no parts: a trace from before they were recorded)
    shaped.append(dict(graph(6, "g", "k1", "cache", 0.5), parts=dict(parts, specs="s2")))  # a load: no compilation
    shaped.append(dict(graph(6, "g", "k2", "compiled", 2.5), parts=dict(parts, specs="s3")))  # the same shapes again
    assert shape_only_compilations(records + shaped) == [3, pytest.approx(6.5)]  # groups {4, 3, 2.5} and {5, 1}

    timeline = [dict(event="start", worker="gw0", test="f.py::t1", t=0.0), dict(event="start", worker="gw1",
                                                                                 test="g.py::t2", t=0.0),
                dict(event="end", worker="gw1", test="g.py::t2", t=1.0),
                dict(event="cpu", t=3.0, seconds=2.0, busy=0.25), dict(event="cpu", t=0.5, seconds=2.0, busy=1.0),
                dict(event="end", worker="gw0", test="f.py::t1", t=4.0)]
    idle, pairs = idle_by_tests(timeline, cores=2)
    assert idle == pytest.approx(3.0) and pairs[0] == ("t1 | (waiting or done)", pytest.approx(3.0))
    assert peak_memory(timeline) is None  # (a trace from before memory was sampled)
    timeline[3]["memory_gb"], timeline[4]["memory_gb"] = 1.5, 2.5
    assert peak_memory(timeline) == (2.5, "t1 | t2")  # at t=0.5 both tests ran
    timeline.append(dict(event="cpu", t=3.5, seconds=2.0, busy=0.5, memory_gb=1.0))  # t1 alone again, less
    assert memory_peaks_by_tests(timeline) == [(2.5, "t1 | t2"), (1.5, "t1")]  # each set of tests' largest
    assert kept_by_workers(timeline) == {}  # (a trace from before the workers' memory was recorded)
    ends = [("gw0", "f.py::a", 1.0), ("gw1", "h.py::a", 0.5), ("gw0", "f.py::b", 1.4), ("gw0", "g.py::a", 2.9),
            ("gw0", "g.py::b", 2.5), ("gw0", "k.py::a", 2.0), ("gw1", "h.py::b", 0.7)]
    timeline = [dict(event="end", worker=w, test=test, t=1.0, resident_gb=gb) for w, test, gb in ends]
    timeline.append(dict(event="end", worker="gw1", test="m.py::a", t=2.0))  # (no resident_gb: not counted)
    assert kept_by_workers(timeline) == {"gw0": [1.4, 2.0, 2.5], "gw1": [0.7, 0.7, 0.7]}  # each file's last test


def test_the_tracer_records_a_compilation_in_a_process_it_starts(tmp_path):
    """The tracer on PYTHONPATH sees the compile cache compile a graph, then load it in a second process."""
    from benchmarks.suite import TRACER, graph_use, load_trace

    code = ("import sys; sys.path.insert(0, sys.argv[1]); from ase.build import bulk; "
            "from orb.inference.calculator import ORBCalculator; "
            "atoms = bulk('Cu', cubic=True); atoms.calc = ORBCalculator.from_checkpoint(sys.argv[2], "
            "device_target='CPU'); atoms.get_potential_energy()")
    env = dict(os.environ, ORB_SUITE_TRACE=str(tmp_path), ORB_CACHE_DIR=str(tmp_path / "cache"),
               ORB_COMPILE_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=TRACER)
    for _ in range(2):
        subprocess.run([sys.executable, "-c", code, ROOT, os.path.join(ROOT, "data", "demo_pretrained.ckpt")],
                       env=env, check=True, capture_output=True, timeout=300)
    records = load_trace(str(tmp_path))["compile"]
    use = graph_use(records)
    assert use["compiled"][0] == 1 and use["loaded"][0] == 1 and use["loaded again in the process"][0] == 0
    assert {r["cell"] for r in records if r["event"] == "cell"} == {"PredictCell"}
    graphs = [r for r in records if r["event"] == "graph"]  # each part of the graph's identity, and its shapes
    parts = {"kind", "specs", "parameters", "structure", "settings", "precision", "profile", "context", "sum form"}
    assert all(set(r["parts"]) == parts and r["shapes"] and all(isinstance(s, list) for s in r["shapes"])
               for r in graphs) and graphs[0]["parts"] == graphs[1]["parts"]  # (the same graph, compiled, then loaded)
    exits = [r for r in records if r["event"] == "process"]  # each of the two processes, with MindSpore imported
    assert len(exits) == 2 and all(r["mindspore"] and r["cpu"] > 0.5 for r in exits)


def test_the_restart_benchmark_reads_the_compilations_a_run_reports_and_tells_their_overhead():
    """``benchmark.py restart`` parses the closing line the trainer writes (orb.training.engine.Compiled.describe),
    and a restart's overhead is each graph's first run beyond its own second run; a graph that ran once in a run
    takes its second run from another run of the same graph; one that ran once everywhere counts whole."""
    from benchmarks.restart import _finished, with_overheads
    from orb.data.buckets import Bucket
    from orb.training.engine import Compiled

    def closing_line(seconds, graph_seconds, sources, second_runs):
        compiled = Compiled()
        compiled.seconds, compiled.graph_seconds, compiled.sources, compiled.second_run_seconds = \
            seconds, graph_seconds, sources, second_runs
        return "log\ntraining finished in 9.0 s (%d compilations: %s)\n" % (len(seconds), compiled.describe())

    a, b, c, d = (("eval", Bucket(8, 16, 2)), ("train", Bucket(12, 24, 2)), ("labels pass", Bucket(8, 16, 2)),
                  ("train", Bucket(20, 40, 3)))
    first = _finished(closing_line({a: 2.3, b: 5.5, c: 1.5, d: 3.0}, {a: 2.0, b: 4.5, c: 1.0, d: 2.5},
                                   {a: "compiled", b: "compiled", c: "compiled", d: "compiled"}, {b: 0.7, d: 0.5}))
    assert first == {"compile": pytest.approx(12.3), "graphs": 4, "cached": 0, "mindspore": 10.0,
                     "each": [["eval 8x16", 2.3, None], ["train 12x24", 5.5, 0.7], ["labels pass 8x16", 1.5, None],
                              ["train 20x40", 3.0, 0.5]]}
    resumed = _finished(closing_line({a: 0.5, b: 1.25, d: 0.75}, {a: 0.25, b: 0.5, d: 0.5},
                                     {a: "cache", b: "cache", d: "cache"}, {a: 0.1, d: 0.25}))
    assert resumed["cached"] == 3 and resumed["each"] == [["eval 8x16", 0.5, 0.1], ["train 12x24", 1.25, None],
                                                          ["train 20x40", 0.75, 0.25]]
    rows = with_overheads({"first start": first, "requeue": resumed})
    # each row's own second run where it has one (train 20x40: 0.5 in one, 0.25 in the other), else another's
    assert rows["first start"]["overhead"] == pytest.approx((2.3 - 0.1) + (5.5 - 0.7) + 1.5 + (3.0 - 0.5))
    assert rows["requeue"]["overhead"] == pytest.approx((0.5 - 0.1) + (1.25 - 0.7) + (0.75 - 0.25))
    with pytest.raises(ValueError, match="2 graphs read from a line that reports 3"):
        _finished("training finished in 9.0 s (3 compilations: eval 8x16 1.00s, train 8x16 2.00s; 0 of 3 from the "
                  "compile cache; 2.0 s of it MindSpore compiling or loading graphs, the rest their first runs)")


def test_the_calculator_benchmarks_phases_add_up_to_its_calls_and_leave_the_code_as_it_was():
    """``calculator --profile-phases``: each phase of a call is timed where its function is looked up (none stays at
    0), they fit in the whole call, the model call is most of it, and every wrapped function is put back."""
    from benchmarks.calculator import PHASES, phase_times
    from orb.inference import calculator as calculators, predictor as predictors

    before = [calculators.atoms_to_graph, predictors.pad_batch, predictors.model_inputs,
              predictors.Predictor.__call__, predictors.Predictor._graph_for, calculators.per_structure]
    calc = calculators.ORBCalculator.from_checkpoint(os.path.join(ROOT, "data", "demo_pretrained.ckpt"),
                                                     device_target="CPU")
    times = phase_times(calc, (2, 1, 1), calls=3)
    assert set(times) == {name for name, *_ in PHASES} | {"the rest (ASE, the calculator's own code)", "whole call"}
    assert all(times[name][0] > 0 for name, *_ in PHASES)  # each function wrapped where the calculator calls it
    assert times["the rest (ASE, the calculator's own code)"][0] >= 0  # (the phases within the whole call)
    assert times["the model call and its outputs read"][0] > 0.5 * times["whole call"][0]
    assert before == [calculators.atoms_to_graph, predictors.pad_batch, predictors.model_inputs,
                      predictors.Predictor.__call__, predictors.Predictor._graph_for, calculators.per_structure]
