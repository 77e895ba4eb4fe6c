"""No command writes over its own input: every output path (and every file a command replaces or removes beside it)
is compared with every input path, the same file through any spelling (the same string, ./x, absolute, a symlink,
a hard link), before anything is written; a collision is one line naming both paths, exit status 2, and every file
stays byte for byte as it was, with nothing new beside it.

Found before (main at 252e4ef): orb-relax --overwrite deleted its --data database (and --resume appended relaxed rows
to it); orb-md --overwrite deleted the traj_0.extxyz it was to start from; orb-convert replaced its source;
orb-export wrote its description over an ASE JSON database it planned on; orb-evaluate removed the uncertain.extxyz
it evaluated; fine-tuning with --overwrite deleted the checkpoints/last.ckpt it was to start from."""

import hashlib
import os
import shutil

import pytest

from conftest import DEMO_VAL, ROOT

DEMO = os.path.join(ROOT, "data", "demo_pretrained.ckpt")
V3 = os.path.join(ROOT, "data", "demo_v3_pretrained.ckpt")
SPELLINGS = ("same", "dot", "absolute", "symlink", "hardlink")


def digest(folder):
    """Every file and link under ``folder``: its bytes' SHA-256 (a link: its target)."""
    found = {}
    for top, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(top, name)
            key = os.path.relpath(path, folder)
            if os.path.islink(path):
                found[key] = "-> " + os.readlink(path)
            else:
                with open(path, "rb") as f:
                    found[key] = hashlib.sha256(f.read()).hexdigest()
    return found


def spelt(path, how):
    """The file ``path`` (in the current folder) named another way."""
    name = os.path.basename(path)
    if how == "same":
        return name
    if how == "dot":
        return os.path.join(".", name)
    if how == "absolute":
        return os.path.abspath(name)
    other = f"{how}-{name}"
    (os.symlink if how == "symlink" else os.link)(name, other)
    return other


def refused(capsys, tmp_path, main, argv, *named):
    """``main(argv)`` refuses in one line naming ``named``, exit 2, and leaves every file under ``tmp_path`` as it
    was (no new one either)."""
    before = digest(tmp_path)
    status = main([str(a) for a in argv])
    lines = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(lines) == 1, (status, lines)
    assert "would write over its own input" in lines[0] and all(str(n) in lines[0] for n in named), lines
    assert digest(tmp_path) == before
    return lines[0]


def demo_copy(path):
    shutil.copyfile(DEMO_VAL, path)
    return os.path.basename(path)


@pytest.mark.parametrize("flag", ["--resume", "--overwrite"])
@pytest.mark.parametrize("how", SPELLINGS)
def test_relax_never_writes_over_its_data(tmp_path, monkeypatch, capsys, how, flag):
    from orb.inference.relax import main

    monkeypatch.chdir(tmp_path)
    data = demo_copy(tmp_path / "structures.db")
    output = spelt(data, how)
    refused(capsys, tmp_path, main, ["--checkpoint", DEMO, "--data", data, "--output", output, flag,
                                     "--device_target", "CPU"], data, output)


def test_relax_never_replaces_the_uncertain_frames_it_reads_nor_its_checkpoint(tmp_path, monkeypatch, capsys):
    from orb.inference.relax import main

    monkeypatch.chdir(tmp_path)
    import ase.db
    import ase.io

    frames = [row.toatoms() for row in ase.db.connect(DEMO_VAL).select(limit=2)]
    ase.io.write("relaxed.uncertain.extxyz", frames, format="extxyz")  # the last round's frames, relaxed again
    refused(capsys, tmp_path, main, ["--checkpoint", DEMO, "--data", "relaxed.uncertain.extxyz", "--output",
                                     "relaxed.db", "--overwrite", "--device_target", "CPU"],
            "relaxed.uncertain.extxyz")
    shutil.copyfile(DEMO, "model.ckpt")
    refused(capsys, tmp_path, main, ["--checkpoint", "model.ckpt", "--data", "relaxed.uncertain.extxyz", "--output",
                                     "./model.ckpt", "--overwrite", "--device_target", "CPU"], "model.ckpt")


