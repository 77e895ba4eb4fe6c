"""Using a fine-tuned model: the ASE calculator, evaluation, export, training-curve plots."""

import csv
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from ase.build import bulk

from conftest import DATA, DEMO_VAL, MPTRJ_DB, ROOT, noting_mindspore, own_compile_cache, reference_graph

DEMO_PRETRAINED = os.path.join(ROOT, "data", "demo_pretrained.ckpt")


@pytest.fixture(scope="module")
def reference_model(reference, tmp_path_factory):
    """orb-v2 with the recipe weights, saved as a MindSpore checkpoint (as a user would have it)."""
    import mindspore as ms

    from orb.io.checkpoint import load_torch_state_dict, save_checkpoint
    from orb.models.orb_v2 import orb_v2
    from orb.models.recipe import model_recipe_weights

    ms.set_context(mode=ms.GRAPH_MODE)
    model = orb_v2()
    load_torch_state_dict(model, model_recipe_weights(model, 0))
    model.set_train(False)
    path = str(tmp_path_factory.mktemp("ckpt") / "orb_v2_recipe.ckpt")
    save_checkpoint(path, model, {})
    return model, path


def atoms_of(z, i):
    from ase import Atoms

    p = f"s{i}/"
    cell = z[p + "cell_input"]
    return Atoms(numbers=z[p + "numbers"], positions=z[p + "positions_input"], cell=cell, pbc=bool(np.any(cell != 0)))


def test_calculator_matches_predict_and_pytorch(reference_model, reference):
    from orb.inference.calculator import ORBCalculator
    from orb.inference.predictor import Predictor

    from ase.calculators.calculator import PropertyNotImplementedError

    model, path = reference_model
    calc = ORBCalculator.from_checkpoint(path)
    for i in (0, 1, 7):  # periodic alloy, non-periodic cluster, large oxide
        atoms = atoms_of(reference, i)
        atoms.calc = calc
        energy, forces = atoms.get_potential_energy(), atoms.get_forces()
        direct = Predictor(model)(reference_graph(reference, i))
        assert energy == pytest.approx(float(direct["energy"][0]), abs=1e-4)
        np.testing.assert_allclose(forces, direct["forces"], atol=2e-5)
        # tie-free structures: the same graph as PyTorch, hence its predictions
        np.testing.assert_allclose(energy, reference[f"s{i}/energy"][0], atol=1e-4, rtol=1e-6)
        np.testing.assert_allclose(forces, reference[f"s{i}/forces"], atol=2e-5)
        assert atoms.get_potential_energy(force_consistent=True) == energy
        if not atoms.cell.any():  # a molecule has no stress (ASE's rule, orb-relax's and orb-md's): orb-v2's head
            with pytest.raises(PropertyNotImplementedError):  # output for it is no prediction
                atoms.get_stress()
            continue
        stress = atoms.get_stress()
        np.testing.assert_allclose(stress, direct["stress"][0], atol=1e-5)
        np.testing.assert_allclose(stress, reference[f"s{i}/stress"][0], atol=1e-5)


def test_relaxation_and_md_with_finetuned_checkpoint():
    """Direct-force model: check behaviour. BFGS lowers the predicted energy; NVE stays finite."""
    from ase.md.velocitydistribution import MaxwellBoltzmannDistribution
    from ase.md.verlet import VelocityVerlet
    from ase.optimize import BFGS
    from ase import units

    from orb.inference.calculator import ORBCalculator

    calc = ORBCalculator.from_checkpoint(DEMO_PRETRAINED)
    atoms = bulk("Cu", "fcc", a=3.6).repeat((2, 2, 2))
    atoms.rattle(0.15, seed=2)
    atoms.calc = calc
    start = atoms.get_potential_energy()
    BFGS(atoms, logfile=None).run(fmax=0.01, steps=20)
    assert atoms.get_potential_energy() < start - 0.05
    md = bulk("Ni", "fcc", a=3.52).repeat((2, 2, 4))
    md.calc = calc
    MaxwellBoltzmannDistribution(md, temperature_K=300, rng=np.random.default_rng(0))
    energies = []
    dyn = VelocityVerlet(md, timestep=1.0 * units.fs)
    dyn.attach(lambda: energies.append(md.get_total_energy()), interval=5)
    dyn.run(50)
    assert len(energies) == 11 and np.all(np.isfinite(energies))
    from orb.inference.predictor import EVERY_SIZE

    assert list(calc.predictor.compiled) == [EVERY_SIZE]  # one graph for both systems (8 and 16 atoms), every step


def run_evaluate(path, data, out, *extra):
    return subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "evaluate.py"), "--checkpoint", path,
                           "--data", data, "--output_dir", str(out), *extra], capture_output=True, text=True,
                          timeout=600)


def test_evaluate_script_on_mptrj(reference_model, tmp_path):
    _, path = reference_model
    out = tmp_path / "eval"
    result = run_evaluate(path, MPTRJ_DB, out, "--batch_size", "4")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = list(csv.DictReader(open(out / "predictions.csv")))
    summary = json.load(open(out / "summary.json"))
    assert len(rows) == 10 == summary["structures"] == summary["labelled"]
    by_hand = np.mean([abs(float(r["energy_pred"]) - float(r["energy_true"])) / int(r["natoms"]) for r in rows])
    assert summary["energy_per_atom_mae"] == pytest.approx(by_hand, rel=1e-9)
    assert summary["forces_mae"] == pytest.approx(np.mean([float(r["forces_mae"]) for r in rows]), rel=1e-9)
    assert "energy_per_atom_mae" in result.stdout and "eV/atom" in result.stdout
    # row 1 and 3 are reference structures 4 and 5: the evaluation sees PyTorch's predictions
    ref = np.load(os.path.join(DATA, "orb_v2_parity.npz"))
    assert float(rows[0]["energy_pred"]) == pytest.approx(float(ref["s4/energy"][0]), abs=1e-4)


@pytest.mark.parametrize("args, message", [(["--batch_size", "0"], "--batch_size must be at least 1, got 0"),
                                           (["--dispersion", "d3bj", "--xc", "nope"], "unknown xc 'nope'")])
