"""val_fraction: a seeded share of the training structures held out for validation when no validation file is given,
never trained on, validated as a validation file is, recorded in the run folder and kept by a resume."""

import json
import os
import subprocess
import sys

import ase.db
import ase.io
import numpy as np
import pytest
from ase import Atoms
from ase.calculators.singlepoint import SinglePointCalculator

from conftest import DEMO_TRAIN, ROOT, SMALL_MODEL
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


def trained_rows(run):
    """The database row ids each training step held, over every epoch."""
    return [row for line in open(os.path.join(run, "batches_rank0.jsonl")) for row in json.loads(line)["row_ids"]]


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
    fits = [load_checkpoint(os.path.join(r, "checkpoints", "last.ckpt"))[2]["reference_energies_fit"]
            for r in (run, explicit_run)]
    assert fits[0] == fits[1] and fits[0]["structures"] == 18