@pytest.mark.parametrize("case", ["trajectory", "uncertain", "folder"])
def test_md_never_cuts_or_removes_its_starting_structures(tmp_path, monkeypatch, capsys, case):
    """A new run started, in the same folder, from a frame of the last one (--overwrite removed it, --resume cut it
    back), or an output folder that is the data folder (its trajectories would be read as structures)."""
    import ase.db
    import ase.io

    from orb.inference.md import main

    monkeypatch.chdir(tmp_path)
    os.mkdir("md")
    frames = [row.toatoms() for row in ase.db.connect(DEMO_VAL).select(limit=2)]
    for k, atoms in enumerate(frames):
        ase.io.write(f"md/traj_{k}.extxyz", atoms, format="extxyz")
    ase.io.write("md/uncertain.extxyz", frames, format="extxyz")
    data, output, flag = {"trajectory": ("md/traj_1.extxyz", "md", "--overwrite"),
                          "uncertain": (os.path.abspath("md/uncertain.extxyz"), "./md/", "--resume"),
                          "folder": ("md", os.path.abspath("md"), "--overwrite")}[case]
    refused(capsys, tmp_path, main, ["--checkpoint", DEMO, "--data", data, "--output", output, flag, "--timestep",
                                     "1", "--steps", "2", "--device_target", "CPU"], data, output)


@pytest.mark.parametrize("how", ["symlink", "dot", "hardlink"])
def test_convert_never_replaces_its_source(tmp_path, monkeypatch, capsys, how):
    from orb.io.convert import main

    monkeypatch.chdir(tmp_path)
    shutil.copyfile(DEMO, "model.ckpt")
    target = spelt("model.ckpt", how)
    refused(capsys, tmp_path, main, ["model.ckpt", target, "--to", "torch", "--overwrite"], "model.ckpt", target)


def test_export_never_writes_over_its_checkpoint_or_data(tmp_path, monkeypatch, capsys):
    """The MindIR file a symlink to the checkpoint; the description ``<stem>.json`` the ASE JSON database the shapes
    are planned on."""
    import ase.db

    from orb.inference.export import main

    monkeypatch.chdir(tmp_path)
    shutil.copyfile(DEMO, "model.ckpt")
    os.symlink("model.ckpt", "model.mindir")
    refused(capsys, tmp_path, main, ["--checkpoint", "model.ckpt", "--output", "model.mindir", "--shape", "16,320,2",
                                     "--device_target", "CPU"], "model.ckpt", "model.mindir")
    with ase.db.connect("structures.json", type="json") as db:
        for row in ase.db.connect(DEMO_VAL).select(limit=2):
            db.write(row.toatoms())
    refused(capsys, tmp_path, main, ["--checkpoint", "model.ckpt", "--output", "structures.mindir", "--data",
                                     "structures.json", "--device_target", "CPU"], "structures.json")


@pytest.mark.parametrize("case", ["uncertain", "folder", "summary"])
def test_evaluate_never_replaces_its_inputs(tmp_path, monkeypatch, capsys, case):
    """Evaluating the last round's uncertain.extxyz into its own folder (an evaluation finding no frame above the
    threshold removed it), a data folder as --output_dir, an ASE JSON database named like an output."""
    import ase.db
    import ase.io

    from orb.inference.evaluate import main

    monkeypatch.chdir(tmp_path)
    os.mkdir("round1")
    frames = [row.toatoms() for row in ase.db.connect(DEMO_VAL).select(limit=2)]
    ase.io.write("round1/uncertain.extxyz", frames, format="extxyz")
    with ase.db.connect("round1/summary.json", type="json") as db:
        for atoms in frames:
            db.write(atoms)
    data = {"uncertain": "round1/uncertain.extxyz", "folder": "round1", "summary": "round1/summary.json"}[case]
    output = "round1" if case != "folder" else os.path.abspath("round1")
    refused(capsys, tmp_path, main, ["--checkpoint", V3, "--data", data, "--output_dir", output,
                                     "--device_target", "CPU", "--uncertain_above", "100"], output)


@pytest.mark.parametrize("case", ["last_checkpoint", "data_folder"])
def test_fine_tuning_never_deletes_its_starting_checkpoint_or_writes_into_its_data(tmp_path, monkeypatch, capsys,
                                                                                    case):
    """``checkpoint_path: outputs/run/checkpoints/last.ckpt`` with --overwrite (deleted before it was loaded), an
    output_dir that is the folder of the training data."""
    import finetune

    monkeypatch.chdir(tmp_path)
    os.makedirs("outputs/run/checkpoints")
    shutil.copyfile(DEMO, "outputs/run/checkpoints/last.ckpt")
    os.mkdir("data")
    demo_copy(tmp_path / "data" / "train.db")
    checkpoint, train, output = {"last_checkpoint": ("outputs/run/checkpoints/last.ckpt", "data/train.db",
                                                     "./outputs/run"),
                                 "data_folder": (DEMO, "data", "data/")}[case]
    refused(capsys, tmp_path, finetune.main, ["--config", os.path.join(ROOT, "configs", "demo.yaml"),
                                              "--checkpoint_path", checkpoint, "--train_data_path", train,
                                              "--val_data_path", "", "--output_dir", output, "--overwrite",
                                              "--device_target", "CPU"], output)