def test_a_wrong_evaluation_option_is_one_line_before_mindspores_import(tmp_path, args, message):
    """Its options are checked before MindSpore's 1 s import; nothing is written."""
    result = subprocess.run(noting_mindspore([sys.executable, "scripts/evaluate.py", "--checkpoint",
                                              "data/demo_pretrained.ckpt", "--data", DEMO_VAL, "--output_dir",
                                              str(tmp_path / "eval"), *args]), cwd=ROOT, capture_output=True,
                            text=True, timeout=300)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and message in lines[0], result.stderr[-2000:]
    assert result.stdout.split() == ["False"] and os.listdir(tmp_path) == []


def test_evaluate_without_labels_and_with_some(reference_model, tmp_path):
    import ase.db
    from ase.calculators.singlepoint import SinglePointCalculator

    _, path = reference_model
    db_path = str(tmp_path / "mixed.db")
    with ase.db.connect(db_path) as db:
        db.write(bulk("Cu", "fcc", a=3.6))
    result = run_evaluate(path, db_path, tmp_path / "eval")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "note: no structure has energy and forces labels" in result.stderr  # (it said "labelled 0" alone)
    rows = list(csv.DictReader(open(tmp_path / "eval" / "predictions.csv")))
    assert list(rows[0]) == ["row_id", "formula", "natoms", "energy_pred"]
    with ase.db.connect(db_path) as db:  # now one labelled row beside the unlabelled one
        atoms = bulk("Cu", "fcc", a=3.7)
        atoms.calc = SinglePointCalculator(atoms, energy=-3.5, forces=np.zeros((1, 3)))
        db.write(atoms)
    result = run_evaluate(path, db_path, tmp_path / "eval2")
    assert result.returncode == 0 and "note:" not in result.stderr, result.stderr[-3000:]
    summary = json.load(open(tmp_path / "eval2" / "summary.json"))
    assert summary["structures"] == 2 and summary["labelled"] == 1 and "energy_mae" in summary
    assert "stress_mae" not in summary and summary["forces_mae_by_element"].keys() == {"Cu"}
    with ase.db.connect(db_path) as db:  # and a row with stress: stress is evaluated over the rows that have it
        atoms = bulk("Cu", "fcc", a=3.65)
        atoms.calc = SinglePointCalculator(atoms, energy=-3.6, forces=np.zeros((1, 3)), stress=np.full(6, 0.01))
        db.write(atoms)
    result = run_evaluate(path, db_path, tmp_path / "eval3")
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.load(open(tmp_path / "eval3" / "summary.json"))
    rows = list(csv.DictReader(open(tmp_path / "eval3" / "predictions.csv")))
    assert summary["structures"] == 3 and summary["labelled"] == 2
    assert summary["stress_mae"] == pytest.approx(float(rows[2]["stress_mae"])) and rows[1]["stress_mae"] == ""
    with ase.db.connect(db_path) as db:  # and forces and stress without an energy: scored, the energy not
        atoms = bulk("Cu", "fcc", a=3.55)
        atoms.calc = SinglePointCalculator(atoms, forces=np.full((1, 3), 0.1), stress=np.full(6, -0.01))
        db.write(atoms)
    result = run_evaluate(path, db_path, tmp_path / "eval4")
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.load(open(tmp_path / "eval4" / "summary.json"))
    rows = list(csv.DictReader(open(tmp_path / "eval4" / "predictions.csv")))
    assert summary["labelled"] == 3 and rows[3]["energy_true"] == "" and rows[3]["forces_mae"] != ""
    for key, scored in (("energy_abs_error", [1, 2]), ("forces_mae", [1, 2, 3]), ("stress_mae", [2, 3])):
        mean = np.mean([float(rows[k][key]) for k in scored])
        assert summary[key.replace("_abs_error", "_mae")] == pytest.approx(mean, rel=1e-12), key


def test_plot_metrics(tmp_path):
    from orb.reports.curves import plot, read_epochs

    metrics = os.path.join(DATA, "demo_metrics.jsonl")
    epochs = read_epochs(metrics)
    fig = plot([("demo", epochs)], str(tmp_path / "direct.png"))
    forces = [ax for ax in fig.axes if ax.get_title().startswith("force MAE")][0]
    val = [line for line in forces.lines if line.get_label() == "val"][0]
    np.testing.assert_array_equal(val.get_xdata(), [r["epoch"] for r in epochs])  # epoch 0: before fine-tuning
    np.testing.assert_allclose(val.get_ydata(), [r["val"]["forces_mae"] for r in epochs])
    # drawn on a figure of its own: the backend a script or notebook chose, and pyplot, are left as they were
    script = ("import sys, matplotlib\nmatplotlib.use('svg')\nfrom orb.reports.curves import plot, read_epochs\n"
              "plot([('demo', read_epochs(sys.argv[1]))], sys.argv[2])\n"
              "print(matplotlib.get_backend(), 'matplotlib.pyplot' in sys.modules)\n")
    own = subprocess.run([sys.executable, "-c", script, metrics, str(tmp_path / "own.png")], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert own.stdout.split() == ["svg", "False"], own.stdout + own.stderr[-2000:]
    assert (tmp_path / "own.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = tmp_path / "curves.png"
    result = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "plot_metrics.py"), metrics, metrics,
                             "--labels", "a", "b", "-o", str(out)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bad = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "plot_metrics.py"), os.path.join(DATA, "x.jsonl")],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.startswith("error:") and "Traceback" not in bad.stderr
    # each was a traceback: a binary file, a line that is no record, an image format matplotlib lacks, a folder
    (tmp_path / "list.jsonl").write_text('{"type": "initial", "epoch": 0}\n[1, 2]\n')
    for args, message in (([DEMO_VAL], "cannot read metrics"),
                          ([str(tmp_path / "list.jsonl")], "list.jsonl, line 2: not a metrics record"),
                          ([metrics, "-o", str(tmp_path / "c.xyz")], "matplotlib writes no .xyz images"),
                          ([metrics, "-o", str(tmp_path)], "is a folder; name an image file")):
        bad = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "plot_metrics.py"), *args],
                             capture_output=True, text=True, timeout=120)
        lines = bad.stderr.strip().splitlines()
        assert bad.returncode == 2 and len(lines) == 1 and message in lines[0], bad.stderr[-2000:]


