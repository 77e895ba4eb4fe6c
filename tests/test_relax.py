"""Batched relaxation (orb-relax): the same minima as ASE's FIRE driving ORBCalculator structure by structure,
with and without the cell; resumable; an existing output refused unless --resume/--overwrite."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import DEMO_VAL, ROOT, noting_mindspore

DEMO_MODEL = os.path.join(ROOT, "data", "demo_pretrained.ckpt")


def rattled(path, count=6, seed=0):
    """``count`` demo structures, rattled and (every other one) strained, in an ASE database."""
    import ase.db

    rng = np.random.default_rng(seed)
    with ase.db.connect(DEMO_VAL) as src, ase.db.connect(path, append=False) as dst:
        for k, row in enumerate(src.select(limit=count)):
            atoms = row.toatoms()
            atoms.calc = None
            atoms.positions += rng.normal(0, 0.08, atoms.positions.shape)
            if k % 2:
                atoms.set_cell(atoms.cell.array * 1.03, scale_atoms=True)
            dst.write(atoms)
    return str(path)


def ase_loop(path, cell, fmax=0.05, steps=300):
    """The reference: ASE's FIRE on ORBCalculator, one structure after another."""
    import ase.db
    from ase.filters import FrechetCellFilter
    from ase.optimize import FIRE

    from orb.inference.calculator import ORBCalculator

    calc = ORBCalculator.from_checkpoint(DEMO_MODEL)
    out = {}
    with ase.db.connect(path) as db:
        for row in db.select():
            atoms = row.toatoms()
            atoms.calc = calc
            opt = FIRE(FrechetCellFilter(atoms) if cell else atoms, logfile=None)
            converged = opt.run(fmax=fmax, steps=steps)
            out[row.id] = (atoms.get_potential_energy() / len(atoms), opt.nsteps, converged)
    return out


def relax_cli(*args, noting=False):
    """orb-relax's run; ``noting``: its last line of output says whether it imported MindSpore."""
    command = [sys.executable, os.path.join(ROOT, "scripts", "relax.py"), "--checkpoint", DEMO_MODEL,
               "--device_target", "CPU", "--progress_bar", "false", *args]
    return subprocess.run(noting_mindspore(command) if noting else command, capture_output=True, text=True,
                          timeout=900, cwd=ROOT)


