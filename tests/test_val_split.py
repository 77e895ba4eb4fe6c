"""val_fraction: a seeded share of the training structures held out for validation when no validation file is given,
never trained on, validated as a validation file is, recorded in the run folder and kept by a resume."""

import json
import os
import shutil
import subprocess
import sys

import ase.db
import ase.io
import numpy as np
import pytest
from ase import Atoms
from ase.calculators.singlepoint import SinglePointCalculator

from conftest import DEMO_TRAIN, DEMO_VAL, ROOT, SMALL_MODEL
from test_training import make_cfg, trainer_for

FRACTION, SEED = 0.25, 1234
TIMING = ("train_time", "val_time", "compile_time", "data_wait")


def rounded_frames(count):
    """``count`` demo structures with every value rounded to 6 decimals, so that an extxyz file (8 decimals) holds
    exactly the values an ASE database does."""
    frames = []
    for row in list(ase.db.connect(DEMO_TRAIN).select())[:count]:
        atoms, results = row.toatoms(), row.toatoms().calc.results
        frame = Atoms(atoms.numbers, positions=np.round(atoms.positions, 6), cell=np.round(atoms.cell.array, 6),
                      pbc=atoms.pbc)
        frame.calc = SinglePointCalculator(frame, energy=round(float(results["energy"]), 6),
                                           forces=np.round(results["forces"], 6), stress=np.round(results["stress"], 6))
        frames.append(frame)
    return frames


def write_db(path, frames):
    with ase.db.connect(str(path), append=False) as db:
        for frame in frames:
            db.write(frame)
    return str(path)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """The same 24 structures as an ASE database, an extxyz file and a list of an extxyz file and a database."""
    folder = tmp_path_factory.mktemp("data")
    frames = rounded_frames(24)
    ase.io.write(str(folder / "all.xyz"), frames, format="extxyz")
    for back, frame in zip(ase.io.read(str(folder / "all.xyz"), index=":"), frames):  # (what the test stands on)
        assert np.array_equal(back.positions, frame.positions) and np.array_equal(back.get_forces(), frame.get_forces())
    ase.io.write(str(folder / "first.xyz"), frames[:10], format="extxyz")
    return {"frames": frames, "db": write_db(folder / "all.db", frames), "extxyz": str(folder / "all.xyz"),
            "list": [str(folder / "first.xyz"), write_db(folder / "rest.db", frames[10:])], "folder": folder}


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ORB_CACHE_DIR", str(tmp_path / "cache"))


def split_cfg(tmp_path, train, name="run", **extra):
    values = dict(train_data_path=train, val_data_path="", val_fraction=FRACTION, random_seed=SEED, max_epochs=1,
                  record_batches=True, output_dir=str(tmp_path / name), lr_schedule="constant")
    values.update(extra)
    return make_cfg(tmp_path, **values)


def trained_rows(run, rank=0):
    """The database row ids rank ``rank``'s training steps held, over every epoch."""
    return [row for line in open(os.path.join(run, f"batches_rank{rank}.jsonl")) for row in json.loads(line)["row_ids"]]


def epoch_records(run):
    def clean(value):
        return {k: clean(v) for k, v in value.items() if k not in TIMING} if isinstance(value, dict) else value

    return [clean(r) for r in map(json.loads, open(os.path.join(run, "metrics.jsonl"))) if r["type"] != "step"]


def test_the_split_is_disjoint_seeded_and_recorded(tmp_path, data):
    from orb.data.dataset import AseDbDataset
    from orb.training import val_split
    from orb.training.distributed import DataParallel

    train = AseDbDataset(data["db"])
    cfg = split_cfg(tmp_path, data["db"])
    split = val_split.choose(cfg, train, DataParallel(), None)
    assert len(split.held) == 6 and len(split.kept) == 18  # 0.25 x 24
    assert sorted(np.concatenate([split.kept, split.held])) == list(range(24))
    again = val_split.choose(cfg, train, DataParallel(), None)
    assert np.array_equal(again.held, split.held)
    other = val_split.choose(split_cfg(tmp_path, data["db"], random_seed=SEED + 1), train, DataParallel(), None)
    assert not np.array_equal(other.held, split.held)
    path = val_split.keep(split, str(tmp_path / "out"), DataParallel())
    record = json.load(open(path))
    assert record["held_out"] == split.held.tolist() and record["train_rows"] == 24
    assert (record["val_fraction"], record["random_seed"]) == (FRACTION, SEED)
    assert record["train_fingerprint"] == train.content_fingerprint()
    assert val_split.read_record(path) == record