def test_plot_skips_a_line_a_kill_cut_short_and_says_it_once(tmp_path, capsys):
    """A metrics.jsonl with one cut line (a kill, or a full disk: then ended with a newline so that readers skip it)
    was refused whole ("cannot read metrics (Expecting ...)"); a resume reads it without that line."""
    from orb.files import read_records
    from orb.reports.curves import read_epochs

    with open(os.path.join(DATA, "demo_metrics.jsonl")) as f:
        lines = f.readlines()[:5]
    cut = tmp_path / "metrics.jsonl"
    cut.write_text("".join(lines[:2]) + lines[2][:-30] + "\n" + lines[3] + lines[4][:-30])
    assert [r["epoch"] for r in read_epochs(str(cut))] == [0]  # (lines 3 and 5: the epochs' records, cut)
    assert capsys.readouterr().err == f"note: {cut}: lines 3, 5 not complete JSON (cut short?): skipped\n"
    assert [r["type"] for r in read_records(str(cut))] == ["initial", "step", "step"]  # (the same reader)


def test_calculator_buckets_fit_a_repeated_size_closely():
    """An MD run repeats one size: its bucket holds it closely (on orb-md's grid of shapes, here 8 padding nodes;
    padding is work at every step), and is orb-md's shape of it (one compiled graph for both tools); the same atoms
    with more edges take orb-md's next shape, no more atoms; a larger structure gets headroom (a k-NN-saturated
    structure, every atom at max_neighbors: exactly its edges)."""
    from orb.data.graphs import atoms_to_graph
    from orb.inference.predictor import Predictor
    from orb.models import create

    predictor = Predictor(create("orb_v2", latent_dim=32, mlp_hidden_dim=64, num_message_passing_steps=2))
    crystal = atoms_to_graph(bulk("Cu", "fcc", a=3.6, cubic=True).repeat((2, 2, 4)))  # 64 atoms, 20 neighbours each
    assert crystal.num_edges == 64 * 20
    first = predictor.bucket_for(crystal)
    assert (first.num_nodes, first.num_edges, first.num_graphs) == (72, 1280, 2)
    assert predictor.bucket_for(crystal) is first
    bigger = atoms_to_graph(bulk("Cu", "fcc", a=3.6, cubic=True).repeat((2, 4, 4)))  # 128 atoms
    grown = predictor.bucket_for(bigger)
    assert grown.num_nodes == 168 and grown.num_edges == int(1.25 * 128 * 20)  # 1.25 x (129 rounded up)
    assert first == Predictor(predictor.model, reuse=False).shape_of(crystal)
    sparse = atoms_to_graph(bulk("Cu", "fcc", a=3.6, cubic=True), radius=3.0)  # 4 atoms x 12 neighbours within 3 Å
    sparse_predictor = Predictor(predictor.model)
    assert sparse_predictor.bucket_for(sparse).num_edges == 48  # orb-md's shape: 48 is on its grid
    squeezed = atoms_to_graph(bulk("Cu", "fcc", a=3.6, cubic=True), radius=3.7)  # the same 4 atoms, 6 more neighbours
    assert squeezed.num_edges > 48
    assert sparse_predictor.bucket_for(squeezed) == Predictor(predictor.model, reuse=False).shape_of(squeezed)
    assert sparse_predictor.bucket_for(squeezed).num_nodes == 8
    larger = atoms_to_graph(bulk("Cu", "fcc", a=3.6, cubic=True).repeat((1, 1, 2)), radius=3.0)
    assert sparse_predictor.bucket_for(larger).num_edges == 120  # grown: 96 edges x 1.25


@pytest.mark.parametrize("name,profile", [("orb_v2", "cpu"), ("orb_v3_direct_20_omat", "cpu"), ("orb_v2", "portable"),
                                          ("orb_v3_conservative_20_omat", "cpu")])
def test_the_calculator_compiles_one_graph_for_structures_of_every_size(name, profile, monkeypatch):
    """On the CPU the calculator (and orb-relax, orb-evaluate) compiles one prediction graph for structures of every
    size, each padded to orb-md's shape of it: the same bits as orb-md's graph of that shape, whatever came before
    (a conservative orb-v3's forces and stress too, as the gradient of the summed energy there). A shape met more
    than OWN_GRAPH_AFTER times gets that graph of its own, with the same bits; beyond OWN_GRAPHS_AT_MOST shapes, the
    graph of the one used longest ago is let go (its cell freed) and that shape earns its own again by its calls."""
    import gc
    import weakref

    from ase.build import molecule

    from orb.data.batching import batch_graphs
    from orb.data.graphs import atoms_to_graph
    from orb.device import set_ops_profile
    from orb.inference import predictor as predictors
    from orb.models import create

    monkeypatch.setattr(predictors, "OWN_GRAPH_AFTER", 2)
    monkeypatch.setattr(predictors, "OWN_GRAPHS_AT_MOST", 2)
    set_ops_profile(profile)
    try:
        model = create(name, latent_dim=32, mlp_hidden_dim=64, num_message_passing_steps=2, head_mlp_hidden_dim=32,
                       seed=4)
        calculator = predictors.Predictor(model)
        batches = []
        for repeat in ((1, 1, 1), (2, 2, 2), (2, 1, 1)):
            atoms = bulk("Cu", "fcc", a=3.6, cubic=True).repeat(repeat)
            atoms.rattle(0.05, seed=sum(repeat))
            structures = [atoms, molecule("CH4")] if repeat == (2, 1, 1) else [atoms]
            batches.append(batch_graphs([atoms_to_graph(a, settings=model.cfg.graph_settings()) for a in structures]))
        md = predictors.Predictor(model, reuse=False)  # orb-md's: each batch in its own shape, whatever came before
        def same_as_md(batch, note):
            got, expected = calculator(batch), md(batch)
            for key in expected:
                np.testing.assert_array_equal(got[key], expected[key], err_msg=f"{key}, {note}")

        for calls in (1, 2, 3):  # the third call of a shape runs its own graph
            for batch in batches:
                same_as_md(batch, f"call {calls}")
            assert predictors.EVERY_SIZE in calculator.compiled
            assert len(calculator.own_graphs) == (2 if calls == 3 else 0), (calls, calculator.own_graphs)
        shapes = [calculator.shape_of(batch) for batch in batches]
        assert list(calculator.own_graphs) == shapes[1:]  # the third's own graph took the first's place
        assert calculator.calls[shapes[0]] == 0
        freed = weakref.ref(calculator.own_graphs[shapes[1]])
        same_as_md(batches[2], "the newest own graph again")
        for calls in (1, 2, 3):  # the first shape earns its own graph again; the second's, used longest ago, goes
            same_as_md(batches[0], f"the first shape again, call {calls}")
            assert list(calculator.own_graphs) == (shapes[1:] if calls < 3 else [shapes[2], shapes[0]]), calls
        gc.collect()
        assert freed() is None  # the cell and with it its graph: memory bounded by OWN_GRAPHS_AT_MOST
        assert len(calculator.any_size_cell.compile_cache) == 1  # one graph: MindSpore compiled no size again
    finally:
        set_ops_profile("auto")