@pytest.mark.parametrize("cell", [False, True])
def test_batched_relaxation_reaches_ase_fire_minima(tmp_path, cell):
    """Positions only: relaxed to convergence, the same minima as ASE's loop. With the cell: the demo model's
    stress (trained without stress labels) is too rough for cells to converge, so the first 8 steps are
    compared, the same FIRE arithmetic on ASE's FrechetCellFilter giving the same energies."""
    import ase.db

    steps = 8 if cell else 150
    data = rattled(tmp_path / "in.db")
    out = tmp_path / "relaxed.db"
    result = relax_cli("--data", data, "--output", str(out), "--steps", str(steps), "--batch_size", "4",
                       *(["--cell"] if cell else []))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Warning" not in result.stderr, result.stderr[-3000:]  # (scipy's logm: a line per cell step)
    reference = ase_loop(data, cell, steps=steps)
    with ase.db.connect(str(out)) as db:
        rows = {row.source_row: row for row in db.select()}
    assert sorted(rows) == sorted(reference)
    converged_both = 0
    for source, (energy, nsteps, converged) in reference.items():
        row = rows[source]
        assert row.converged == converged, (source, nsteps, row.relax_steps)  # the same FIRE steps
        assert row.energy / row.natoms == pytest.approx(energy, abs=1e-4 if cell else 1e-3)
        if converged:
            converged_both += 1
            assert np.linalg.norm(row.forces, axis=1).max() < 0.05 or cell  # with --cell: cell forces count too
            assert 0 < row.relax_steps and abs(row.relax_steps - nsteps) <= max(10, nsteps // 5)
    assert converged_both >= len(reference) // 2 or cell
    summary = json.load(open(tmp_path / "relaxed.summary.json"))
    assert summary["structures"] == len(reference) and summary["converged"] == converged_both
    assert sorted(summary["not_converged_rows"]) == sorted(s for s, r in reference.items() if not r[2])
    assert summary["model_calls"] < sum(r[1] + 1 for r in reference.values())  # many structures per call


def test_a_cell_relaxation_says_nothing_of_scipys_logm():
    """ASE's FrechetCellFilter takes scipy's matrix logarithm at every step, which warned "logm result may be
    inaccurate, approximate err = 2.2e-13" a line a step: 450 lines on stderr for 2 structures with orb-relax --cell."""
    import warnings

    from ase.build import bulk

    from orb.device import configure_mindspore
    from orb.inference.relax import BatchRelaxer
    from orb.io.checkpoint import model_from_checkpoint

    configure_mindspore("CPU")
    atoms = bulk("Cu", "fcc", a=3.7, cubic=True).repeat(2)
    atoms.rattle(0.1, seed=1)
    atoms.set_cell(atoms.cell.array @ np.array([[1.05, 0.08, 0], [0, 0.96, 0.03], [0, 0, 1.02]]), scale_atoms=True)
    done = []
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        BatchRelaxer(model_from_checkpoint(DEMO_MODEL), fmax=0.02, steps=150, cell=True, batch_size=2).run(
            [(1, atoms)], lambda r, converged: done.append(r.steps))
    assert done and done[0] > 60 and not [str(w.message) for w in seen], [str(w.message) for w in seen][:3]


def test_relaxation_resumes_and_refuses_to_mix_outputs(tmp_path):
    import ase.db

    data = rattled(tmp_path / "in.db", count=5)
    out = tmp_path / "relaxed.db"
    first = relax_cli("--data", data, "--output", str(out), "--steps", "4", "--batch_size", "2", "--resume")
    assert first.returncode == 0, first.stderr[-3000:]  # (a requeue script's first start: said, not silent)
    assert f"--resume: {out} holds no earlier run to continue: starting it" in first.stderr, first.stderr[-3000:]
    summary = json.load(open(tmp_path / "relaxed.summary.json"))
    assert summary["not_converged_rows"]  # 4 steps are too few: reported, not an error
    refused = relax_cli("--data", data, "--output", str(out))
    assert refused.returncode == 2 and refused.stderr.strip() == (
        f"error: --output {out} exists: pass --resume to continue it or --overwrite to replace it")
    with ase.db.connect(str(out)) as db:  # a run killed after three structures
        for row_id in [row.id for row in db.select()][3:]:
            del db[row_id]
    resumed = relax_cli("--data", data, "--output", str(out), "--steps", "4", "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert json.load(open(tmp_path / "relaxed.summary.json"))["already_done"] == 3
    with ase.db.connect(str(out)) as db:
        assert sorted(row.source_row for row in db.select()) == [1, 2, 3, 4, 5]  # each structure once
    shrunk = relax_cli("--data", data, "--output", str(out), "--steps", "2", "--resume")
    assert shrunk.returncode == 2 and "steps: 4 -> 2 (it may grow, not shrink)" in shrunk.stderr, shrunk.stderr
    changed = relax_cli("--data", data, "--output", str(out), "--steps", "4", "--fmax", "0.1", "--resume")
    assert changed.returncode == 2 and changed.stderr.strip().splitlines() == [  # it mixed two settings' rows
        f"error: --resume {out}: these settings differ from the run's: fmax: 0.05 -> 0.1. Restore them, or start a "
        "new run in another --output"]
    moved = rattled(tmp_path / "moved.db", count=5, seed=1)  # the same rows, atoms and elements, other positions
    os.replace(moved, data)
    edited = relax_cli("--data", data, "--output", str(out), "--steps", "4", "--resume")
    lines = edited.stderr.strip().splitlines()  # it resumed, mixing two inputs' structures in one output
    assert edited.returncode == 2 and len(lines) == 1 and "structures_fingerprint: " in lines[0], edited.stderr
    assert "data_fingerprint" not in lines[0]
    refused = relax_cli("--data", data, "--output", str(out), "--overwrite", "--uncertain_above", "0.1")
    assert refused.returncode == 2 and "orb_v2 has no confidence head" in refused.stderr
    assert sorted(energies(out)) == [1, 2, 3, 4, 5]  # refused before --overwrite deleted anything
    bad = relax_cli("--data", data, "--output", str(tmp_path / "x.db"), "--dispersion", "d3bj", "--xc", "nope",
                    noting=True)
    assert bad.returncode == 2 and "unknown xc 'nope'" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    assert bad.stdout.split()[-1:] == ["False"]  # said before MindSpore's 1 s import
    from ase import Atoms

    heavy = tmp_path / "heavy.db"  # dftd3 returns 0 eV for Rf, raises for Mc, crashes the process for Fl
    with ase.db.connect(str(heavy)) as db:
        db.write(Atoms("Cu2", positions=[[0, 0, 0], [0, 0, 2.3]]))
        db.write(Atoms("Rf2", positions=[[0, 0, 0], [0, 0, 2.9]]))
    close = tmp_path / "close.db"  # atoms 0.02 Å apart: no model describes them (it relaxed them and wrote the row)
    with ase.db.connect(str(close)) as db:
        db.write(Atoms("Cu2", positions=[[0, 0, 0], [0, 0, 2.3]]))
        db.write(Atoms("Cu2", positions=[[0, 0, 0], [0, 0, 0.02]]))
    result = relax_cli("--data", str(close), "--output", str(tmp_path / "c.db"))
    assert result.returncode == 1 and "row 2 stopped: step 0: atoms 0 and 1 are 0.02 Å apart (on top of each other)" \
        in result.stderr.splitlines(), result.stderr[-2000:]
    assert sorted(energies(tmp_path / "c.db")) == [1]
    import ase.io

    # two files: the structure is named by its file and frame, in the message, the summary and every output row (it
    # was "row 4", a position across both files)
    files = [str(tmp_path / "fine.extxyz"), str(tmp_path / "close.extxyz")]
    ase.io.write(files[0], [Atoms("Cu2", positions=[[0, 0, 0], [0, 0, d]]) for d in (2.3, 2.4)], format="extxyz")
    ase.io.write(files[1], [Atoms("Cu2", positions=[[0, 0, 0], [0, 0, d]]) for d in (2.3, 0.02)], format="extxyz")
    result = relax_cli("--data", *files, "--output", str(tmp_path / "two.db"))
    assert result.returncode == 1 and f"{files[1]}, frame 1 stopped: step 0: atoms 0 and 1 are 0.02 Å apart (on top " \
        "of each other)" in result.stderr.splitlines(), result.stderr[-2000:]
    summary = json.load(open(tmp_path / "two.summary.json"))
    assert list(summary["failed_rows"]) == ["4"] and summary["failed_sources"] == {"4": f"{files[1]}, frame 1"}
    with ase.db.connect(str(tmp_path / "two.db")) as db:
        assert sorted((r.source_row, r.source_file, r.source_frame) for r in db.select()) == [
            (1, files[0], 0), (2, files[0], 1), (3, files[1], 0)]
    bad = relax_cli("--data", str(heavy), "--output", str(tmp_path / "h.db"), "--dispersion", "d3bj")
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        f"error: {heavy}, row 2, key 'numbers': Rf (Z=104) has no DFT-D3 parameters (dftd3 covers H to Lr, Z <= 103): "
        "run without --dispersion"], bad.stderr[-2000:]


def rows_in(path):
    """(source_row, energy per atom) of an output database, read without taking its lock (it may be being
    written)."""
    import sqlite3

    if not os.path.exists(path):
        return []
    connection = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return connection.execute("SELECT value FROM number_key_values WHERE key = 'source_row'").fetchall()
    except sqlite3.OperationalError:  # the tables do not exist yet
        return []
    finally:
        connection.close()


def relax_process(*args):
    return subprocess.Popen([sys.executable, os.path.join(ROOT, "scripts", "relax.py"), "--checkpoint", DEMO_MODEL,
                             "--device_target", "CPU", "--progress_bar", "false", *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_for_rows(path, process, count, timeout=600):
    import time

    deadline = time.time() + timeout
    while time.time() < deadline:
        if len(rows_in(path)) >= count:
            return
        assert process.poll() is None, process.stdout.read()[-3000:]
        time.sleep(0.05)
    raise AssertionError(f"{path} never held {count} rows")


def energies(path):
    import ase.db

    with ase.db.connect(str(path)) as db:
        return {row.source_row: (row.energy / row.natoms, row.relax_steps, row.converged) for row in db.select()}


TWELVE = ("--steps", "60", "--batch_size", "1")  # 12 structures one at a time: a kill finds some finished


@pytest.fixture(scope="module")
def twelve_relaxed(tmp_path_factory):
    """The 12 rattled structures relaxed without interruption: what every interrupted and resumed run must equal."""
    folder = tmp_path_factory.mktemp("straight")
    straight = relax_cli("--data", rattled(folder / "in.db", count=12), *TWELVE, "--output", str(folder / "out.db"))
    assert straight.returncode == 0, straight.stderr[-3000:]
    return energies(folder / "out.db")


@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM"])
def test_a_killed_or_stopped_relaxation_keeps_every_finished_structure(tmp_path, how, twelve_relaxed):
    """Each finished structure is committed as it is written: kill -9 after some of 12 keeps them (no transaction
    left open to roll back), SIGTERM stops between two steps with exit 75; --resume relaxes only the others,
    and the output equals an uninterrupted run's (each structure once, the same energies and steps)."""
    import signal

    data = rattled(tmp_path / "in.db", count=12)
    out = tmp_path / "relaxed.db"
    args = ("--data", data, *TWELVE)
    process = relax_process(*args, "--output", str(out))
    wait_for_rows(out, process, 3)
    process.send_signal(getattr(signal, how))
    output, _ = process.communicate(timeout=300)
    kept = len(rows_in(out))
    assert 3 <= kept < 12, output[-2000:]
    if how == "SIGTERM":
        assert process.returncode == 75, output[-3000:]
        assert f"the {kept} finished ones are kept in {out}: continue with --resume" in output
    else:
        assert process.returncode == -signal.SIGKILL
        # a kill inside a row's write left ASE's lock file beside the output: every later start waited for it
        # forever (a stop signal deferred meanwhile); the output is SQLite's to lock
        (tmp_path / "relaxed.db.lock").write_text("")
    resumed = relax_cli(*args, "--output", str(out), "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert not (tmp_path / "relaxed.db.lock").exists()
    summary = json.load(open(tmp_path / "relaxed.summary.json"))
    assert summary["already_done"] == kept and summary["relaxed_now"] == 12 - kept and summary["structures"] == 12
    got, expected = energies(out), twelve_relaxed
    assert sorted(got) == sorted(expected) == list(range(1, 13))
    for row, (energy, steps, converged) in expected.items():
        assert got[row][1:] == (steps, converged), row
        assert got[row][0] == pytest.approx(energy, abs=1e-5), row


def small_omol_checkpoint(tmp_path):
    """A small orb_v3_direct_omol model (random weights; no stress head) saved as an exported checkpoint."""
    from orb.io.checkpoint import save_checkpoint
    from orb.models import create

    model = create("orb_v3_direct_omol", latent_dim=16, mlp_hidden_dim=32, num_message_passing_steps=1,
                   head_mlp_hidden_dim=16)
    checkpoint = tmp_path / "omol.ckpt"
    save_checkpoint(str(checkpoint), model, {"model": model.cfg.to_dict()}, exported=True)
    return checkpoint


def test_relax_and_md_read_charge_and_spin_under_the_users_keys(tmp_path):
    """Fine-tuning and orb-evaluate read each structure's total charge and spin under the user's keys (charge_key,
    --charge_key); orb-relax and orb-md read only ``charge`` and ``spin``, and refused the same structures. Labels
    they never use are not read: a NaN energy left in a file (a failed DFT run's) and a negative weight stopped both
    ("frame 0, key 'energy': energy contains NaN or inf")."""
    import ase.io
    from ase.build import molecule
    from ase.calculators.singlepoint import SinglePointCalculator

    checkpoint = small_omol_checkpoint(tmp_path)
    frames = []
    for name, charge, multiplicity in (("H2O", 0, 1), ("NH3", 1, 2)):
        atoms = molecule(name)
        atoms.info.update(q=charge, mult=multiplicity, weight=-1.0)
        atoms.calc = SinglePointCalculator(atoms, energy=float("nan"), forces=np.full((len(atoms), 3), np.nan))
        frames.append(atoms)
    data = tmp_path / "molecules.extxyz"
    ase.io.write(data, frames, format="extxyz")
    keys = ["--charge_key", "q", "--spin_key", "mult"]
    runs = {"relax.py": ["--output", str(tmp_path / "relaxed.db"), "--steps", "2"],
            "md.py": ["--output", str(tmp_path / "md"), "--timestep", "1", "--steps", "2", "--write_every", "1"]}
    for script, args in runs.items():
        command = [sys.executable, os.path.join(ROOT, "scripts", script), "--checkpoint", str(checkpoint),
                   "--device_target", "CPU", "--data", str(data), *args]
        refused = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)
        assert refused.returncode == 2 and refused.stderr.strip().splitlines()[-1] == (
            f"error: {data}, frame 0, key 'charge': frame has no total charge, which OMol models need (set "
            "info['charge'] and info['spin'] on each structure)"), (script, refused.stderr[-2000:])
        done = subprocess.run(command + keys, capture_output=True, text=True, timeout=600, cwd=ROOT)
        assert done.returncode == 0, (script, done.stderr[-3000:])
    assert len(rows_in(tmp_path / "relaxed.db")) == 2
    assert sorted(os.listdir(tmp_path / "md"))[:2] == ["log_0.csv", "log_1.csv"]


def test_relaxing_with_an_omol_model_names_a_row_without_charge(tmp_path):
    """OMol models need each structure's total charge and spin: a row without them is one line naming the file,
    row and key, before any structure is relaxed (it was a TypeError traceback); the relaxed rows keep them (and
    the rows' other attributes); a structure that cannot be relaxed is named, the others are relaxed."""
    import ase.db
    from ase.build import molecule

    checkpoint = small_omol_checkpoint(tmp_path)
    data = tmp_path / "molecules.db"
    with ase.db.connect(str(data)) as db:
        db.write(molecule("H2O"), charge=0, spin=1)
        db.write(molecule("CH4"))
    result = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "relax.py"), "--checkpoint",
                             str(checkpoint), "--device_target", "CPU", "--data", str(data), "--output",
                             str(tmp_path / "out.db")], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip().splitlines() == [f"error: {data}, row 2, key 'charge': row has no total charge, "
                                                  "which OMol models need (store it with db.write(atoms, charge=..., "
                                                  "spin=...))"]
    assert not rows_in(tmp_path / "out.db")
    # this model has no stress head: a cell relaxation (or NPT) would see zero stress and never move the cell
    for script, args in (("relax.py", ["--output", str(tmp_path / "cell.db"), "--cell"]),
                         ("md.py", ["--output", str(tmp_path / "md"), "--ensemble", "npt", "--timestep", "1",
                                    "--steps", "2"])):
        refused = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", script), "--checkpoint",
                                  str(checkpoint), "--device_target", "CPU", "--data", str(data), *args],
                                 capture_output=True, text=True, timeout=600, cwd=ROOT)
        assert refused.returncode == 2 and refused.stderr.strip().splitlines()[-1].endswith(
            "needs stress, and orb_v3_direct_omol predicts none (no stress head)"), refused.stderr[-2000:]

    # a structure that cannot be computed is named and the others relax; each relaxed row keeps its input's
    # attributes, so the OMol model reads the output as it read the input (the charge and spin were dropped)
    from orb.data.dataset import AseDbDataset

    data = tmp_path / "charged.db"
    with ase.db.connect(str(data)) as db:
        db.write(molecule("H2O"), charge=0, spin=1, config_type="solvent", REF_energy=-14.2)  # a label of its own
        crowded = molecule("CH4")
        crowded.positions[1] = crowded.positions[0]  # two atoms at one place: no graph
        db.write(crowded, charge=1, spin=2)
        db.write(molecule("NH3"), charge=-1, spin=2, config_type="amine")
    out = tmp_path / "charged_out.db"
    result = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "relax.py"), "--checkpoint",
                             str(checkpoint), "--device_target", "CPU", "--data", str(data), "--output", str(out),
                             "--steps", "2", "--progress_bar", "false"], capture_output=True, text=True, timeout=600,
                            cwd=ROOT)
    assert result.returncode == 1, result.stderr[-3000:]
    assert [line for line in result.stderr.splitlines() if "stopped" in line][0].startswith("row 2 stopped: step 0:")
    assert list(json.load(open(tmp_path / "charged_out.summary.json"))["failed_rows"]) == ["2"]
    relaxed = AseDbDataset(str(out), require_labels=False, charge_spin=True)
    assert [int(i) for i in relaxed.ids] and [relaxed.row(i).key_value_pairs["source_row"]
                                              for i in range(len(relaxed))] == [1, 3]
    assert [relaxed.charge_and_spin(i) for i in range(2)] == [(0.0, 1.0), (-1.0, 2.0)]
    assert [relaxed.get_atoms(i).info["config_type"] for i in range(2)] == ["solvent", "amine"]
    assert "REF_energy" not in relaxed.get_atoms(0).info  # the input's label is not the relaxed geometry's


