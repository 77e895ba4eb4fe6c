"""Every resume reads its state through one validated reader and compares every setting that changes the arithmetic.

orb-md's per-structure state (``state_k.json``, and the trajectory and log it keeps), its uncertain frames and run
record, and orb-relax's output database, uncertain frames and run record, damaged in each way a file can be (empty,
cut short mid-JSON, a key missing, a value of another type or shape, a companion file cut short or removed): a
``--resume`` is one line naming the file and the cause, exit status 2, and every file byte for byte as it was --
even those of the structures before the damaged one, which a resume used to cut back before it reached it. A
resume with another operator profile, precision, batch size or model is refused naming it (orb-md, whose resumes are
exact), or continues and says so (orb-relax's batch size and operator profile: it relaxes the unfinished structures
from their start).

Found before (main at 252e4ef): each damaged state, record or database ended in a traceback (JSONDecodeError,
KeyError, TypeError, ValueError from numpy's generator, AttributeError 'source_row'), some after the earlier
structures' files were cut; a trajectory cut short or a log removed was continued with a gap and exit 0; a missing
run record was written afresh and the run continued uncompared; another --ops_profile resumed without a word.
"""

import hashlib
import json
import os
import shutil

import numpy as np
import pytest

from conftest import DEMO_VAL, ROOT

V3 = os.path.join(ROOT, "data", "demo_v3_pretrained.ckpt")
V2 = os.path.join(ROOT, "data", "demo_pretrained.ckpt")
OTHER = "other weights"  # (a test's argument: the orb-v3 demo with one weight changed, made by other_weights)
COMMON = ["--device_target", "CPU", "--progress_bar", "false"]


def digest(folder):
    found = {}
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            with open(path, "rb") as f:
                found[name] = hashlib.sha256(f.read()).hexdigest()
    return found


def structures(path, count=3):
    """``count`` demo structures, rattled, in an extxyz file."""
    import ase.db
    import ase.io

    rng = np.random.default_rng(0)
    frames = []
    for row in ase.db.connect(DEMO_VAL).select(limit=count):
        atoms = row.toatoms()
        atoms.calc = None
        atoms.positions += rng.normal(0, 0.05, atoms.positions.shape)
        frames.append(atoms)
    ase.io.write(path, frames, format="extxyz")
    return str(path)


def run(main, capsys, argv):
    """``main(argv)`` in this process: (exit status, its standard error's lines)."""
    status = main([str(a) for a in argv])
    return status, capsys.readouterr().err.strip().splitlines()


def md_args(data, output, *extra, steps=4):
    return ["--checkpoint", V3, "--data", data, "--output", output, "--ensemble", "nvt", "--timestep", "1",
            "--steps", str(steps), "--write_every", "2", "--seed", "5", "--uncertain_above", "0.01", *COMMON, *extra]


@pytest.fixture(scope="module")
def other_weights(tmp_path_factory):
    """The orb-v3 demo checkpoint with one weight moved: the same model, another digest."""
    from mindspore import Tensor

    from orb.io.checkpoint import model_from_checkpoint, save_checkpoint

    model = model_from_checkpoint(V3)
    name, param = next(iter(model.parameters_and_names()))
    param.set_data(Tensor(param.asnumpy() + 1e-3))
    path = str(tmp_path_factory.mktemp("weights") / "other.ckpt")
    save_checkpoint(path, model, {"model": model.cfg.to_dict()})
    return path


@pytest.fixture(scope="module")
def md_run(tmp_path_factory):
    """A finished 4-step run of 3 structures (Langevin: a random generator in each state), its frames uncertain."""
    from orb.inference.md import main

    folder = tmp_path_factory.mktemp("md")
    data = structures(folder / "start.extxyz")
    assert main(md_args(data, str(folder / "run"))) == 0
    return data, folder / "run"


def edit_json(path, change):
    record = json.load(open(path))
    change(record)
    json.dump(record, open(path, "w"))


def cut(path, fraction=0.5):
    text = open(path, "rb").read()
    open(path, "wb").write(text[:int(len(text) * fraction)])


def garbled(path):
    """A frame that is no extxyz (a line edited by hand) before the file's whole frames."""
    text = open(path).read()
    open(path, "w").write("2\nnot a comment line\nCu 0 0\nCu 1 1\n" + text)