def test_a_graph_for_every_size_that_fails_is_said_once_and_the_calculator_goes_on_with_a_graph_per_shape(
        monkeypatch, caplog):
    """A model or setting on which MindSpore refused the graph for every size failed every calculator call (each
    building and compiling it again), where a graph per shape works: now the first failure is one warning, and
    every call, the first included, computes what a calculator with a graph per shape does."""
    import logging

    from orb.data.graphs import atoms_to_graph
    from orb.inference import predictor as predictors
    from orb.models import create

    model = create("orb_v2", latent_dim=32, mlp_hidden_dim=64, num_message_passing_steps=2, seed=6)
    tries = []

    def refused(inputs):
        tries.append(len(inputs))
        raise RuntimeError("The shape of sense must not be dynamic shape.\n(MindSpore's C++ trace)")

    per_shape = predictors.Predictor(model)
    per_shape.every_size = False  # (as on a device without the graph for every size)
    monkeypatch.setattr(predictors, "any_size", refused)
    calculator = predictors.Predictor(model)
    assert calculator.every_size
    with caplog.at_level(logging.WARNING, logger="orb"):
        for repeat in ((1, 1, 1), (2, 1, 1), (1, 1, 1)):
            graph = atoms_to_graph(bulk("Cu", "fcc", a=3.6, cubic=True).repeat(repeat),
                                   settings=model.cfg.graph_settings())
            got, expected = calculator(graph), per_shape(graph)
            for key in expected:
                np.testing.assert_array_equal(got[key], expected[key], err_msg=f"{key}, {repeat}")
    warnings = [r.getMessage() for r in caplog.records if "every size failed" in r.getMessage()]
    assert len(tries) == 1 and len(warnings) == 1 and "RuntimeError: The shape of sense" in warnings[0], warnings
    assert predictors.EVERY_SIZE not in calculator.compiled and not calculator.every_size


def test_without_reuse_a_batch_computes_the_same_bits_whatever_came_before():
    """A resumed orb-md run differed from the uninterrupted one in the last bits (kinetic energy 0.5711938863 vs
    ...867): the padded shape, hence the float32 products' blocking, came from the batches this process had seen
    before. Without reuse (orb-md, the calculator) a batch's shape is its own."""
    from orb.data.batching import batch_graphs
    from orb.data.graphs import atoms_to_graph
    from orb.inference.predictor import Predictor
    from orb.models import create

    model = create("orb_v2", latent_dim=32, mlp_hidden_dim=64, num_message_passing_steps=2, seed=3)
    small = atoms_to_graph(bulk("Cu", "fcc", a=3.6, cubic=True).repeat((2, 2, 2)))
    large = batch_graphs([atoms_to_graph(bulk("Cu", "fcc", a=3.6, cubic=True).repeat((2, 2, 4)))] * 3)
    seen_large = Predictor(model, reuse=False)
    seen_large(large)
    after, fresh = seen_large(small), Predictor(model, reuse=False)(small)
    for key in after:
        np.testing.assert_array_equal(after[key], fresh[key], err_msg=key)
    bucket = Predictor(model, reuse=False).shape_of(small)
    assert (bucket.num_nodes, bucket.num_edges, bucket.num_graphs) == (40, 640, 2)  # saturated: its edges exactly
    rattled = bulk("Cu", "fcc", a=3.6, cubic=True).repeat((2, 2, 2))
    rattled.rattle(0.3, seed=1)
    sparse = atoms_to_graph(rattled, radius=3.0)
    shape = Predictor(model, reuse=False).shape_of(sparse)
    assert sparse.num_edges <= shape.num_edges <= 1.1 * sparse.num_edges + 8


PYNATIVE_CALCULATOR = """
import sys
import numpy as np
import mindspore as ms
sys.path.insert(0, "tests")
from test_use import atoms_of
from orb.inference.calculator import ORBCalculator
from orb.io.checkpoint import load_torch_state_dict
from orb.models.orb_v2 import orb_v2
from orb.models.recipe import model_recipe_weights

ms.set_context(mode=ms.PYNATIVE_MODE)  # a script that never set graph mode
reference = np.load("tests/data/orb_v2_parity.npz")
model = orb_v2()
load_torch_state_dict(model, model_recipe_weights(model, int(reference["meta/seed"])))
model.set_train(False)
atoms = atoms_of(reference, 0)
atoms.calc = ORBCalculator(model)
energy, forces = atoms.get_potential_energy(), atoms.get_forces()
assert ms.get_context("mode") == ms.PYNATIVE_MODE  # the caller's mode is left alone
np.testing.assert_allclose(energy, reference["s0/energy"][0], atol=1e-4, rtol=1e-6)
np.testing.assert_allclose(forces, reference["s0/forces"], atol=2e-5)
print("OK", *atoms.calc.predictor.sources.values())
"""


def test_calculator_from_a_model_object_in_pynative_mode(tmp_path):
    """ORBCalculator(model) in a script left in PyNative mode runs the compiled forward and PyTorch's numbers, with
    the graph from the compile cache in a second process."""
    for expected in ("compiled", "cache"):
        result = subprocess.run([sys.executable, "-c", PYNATIVE_CALCULATOR], cwd=ROOT, capture_output=True, text=True,
                                timeout=600, env=dict(os.environ, **own_compile_cache(tmp_path)))
        assert result.returncode == 0 and result.stdout.strip() == f"OK {expected}", result.stderr[-3000:]


