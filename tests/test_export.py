"""orb-export: a checkpoint as MindIR, one graph per padded batch shape, loaded back with MindSpore's own loader,
predicts what the checkpoint predicts (orb-v2, and an orb-v3 conservative model whose forces are derivatives
inside the exported graph); bad input is one line."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import DEMO_VAL, ROOT, noting_mindspore


@pytest.mark.parametrize("checkpoint", ["demo_pretrained.ckpt", "demo_v3_pretrained.ckpt"])
def test_an_exported_model_predicts_what_the_checkpoint_predicts(tmp_path, checkpoint):
    from orb.data.dataset import AseDbDataset
    from orb.data.batching import batch_graphs, pad_batch
    from orb.data.tensors import model_inputs
    from orb.device import set_ops_profile
    from orb.inference.export import load_exported, predictions_of
    from orb.precision import set_sum_form, sum_form_for_device
    from orb.inference.predictor import Predictor
    from orb.io.checkpoint import model_from_checkpoint

    path = os.path.join(ROOT, "data", checkpoint)
    out = tmp_path / "model.mindir"
    env = {k: v for k, v in os.environ.items() if k != "ORB_OPS_PROFILE"}  # (it would override the default)
    result = subprocess.run([sys.executable, "scripts/export.py", "--checkpoint", path, "--output", str(out),
                             "--data", DEMO_VAL, "--device_target", "CPU"], cwd=ROOT, capture_output=True, text=True,
                            timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    description = json.load(open(tmp_path / "model.json"))
    # the default: MindSpore's own operators and Ascend's form of the long sums, so a file made on a CPU is served there
    assert description["ops_profile"] == "portable" and description["sum_form"] == "split"
    set_ops_profile("portable")
    set_sum_form("split")
    try:
        model = model_from_checkpoint(path)
    finally:
        set_ops_profile("auto")
        set_sum_form(sum_form_for_device("CPU"))
    data = AseDbDataset(DEMO_VAL, settings=model.cfg.graph_settings())
    batch = batch_graphs([data.get(i) for i in range(3)])
    for name, shape in description["files"].items():
        assert b"native_activations" not in (tmp_path / name).read_bytes()  # no path to this machine's kernels
        exported = load_exported(str(tmp_path / name))
        padded = pad_batch(batch, shape["nodes"], shape["edges"], shape["graphs"])
        theirs = predictions_of(exported, model_inputs(padded))
        ours = Predictor(model)(batch)
        n = batch.num_nodes
        np.testing.assert_allclose(theirs["energy"][:3], ours["energy"], rtol=1e-6, atol=1e-5)
        np.testing.assert_allclose(theirs["forces"][:n], ours["forces"], atol=1e-5)
        np.testing.assert_allclose(theirs["stress"][:3], ours["stress"], atol=1e-6)
        assert np.abs(ours["forces"]).max() > 1e-2


def test_an_export_in_the_cpu_profile_holds_this_machines_kernels_and_says_so(tmp_path):
    """``--ops_profile cpu``: the graph calls the kernel library by its path on this machine (what the portable
    default keeps out of a file meant for any device), and model.json says which profile it holds."""
    out = tmp_path / "model.mindir"
    result = subprocess.run([sys.executable, "scripts/export.py", "--checkpoint", "data/demo_pretrained.ckpt",
                             "--output", str(out), "--shape", "40,400,3", "--device_target", "CPU", "--ops_profile",
                             "cpu"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    description = json.load(open(tmp_path / "model.json"))
    assert description["ops_profile"] == "cpu" and description["sum_form"] == "float64"  # the CPU's own
    assert b"native_activations" in out.read_bytes()


def test_an_export_in_a_script_leaves_the_profile_and_the_sums_as_they_were(tmp_path):
    """orb-export's run called in-process (a script) builds its model in the portable profile with split sums, then
    puts both back: the script's later models are built as before. Its --output folder is made (it was refused);
    one under a file is one line."""
    from orb.device import configured_profile, set_ops_profile
    from orb.inference.export import main
    from orb.precision import set_sum_form, sum_form, sum_form_for_device

    set_sum_form(sum_form_for_device("CPU"))
    set_ops_profile("cpu")
    try:
        assert main(["--checkpoint", os.path.join(ROOT, "data", "demo_pretrained.ckpt"), "--output",
                     str(tmp_path / "exports" / "v1" / "model.mindir"), "--shape", "40,400,3",
                     "--device_target", "CPU"]) == 0
        assert json.load(open(tmp_path / "exports" / "v1" / "model.json"))["ops_profile"] == "portable"
        assert sorted(os.listdir(tmp_path / "exports" / "v1")) == ["model.json", "model.mindir"]
        assert configured_profile() == "cpu" and sum_form() == "float64"
    finally:
        set_ops_profile("auto")


@pytest.mark.parametrize("args, message, read", [
    (["--checkpoint", "data/missing.ckpt", "--shape", "64,1280,5"], "data/missing.ckpt: checkpoint file does not exist",
     True),
    (["--checkpoint", "data/demo_pretrained.ckpt"], "give the batch shapes to export", False),
    (["--checkpoint", "data/demo_pretrained.ckpt", "--shape", "64,x,5"], "--shape '64,x,5': expected NODES,EDGES,GRAPHS",
     False),
    (["--checkpoint", "README.md", "--shape", "64,1280,5"], "README.md: not a checkpoint (a PyTorch zip, or a MindSpore "
     "file ending in .ckpt)", True),
    (["--checkpoint", "data/demo_pretrained.ckpt", "--data", "data/demo_val.db", "--batch_size", "0"],
     "--batch_size must be within 1 and 100000, got 0", False),
    # (a shape of 1e11 nodes was numpy's 1.1 TiB allocation error and a traceback)
    (["--checkpoint", "data/demo_pretrained.ckpt", "--shape", "100000000000,16,2"],
     "--shape 100000000000,16,2: at most 10000000 nodes, 128 edges a node and a graph a node", False),
])
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, args, message, read):
    """One line, status 2, nothing written; an option's error before MindSpore is imported (1 s), a checkpoint's after
    (its reader needs it)."""
    out = tmp_path / "model.mindir"
    result = subprocess.run(noting_mindspore([sys.executable, "scripts/export.py", *args, "--output", str(out),
                                              "--device_target", "CPU"]), cwd=ROOT, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines
    assert os.listdir(tmp_path) == []
    assert result.stdout.split() == [str(read)]  # MindSpore imported


@pytest.mark.parametrize("key, message", [("numbers", "atom 1 has atomic number 0; orb supports 1..118"),
                                          ("positions", "positions contain NaN or inf")])
def test_data_every_other_command_refuses_is_refused_and_nothing_is_written(tmp_path, key, message):
    """--data is checked as orb-evaluate checks it: an atom of Z=0 or a NaN position is one line naming file, frame
    and key (the shapes were planned on it, and the export written, exit 0)."""
    import ase.io
    from ase import Atoms

    good = Atoms("Cu2", positions=[[0, 0, 0], [0, 0, 2.3]])
    bad = good.copy()
    if key == "numbers":
        bad.numbers[1] = 0
    else:
        bad.positions[1, 2] = np.nan
    data = str(tmp_path / "data.extxyz")
    ase.io.write(data, [good, bad], format="extxyz")
    out = tmp_path / "export"
    result = subprocess.run([sys.executable, "scripts/export.py", "--checkpoint", "data/demo_pretrained.ckpt",
                             "--data", data, "--output", str(out / "m.mindir"), "--device_target", "CPU"], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        f"error: {data}, frame 1, key '{key}': {message}"], result.stderr[-2000:]
    assert not os.path.exists(out) or os.listdir(out) == []


def test_an_output_folder_under_a_file_is_one_line(tmp_path):
    (tmp_path / "notes").write_text("a file, not a folder")
    result = subprocess.run([sys.executable, "scripts/export.py", "--checkpoint", "data/demo_pretrained.ckpt",
                             "--shape", "40,400,3", "--output", str(tmp_path / "notes" / "v1" / "model.mindir"),
                             "--device_target", "CPU"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        f"error: --output {tmp_path / 'notes' / 'v1' / 'model.mindir'}: {tmp_path / 'notes'} is a file, not a folder"], \
        result.stderr[-2000:]
    assert os.listdir(tmp_path) == ["notes"]


def test_an_export_replaces_the_earlier_one_whole_or_not_at_all(tmp_path):
    """A second export of the same name leaves exactly the files its model.json lists (the earlier export's other
    shapes were left beside it, undescribed); one stopped by SIGTERM while it exports ends with one line and status 75
    and leaves the earlier export as it was (it printed MindSpore's analyzer trace, left new files beside the old
    model.json and wrote rank_0/om/analyze_fail.ir into the working folder)."""
    import signal
    import time

    from conftest import wait_until_handling

    out = tmp_path / "out" / "model.mindir"
    out.parent.mkdir()
    command = [sys.executable, os.path.join(ROOT, "scripts", "export.py"), "--checkpoint",
               os.path.join(ROOT, "data", "demo_pretrained.ckpt"), "--output", str(out), "--device_target", "CPU"]
    two = ["--shape", "40,800,3", "--shape", "64,1280,5"]
    first = subprocess.run(command + two, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-2000:]
    assert sorted(os.listdir(out.parent)) == ["model.json", "model_40x800x3.mindir", "model_64x1280x5.mindir"]
    second = subprocess.run(command + ["--shape", "48,960,4"], cwd=tmp_path, capture_output=True, text=True,
                            timeout=600)
    assert second.returncode == 0, second.stderr[-2000:]
    assert sorted(os.listdir(out.parent)) == ["model.json", "model.mindir"]
    assert list(json.load(open(out.parent / "model.json"))["files"]) == ["model.mindir"]
    before = {name: open(out.parent / name, "rb").read() for name in os.listdir(out.parent)}
    process = subprocess.Popen(command + two, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    wait_until_handling(process, signal.SIGTERM)
    deadline = time.time() + 300
    while not any(name.startswith(".") for name in os.listdir(out.parent)):  # the first shape is being written
        assert process.poll() is None and time.time() < deadline, process.communicate()[1][-2000:]
        time.sleep(0.01)
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=300)
    assert process.returncode == 75 and err.strip().splitlines() == [
        f"stopped by SIGTERM while exporting: none of this export's files are kept (an earlier export of {out} is): "
        "run the same command again (exit status 75)"], err[-3000:]
    assert {name: open(out.parent / name, "rb").read() for name in os.listdir(out.parent)} == before
    assert sorted(os.listdir(tmp_path)) == ["out"]  # nothing in the working folder (no rank_0/om/analyze_fail.ir)
    # the disk full as the description is written: the earlier export whole (the new graphs were left beside it)
    full = subprocess.run([sys.executable, "-c", FULL_AT_DESCRIPTION, *command[2:], *two], cwd=tmp_path,
                          capture_output=True, text=True, timeout=600, env=dict(os.environ, PYTHONPATH=ROOT))
    assert full.returncode == 1 and full.stderr.strip().splitlines()[-1].startswith(
        "error: No space left on device"), full.stderr[-3000:]
    assert {name: open(out.parent / name, "rb").read() for name in os.listdir(out.parent)} == before


FULL_AT_DESCRIPTION = """
import errno, os, sys
from orb import files