def test_uncertain_structures_are_collected_once_across_a_kill(tmp_path):
    """orb-v3: every relaxed structure past --uncertain_above goes to OUTPUT.uncertain.extxyz with its predicted
    errors (untested before). A frame is written before its row: killed between the two, the frame is dropped on
    --resume and written again with its row, once (written after the row, it was lost for good)."""
    import ase.db
    import ase.io

    data = rattled(tmp_path / "in.db", count=4)
    out = tmp_path / "relaxed.db"
    args = ("--checkpoint", os.path.join(ROOT, "data", "demo_v3_pretrained.ckpt"), "--data", data, "--output",
            str(out), "--steps", "3", "--uncertain_above", "1e-6")  # every structure: each once is what counts
    first = relax_cli(*args)
    assert first.returncode == 0, first.stderr[-3000:]
    said = (f"{tmp_path / 'relaxed.uncertain.extxyz'} holds 4 relaxed structures past --uncertain_above 1e-06 eV/Å "
            "(the predicted force error, largest over the atoms)")
    assert first.stdout.strip().splitlines()[-1] == said  # (the file and its count went unsaid)
    frames = ase.io.read(tmp_path / "relaxed.uncertain.extxyz", index=":")
    with ase.db.connect(str(out)) as db:
        predicted = {row.source_row: row.predicted_force_error_max for row in db.select()}
    assert sorted(f.info["source_row"] for f in frames) == sorted(predicted) == [1, 2, 3, 4]
    for frame in frames:
        assert frame.arrays["predicted_force_error"].max() == pytest.approx(predicted[frame.info["source_row"]])
    with ase.db.connect(str(out)) as db:  # killed after row 4's frame, before its row
        db.delete([row.id for row in db.select() if row.source_row == 4])
    resumed = relax_cli(*args, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    again = ase.io.read(tmp_path / "relaxed.uncertain.extxyz", index=":")
    assert sorted(f.info["source_row"] for f in again) == [1, 2, 3, 4]
    assert json.load(open(tmp_path / "relaxed.summary.json"))["uncertain"] == 4
    assert resumed.stdout.strip().splitlines()[-1] == said  # (the file's frames, the earlier run's too)


def test_a_model_without_a_stress_head_reports_no_stress_anywhere(tmp_path):
    """orb_v3_direct_omol predicts no stress (the calculator raises ASE's PropertyNotImplementedError): orb-evaluate,
    orb-relax and orb-md report none either. Its head's zeros were reported as a prediction: a stress MAE of |label|
    and a parity plot of zeros, zero stress in every relaxed row and trajectory frame, a pressure of the kinetic
    term alone."""
    import ase.db
    import ase.io
    from ase.build import bulk
    from ase.calculators.singlepoint import SinglePointCalculator

    checkpoint = small_omol_checkpoint(tmp_path)
    data = tmp_path / "cells.db"
    with ase.db.connect(str(data)) as db:
        for k in range(2):
            atoms = bulk("Cu", "fcc", a=3.6, cubic=True)
            atoms.rattle(0.05, seed=k)
            atoms.calc = SinglePointCalculator(atoms, energy=-14.0, forces=np.zeros((4, 3)),
                                               stress=np.full(6, 0.1))
            db.write(atoms, charge=0, spin=1)

    def run(script, *args):
        result = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", script), "--checkpoint",
                                 str(checkpoint), "--device_target", "CPU", "--data", str(data), "--progress_bar",
                                 "false", *args], capture_output=True, text=True, timeout=600, cwd=ROOT)
        assert result.returncode == 0, result.stderr[-3000:]

    run("evaluate.py", "--output_dir", str(tmp_path / "eval"))
    summary = json.load(open(tmp_path / "eval" / "summary.json"))
    assert "stress_mae" not in json.dumps(summary) and "forces_mae" in json.dumps(summary)
    assert "stress_mae" not in (tmp_path / "eval" / "predictions.csv").read_text().splitlines()[0]
    assert not (tmp_path / "eval" / "parity_stress.png").exists()
    run("relax.py", "--output", str(tmp_path / "relaxed.db"), "--steps", "1")
    rows = list(ase.db.connect(str(tmp_path / "relaxed.db")).select())
    assert len(rows) == 2 and all(row.get("stress") is None and row.get("forces") is not None for row in rows)
    run("md.py", "--output", str(tmp_path / "md"), "--ensemble", "nvt", "--timestep", "1", "--steps", "2",
        "--temperature", "300")
    frames = ase.io.read(tmp_path / "md" / "traj_0.extxyz", ":")
    results = [frame.calc.results for frame in frames]  # steps 0 and 2 (ase.io reads the labels into a calculator)
    assert len(frames) == 2 and all("stress" not in r and "forces" in r for r in results)
    log = (tmp_path / "md" / "log_0.csv").read_text().splitlines()
    column = log[0].split(",").index("pressure_GPa")
    assert [line.split(",")[column] for line in log[1:]] == ["nan"] * 2