def test_evaluate_report_compares_two_checkpoints(reference_model, tmp_path):
    """--compare: both checkpoints' metrics side by side (the second's equal to evaluating it alone), parity plots,
    and errors by element whose force MAE is the summary's and whose energy MAE is that of the structures
    containing the element."""
    from ase.formula import Formula

    _, path = reference_model
    demo = os.path.join(ROOT, "data", "demo_val.db")
    result = run_evaluate(path, demo, tmp_path / "both", "--compare", DEMO_PRETRAINED)
    assert result.returncode == 0, result.stderr[-3000:]
    alone = run_evaluate(DEMO_PRETRAINED, demo, tmp_path / "alone")
    assert alone.returncode == 0, alone.stderr[-3000:]
    both, single = json.load(open(tmp_path / "both" / "summary.json")), json.load(open(tmp_path / "alone" / "summary.json"))
    for key in ("energy_mae", "forces_mae", "stress_mae"):
        assert both["compare"][key] == pytest.approx(single[key], rel=1e-9)
        assert both[key] != pytest.approx(single[key], rel=1e-3)  # the first column is the other checkpoint
    for name in ("parity_energy_per_atom.png", "parity_forces.png", "parity_stress.png"):
        assert (tmp_path / "both" / name).stat().st_size > 10_000
    table = list(csv.DictReader(open(tmp_path / "alone" / "errors_by_element.csv")))
    rows = list(csv.DictReader(open(tmp_path / "alone" / "predictions.csv")))
    column = "demo_pretrained.ckpt"
    for line in table:
        element = line["element"]
        assert float(line[f"{column}_forces_mae"]) == pytest.approx(single["forces_mae_by_element"][element], rel=1e-9)
        containing = [float(r["energy_per_atom_abs_error"]) for r in rows if element in Formula(r["formula"]).count()]
        assert int(line[f"{column}_structures"]) == len(containing)
        assert float(line[f"{column}_energy_per_atom_mae"]) == pytest.approx(np.mean(containing), rel=1e-9)
    assert "errors by element" in alone.stdout
    assert "forces_mae_by_element" not in alone.stdout  # (its force MAE was printed twice, in two tables)
    assert sum(line.split()[:1] == [table[0]["element"]] for line in alone.stdout.splitlines()) == 1


def test_checkpoint_names_alike_in_their_first_characters_get_headings_of_their_own(capsys):
    """The evaluation's tables cut a checkpoint's name to its column: a fine-tuned file and its starting model's
    (``orb_v3_conservative_inf_omat.ckpt`` and ``orb_v3_conservative_inf_omat_finetuned.ckpt``) were both headed
    ``orb_v3_conservative_in``. Names too long get A, B headings, each named in full above the table."""
    from orb.inference.evaluate import print_comparison
    from orb.reports.evaluation import print_element_table

    names = ["orb_v3_conservative_inf_omat.ckpt", "orb_v3_conservative_inf_omat_finetuned.ckpt"]
    row = {"element": "Cu", "atoms": 4, "forces_mae": 0.1, "structures": 1, "energy_per_atom_mae": 0.01}
    print_element_table({name: [dict(row)] for name in names})
    print_comparison({"energy_mae": 1.0}, {"energy_mae": 2.0}, names)
    lines = capsys.readouterr().out.splitlines()
    assert lines.count(f"A: {names[0]}") == 2 and lines.count(f"B: {names[1]}") == 2
    header = next(line for line in lines if line.startswith("element"))
    assert header.split() == ["element", "A", "F-MAE", "E/atom", "MAE", "B", "F-MAE", "E/atom", "MAE"]
    assert next(line for line in lines if line.startswith("metric")).split() == ["metric", "A", "B", "unit"]
    print_element_table({"demo.ckpt": [dict(row)], "other.ckpt": [dict(row)]})  # short names head their columns
    out = capsys.readouterr().out
    assert "demo.ckpt F-MAE" in out and "A:" not in out


def test_d3_dispersion_equals_dftd3s_own_calculator_added(reference_model, reference, monkeypatch, tmp_path):
    """``dispersion="d3bj"`` adds exactly what dftd3's own ASE calculator gives (same parameters), to 1e-8 eV, in
    energy, forces and (periodic) stress, at every MD-like update of the same structure; bad names and a missing
    extra are one-line errors listing the valid values."""
    from ase.calculators.mixing import SumCalculator
    from ase.db import connect
    from dftd3.ase import DFTD3

    from orb.errors import OrbInputError
    from orb.inference import dispersion
    from orb.inference.calculator import ORBCalculator

    model, path = reference_model
    ours = ORBCalculator(model, dispersion="d3bj", xc="PBE")
    theirs = SumCalculator([ORBCalculator(model), DFTD3(method="PBE", damping="d3bj")])
    rng = np.random.default_rng(0)
    for i in (0, 1, 7):  # periodic alloy, non-periodic cluster, large oxide
        atoms = atoms_of(reference, i)
        for _ in range(2):  # the dispersion model of a size is updated in place
            atoms.positions += rng.normal(0, 0.01, atoms.positions.shape)
            a, b = atoms.copy(), atoms.copy()
            a.calc, b.calc = ours, theirs
            assert a.get_potential_energy() == pytest.approx(b.get_potential_energy(), abs=1e-8)
            np.testing.assert_allclose(a.get_forces(), b.get_forces(), rtol=0, atol=1e-8)
            if atoms.pbc.any():
                np.testing.assert_allclose(a.get_stress(), b.get_stress(), rtol=0, atol=1e-8)
    plain = atoms_of(reference, 0)
    plain.calc = ORBCalculator(model)
    assert abs(plain.get_potential_energy() - a.get_potential_energy()) > 1e-3  # D3 is not nothing
    with pytest.raises(OrbInputError, match="unknown dispersion 'd4'; valid: d3bj, d3zero"):
        ORBCalculator.from_checkpoint(path, dispersion="d4")
    with pytest.raises(OrbInputError, match="unknown xc 'pbe99'; valid: .*pbe0"):
        ORBCalculator(model, dispersion="d3bj", xc="pbe99")
    out = tmp_path / "d3"
    result = run_evaluate(path, MPTRJ_DB, out, "--dispersion", "d3bj", "--xc", "pbe")
    assert result.returncode == 0, result.stderr[-3000:]
    plain = run_evaluate(path, MPTRJ_DB, tmp_path / "plain")
    assert plain.returncode == 0, plain.stderr[-3000:]
    with_d3, without = (list(csv.DictReader(open(d / "predictions.csv"))) for d in (out, tmp_path / "plain"))
    for k, row in enumerate(connect(MPTRJ_DB).select()):
        atoms = row.toatoms()
        atoms.calc = DFTD3(method="PBE", damping="d3bj")
        assert float(with_d3[k]["energy_pred"]) - float(without[k]["energy_pred"]) == pytest.approx(
            atoms.get_potential_energy(), abs=2e-5)  # float32 model energies of ~100 eV
    result = run_evaluate(path, MPTRJ_DB, tmp_path / "bad", "--dispersion", "d3bj", "--xc", "pbe99")
    assert result.returncode == 2 and result.stderr.strip().splitlines()[-1].startswith("error: dispersion d3bj: "
                                                                                        "unknown xc 'pbe99'")
    monkeypatch.setitem(sys.modules, "dftd3.interface", None)
    dispersion.functionals.cache_clear()
    with pytest.raises(OrbInputError, match=r"pip install '\.\[d3\]'"):
        ORBCalculator(model, dispersion="d3bj")
    dispersion.functionals.cache_clear()