original = files.write_json

def full(path, value):
    if os.path.basename(path).lstrip(".").startswith("model.json"):  # (its temporary, or itself)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
    return original(path, value)

files.write_json = full
from orb.inference.export import main
sys.exit(main(sys.argv[1:]))
"""


def test_model_json_says_a_stressless_models_stress_output_is_no_prediction():
    """orb_v3_direct_omol's exported graph outputs zeros where the others output stress: model.json says so (it
    described them as stress in eV/Å³, which a deployment would read as a prediction)."""
    from orb.inference.export import described_outputs
    from orb.models.config import ModelConfig

    assert described_outputs(ModelConfig.from_dict({"name": "orb_v2"}))[2] == "stress (graphs, 6) eV/Å³ Voigt, ASE sign"
    omol = described_outputs(ModelConfig.from_dict({"name": "orb_v3_direct_omol"}))
    assert len(omol) == 4 and omol[2] == "stress (graphs, 6): zeros, not a prediction (orb_v3_direct_omol has no " \
                                         "stress head)"


def test_shapes_from_data_keep_a_batch_of_small_structures_while_orb_evaluate_fills_its_steps():
    """--data plans the shapes orb-evaluate packs, with a served batch's graph slots (4 batches' worth of structures
    plus one padding graph): orb-evaluate's own steps have the slots their structures fill."""
    from orb.data.dataset import AseDbDataset
    from orb.inference.evaluate import packed_batches
    from orb.inference.export import shapes_for
    from orb.models import create

    from conftest import SMALL_MODEL

    model = create("orb_v2", **SMALL_MODEL)
    shapes = shapes_for(DEMO_VAL, model, 2)
    assert shapes and all(graphs == 4 * 2 + 1 for _, _, graphs in shapes)
    data = AseDbDataset(DEMO_VAL, require_labels=False, settings=model.cfg.graph_settings())
    batches, buckets = packed_batches(data, 2)
    assert [(b.num_nodes, b.num_edges) for b in buckets] == [shape[:2] for shape in shapes]
    assert {b.num_graphs for b in buckets} == {max(len(batch) for batch in batches) + 1}
