"""Compiled graphs kept between processes (orb.graph_cache): a graph is loaded only for the cell, shapes and settings
it was compiled for, in any order, and equals a fresh compilation's numbers to the bit; anything else compiles."""

import csv
import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from conftest import DEMO_VAL, MPTRJ_DB, ROOT, SMALL_MODEL, own_compile_cache


@pytest.fixture
def cache_dir(monkeypatch, tmp_path):
    """A cache of the test's own, in graph mode (where graphs are compiled, as every command runs)."""
    import mindspore as ms

    from orb import native

    for key, value in own_compile_cache(tmp_path / "cache").items():
        monkeypatch.setenv(key, value)
    before = ms.get_context("mode")
    ms.set_context(mode=ms.GRAPH_MODE)
    yield tmp_path / "cache"
    ms.set_context(mode=before)
    native.build.cache_clear()  # a kernel library built in this folder: its path is in every later graph's identity


def batches(cfg, sizes=((0, 2), (2, 7))):
    """Batches of MPtrj structures of different sizes (each compiles its own shape)."""
    from ase.db import connect

    from orb.data.batching import batch_graphs
    from orb.data.graphs import atoms_to_graph

    atoms = [row.toatoms() for row in connect(MPTRJ_DB).select()]
    return [batch_graphs([atoms_to_graph(a, settings=cfg.graph_settings()) for a in atoms[lo:hi]]) for lo, hi in sizes]


def model(name="orb_v2", seed=5, **overrides):
    from orb.models import create
    from orb.models.recipe import model_recipe_weights
    from orb.io.checkpoint import load_torch_state_dict

    settings = dict(SMALL_MODEL, **overrides) if name == "orb_v2" else dict(
        latent_dim=32, mlp_hidden_dim=64, num_message_passing_steps=2, head_mlp_hidden_dim=32, **overrides)
    made = create(name, **settings)
    load_torch_state_dict(made, model_recipe_weights(made, seed))
    made.set_train(False)
    return made


def predict(made, graphs):
    """Each batch's outputs in its own shape, and where each shape's graph came from."""
    from orb.inference.predictor import Predictor

    predictor = Predictor(made, reuse=False)
    outputs = [predictor(graph) for graph in graphs]
    return outputs, list(predictor.sources.values())


def uncached(made, graphs):
    from orb import graph_cache

    before = graph_cache.GRAPHS.enabled
    graph_cache.GRAPHS.enabled = False
    try:
        return predict(made, graphs)[0]
    finally:
        graph_cache.GRAPHS.enabled = before


def assert_equal(ours, theirs):
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        assert a.keys() == b.keys()
        for key in a:
            np.testing.assert_array_equal(a[key], b[key], err_msg=key)


def test_graphs_compiled_in_another_order_load_their_own(cache_dir):
    """One process compiles shapes A then B; the next cells compile B then A: each loads its own graph (a graph
    loaded by position, as MindSpore's cache does, gave another shape's graph and garbage), equal to a fresh
    compilation's numbers to the bit."""
    first = model()
    graphs = batches(first.cfg)
    expected = uncached(first, graphs)
    out, sources = predict(first, graphs)
    assert sources == ["compiled", "compiled"]
    assert_equal(out, expected)
    again, sources = predict(model(), graphs[::-1])
    assert sources == ["cache", "cache"]
    assert_equal(again[::-1], expected)
    assert len([n for n in os.listdir(cache_dir / "graphs") if n.startswith("graphs-")]) == 2