def test_the_calculator_recomputes_for_a_new_charge_and_refuses_what_its_model_cannot_compute():
    """ASE compares positions, numbers, cell and pbc, not atoms.info: an OMol model gave the previous charge's energy
    for a new charge on the same geometry. A model without a stress head returned zero stress (an NPT run took it for
    zero pressure); an element beyond the model's table was a C++ stack from MindSpore's Gather; a batch in which one
    structure had no charge was computed with charge 0 for all; a pathlib.Path checkpoint was refused."""
    import pathlib

    from ase.build import molecule
    from ase.calculators.calculator import PropertyNotImplementedError

    from orb.data.batching import batch_graphs
    from orb.data.graphs import atoms_to_graph
    from orb.errors import StructureError
    from orb.inference.calculator import ORBCalculator
    from orb.inference.predictor import Predictor
    from orb.models import create

    small = dict(latent_dim=16, mlp_hidden_dim=32, num_message_passing_steps=1, head_mlp_hidden_dim=16)
    omol = create("orb_v3_direct_omol", seed=3, **small)
    water = molecule("H2O")
    water.info.update(charge=0, spin=1)
    water.calc = ORBCalculator(omol)
    neutral = water.get_potential_energy()
    water.info.update(charge=1, spin=2)
    charged = water.get_potential_energy()
    water.calc.reset()
    assert charged == water.get_potential_energy() and abs(charged - neutral) > 1e-3
    for value, message in (("abc", "must be a number, got 'abc'"), (float("nan"), "must be finite")):
        water.info["charge"] = value
        with pytest.raises(StructureError, match=f"^atoms.info\\['charge'\\] {message}"):
            water.get_potential_energy()
    crystal = bulk("Cu", "fcc", a=3.6, cubic=True)
    crystal.info.update(charge=0, spin=1)
    crystal.calc = ORBCalculator(omol)
    assert np.isfinite(crystal.get_potential_energy())
    with pytest.raises(PropertyNotImplementedError):
        crystal.get_stress()
    methane = molecule("CH4")
    water.info["charge"] = 1
    graphs = [atoms_to_graph(a, settings=omol.cfg.graph_settings()) for a in (water, methane)]
    with pytest.raises(StructureError, match="needs every structure's total charge and spin"):
        Predictor(omol)(batch_graphs(graphs))
    silver = bulk("Ag", "fcc", a=4.1)
    silver.calc = ORBCalculator(create("orb_v2", num_elements=30, **small))
    with pytest.raises(StructureError, match="atomic number 47 is beyond the elements orb_v2 was built for"):
        silver.get_potential_energy()
    silver.calc = ORBCalculator.from_checkpoint(pathlib.Path(ROOT) / "data" / "demo_pretrained.ckpt")
    assert np.isfinite(silver.get_potential_energy())
    assert "confidence" not in silver.calc.implemented_properties


def test_dispersion_sees_a_structure_as_periodic_exactly_when_the_model_does():
    """orb-v2 takes a non-zero cell as periodic whatever pbc says (as orb-models 0.4.2); D3 followed pbc, so a boxed
    crystal with pbc=False got a crystal's model energy and a cluster's dispersion (-0.16 eV instead of -2.36 eV),
    and a molecule with pbc=True and no cell crashed in ASE's get_volume."""
    from ase.build import molecule

    from orb.inference.calculator import ORBCalculator

    calculator = ORBCalculator.from_checkpoint(os.path.join(ROOT, "data", "demo_pretrained.ckpt"), dispersion="d3bj")
    energies = []
    for structure, pbc in (("Cu", True), ("Cu", False), ("CH4", False), ("CH4", True)):
        atoms = bulk("Cu", "fcc", a=3.6, cubic=True) if structure == "Cu" else molecule("CH4")
        atoms.pbc = pbc
        atoms.calc = calculator
        energies.append(atoms.get_potential_energy())
    assert energies[0] == energies[1] and energies[2] == energies[3]