def test_a_molecule_is_stored_without_a_stress_and_a_crystal_with_one(tmp_path):
    """orb-v2 computes a stress for every structure; a molecule's (no cell) is meaningless and was stored in its
    relaxed row (orb-md leaves it out of the frames of a structure the model does not see as periodic)."""
    import ase.db

    result = relax_cli("--data", DEMO_VAL, "--output", str(tmp_path / "relaxed.db"), "--steps", "1")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = list(ase.db.connect(str(tmp_path / "relaxed.db")).select())
    molecules = [row for row in rows if not row.toatoms().cell.any()]
    crystals = [row for row in rows if row.toatoms().cell.any()]
    assert molecules and crystals
    assert all(row.get("stress") is None and row.get("forces") is not None for row in molecules)
    assert all(row.get("stress") is not None for row in crystals)


def test_an_output_that_is_a_folder_is_refused_and_nothing_is_left_beside_it(tmp_path):
    """--output naming a folder, with --resume: 'disk I/O error' after its run.json was written beside it."""
    os.makedirs(tmp_path / "adir")
    result = relax_cli("--data", DEMO_VAL, "--output", str(tmp_path / "adir"), "--steps", "1", "--resume")
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        f"error: --output {tmp_path / 'adir'} is a folder: name an ASE database file (relaxed.db)"], result.stderr
    assert sorted(os.listdir(tmp_path)) == ["adir"]
    # an .extxyz or .json name got an SQLite file ase.io could not read; --resume with --overwrite was --resume
    for args, message in ((["--output", str(tmp_path / "out.extxyz")], f"--output {tmp_path / 'out.extxyz'}: "
                           "orb-relax writes an ASE SQLite database: name it with .db"),
                          (["--output", str(tmp_path / "out.db"), "--resume", "--overwrite"], "--resume continues "
                           "the earlier run and --overwrite replaces it: give one of them")):
        result = relax_cli("--data", DEMO_VAL, "--steps", "1", *args, noting=True)
        assert result.returncode == 2 and result.stderr.strip().splitlines() == [f"error: {message}"], result.stderr
        assert result.stdout.split() == ["False"]  # said before MindSpore's import
    assert sorted(os.listdir(tmp_path)) == ["adir"]