def test_the_calculator_computes_orb_mds_bits_and_loads_its_graph_of_a_structure_it_meets_again(cache_dir,
                                                                                                 monkeypatch):
    """The calculator's (and orb-relax's) shape of a structure is orb-md's: through its graph for every size it
    computes orb-md's bits, and a structure it meets more than OWN_GRAPH_AFTER times (an MD run) takes orb-md's graph,
    loaded from the cache. The graph for every size is kept apart: its sums are TensorScatterAdd, orb-md's graph
    compiled after it in the same process holds none; a second calculator loads it."""
    from ase.build import molecule

    from orb import graph_cache
    from orb.cache import load_arrays
    from orb.data.graphs import atoms_to_graph
    from orb.inference import predictor as predictors

    monkeypatch.setattr(predictors, "OWN_GRAPH_AFTER", 1)
    graph = atoms_to_graph(molecule("C2H4"), settings=model().cfg.graph_settings())
    assert graph.num_edges == 30  # not on orb-md's grid of shapes (32): the calculator padded it to 40 before
    calculator = predictors.Predictor(model())
    first = calculator(graph)  # the graph for every size
    md, sources = predict(model(), [graph])
    assert sources == ["compiled"]
    assert_equal([first], md)
    assert_equal([calculator(graph)], md)  # met again: orb-md's graph
    assert calculator.sources == {predictors.EVERY_SIZE: "compiled", list(calculator.sources)[1]: "cache"}
    again = predictors.Predictor(model())
    assert_equal([again(graph)], md)
    assert again.sources == {predictors.EVERY_SIZE: "cache"}
    kept = [load_arrays(str(path))["mindir"].tobytes() for path in cache_dir.rglob(f"{graph_cache.KIND}-*.npz")]
    assert len(kept) == 2  # the graph for every size and orb-md's: one with TensorScatterAdd, one without
    scattered, plain = sorted(kept, key=lambda mindir: b"TensorScatterAdd" not in mindir)
    assert b"TensorScatterAdd" in scattered and b"TensorScatterAdd" not in plain and b"UnsortedSegmentSum" in plain


def test_orb_evaluate_of_one_structure_loads_the_graph_the_calculator_compiled(cache_dir, tmp_path, capsys):
    """orb-evaluate loads the calculator's graph (on the CPU the one for every size; it padded to a batch's 33 slots
    and compiled a graph of its own before), with the same energy."""
    import ase.io
    from ase.build import bulk

    from orb import graph_cache
    from orb.inference import evaluate
    from orb.inference.calculator import ORBCalculator

    checkpoint = os.path.join(ROOT, "data", "demo_pretrained.ckpt")
    atoms = bulk("Cu", "fcc", a=3.6, cubic=True).repeat((2, 1, 1))
    atoms.rattle(0.05, seed=3)
    ase.io.write(tmp_path / "cu.extxyz", atoms, format="extxyz")
    atoms.calc = ORBCalculator.from_checkpoint(checkpoint, device_target="CPU")
    energy = atoms.get_potential_energy()
    loaded, kept = len(graph_cache.GRAPHS.loaded), len(graph_cache.GRAPHS.kept)
    assert kept >= 1  # the calculator's graph, compiled and kept
    status = evaluate.main(["--checkpoint", checkpoint, "--data", str(tmp_path / "cu.extxyz"), "--output_dir",
                            str(tmp_path / "eval"), "--device_target", "CPU", "--progress_bar", "false"])
    assert status == 0, capsys.readouterr().err
    assert (len(graph_cache.GRAPHS.loaded), len(graph_cache.GRAPHS.kept)) == (loaded + 1, kept)
    with open(tmp_path / "eval" / "predictions.csv") as f:
        assert float(next(csv.DictReader(f))["energy_pred"]) == pytest.approx(energy, rel=1e-6)