def test_calculator_input_mistakes_are_one_line_naming_what_is_wrong(tmp_path):
    """Each was a raw Python, numpy or MindSpore error that named nothing the user typed, or a wrong statement (a
    folder 'does not exist'), found by a reviewer."""
    import mindspore as ms

    from orb.errors import OrbInputError
    from orb.inference.calculator import ORBCalculator

    path = os.path.join(ROOT, "data", "demo_pretrained.ckpt")
    (tmp_path / "empty.ckpt").write_bytes(b"")
    ms.save_checkpoint([{"name": "w", "data": ms.Tensor(np.ones(3, np.float32))}], str(tmp_path / "other.ckpt"))
    for call, message in [
        (lambda: ORBCalculator(path), "ORBCalculator takes an orb model .*, got str; for a checkpoint file use "
                                      "ORBCalculator.from_checkpoint"),
        (lambda: ORBCalculator.from_checkpoint(str(tmp_path)), f"{tmp_path}: is a folder, not a checkpoint file"),
        (lambda: ORBCalculator.from_checkpoint(str(tmp_path / "empty.ckpt")), "empty.ckpt: checkpoint file is empty"),
        (lambda: ORBCalculator.from_checkpoint(str(tmp_path / "other.ckpt")), "other.ckpt: not an orb state dict"),
        (lambda: ORBCalculator.from_checkpoint(path, matmul_precision="low"), "matmul_precision must be 'high' or "
                                                                               "'highest', got 'low'"),
        (lambda: ORBCalculator.from_checkpoint(path, dispersion="d3bj", xc=None), "unknown xc None"),
        (lambda: ORBCalculator.from_checkpoint(path, dispersion=0), "dispersion must be a name .* or None, got 0"),
        (lambda: ORBCalculator.from_checkpoint(path, model_name="orb-v2"), "unknown model 'orb-v2'; valid names: "),
        (lambda: ORBCalculator.from_checkpoint(path, xc="b3lyp"), "xc 'b3lyp' chooses DFT-D3's parameters and does "
                                                                  "nothing without dispersion"),
        # a keyword of its own misspelt: named, with the method's own keywords (it listed ASE's alone)
        (lambda: ORBCalculator.from_checkpoint(path, device="CPU"), r"unknown keyword\(s\) \['device'\] \(did you mean "
                                                                    r"device_target\?\); valid: device_target, "
                                                                    "model_name, precision, ops_profile, dispersion"),
        (lambda: ORBCalculator.from_checkpoint(path, dispresion="d3bj"), r"\(did you mean dispersion\?\)"),
    ]:
        with pytest.raises((OrbInputError, TypeError), match=message):
            call()
    from ase.build import molecule

    from orb.models import create

    flat = molecule("CH4")  # orb-v3 without pbc: its cell (here singular) plays no part, so it is no error
    flat.cell = [[3.6, 0, 0], [0, 3.6, 0], [0, 0, 0]]
    flat.calc = ORBCalculator(create("orb_v3_direct_20_omat", latent_dim=16, mlp_hidden_dim=32,
                                     num_message_passing_steps=1, head_mlp_hidden_dim=16))
    energy = flat.get_potential_energy()
    flat.cell = np.zeros((3, 3))
    assert flat.get_potential_energy() == energy


def test_a_stop_while_the_results_are_written_writes_them_all(tmp_path):
    """SIGTERM while orb-evaluate writes its files: it writes them all (exit 0, the folder holds this
    evaluation alone). It stopped between two files (exit 75): the new summary and predictions beside an earlier
    evaluation's plots and per-element table."""
    import signal as signals
    import time

    out = tmp_path / "eval"
    command = [sys.executable, os.path.join(ROOT, "scripts", "evaluate.py"), "--data", DEMO_VAL, "--output_dir",
               str(out), "--device_target", "CPU", "--progress_bar", "false", "--checkpoint"]
    first = subprocess.run(command + [os.path.join(ROOT, "data", "demo_pretrained.ckpt")], capture_output=True,
                           text=True, timeout=600, cwd=ROOT)
    assert first.returncode == 0, first.stderr[-2000:]
    before = {name: os.stat(out / name).st_mtime_ns for name in os.listdir(out)}
    process = subprocess.Popen(command + [os.path.join(ROOT, "data", "demo_v3_pretrained.ckpt")], cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 600
    while not any((out / name / "predictions.csv").exists() for name in os.listdir(out)  # the files are being
                  if name.startswith(".staging-")):  # written (the plots take a second more)
        assert process.poll() is None and time.time() < deadline, process.communicate()[1][-2000:]
        time.sleep(0.005)
    process.send_signal(signals.SIGTERM)
    _, err = process.communicate(timeout=300)
    assert process.returncode == 0 and "the evaluation is complete" in err, err[-2000:]
    assert "demo_v3_pretrained" in json.load(open(out / "summary.json"))["checkpoint"]
    for name in os.listdir(out):  # every file there is this evaluation's
        assert name not in before or os.stat(out / name).st_mtime_ns != before[name], name


KILLED_WHILE_WRITING = """
import os, signal, sys
from orb import files

original = files.write_json

def killed(path, value):
    if os.path.basename(path) == "summary.json":  # (after predictions.csv)
        os.kill(os.getpid(), signal.SIGKILL)
    return original(path, value)

files.write_json = killed
from orb.inference.evaluate import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_kill_while_the_results_are_written_leaves_the_earlier_evaluation_as_it_was(tmp_path):
    """A kill (or a full disk) after orb-evaluate's predictions.csv was written left it beside the earlier
    evaluation's summary.json and plots, one folder describing two evaluations. Now its files replace the earlier
    ones only once all are written; the next evaluation removes what the killed one staged."""
    out = tmp_path / "eval"
    command = ["--data", DEMO_VAL, "--output_dir", str(out), "--device_target", "CPU", "--progress_bar", "false",
               "--checkpoint"]
    first = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "evaluate.py"), *command,
                            os.path.join(ROOT, "data", "demo_pretrained.ckpt")], capture_output=True, text=True,
                           timeout=600, cwd=ROOT)
    assert first.returncode == 0, first.stderr[-2000:]
    before = {name: (out / name).read_bytes() for name in os.listdir(out)}
    killed = subprocess.run([sys.executable, "-c", KILLED_WHILE_WRITING, *command,
                             os.path.join(ROOT, "data", "demo_v3_pretrained.ckpt")], capture_output=True, text=True,
                            timeout=600, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert {name: (out / name).read_bytes() for name in os.listdir(out) if not name.startswith(".")} == before
    from orb.inference.evaluate import write_outputs

    write_outputs(str(out), [], {}, {})  # (what the next evaluation does first)
    assert not [name for name in os.listdir(out) if name.startswith(".")]


def test_orb_plot_ends_on_a_stop_signal_with_one_line_and_75(tmp_path):
    """It listened to no stop signal: a job's SIGUSR1 ended it with 138 and no word (Ctrl-C during matplotlib's import
    was a KeyboardInterrupt traceback)."""
    import signal

    from conftest import wait_until_handling

    process = subprocess.Popen([sys.executable, os.path.join(ROOT, "scripts", "plot_metrics.py"),
                                os.path.join(ROOT, "tests", "data", "demo_metrics.jsonl"), "-o",
                                str(tmp_path / "curves.png")], cwd=ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    wait_until_handling(process, signal.SIGUSR1)
    process.send_signal(signal.SIGUSR1)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 75 and err.strip().splitlines()[-1].startswith("stopped by SIGUSR1"), err[-2000:]
    assert os.listdir(tmp_path) == []


HOLDER = """
import sys, time
from orb.files import sole_writer