DAMAGE = {  # what is done to a finished run's files -> (the file named, what the one line says)
    "empty state": (lambda d: open(d / "state_1.json", "w").close(), "state_1.json", "is empty"),
    "state cut mid-JSON": (lambda d: cut(d / "state_1.json"), "state_1.json", "is cut short"),
    "state without momenta": (lambda d: edit_json(d / "state_1.json", lambda s: s.pop("momenta")), "state_1.json",
                              "key 'momenta' is missing"),
    "step as text": (lambda d: edit_json(d / "state_1.json", lambda s: s.update(step="4")), "state_1.json",
                     "key 'step' must be a whole number"),
    "positions of another shape": (lambda d: edit_json(d / "state_1.json",
                                                       lambda s: s.update(positions=s["positions"][:-1])),
                                   "state_1.json", "key 'positions' must have shape ("),
    "integrator without its generator": (lambda d: edit_json(d / "state_1.json", lambda s: s.update(integrator={})),
                                         "state_1.json", "key 'integrator' lacks rng"),
    "generator state of another kind": (lambda d: edit_json(d / "state_1.json",
                                                            lambda s: s["integrator"].update(rng={"state": 1})),
                                        "state_1.json", "key 'integrator' does not fit Langevin"),
    "state a list": (lambda d: open(d / "state_1.json", "w").write("[1, 2]"), "state_1.json",
                     "holds a JSON list"),
    "trajectory cut short": (lambda d: cut(d / "traj_1.extxyz", 0.7), "traj_1.extxyz", "fewer than the"),
    "log removed": (lambda d: os.remove(d / "log_1.csv"), "log_1.csv", "holds 0 bytes, fewer than the"),
    "empty run record": (lambda d: open(d / "run.json", "w").close(), "run.json", "is empty"),
    "run record a list": (lambda d: open(d / "run.json", "w").write("[]"), "run.json", "holds a JSON list"),
    "run record removed": (lambda d: os.remove(d / "run.json"), "run.json", "are missing, so they cannot be "
                                                                           "compared"),
    "uncertain frames damaged": (lambda d: garbled(d / "uncertain.extxyz"), "uncertain.extxyz",
                                 "cannot read its frames"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_md_state_is_one_line_and_nothing_is_cut(md_run, tmp_path, capsys, damage):
    """Structure 0's trajectory and log also hold a frame written after its state (a kill between the two), which a
    resume cuts back: a refused resume must not have cut it."""
    from orb.inference.md import main

    data, finished = md_run
    folder = tmp_path / "run"
    shutil.copytree(finished, folder)
    with open(folder / "traj_0.extxyz", "a") as f:
        f.write(open(folder / "traj_0.extxyz").read().split("\n", 1)[0] + "\n")  # a frame's first line, cut by a kill
    make, name, says = DAMAGE[damage]
    make(folder)
    before = digest(folder)
    status, lines = run(main, capsys, md_args(data, str(folder), "--resume", steps=6))
    assert status == 2 and len(lines) == 1, lines
    assert name in lines[0] and says in lines[0] and lines[0].startswith("error: "), lines
    assert digest(folder) == before


def test_an_undamaged_md_state_resumes(md_run, tmp_path, capsys):
    """The reader refuses nothing sound: the finished run extended to 6 steps, every structure done."""
    from orb.inference.md import main

    data, finished = md_run
    shutil.copytree(finished, tmp_path / "run")
    status, lines = run(main, capsys, md_args(data, str(tmp_path / "run"), "--resume", steps=6))
    assert status == 0, lines
    summary = json.load(open(tmp_path / "run" / "summary.json"))
    assert [s["steps_done"] for s in summary["structures"]] == [6, 6, 6]


@pytest.mark.parametrize("change", [["--ops_profile", "portable"], ["--precision", "float32-highest"],
                                    ["--batch_size", "2"], ["--checkpoint", OTHER]])
def test_an_md_resume_with_other_arithmetic_is_refused_naming_it(md_run, other_weights, tmp_path, capsys, change):
    from orb.inference.md import main

    data, finished = md_run
    shutil.copytree(finished, tmp_path / "run")
    before = digest(tmp_path / "run")
    argv = md_args(data, str(tmp_path / "run"), "--resume", steps=6)
    flag, value = change[0], change[1] if change[1] != OTHER else other_weights
    if flag in argv:
        argv[argv.index(flag) + 1] = value
    else:
        argv += [flag, value]
    status, lines = run(main, capsys, argv)
    named = {"--ops_profile": "ops_profile: 'cpu' -> 'portable'", "--precision": "precision: 'float32-high' -> "
             "'float32-highest'", "--batch_size": "batch_size: 32 -> 2", "--checkpoint": "weights_digest"}[flag]
    assert status == 2 and len(lines) == 1 and named in lines[0], lines
    assert digest(tmp_path / "run") == before


def relax_args(data, output, *extra, checkpoint=V3):
    return ["--checkpoint", checkpoint, "--data", data, "--output", output, "--steps", "3", "--batch_size", "2",
            "--uncertain_above", "0.01", *COMMON, *extra]


@pytest.fixture(scope="module")
def relax_run(tmp_path_factory):
    from orb.inference.relax import main

    folder = tmp_path_factory.mktemp("relax")
    data = structures(folder / "start.extxyz")
    assert main(relax_args(data, str(folder / "out" / "relaxed.db"))) == 0
    return data, folder / "out"


def foreign_row(folder):
    import ase.db
    from ase.build import bulk

    with ase.db.connect(str(folder / "relaxed.db")) as db:
        db.write(bulk("Cu"))


RELAX_DAMAGE = {
    "database cut short": (lambda d: cut(d / "relaxed.db", 0.4), "relaxed.db", "cannot read it as an ASE database"),
    "a row orb-relax did not write": (foreign_row, "relaxed.db, row 4", "key 'source_row' is missing"),
    "a text file as the output": (lambda d: open(d / "relaxed.db", "w").write("energies\n"), "relaxed.db",
                                  "is not an ASE SQLite database"),
    "run record cut mid-JSON": (lambda d: cut(d / "relaxed.run.json"), "relaxed.run.json", "is cut short"),
    "run record removed": (lambda d: os.remove(d / "relaxed.run.json"), "relaxed.run.json", "are missing"),
    "uncertain frames damaged": (lambda d: garbled(d / "relaxed.uncertain.extxyz"), "relaxed.uncertain.extxyz",
                                 "cannot read its frames"),
}


@pytest.mark.parametrize("damage", list(RELAX_DAMAGE))
def test_a_damaged_relax_output_or_record_is_one_line(relax_run, tmp_path, capsys, damage):
    from orb.inference.relax import main

    data, finished = relax_run
    shutil.copytree(finished, tmp_path / "out")
    make, name, says = RELAX_DAMAGE[damage]
    make(tmp_path / "out")
    before = digest(tmp_path / "out")
    status, lines = run(main, capsys, relax_args(data, str(tmp_path / "out" / "relaxed.db"), "--resume"))
    assert status == 2 and len(lines) == 1, lines
    assert name in lines[0] and says in lines[0], lines
    assert digest(tmp_path / "out") == before


def test_an_empty_relax_output_restarts_every_structure(relax_run, tmp_path, capsys):
    """A zero-byte output (created, never written: SQLite's empty database) holds nothing: all are relaxed again."""
    import ase.db

    from orb.inference.relax import main

    data, finished = relax_run
    shutil.copytree(finished, tmp_path / "out")
    open(tmp_path / "out" / "relaxed.db", "w").close()
    status, lines = run(main, capsys, relax_args(data, str(tmp_path / "out" / "relaxed.db"), "--resume"))
    assert status == 0, lines
    with ase.db.connect(str(tmp_path / "out" / "relaxed.db")) as db:
        assert sorted(row.source_row for row in db.select()) == [1, 2, 3]


@pytest.mark.parametrize("change, refused", [(["--precision", "float32-highest"], "precision: 'float32-high' -> "
                                                                                 "'float32-highest'"),
                                             (["--checkpoint", OTHER], "weights_digest"),
                                             (["--batch_size", "1"], ""), (["--ops_profile", "portable"], "")])
def test_a_relax_resume_with_other_arithmetic_is_refused_or_said(relax_run, other_weights, tmp_path, capsys, change,
                                                                 refused):
    """Precision and model: refused. Batch size and operator profile: the structures left are relaxed from their
    start, in other batches: it continues, and says so in one line."""
    from orb.inference.relax import main

    data, finished = relax_run
    shutil.copytree(finished, tmp_path / "out")
    argv = relax_args(data, str(tmp_path / "out" / "relaxed.db"), "--resume")
    value = change[1] if change[1] != OTHER else other_weights
    if change[0] in argv:
        argv[argv.index(change[0]) + 1] = value
    else:
        argv += [change[0], value]
    before = digest(tmp_path / "out")
    status, lines = run(main, capsys, argv)
    if refused:
        assert status == 2 and len(lines) == 1 and refused in lines[0], lines
        assert digest(tmp_path / "out") == before
    else:
        name = change[0][2:]
        notes = [line for line in lines if line.startswith("note: --resume")]
        assert status == 0 and len(notes) == 1 and f"{name}: " in notes[0], lines
        assert json.load(open(tmp_path / "out" / "relaxed.run.json"))[name] == (
            int(change[1]) if name == "batch_size" else change[1])