@pytest.fixture(scope="module")
def explicit_run(tmp_path_factory, data):
    """The split's two parts written as files: trained on the kept structures, validated on a file holding the
    held-out ones (in their order), everything else as the split runs below."""
    from orb.data.selection import hold_out

    folder = tmp_path_factory.mktemp("explicit")
    kept, held = hold_out(24, 6, SEED)
    cfg = split_cfg(folder, write_db(folder / "kept.db", [data["frames"][i] for i in kept]), val_fraction=0.0,
                    val_data_path=write_db(folder / "held.db", [data["frames"][i] for i in held]),
                    reference_energies=dict(fit="least_squares"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ORB_CACHE_DIR", str(folder / "cache"))
        trainer_for(cfg).fit()
    return cfg.output_dir


@pytest.mark.parametrize("kind", ["db", "extxyz", "list"])
def test_held_out_structures_are_never_trained_and_validate_as_a_validation_file(tmp_path, data, explicit_run, kind):
    """Whatever the format, the held-out structures are in no training step; the run (with a least-squares fit of
    the reference energies, a training-only pass) validates them to the values a validation file holding them gives,
    before and after an epoch, and trains to the same values: the fit, the batch plan and the epoch saw only the
    kept structures."""
    from orb.io.checkpoint import load_checkpoint

    trainer = trainer_for(split_cfg(tmp_path, data[kind], reference_energies=dict(fit="least_squares")))
    held = trainer.data.val_sets["val"]
    assert held.dataset is trainer.data.train_source.dataset and len(held) == 6
    assert len(trainer.data.train_source) == 18 and trainer.data.steps_per_epoch == 3  # 8 + 8 + 2
    trainer.fit()
    run = trainer.cfg.output_dir
    seen = trained_rows(run)
    assert len(seen) == 18 and not set(seen) & set(held.ids.tolist())
    records = epoch_records(run)
    assert [r["type"] for r in records] == ["initial", "epoch"] and records[1]["val"]["loss"] > 0
    assert records == epoch_records(explicit_run)
    metas = [load_checkpoint(os.path.join(r, "checkpoints", "best.ckpt"))[2] for r in (run, explicit_run)]
    assert metas[0]["reference_energies_fit"] == metas[1]["reference_energies_fit"]
    assert metas[0]["reference_energies_fit"]["structures"] == 18
    assert (metas[0]["best_val_loss"], metas[0]["best_epoch"]) == (metas[1]["best_val_loss"], metas[1]["best_epoch"])
    assert metas[0]["best_val_loss"] == records[1]["val"]["loss"]  # the best epoch chosen by the held-out loss


@pytest.fixture(scope="module")
def first_epoch(tmp_path_factory, data):
    """The first of two epochs with val_fraction on the database, trained once for the tests below."""
    folder = tmp_path_factory.mktemp("first_epoch")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ORB_CACHE_DIR", str(folder / "cache"))
        trainer_for(split_cfg(folder, data["db"], max_epochs=2)).fit(until_epoch=1)
    return folder / "run"


@pytest.fixture
def one_epoch(tmp_path, data, first_epoch):
    """A copy of that run to resume: its config and its record's text."""
    shutil.copytree(first_epoch, tmp_path / "run")
    cfg = split_cfg(tmp_path, data["db"], max_epochs=2)
    return cfg, open(os.path.join(cfg.output_dir, "val_split.json")).read()


def test_a_resume_keeps_the_recorded_split_and_refuses_another(tmp_path, data, one_epoch, monkeypatch):
    """A resume takes the held-out structures from the record, whatever the code would draw now; a changed
    val_fraction, a validation file instead, or changed training data are refused unless accepted (the record is
    then left as it was); accepted, the split is drawn again and recorded."""
    from orb.data.selection import hold_out
    from orb.errors import ConfigError
    from orb.training import val_split

    cfg, text = one_epoch
    recorded = json.loads(text)["held_out"]
    monkeypatch.setattr(val_split, "hold_out", lambda count, held, seed: hold_out(count, held, seed + 1))
    resumed = trainer_for(cfg, resume=cfg.output_dir)
    assert resumed.data.split.held.tolist() == recorded and resumed.progress.epochs_done == 1
    assert resumed.data.split.describe(cfg, data["db"]).endswith(f"; read from {cfg.output_dir}/val_split.json")
    for change, said in ((dict(val_fraction=0.5), "val_fraction: 0.25 -> 0.5"),
                         (dict(val_fraction=0.0, val_data_path=data["db"]), "val_fraction: the training structures "
                                                                             "held out for validation differ"),
                         (dict(random_seed=7), "random_seed: 1234 -> 7")):
        with pytest.raises(ConfigError, match=said):
            trainer_for(split_cfg(tmp_path, data["db"], max_epochs=2, **change), resume=cfg.output_dir)
        assert open(os.path.join(cfg.output_dir, "val_split.json")).read() == text
    changed = write_db(tmp_path / "changed.db", data["frames"][:23])
    with pytest.raises(ConfigError, match="rows in train_data_path: 24 -> 23"):
        trainer_for(split_cfg(tmp_path, changed, max_epochs=2), resume=cfg.output_dir)
    assert open(os.path.join(cfg.output_dir, "val_split.json")).read() == text
    monkeypatch.undo()
    accepted = trainer_for(split_cfg(tmp_path, data["db"], max_epochs=2, val_fraction=0.5), resume=cfg.output_dir,
                           accept=True)
    assert len(accepted.data.split.held) == 12 and accepted.data.split.redrawn
    record = json.load(open(os.path.join(cfg.output_dir, "val_split.json")))
    assert record["val_fraction"] == 0.5 and record["held_out"] == accepted.data.split.held.tolist()


def test_a_lost_record_is_drawn_again_and_must_be_the_runs(tmp_path, data, one_epoch, monkeypatch):
    """Without its record a resume draws the split again from random_seed: the run's (the checkpoint's digest of it
    agrees) resumes and is recorded again; another (the code that draws it changed) is refused."""
    from orb.data.selection import hold_out
    from orb.errors import ConfigError
    from orb.training import val_split

    cfg, text = one_epoch
    record = os.path.join(cfg.output_dir, "val_split.json")
    os.remove(record)
    monkeypatch.setattr(val_split, "hold_out", lambda count, held, seed: hold_out(count, held, seed + 1))
    with pytest.raises(ConfigError, match="val_fraction: the training structures held out for validation differ"):
        trainer_for(cfg, resume=cfg.output_dir)
    assert not os.path.exists(record)
    monkeypatch.undo()
    resumed = trainer_for(cfg, resume=cfg.output_dir)
    assert resumed.data.split.redrawn and "is missing" in resumed.data.split.origin
    assert open(record).read() == text


@pytest.mark.parametrize("damage, said", [("", "empty"), ("truncated", "not complete JSON"),
                                          ("positions", "held_out is not 6 ascending positions below 24"),
                                          ("other", "not a record of format")])
def test_a_damaged_record_is_one_line_naming_it(tmp_path, one_epoch, damage, said):
    from orb.errors import OrbInputError

    cfg, text = one_epoch
    path = os.path.join(cfg.output_dir, "val_split.json")
    record = json.loads(text)
    damaged = {"": "", "truncated": text[:len(text) // 2], "other": json.dumps({"format": "x"}),
               "positions": json.dumps(dict(record, held_out=record["held_out"][::-1]))}[damage]
    with open(path, "w") as f:
        f.write(damaged)
    with pytest.raises(OrbInputError) as raised:
        trainer_for(cfg, resume=cfg.output_dir)
    message = str(raised.value)
    assert message.startswith(f"{path}: the run's record of its validation split is damaged ({said}")
    assert "\n" not in message and "delete it to draw the split again" in message


def test_a_killed_run_resumes_to_the_uninterrupted_runs_metrics_with_the_same_split(tmp_path):
    """SIGKILL after global step 7 (a step save at 6, between logging boundaries): --resume auto reads the split
    from the record (the start-up log says so) and ends bit for bit at the uninterrupted run, whose start-up log
    said the split in one line."""
    from test_preemption import CALLBACKS, assert_same_run, run_args

    def args(run):
        return run_args(run, val_data_path="", val_fraction=FRACTION, batch_size=4, buckets="[[80,1600]]",
                        save_every_n_steps=3, record_batches="true")

    straight, killed = tmp_path / "straight", tmp_path / "killed"
    done = subprocess.run([sys.executable, "finetune.py", *args(straight)], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    said = [line for line in (straight / "train.log").read_text().splitlines() if "held out" in line]
    assert len(said) == 1 and said[0].endswith(
        f"validation data: 16 of the 64 structures of {DEMO_TRAIN} held out, never trained on "
        f"(val_fraction 0.25, random_seed 1234); drawn, recorded in {straight / 'val_split.json'}"), said
    stopped = subprocess.run([sys.executable, "finetune.py", *args(killed), "--callbacks",
                              "[stop_callbacks:KillAtStep7]"], cwd=ROOT, capture_output=True, text=True, timeout=600,
                             env=CALLBACKS)
    assert stopped.returncode == -9, stopped.stderr[-3000:]
    record = (killed / "val_split.json").read_text()
    assert record == (straight / "val_split.json").read_text()
    resumed = subprocess.run([sys.executable, "finetune.py", *args(killed), "--resume", "auto"], cwd=ROOT,
                             capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-2000:]
    assert "and 6 of 12 steps done" in resumed.stdout
    assert f"random_seed 1234); read from {killed / 'val_split.json'}" in resumed.stdout
    assert (killed / "val_split.json").read_text() == record
    assert_same_run(killed, straight)
    held = {int(json.loads(record)["held_out"][k]) + 1 for k in range(16)}  # row ids of the demo database: 1..64
    assert not held & set(trained_rows(killed)) and len(trained_rows(straight)) == 2 * 48
    evaluating_the_held_out_share_reproduces_the_validation(straight, tmp_path)


def evaluating_the_held_out_share_reproduces_the_validation(run, tmp_path):
    """orb-evaluate --held_out RUN on the run's training data scores the structures the run validated on, and
    reproduces its last epoch's validation metrics (its last.ckpt read as the EMA weights validation used); other
    data is refused in one line naming both."""
    from orb.data.dataset import AseDbDataset
    from orb.errors import OrbInputError
    from orb.inference.evaluate import held_out_positions

    evaluated = subprocess.run([sys.executable, os.path.join("scripts", "evaluate.py"), "--checkpoint",
                                str(run / "checkpoints" / "last.ckpt"), "--data", DEMO_TRAIN, "--held_out", str(run),
                                "--output_dir", str(tmp_path / "held"), "--device_target", "CPU"], cwd=ROOT,
                               capture_output=True, text=True, timeout=600)
    assert evaluated.returncode == 0, evaluated.stderr[-2000:]
    summary = json.load(open(tmp_path / "held" / "summary.json"))
    val = epoch_records(run)[-1]["val"]
    assert summary["structures"] == 16 and summary["held_out"] == str(run / "val_split.json")
    for key in ("energy_mae", "energy_per_atom_mae", "forces_mae", "stress_mae"):
        assert summary[key] == pytest.approx(val[key], rel=2e-5, abs=1e-7), key  # (rounding: other padded shapes)
    with pytest.raises(OrbInputError, match=f"--held_out {run}: the split was drawn from .*not from --data "):
        held_out_positions(str(run), AseDbDataset(DEMO_VAL))


@pytest.mark.parametrize("values, said", [
    (dict(val_fraction=1.0), "config key 'val_fraction' must be in [0, 1) (the share of the training structures held "
                             "out for validation; 0 = off), got 1.0"),
    (dict(val_fraction=-0.1), "config key 'val_fraction' must be in [0, 1)"),
    (dict(val_fraction="some"), "config key 'val_fraction' must be a number, got 'some'"),
    (dict(patience=2), "config key 'patience' stops on the validation loss and needs val_data_path or val_fraction")])
def test_config_errors_are_one_line(values, said):
    from orb.errors import ConfigError
    from orb.training.config import config_from_dict

    with pytest.raises(ConfigError) as raised:
        config_from_dict(dict(dict(val_data_path=""), **values))
    assert str(raised.value).startswith(said) and "\n" not in str(raised.value)
    assert config_from_dict(dict(val_data_path="", val_fraction=0.1, patience=2)).val_fraction == 0.1
    assert config_from_dict({}).val_fraction == 0.0  # off by default: every existing config keeps its numbers


@pytest.mark.parametrize("fraction, world, said", [
    (0.01, 1, "holds out 0 of the 24 structures of x.db: none to validate; raise it or set val_data_path"),
    (0.05, 2, "holds out 1 of the 24 structures of x.db: 1 to validate, fewer than the 2 workers; raise it"),
    (0.99, 1, "holds out 24 of the 24 structures of x.db, leaving 0 to train on; lower it"),
    (0.97, 2, "holds out 23 of the 24 structures of x.db, leaving 1 to train on, fewer than the 2 workers; lower it")])
def test_a_split_that_leaves_a_part_empty_is_refused_naming_the_counts(fraction, world, said):
    from orb.errors import ConfigError
    from orb.training.val_split import held_out_count

    with pytest.raises(ConfigError, match=f"^config key 'val_fraction' \\({fraction}\\) {said}"):
        held_out_count(fraction, 24, world, "x.db")
    assert held_out_count(0.1, 24, 2, "x.db") == 2 and held_out_count(0.3, 10, 1, "x.db") == 3  # the nearest count


def test_refusals_end_the_command_with_one_line_and_leave_nothing(tmp_path):
    """finetune.py: a fraction out of range, and one that holds out no structure of the data, each one line on
    stderr, exit 2, no traceback and no output folder."""
    for fraction, said in (("1", "config key 'val_fraction' must be in [0, 1)"),
                           ("0.005", "config key 'val_fraction' (0.005) holds out 0 of the 64 structures of "
                                     f"{DEMO_TRAIN}: none to validate")):
        out = tmp_path / f"run{fraction}"
        result = subprocess.run([sys.executable, "finetune.py", "--config", "configs/demo.yaml", "--device_target",
                                 "CPU", "--output_dir", str(out), "--val_data_path", "", "--val_fraction", fraction],
                                cwd=ROOT, capture_output=True, text=True, timeout=300)
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"error: {said}"), result.stderr
        assert "Traceback" not in result.stdout
        assert not out.exists()


def test_a_kill_while_recording_leaves_no_partial_file(tmp_path):
    """SIGKILL in the middle of writing val_split.json: no record (never half of one); the next start removes the
    writer's temporary. A run that fails before its first step takes its record with it."""
    from orb.training.outputs import discard_unstarted, prepare_output_dir

    out = tmp_path / "run"
    code = ("import os, signal, sys, numpy as np\n"
            f"sys.path.insert(0, {ROOT!r})\n"
            "import orb.files as files\n"
            "from orb.training import val_split\n"
            "from orb.training.distributed import DataParallel\n"
            "files.fsync_file = lambda path: os.kill(os.getpid(), signal.SIGKILL)\n"
            "split = val_split.ValSplit(np.arange(3), np.arange(3, 5), {'held_out': [3, 4]})\n"
            f"val_split.keep(split, {str(out)!r}, DataParallel())\n")
    killed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert killed.returncode == -9, killed.stderr[-2000:]
    left = os.listdir(out)
    assert "val_split.json" not in left and len(left) == 1 and left[0].startswith(".val_split.json.tmp-"), left
    prepare_output_dir(str(out), resume=True, overwrite=False)
    assert sorted(os.listdir(out)) == ["checkpoints"]
    (out / "val_split.json").write_text("{}")
    (out / "train.log").write_text("started\n")
    discard_unstarted(str(out))
    assert not out.exists()


def test_every_rank_holds_rank_0s_split(tmp_path, data, one_epoch, monkeypatch):
    """Two ranks (threads summing through a shared all-reduce): rank 0 draws the split, or on resume reads it from
    the record (here unlike what drawing would give now), and rank 1 receives the same positions; a damaged record
    stops both, rank 0 naming it and rank 1 saying rank 0 could not read it."""
    import threading

    from orb.data.dataset import AseDbDataset
    from orb.data.selection import hold_out
    from orb.errors import ClusterError, OrbInputError
    from orb.training import val_split
    from orb.training.distributed import DataParallel
    from test_pieces import ThreadRanks

    cfg, text = one_epoch

    def on_two_ranks(resume):
        ranks, out = ThreadRanks(2), {}

        def rank(r):
            try:
                dp = DataParallel(r, 2, all_reduce=ranks.all_reduce(r))
                out[r] = val_split.choose(cfg, AseDbDataset(data["db"]), dp, resume)
            except Exception as exc:
                out[r] = exc

        threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        return out

    fresh = on_two_ranks(None)
    drawn = hold_out(24, 6, SEED)[1]
    assert fresh[0].held.tolist() == fresh[1].held.tolist() == drawn.tolist()
    assert fresh[1].kept.tolist() == sorted(set(range(24)) - set(drawn.tolist()))
    monkeypatch.setattr(val_split, "hold_out", lambda count, held, seed: hold_out(count, held, seed + 1))
    resumed = on_two_ranks(cfg.output_dir)
    assert resumed[0].held.tolist() == resumed[1].held.tolist() == json.loads(text)["held_out"]
    path = os.path.join(cfg.output_dir, "val_split.json")
    with open(path, "w") as f:
        f.write(text[:20])
    failed = on_two_ranks(cfg.output_dir)
    assert isinstance(failed[0], OrbInputError) and str(failed[0]).startswith(f"{path}: the run's record")
    assert isinstance(failed[1], ClusterError) and str(failed[1]) == (
        f"rank 0 could not read the validation split {path} (its log says why)")


def test_two_workers_hold_out_the_same_structures_and_validate_their_parts(tmp_path, data):
    """msrun with 2 workers: the same record as one device's, no held-out structure in either rank's steps, and the
    validation metrics (each rank validating its part, summed) one device's to rounding."""
    from test_parallel import common_args, epochs, launch, single

    extra = dict(val_data_path="", val_fraction=FRACTION, random_seed=SEED, num_buckets=1)
    job = launch(common_args(tmp_path / "par", data["db"], **extra), tmp_path / "logs", cwd=ROOT,
                 env_extra={"ORB_CACHE_DIR": str(tmp_path / "cache")})
    out, _ = job.communicate(timeout=600)
    one = single(common_args(tmp_path / "one", data["db"], **extra), timeout=600)
    assert job.returncode == 0 and one.returncode == 0, out[-3000:] + one.stderr[-3000:]
    record = json.loads((tmp_path / "par" / "val_split.json").read_text())
    assert record == json.loads((tmp_path / "one" / "val_split.json").read_text())
    held = {int(p) + 1 for p in record["held_out"]}  # row ids 1..24
    seen = [set(trained_rows(tmp_path / "par", rank)) for rank in (0, 1)]
    assert not (seen[0] | seen[1]) & held and len(seen[0] | seen[1]) == 18 and seen[0] and seen[1]
    for a, b in zip(epochs(tmp_path / "par"), epochs(tmp_path / "one")):
        for key, value in b["val"].items():
            if key not in TIMING and not isinstance(value, dict):
                assert a["val"][key] == pytest.approx(value, rel=1e-4, abs=2e-3 if "cosine" in key else 1e-6), key