def test_files_mindspore_made_read_only_are_replaced_as_a_user_who_is_not_root(cache_dir, monkeypatch):
    """MindSpore writes its cache files read-only (0400); a user other than root cannot open them for writing, so the
    first cached graph after a fresh compilation in the same process ended in PermissionError on every cluster (the
    suite runs as root, which may: here the file system's rule for other users is applied to the module's writes;
    measured as user nobody before the fix)."""
    import builtins
    import stat

    from orb import graph_cache

    def as_a_user(path, mode="r", *args, **kwargs):
        if any(m in mode for m in "wa+") and os.path.exists(path) and not os.stat(path).st_mode & stat.S_IWUSR:
            raise PermissionError(13, "Permission denied", path)
        return builtins.open(path, mode, *args, **kwargs)

    monkeypatch.setattr(graph_cache, "open", as_a_user, raising=False)
    first = model()
    graphs = batches(first.cfg)
    expected = uncached(first, graphs)
    assert predict(first, graphs[:1])[1] == ["compiled"]  # MindSpore's own files, read-only, in the scratch folder
    again, sources = predict(model(), graphs)
    assert sources == ["cache", "compiled"]
    assert_equal(again, expected)
    last, sources = predict(model(), graphs[::-1])  # a staged file over the one MindSpore wrote for the second
    assert sources == ["cache", "cache"]
    assert_equal(last[::-1], expected)


def test_another_setting_precision_or_code_compiles_afresh(cache_dir, monkeypatch):
    """A setting no tensor shape shows (the radial basis's radius; the envelope's cutoff and order, which the model
    reads from its settings object: another cutoff loaded the first one's graph), another precision, another version
    of the code: each compiles its own graph (and equals its fresh compilation); the first graph is still found after
    them."""
    from orb import cache, precision

    base = model()
    graphs = batches(base.cfg)[:1]
    predict(base, graphs)
    assert predict(model(), graphs)[1] == ["cache"]
    for setting in (dict(rbf_radius=7.0), dict(cutoff_rmax=5.0)):  # (polynomial_order: read as cutoff_rmax is)
        other = model(**setting)
        out, sources = predict(other, graphs)
        assert sources == ["compiled"], setting
        assert_equal(out, uncached(other, graphs))
    with precision.in_force("fp16-mixed"):
        half = model()
    out, sources = predict(half, graphs)
    assert sources == ["compiled"]
    assert_equal(out, uncached(half, graphs))
    precision.set_sum_form("split")  # (Ascend's form of the long sums, read while a graph is traced)
    try:
        out, sources = predict(base, graphs)
        assert sources == ["compiled"]
        assert_equal(out, uncached(base, graphs))
    finally:
        precision.set_sum_form("float64")
    monkeypatch.setitem(cache._SOURCE_DIGESTS, ("orb",), "another version of the code")
    assert predict(model(), graphs)[1] == ["compiled"]
    monkeypatch.undo()
    for key, value in own_compile_cache(cache_dir).items():
        monkeypatch.setenv(key, value)
    assert predict(model(), graphs)[1] == ["cache"]


def test_a_full_temporary_folder_compiles_on_without_the_cache(cache_dir, monkeypatch, caplog):
    """MindSpore's files are staged in a scratch folder under $TMPDIR: a full disk there stopped the run at a
    compilation ("error: No space left on device"), though the cache is an optional speed-up. Now one warning, and
    the run computes what it computes without the cache."""
    import errno

    from orb import graph_cache

    made = model(seed=11)
    graphs = batches(made.cfg)[:1]
    expected = uncached(made, graphs)
    graph_cache.GRAPHS.usable()
    monkeypatch.setattr(graph_cache.GRAPHS, "enabled", graph_cache.GRAPHS.enabled)  # (restored after the test)

    def full(*args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.path.join(graph_cache.GRAPHS.scratch, "x.mindir"))

    monkeypatch.setattr(graph_cache.GraphCache, "_stage", full)
    with caplog.at_level("WARNING", logger="orb"):
        out, sources = predict(made, graphs)
    assert sources == ["uncached"] and "compiled graphs are not kept from now on: No space left" in caplog.text
    assert_equal(out, expected)