with sole_writer(sys.argv[1], "--output"):
    print("holding", flush=True)
    time.sleep(300)
"""


@pytest.mark.parametrize("command", ["finetune", "relax", "md", "evaluate"])
def test_a_second_command_writing_the_same_output_at_once_is_refused(tmp_path, command):
    """The same job submitted twice (or a requeue while the first still runs): both wrote one output, the second
    resuming from the first's checkpoints and both replacing them in turn, orb-relax writing every row twice, orb-md
    appending to the same trajectories, evaluations deleting each other's collected frames. Now the second is
    refused in one line naming the first (exit 2), touching nothing of the first's (the refused fine-tuning removed a
    run's files as its own before the first step); the first's lock goes with it."""
    output = tmp_path / {"finetune": "run", "relax": "relaxed.db", "md": "md", "evaluate": "eval"}[command]
    if command != "relax":  # what the first has written so far (a fine-tuning before its first step: its log)
        output.mkdir()
        for name in ("train.log", "metrics.jsonl") if command == "finetune" else ("first.txt",):
            (output / name).write_text("the first's\n")
    first = sorted(os.listdir(output)) if output.exists() else []
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(output)], stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, PYTHONPATH=ROOT))
    try:
        assert holder.stdout.readline().strip() == "holding"
        args = {"finetune": ["finetune.py", "--config", "configs/demo.yaml", "--output_dir", str(output),
                             "--max_epochs", "1"],
                "relax": ["scripts/relax.py", "--checkpoint", "data/demo_pretrained.ckpt", "--data", DEMO_VAL,
                          "--output", str(output), "--steps", "1"],
                "md": ["scripts/md.py", "--checkpoint", "data/demo_pretrained.ckpt", "--data", DEMO_VAL, "--output",
                       str(output), "--steps", "1", "--timestep", "1"],
                "evaluate": ["scripts/evaluate.py", "--checkpoint", "data/demo_pretrained.ckpt", "--data", DEMO_VAL,
                             "--output_dir", str(output)]}[command]
        second = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
        lines = second.stderr.strip().splitlines()
        assert second.returncode == 2 and lines[-1].startswith("error: ") and \
            f"{output} is being written by another command (process {holder.pid}@" in lines[-1], second.stderr[-2000:]
        assert (sorted(os.listdir(output)) if output.exists() else []) == first  # (the first's output untouched)
    finally:
        holder.kill()
        holder.wait()
    assert [name for name in os.listdir(tmp_path) if name.endswith(".writer")] == [f".{output.name}.writer"]
    from orb.files import sole_writer

    with sole_writer(str(output), "--output"):  # the killed holder's lock file blocks nobody (the kernel let it go)
        pass
    assert not [name for name in os.listdir(tmp_path) if name.endswith(".writer")]  # and a finished writer's goes


def test_one_writer_even_when_the_holder_ends_as_another_takes_over_and_in_a_new_folder(tmp_path, monkeypatch):
    """The lock file beside an output: in a folder not made yet, the first command was not guarded (the default
    outputs/ and evaluation/ of a fresh checkout), and a holder that removed it as it ended let the one that had opened
    it meanwhile lock the removed file while a third made and locked a new one: two writers. Now the folder is made,
    and a taker checks that the file it locked is the one there."""
    import fcntl

    from orb.errors import OutputBusy
    from orb.files import sole_writer

    output = tmp_path / "not" / "made" / "run"
    lock = output.parent / ".run.writer"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(output)], stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, PYTHONPATH=ROOT))
    assert holder.stdout.readline().strip() == "holding"  # (it made the folder: guarded from the first command)
    with pytest.raises(OutputBusy, match=f"process {holder.pid}@"):
        with sole_writer(str(output), "--output"):
            pass
    real = fcntl.flock

    def holder_ends_first(handle, mode):  # the holder removes its lock file and ends between this open and lock
        if holder.poll() is None:
            os.remove(lock)
            holder.kill()
            holder.wait()
        return real(handle, mode)

    monkeypatch.setattr(fcntl, "flock", holder_ends_first)
    with sole_writer(str(output), "--output"):
        monkeypatch.setattr(fcntl, "flock", real)
        third = subprocess.run([sys.executable, "-c", HOLDER, str(output)], capture_output=True, text=True,
                               timeout=60, env=dict(os.environ, PYTHONPATH=ROOT))
        assert third.returncode == 1 and "is being written by another command" in third.stderr, third.stdout
    assert not lock.exists()


def test_a_calculator_script_prints_nothing_but_its_own_output(tmp_path):
    """A script using ORBCalculator (docs/use.md) printed MindSpore's warnings on stderr: backends not installed
    (twice each), a checkpoint without CRC, its compile cache's notes; the commands print none of them. With the
    docs' Langevin (fixcm=False: ASE 3.28 deprecates fixcm=True with a FutureWarning), nothing at all."""
    script = tmp_path / "script.py"
    script.write_text(
        "from ase import units\n"
        "from ase.build import bulk\n"
        "from ase.md.langevin import Langevin\n"
        "from orb.inference.calculator import ORBCalculator\n"
        "atoms = bulk('Cu', 'fcc', a=3.6).repeat(2)\n"
        f"atoms.calc = ORBCalculator.from_checkpoint({os.path.join(ROOT, 'data', 'demo_pretrained.ckpt')!r})\n"
        "Langevin(atoms, 1 * units.fs, temperature_K=300, friction=0.01 / units.fs, fixcm=False).run(2)\n"
        "print(atoms.get_potential_energy())\n")
    env = {k: v for k, v in os.environ.items() if k not in ("GLOG_v", "PYTHONWARNINGS")}
    env.update(PYTHONPATH=ROOT, ORB_CACHE_DIR=str(tmp_path / "cache"))
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0 and result.stderr == "", result.stderr[-3000:]
    assert np.isfinite(float(result.stdout.strip().splitlines()[-1]))