UNFINISHED_COMMIT = """
import os, signal, sqlite3, sys
connection = sqlite3.connect(sys.argv[1])
connection.execute("PRAGMA cache_size=1")  # (pages reach the file before the commit, as a large row's do)
connection.execute("BEGIN")
for i in range(3000):
    connection.execute("INSERT INTO keys VALUES (?, ?)", ("k%d" % i, 1))
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_kill_while_a_row_is_committed_loses_no_row_and_the_resume_reads_the_rest(tmp_path):
    """A kill in the middle of a row's commit (ASE commits each) leaves SQLite's -journal beside the output, which a
    read-only connection cannot roll back: orb-relax --resume called the output damaged and advised another --output
    (every relaxed structure given up), and orb-finetune and orb-evaluate refused it as data. Now the unfinished write
    is rolled back and every committed row read."""
    from ase.build import bulk
    from ase.db import connect

    from orb.data.sqlite_rows import RowReader
    from orb.inference.relax import read_output

    output = str(tmp_path / "relaxed.db")
    with connect(output) as db:
        for i in range(3):
            db.write(bulk("Cu", cubic=True), key_value_pairs=dict(source_row=i, relax_steps=4 + i, converged=1))
    subprocess.run([sys.executable, "-c", UNFINISHED_COMMIT, output], timeout=120)
    assert os.path.getsize(output + "-journal") > 0  # (what the kill left)
    assert read_output(output) == {0: (4, True), 1: (5, True), 2: (6, True)}
    assert not os.path.exists(output + "-journal")
    subprocess.run([sys.executable, "-c", UNFINISHED_COMMIT, output], timeout=120)
    old = os.path.getmtime(output + "-journal") - 700  # (a user's data: only a journal no live writer can hold)
    os.utime(output + "-journal", (old, old))
    reader = RowReader(output)  # the training data's reader
    assert [reader.read(i).natoms for i in (1, 2, 3)] == [4, 4, 4]
    reader.close()


FULL_DISK_AT_RUN_RECORD = """
import errno, os, sys
from orb import files