def test_scratch_folders_of_gone_processes_on_this_host_are_removed_and_no_other(tmp_path):
    """The scratch folders were judged by a bare pid: on a temporary folder other nodes share, a live process's folder
    on another node was removed mid-compilation when its pid was free here."""
    from orb.files import owner_tag
    from orb.graph_cache import SCRATCH, remove_stale_scratch

    pid = 4194304 + 12345  # (above Linux's largest process id: surely gone)
    host = owner_tag().partition("@")[2]
    names = {"gone here": f"{SCRATCH}{pid}@{host}-abc_1", "another node's": f"{SCRATCH}{pid}@other-node-7-x1y",
             "mine": f"{SCRATCH}{owner_tag()}-q2", "an older version's": f"{SCRATCH}{pid}-zz9"}
    for name in names.values():
        (tmp_path / name).mkdir()
    remove_stale_scratch(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == sorted([names["another node's"], names["mine"]])


def test_a_damaged_graph_is_compiled_again_never_loaded(cache_dir, caplog):
    first = model()
    graphs = batches(first.cfg)[:1]
    expected = predict(first, graphs)[0]
    (entry,) = [cache_dir / "graphs" / n for n in os.listdir(cache_dir / "graphs") if n.startswith("graphs-")]
    data = bytearray(entry.read_bytes())
    data[len(data) // 2] ^= 0xFF
    entry.write_bytes(bytes(data))
    out, sources = predict(model(), graphs)
    assert sources == ["compiled"]
    assert_equal(out, expected)
    assert any("is damaged" in r.getMessage() for r in caplog.records)
    assert predict(model(), graphs)[1] == ["cache"]


def test_mindspores_full_collection_before_a_compilation_scans_nothing_and_the_collector_is_left_as_found(
        cache_dir, monkeypatch):
    """MindSpore runs gc.collect() before every compilation (a scan of every object: 0.07-0.1 s in a tool, more in a
    long process); the cache compiles with the heap frozen, so that scan is empty, and unfreezes it afterwards,
    also when the compilation fails."""
    import gc

    from orb import graph_cache

    seen = []
    collect = gc.collect

    def spy(*generation):
        if not generation:  # (MindSpore's call: a full collection)
            seen.append(gc.get_freeze_count())
        return collect(*generation)

    monkeypatch.setattr(gc, "collect", spy)
    made = model()
    predict(made, batches(made.cfg)[:1])
    assert seen and all(count > 0 for count in seen) and gc.get_freeze_count() == 0

    class Failing:
        def compile(self, *inputs):
            raise RuntimeError("no graph")

    with pytest.raises(RuntimeError, match="no graph"):
        graph_cache.compile_cell_now(Failing(), ())
    assert gc.get_freeze_count() == 0


FREED_FIRST = """
import gc, json, logging, sys
logging.basicConfig(level=logging.INFO)
sys.path.insert(0, sys.argv[1])
sys.path.insert(0, sys.argv[2])
import numpy as np
import mindspore as ms
from orb import graph_cache
from orb.inference.predictor import Predictor
from test_graph_cache import batches, model

ms.set_context(mode=ms.GRAPH_MODE)
graphs = batches(model().cfg)[:1]
first = Predictor(model(seed=5), reuse=False)
first(graphs[0])  # the process's first compiled cell
second = Predictor(model(seed=6), reuse=False)
expected = second(graphs[0])
loaded = len(graph_cache.GRAPHS.loaded)
del first
gc.collect()  # freed: MindSpore renumbers its graphs
again = second(graphs[0])
print(json.dumps(dict(loaded=len(graph_cache.GRAPHS.loaded) - loaded,
                      equal=all(np.array_equal(again[k], expected[k]) for k in expected))))
"""


def test_a_graph_mindspore_lets_go_of_when_another_cell_is_freed_is_loaded_again_not_compiled(cache_dir):
    """MindSpore 2.10 renumbers its graphs when a process's first compiled cell is freed, and every other cell's next
    call compiled its graph afresh, outside the cache (measured: 1.4 s for this small model, 2-14 s in the test
    suite, 380 s over it). That call now loads the graph the cache keeps, once, said in the log: the same numbers to
    the bit. (A fresh process: which cell was first is decided there.)"""
    result = subprocess.run([sys.executable, "-c", FREED_FIRST, ROOT, os.path.join(ROOT, "tests")], env=dict(
        os.environ, **own_compile_cache(cache_dir)), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == {"loaded": 1, "equal": True}  # (before: 0 loaded)
    assert result.stderr.count("loading it again from the compile cache") == 1


def test_a_wrong_guess_of_mindspores_graph_names_leaves_mindspore_to_decide_from_then_on(cache_dir, monkeypatch):
    """Where the phase MindSpore looks for is not the one predicted (another MindSpore), the call still computes the
    same numbers, and later calls go to MindSpore alone (not through the cache at every call)."""
    from orb import graph_cache
    from orb.inference.predictor import Predictor

    made = model()
    graphs = batches(made.cfg)[:1]
    predictor = Predictor(made, reuse=False)
    expected = predictor(graphs[0])
    monkeypatch.setattr(graph_cache, "_PREDICTING", [True])
    monkeypatch.setattr(graph_cache, "_phase", lambda cell, args: "not MindSpore's name" if graph_cache._PREDICTING[0]
                        else None)
    routed, compile_cell = [], graph_cache.compile_cell
    monkeypatch.setattr(graph_cache, "compile_cell", lambda *a, **k: routed.append(1) or compile_cell(*a, **k))
    for _ in range(3):
        assert_equal([predictor(graphs[0])], [expected])
    assert graph_cache._PREDICTING == [False] and len(routed) == 1


def test_a_call_to_a_compiled_graph_hands_its_phase_to_no_sub_cell(cache_dir):
    """MindSpore's ``Cell.compile`` hands the cell's phase to every sub-cell at every call (``benchmark.py
    cell-call``: 0.6-0.8 ms of each call of the demo model); a call whose graph is compiled compiles nothing and now
    hands nothing down. A compilation still finds its phase on every sub-cell, and every call computes what the first
    did. (No collection meanwhile: an earlier test's cell freed then would renumber MindSpore's graphs, and this
    cell's next call would compile again, rightly handing its phase down.)"""
    import gc

    from orb.inference.predictor import Predictor

    made = model()
    small, large = batches(made.cfg)
    predictor = Predictor(made, reuse=False)
    gc.collect()
    gc.disable()
    try:
        first = predictor(small)
        cell = predictor.cell
        subs = [sub for _, sub in cell.cells_and_names() if sub is not cell]
        assert len(subs) > 100 and all(sub.compile_phase == cell.compile_phase for sub in subs)
        compiled = cell.compile_phase
        for sub in subs:
            sub.__dict__["_compile_phase"] = "set before"
        assert_equal([predictor(small), predictor(small)], [first, first])
        assert cell.compile_phase == compiled and all(sub.compile_phase == "set before" for sub in subs)
        predictor(large)  # a new shape: compiled, its phase on every sub-cell
        assert cell.compile_phase != compiled and all(sub.compile_phase == cell.compile_phase for sub in subs)
        assert_equal([predictor(small)], [first])
    finally:
        gc.enable()


KILLED_WRITER = """
import os, signal, sys
sys.path.insert(0, {tests!r})
import numpy as np
from test_graph_cache import batches, model, predict

def killed(path, **arrays):
    with open(path, "wb") as f:
        f.write(b"PK" + bytes(1000))
    os.kill(os.getpid(), signal.SIGKILL)

np.savez = killed
import mindspore as ms
ms.set_context(mode=ms.GRAPH_MODE)
made = model()
predict(made, batches(made.cfg)[:1])
"""


def test_a_writer_killed_while_keeping_a_graph_leaves_nothing_loaded(cache_dir):
    env = dict(os.environ, PYTHONPATH=ROOT)
    child = subprocess.run([sys.executable, "-c", KILLED_WRITER.format(tests=os.path.join(ROOT, "tests"))], env=env,
                           capture_output=True, text=True, timeout=600)
    assert child.returncode == -signal.SIGKILL, child.stderr[-2000:]
    assert not [n for n in os.listdir(cache_dir / "graphs") if n.startswith("graphs-")]
    made = model()
    graphs = batches(made.cfg)[:1]
    out, sources = predict(made, graphs)
    assert sources == ["compiled"]
    assert_equal(out, uncached(model(), graphs))


DEMO_RUN = ["--train_data_path", MPTRJ_DB, "--val_data_path", MPTRJ_DB, "--checkpoint_path", "", "--max_epochs", "2",
            "--batch_size", "4", "--num_buckets", "2", "--device_target", "CPU", "--progress_bar", "false",
            "--data_workers", "0", "--deterministic", "true",
            *" ".join(f"--model.{k} {v}" for k, v in SMALL_MODEL.items()).split()]


def fine_tune(out, cache: str, *overrides) -> str:
    """finetune.py on the demo config with DEMO_RUN and ``overrides`` (ORB_COMPILE_CACHE=``cache``): its output."""
    result = subprocess.run([sys.executable, os.path.join(ROOT, "finetune.py"), "--config",
                             os.path.join(ROOT, "configs", "demo.yaml"), *DEMO_RUN, *overrides, "--output_dir",
                             str(out)], env=dict(os.environ, ORB_COMPILE_CACHE=cache), capture_output=True, text=True,
                            timeout=900)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return result.stdout


def from_cache(output: str) -> tuple:
    """(graphs loaded from the compile cache, graphs compiled) as the run's last line says them."""
    line = [ln for ln in output.splitlines() if "training finished" in ln][0]
    count = int(line.split(" compilations")[0].rsplit("(", 1)[1])
    return int(line.split(f" of {count} from the compile cache")[0].rsplit(" ", 1)[1]), count


def metrics(run_dir) -> list:
    """Every record of metrics.jsonl without its timings: what must equal, value by value."""
    timing = ("train_time", "val_time", "compile_time", "data_wait", "time")
    return [{part: {k: v for k, v in value.items() if k not in timing} if isinstance(value, dict) else value
             for part, value in json.loads(line).items() if part not in timing}
            for line in open(os.path.join(run_dir, "metrics.jsonl"))]


def test_a_second_start_loads_every_graph_and_trains_the_same_bits(cache_dir, tmp_path):
    """The user's case: the same fine-tuning started again (a second start, a requeue) loads its graphs from the
    cache, and its metrics equal those of a run that compiled everything afresh (ORB_COMPILE_CACHE=0). A run that
    changes only the schedule (lr, lr_schedule, warmup_fraction, max_epochs: a sweep, a longer run), or only what
    decides values (the seed, augmentation, the replay mix, selection and weight, the reference fit: a strategy
    comparison) loads them too and trains as its own fresh compilation: those are in parameters and inputs of the
    step, not in its graph."""
    runs = {name: fine_tune(tmp_path / name, cache) for name, cache in (("fresh", "0"), ("first", "1"), ("second", "1"))}
    loaded, count = from_cache(runs["second"])
    assert loaded == count and from_cache(runs["first"])[0] == 0
    assert metrics(tmp_path / "second") == metrics(tmp_path / "first") == metrics(tmp_path / "fresh")
    # with replay, in one bucket (the replay mix and selection decide the planned buckets' shapes: in the identity)
    start = ["--buckets", "[[256, 5120]]", "--replay.data_path", DEMO_VAL, "--replay.fraction", "0.25",
             "--replay.val_samples", "2", "--replay.selection", "random"]
    count = from_cache(fine_tune(tmp_path / "start", "1", *start))[1]
    sweep = [*start, "--lr", "3e-3", "--lr_schedule", "one_cycle", "--warmup_fraction", "0.3", "--max_epochs", "3",
             "--random_seed", "7", "--augmentation", "false", "--replay.fraction", "0.5", "--replay.val_samples", "3",
             "--replay.selection", "fps", "--replay.loss_weight", "2", "--replay.in_selection", "true",
             "--reference_energies.fit", "least_squares"]
    assert from_cache(fine_tune(tmp_path / "sweep", "1", *sweep)) == (count, count)
    fine_tune(tmp_path / "sweep_fresh", "0", *sweep)
    assert metrics(tmp_path / "sweep") == metrics(tmp_path / "sweep_fresh")
    assert metrics(tmp_path / "sweep")[1]["loss"] != metrics(tmp_path / "start")[1]["loss"]  # (other settings)


def test_only_settings_that_decide_values_inputs_or_shapes_leave_a_graphs_key():
    """Each key of VALUES_ONLY, changed, leaves the graph settings as they were (the sweep above shows such a run
    computes as its own fresh compilation); a setting that decides the graph (a loss weight, separate replay heads,
    the normalisers' updates, the clipping) changes them."""
    from orb.training.config import config_from_dict
    from orb.training.distributed import DataParallel
    from orb.training.engine import VALUES_ONLY, graph_settings

    base = dict(train_data_path=MPTRJ_DB, checkpoint_path="start.ckpt",
                replay=dict(data_path=DEMO_VAL, fraction=0.25, val_samples=2))
    changed = {"random_seed": 7, "augmentation": False, "num_buckets": 3, "buckets": [[64, 1280]],
               "reference_energies.fit": "least_squares", "reference_energies.table": "matpes-pbe",
               "replay.fraction": 0.5, "replay.num_samples": 5, "replay.selection": "random",
               "replay.val_samples": 4, "replay.labels": "model", "replay.loss_weight": 2.0,
               "replay.in_selection": True}
    assert set(changed) == set(VALUES_ONLY)

    def settings(key=None, value=None):
        values = json.loads(json.dumps(base))
        if key:
            section, _, name = key.rpartition(".")
            (values.setdefault(section, {}) if section else values)[name] = value
        return graph_settings(config_from_dict(values), DataParallel())

    reference = settings()
    for key, value in changed.items():
        assert settings(key, value) == reference, key
    for key, value in (("loss_weights.energy", 2.0), ("replay.head", "separate"), ("online_normalisation", False),
                       ("gradient_clip_val", 1.0)):
        assert settings(key, value) != reference, key


def test_a_graph_for_every_size_is_traced_so_in_its_own_thread_only():
    """While a calculator's call traces its graph for every size (dynamic_shapes), a training step compiled in
    another thread was traced in that form too (the setting was the process's): a conservative orb-v3 model's
    gradient of the summed energy, which cuts the energy and confidence losses' gradients. It is per thread now."""
    import threading

    from orb.precision import dynamic_shapes, traced_for_every_size

    inside, seen = threading.Event(), {}
    leave = threading.Event()

    def calculator_call():
        with dynamic_shapes():
            seen["calculator"] = traced_for_every_size()
            inside.set()
            leave.wait(timeout=60)

    thread = threading.Thread(target=calculator_call)
    thread.start()
    assert inside.wait(timeout=60)
    seen["training"] = traced_for_every_size()  # this thread, meanwhile
    leave.set()
    thread.join()
    assert seen == {"calculator": True, "training": False} and not traced_for_every_size()


def test_an_unknown_orb_compile_cache_value_is_refused_as_orb_ops_profiles_is(monkeypatch):
    """``ORB_COMPILE_CACHE=maybe`` was read as on, where ``ORB_OPS_PROFILE=bogus`` is refused: now refused too, at
    every command's start (configure_mindspore) and where it is read (the first compilation)."""
    import re

    from orb.device import compile_cache_on, configure_mindspore
    from orb.errors import ConfigError
    from orb.graph_cache import GraphCache

    for value, on in (("", True), ("1", True), ("Yes", True), (" off ", False), ("0", False)):
        monkeypatch.setenv("ORB_COMPILE_CACHE", value)
        assert compile_cache_on() is on
    monkeypatch.setenv("ORB_COMPILE_CACHE", "maybe")
    said = ("ORB_COMPILE_CACHE must be one of 1, true, on, yes (keep compiled graphs) or 0, false, off, no (compile "
            "afresh), got 'maybe'")
    for call in (lambda: configure_mindspore("CPU"), GraphCache().usable):
        with pytest.raises(ConfigError, match=re.escape(said)):
            call()