original = files.write_atomically

def full(path, *args, **kwargs):
    if path.endswith("run.json"):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
    return original(path, *args, **kwargs)

files.write_atomically = full
if sys.argv[1] == "relax":
    from orb.inference.relax import main
else:
    from orb.inference.md import main
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.parametrize("command", ["relax", "md"])
def test_a_full_disk_at_the_start_is_the_file_systems_line_not_bad_input(tmp_path, command):
    """orb-relax's and orb-md's first write (their run record) on a full disk said "cannot write there" and exited 2,
    as for a folder the user chose wrong, which a requeue script takes for a mistake not worth retrying. Now the full
    disk's own line (free space, then run the same command again) and status 1."""
    output = str(tmp_path / ("relaxed.db" if command == "relax" else "md"))
    args = ["--checkpoint", "data/demo_pretrained.ckpt", "--data", DEMO_VAL, "--output", output, "--steps", "1"]
    if command == "md":
        args += ["--timestep", "1"]
    result = subprocess.run([sys.executable, "-c", FULL_DISK_AT_RUN_RECORD, command, *args], cwd=ROOT,
                            capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONPATH=ROOT))
    record = os.path.join(output, "run.json") if command == "md" else str(tmp_path / "relaxed.run.json")
    assert result.returncode == 1, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1].startswith("error: No space left on device ("), result.stderr
    assert "free space, then run the same command again" in result.stderr.strip().splitlines()[-1]
    assert "Traceback" not in result.stderr and not os.path.exists(record)


@pytest.mark.parametrize("flag, value, line", [("--fmax", "0", "--fmax must be a finite number > 0, got 0.0"),
                                               ("--steps", "-1", "--steps must be >= 0, got -1"),
                                               ("--batch_size", "0", "--batch_size must be >= 1, got 0")])
def test_a_wrong_setting_is_named_alone(tmp_path, capsys, flag, value, line):
    """`orb-relax --fmax 0` said "--fmax must be a finite number > 0, --steps >= 0 and --batch_size >= 1"."""
    from orb.inference.relax import main

    status = main(["--checkpoint", DEMO_MODEL, "--data", DEMO_VAL, "--output", str(tmp_path / "out.db"), flag, value])
    assert status == 2 and capsys.readouterr().err.strip().splitlines() == [f"error: {line}"]
    assert not os.listdir(tmp_path)
