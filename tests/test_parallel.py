"""Data parallel with msrun on CPU: real workers, compared with one device.

Jobs share one small setup: 9 structures (global batches of 4, 4, 1 -- the last smaller than the
2 workers), 3 buckets, constant learning rate, augmentation on. Every job gets its own free port
and a time bound. msrun comes with MindSpore: these tests never skip.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import ase.db
import numpy as np
from ase.calculators.singlepoint import SinglePointCalculator
import pytest

from orb.files import free_port
from conftest import DEMO_TRAIN, DEMO_VAL, ROOT, SMALL_MODEL, descendants, own_compile_cache

TIMING = ("train_time", "val_time", "compile_time", "data_wait")
# MindSpore's cluster notices a vanished process after MS_NODE_TIMEOUT seconds (default 30): shorter in tests
FAST_FAILURE = {"MS_NODE_TIMEOUT": "10"}


def common_args(out, train, **extra):
    values = dict(train_data_path=train, val_data_path=DEMO_VAL, val_fraction=0, output_dir=str(out),
                  checkpoint_path="", batch_size=4, max_epochs=2, lr=1e-3, lr_schedule="constant", num_buckets=3,
                  log_every_n_steps=2, record_batches="true", progress_bar="false", device_target="CPU", data_workers=0)
    values.update(extra)
    # random weights of a small orb-v2 over the templates' published orb-v3, unless the test names another model
    model = dict(SMALL_MODEL, name=values.pop("model.name", "orb_v2"))
    args = sum(([f"--{k}", str(v)] for k, v in values.items()), [])
    return args + sum((["--model." + k, str(v)] for k, v in model.items()), [])


def launch(args, log_dir, cwd, config="configs/config_parallel.yaml", env_extra=None, prefix=()):
    """run_parallel.sh with 2 workers (the launcher finds msrun next to this interpreter)."""
    env = dict(os.environ, MASTER_PORT=str(free_port()), WORKER_NUM="2", LOG_DIR=str(log_dir),
               CLUSTER_TIME_OUT="60", PYTHON=sys.executable)
    env.update(env_extra or {})
    return subprocess.Popen([*prefix, "bash", os.path.join(ROOT, "run_parallel.sh"), config, *args], cwd=cwd,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def msrun_started(launcher: int) -> bool:
    """Whether the launcher's child msrun runs its own code (not the launcher's copy forked, before its exec: its
    cmdline is the launcher's then)."""
    for pid in descendants(launcher):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"orb.training.msrun_main" in f.read():
                    return True
        except OSError:
            continue
    return False


def single(args, timeout=420):
    return subprocess.run([sys.executable, os.path.join(ROOT, "finetune.py"), "--config", "finetune_orb_v3",
                           *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def weights(run_dir, name="last.ckpt"):
    from orb.io.checkpoint import load_checkpoint

    w, opt, _ = load_checkpoint(os.path.join(run_dir, "checkpoints", name))
    return w, opt


def epochs(run_dir):
    return [r for r in map(json.loads, open(os.path.join(run_dir, "metrics.jsonl"))) if r["type"] == "epoch"]


def without_timing(record):
    return {p: {k: v for k, v in record[p].items() if k not in TIMING} for p in ("train", "val")}


def assert_same_weights(a, b, rel=1e-5):
    """Per tensor within ``rel`` (L2): float32 sums of the same numbers in another order (2 ranks' partial
    gradients then the all-reduce, vs one device's sum) differ by rounding only."""
    for key in b:
        diff = np.linalg.norm(a[key].astype(np.float64) - b[key])
        assert diff <= rel * max(np.linalg.norm(b[key].astype(np.float64)), 1e-3), key


@pytest.fixture(scope="module")
def nine_rows(tmp_path_factory):
    """9 demo structures, two of them (rows 3 and 7) without a stress label: a rank's share of a step may hold none
    with stress, and its stress normaliser's sums, loss terms and stress MAE count must still add up to one
    device's."""
    path = str(tmp_path_factory.mktemp("data") / "nine.db")
    with ase.db.connect(DEMO_TRAIN) as src, ase.db.connect(path) as dst:
        for k, row in enumerate(list(src.select())[:9]):
            atoms = row.toatoms()
            if k in (2, 6):
                atoms.calc = SinglePointCalculator(atoms, energy=row.energy, forces=row.forces)
            dst.write(atoms)
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory, nine_rows):
    """2-worker Adam job started from the user's own folder with a relative config path, and the single-device run.
    The job compiles into a cache of its own (``cache``: empty at first), which the module's later jobs of the same
    settings load."""
    base = tmp_path_factory.mktemp("parallel")
    user_dir = base / "user"
    user_dir.mkdir()
    shutil.copy(os.path.join(ROOT, "configs", "config_parallel.yaml"), user_dir / "my.yaml")
    cache = own_compile_cache(base / "cache")
    job = launch(common_args("par", nine_rows), base / "logs", cwd=user_dir, config="my.yaml", env_extra=cache)
    one = single(common_args(base / "single", nine_rows))
    out, _ = job.communicate(timeout=420)
    return {"base": base, "par": user_dir / "par", "single": base / "single", "status": job.returncode,
            "output": out, "single_result": one, "cache": cache}


def test_parallel_job_matches_one_device(runs):
    assert runs["single_result"].returncode == 0, runs["single_result"].stderr[-3000:]
    assert runs["status"] == 0, runs["output"][-3000:]
    assert "worker logs in" in runs["output"]
    par, _ = weights(runs["par"])  # output_dir "par" is relative to where the job was started
    one, _ = weights(runs["single"])
    assert_same_weights(par, one)
    ep_par, ep_one = epochs(runs["par"]), epochs(runs["single"])
    assert len(ep_par) == len(ep_one) == 2
    for a, b in zip(ep_par, ep_one):
        for part in ("train", "val"):
            for key, value in b[part].items():
                if key not in TIMING:
                    # near initialisation the predicted forces are tiny, so their directions (and this
                    # cosine) shift with float rounding; every other metric agrees to ~1e-7
                    tol = 2e-3 if key == "forces_cosine" else 1e-6
                    assert a[part][key] == pytest.approx(value, rel=1e-4, abs=tol), (part, key)


def test_same_bucket_on_every_rank_and_one_compilation_each(runs):
    logs = {r: (runs["base"] / "logs" / f"worker_{r}.log").read_text() for r in (0, 1)}
    shapes = {r: re.findall(r"compiling the (train|eval) step for batch shape \((.*?)\)", logs[r]) for r in (0, 1)}
    assert shapes[0] == shapes[1]  # same shapes in the same order: a rank waits only for a graph it needs next
    train = [s for k, s in shapes[0] if k == "train"]
    assert len(train) == len(set(train)) >= 2  # several buckets used, each compiled once
    assert len(train) <= 3
    # each graph compiled by one rank only, the other loaded it (the job's cache was empty)
    loaded = {r: len(re.findall(r"the \w+ step's graph came from the compile cache", logs[r])) for r in (0, 1)}
    assert loaded[0] + loaded[1] == len(shapes[0]), loaded  # (a rank that came later waited, or found it written)


def test_every_row_once_per_epoch_across_ranks(runs):
    seen = {}
    for rank in (0, 1):
        for line in open(runs["par"] / f"batches_rank{rank}.jsonl"):
            rec = json.loads(line)
            seen.setdefault(rec["epoch"], []).append((rank, rec["step"], rec["row_ids"]))
    for epoch, steps in seen.items():
        rows = sorted(i for _, _, ids in steps for i in ids)
        assert rows == list(range(1, 10)), epoch  # all 9 rows, none twice
        per_rank = {r: [s for rr, s, _ in steps if rr == r] for r in (0, 1)}
        assert per_rank[0] == per_rank[1]  # both ranks run the same steps, even when one has no data
    assert any(ids == [] for _, _, ids in seen[1])  # the last batch of 1 leaves a rank empty (padded)


def test_only_rank0_writes_and_the_console_shows_rank0(runs):
    assert (runs["par"] / "checkpoints" / "last.ckpt").exists() and (runs["par"] / "train.log").exists()
    worker1 = (runs["base"] / "logs" / "worker_1.log").read_text()
    assert "Epoch: 2/2" not in worker1 and "parameters identical on all 2 ranks" in worker1
    assert "Epoch: 2/2, train_metrics:" in runs["output"]
    assert " rank 1 " not in runs["output"]  # rank 1's log lines stay in its worker log
    # MindSpore's log is kept to errors also where it writes past GLOG_v (each worker's TCP client and server said
    # "[INFO] DISTRIBUTED ... Event base dispatch success!" as the job ended, rank 0's on the console)
    assert "Event base dispatch" not in runs["output"] + worker1
    assert len([l for l in open(runs["par"] / "metrics.jsonl") if '"type": "epoch"' in l]) == 2  # written once


def test_strategies_on_orb_v3_two_workers_equal_one_device(tmp_path, nine_rows):
    """freeze, lr_multipliers, anchor and LoRA (adapters beside the other parameters) on an orb-v3 model, plain
    SGD: 2 workers end with one device's weights (every factor and penalty applied once, after the gradient
    sum); the frozen layer is the starting one; the exported weights are plain."""
    extra = {"optimizer": "sgd", "gradient_clip_mode": "none", "lr": 0.05, "model.name": "orb_v3_direct_20_omat",
             "num_buckets": 1, "freeze": "[layers:0]", "lr_multipliers": "{encoder: 0.25}", "anchor.weight": 0.5,
             "anchor.groups": "[heads]", "lora.rank": 2, "lora.groups": "[layers:1]", "lora.train_others": "true",
             "val_data_path": ""}  # weights and exports are compared: no validation set to compile for
    job = launch(common_args(tmp_path / "par", nine_rows, **extra), tmp_path / "logs", cwd=ROOT)
    one = single(common_args(tmp_path / "one", nine_rows, **extra), timeout=600)
    out, _ = job.communicate(timeout=600)
    assert job.returncode == 0 and one.returncode == 0, out[-2000:] + one.stderr[-2000:]
    par, _ = weights(tmp_path / "par")
    ref, _ = weights(tmp_path / "one")
    assert any(k.endswith(".lora_b") and np.abs(v).max() > 0 for k, v in ref.items())  # the adapters trained
    assert_same_weights(par, ref)
    from orb.io.checkpoint import load_checkpoint, to_torch_state_dict
    from orb.models import create

    start = to_torch_state_dict(create("orb_v3_direct_20_omat", seed=1234, **SMALL_MODEL))
    for key, value in ref.items():
        if key.startswith("model.gnn_stacks.0.") and key.endswith(".lora_b"):
            assert not value.any(), key  # a layer not asked for carries zero adapters that never train
        elif key.startswith("model.gnn_stacks.0.") and not key.endswith(".lora_a"):
            np.testing.assert_array_equal(value, start[key], err_msg=key)
    exported = load_checkpoint(str(tmp_path / "par" / "checkpoints" / "best_weights.ckpt"))[0]
    assert set(exported) == set(start)


def test_fp16_mixed_two_workers_equal_one_device(tmp_path, nine_rows):
    """fp16-mixed in data parallel: 2 workers end with one device's weights and loss scale, and skip the same steps
    (none here); the checkpoint's weights stay float32. (From a loss scale near the overflow threshold the two skip
    different steps: a rank's float16 weight gradient sums half the batch, one device's all of it.)"""
    extra = {"precision": "fp16-mixed", "num_buckets": 1, "lr": 3e-3, "initial_loss_scale": 1024}
    job = launch(common_args(tmp_path / "par", nine_rows, **extra), tmp_path / "logs", cwd=ROOT)
    one = single(common_args(tmp_path / "one", nine_rows, **extra), timeout=600)
    out, _ = job.communicate(timeout=600)
    assert job.returncode == 0 and one.returncode == 0, out[-2000:] + one.stderr[-2000:]
    (par, par_opt), (ref, ref_opt) = weights(tmp_path / "par"), weights(tmp_path / "one")
    assert all(v.dtype == np.float32 for k, v in ref.items() if np.issubdtype(v.dtype, np.floating))
    # (float16 products of half a batch or of the whole: a rounding of another sum now and then, nothing more)
    assert_same_weights(par, ref, rel=5e-3)
    assert par_opt["loss_scale"] == ref_opt["loss_scale"] == 1024
    skipped = [[e["train"].get("nonfinite_steps", 0) for e in epochs(tmp_path / run)] for run in ("par", "one")]
    assert skipped[0] == skipped[1] == [0, 0]


def test_replay_two_workers_equal_one_device(tmp_path, nine_rows):
    """Replay on 2 workers: the starting model's passes over the data (farthest-point descriptors, pseudo-labels,
    the residual fit of the reference energies) are computed in parts by the ranks and summed; every rank then
    holds what one device computes, trains each step's replay structures (each rank its share; separate replay
    heads, whose normalisers absorb only replay structures over both ranks) and ends, with plain SGD, at one
    device's weights; the same rows in every step. Plain SGD, constant lr, no clipping: the update is lr x
    gradient, so a gradient off by any factor (a loss not divided by the global batch, a mean instead of a sum over
    ranks) moves every weight by that factor -- far outside the 1e-5 rounding bound (Adam would hide it)."""
    from orb.io.checkpoint import load_checkpoint, save_checkpoint
    from orb.models import create

    replay = str(tmp_path / "replay.db")
    with ase.db.connect(os.path.join(ROOT, "data", "pretrain", "pretrain_train.db")) as src, \
            ase.db.connect(replay) as dst:
        for row in list(src.select())[:20]:
            dst.write(row.toatoms())
    start = str(tmp_path / "start.ckpt")
    save_checkpoint(start, create("orb_v2", seed=7, **SMALL_MODEL))
    extra = {"optimizer": "sgd", "gradient_clip_mode": "none", "lr": 0.05, "checkpoint_path": start,
             "replay.data_path": replay, "replay.fraction": 0.5, "replay.labels": "model", "replay.num_samples": 8,
             "replay.val_samples": 5, "replay.selection": "fps", "replay.head": "separate",
             "reference_energies.fit": "residual",
             "num_buckets": 1, "val_data_path": ""}  # one compilation per step kind: buckets agree in the tests above
    cache = {"ORB_CACHE_DIR": str(tmp_path / "cache")}
    job = launch(common_args(tmp_path / "par", nine_rows, **extra), tmp_path / "logs", cwd=ROOT, env_extra=cache)
    one = single(common_args(tmp_path / "one", nine_rows, **extra), timeout=600)
    out, _ = job.communicate(timeout=600)
    assert job.returncode == 0 and one.returncode == 0, out[-3000:] + one.stderr[-3000:]
    for r in (0, 1):
        log = (tmp_path / "logs" / f"worker_{r}.log").read_text()
        assert "replay: 8 of 15 structures" in log and "pseudo-labels of 13 structures" in log
    _, _, meta_par = load_checkpoint(str(tmp_path / "par" / "checkpoints" / "last.ckpt"))
    _, _, meta_one = load_checkpoint(str(tmp_path / "one" / "checkpoints" / "last.ckpt"))
    for symbol, change in meta_one["reference_energies_fit"]["change"].items():
        assert meta_par["reference_energies_fit"]["change"][symbol] == pytest.approx(change, rel=1e-5, abs=1e-6)

    def steps(run, ranks):
        rows = {}
        for rank in ranks:
            for line in open(run / f"batches_rank{rank}.jsonl"):
                rec = json.loads(line)
                rows.setdefault(rec["step"], []).extend(map(tuple, rec["row_ids"]))
        return {step: sorted(ids) for step, ids in rows.items()}

    assert steps(tmp_path / "par", (0, 1)) == steps(tmp_path / "one", (0,))
    assert all(sum(kind == "replay" for kind, _ in ids) in (1, 2) for ids in steps(tmp_path / "one", (0,)).values())
    from orb.io.checkpoint import to_torch_state_dict

    ref, initial = weights(tmp_path / "one")[0], to_torch_state_dict(create("orb_v2", seed=7, **SMALL_MODEL))
    moved = [np.linalg.norm(ref[k] - initial[k]) / max(np.linalg.norm(initial[k]), 1e-3) for k in initial
             if k in ref and "normalizer" not in k]
    assert np.median(moved) > 1e-3  # training moved the weights well beyond the comparison's tolerance
    assert_same_weights(weights(tmp_path / "par")[0], ref)
    ep_par, ep_one = epochs(tmp_path / "par")[-1], epochs(tmp_path / "one")[-1]
    for key, value in ep_one["replay_val"].items():
        if key not in TIMING and not isinstance(value, dict):
            assert ep_par["replay_val"][key] == pytest.approx(value, rel=1e-4, abs=2e-3 if "cosine" in key else 1e-6)


def records_without_timing(run_dir):
    """Every record of metrics.jsonl with its timings left out: what must equal, value by value."""
    def clean(value):
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items() if k not in TIMING}
        return value

    return [clean(json.loads(line)) for line in open(os.path.join(run_dir, "metrics.jsonl"))]


def test_killed_stopped_in_validation_and_by_the_scheduler_resumes_equal_the_uninterrupted_run(tmp_path):
    """2 workers, a log record every 4 steps, a step save every 3; one run interrupted three ways, each resumed with
    --resume auto:
    1. both workers killed (SIGKILL) after global step 7: the run continues from the step-6 save, between two log
       boundaries, whose open interval held each rank's own metric sums (every rank was given rank 0's: epoch-1
       loss 2.611 vs 2.693);
    2. SIGTERM during the first epoch's validation: exit 75, saved at the epoch's end (global step 16) with each
       rank's validation sums so far (bit for bit), which the resume continues;
    3. SIGTERM to the launcher (as a scheduler sends it) in the middle of the second epoch: it relays the signal to
       both workers, which agree on a step through the interval all-reduce, save there and stop; run_parallel
       exits 75 with one line; the resumed job reads the checkpoint once, on rank 0.
    Weights, optimizer state and every record of metrics.jsonl equal the uninterrupted 2-worker run's, value by
    value."""
    extra = dict(train_data_path=DEMO_TRAIN, max_epochs=2, lr_schedule="constant", record_batches="false",
                 log_every_n_steps=4, save_every_n_steps=3, num_buckets=1)  # one compilation per launch
    callbacks = dict(FAST_FAILURE, PYTHONPATH=os.path.join(ROOT, "tests"))
    par = tmp_path / "par"
    killed = launch(common_args(par, DEMO_TRAIN, callbacks="[stop_callbacks:KillAtStep7]", **extra),
                    tmp_path / "logs1", cwd=ROOT, env_extra=callbacks)
    out, _ = killed.communicate(timeout=420)
    assert killed.returncode != 0, out[-3000:]
    # the uninterrupted run loads the graphs the killed one kept (one rank compiled each, the other loaded it)
    straight = launch(common_args(tmp_path / "straight", DEMO_TRAIN, **extra), tmp_path / "logs0", cwd=ROOT)
    from orb.io.checkpoint import load_checkpoint

    meta = load_checkpoint(str(par / "checkpoints" / "last.ckpt"))[2]
    assert (meta["global_step"], meta["step_in_epoch"]) == (6, 6) and len(meta["interval_sums"]) == 2
    stopped = launch(common_args(par, DEMO_TRAIN, callbacks="[stop_callbacks:TermInFirstValidation]", **extra)
                     + ["--resume", "auto"], tmp_path / "logs2", cwd=ROOT, env_extra=callbacks)
    out, _ = stopped.communicate(timeout=420)
    assert stopped.returncode == 75, out[-3000:]
    for r in (0, 1):
        assert "stopped by SIGTERM at the validation of epoch 1 (global step 16)" in (
            tmp_path / "logs2" / f"worker_{r}.log").read_text()
    meta = load_checkpoint(str(par / "checkpoints" / "last.ckpt"))[2]
    assert (meta["epoch"], meta["global_step"], meta["step_in_epoch"]) == (0, 16, 16)
    assert meta["validation"]["batches"] == 1 and len(meta["validation"]["sums"]) == 2  # each rank's sums, kept

    metrics = par / "metrics.jsonl"
    records_before = metrics.read_text().count('"type": "step"')
    term = launch(common_args(par, DEMO_TRAIN, **extra) + ["--resume", "auto"], tmp_path / "logs3", cwd=ROOT)
    deadline = time.time() + 300
    while metrics.read_text().count('"type": "step"') == records_before:  # the second epoch's first record
        assert term.poll() is None and time.time() < deadline
        time.sleep(0.2)
    term.send_signal(signal.SIGTERM)  # run_parallel.sh execs the launcher: this is the launcher
    out, _ = term.communicate(timeout=300)
    assert term.returncode == 75, out[-3000:]
    assert "run_parallel: stopped by SIGTERM with the state saved" in out
    lines = [re.search(r"stopped by SIGTERM at (epoch 2, step \d+)", (tmp_path / "logs3" / f"worker_{r}.log")
                       .read_text()) for r in (0, 1)]
    assert lines[0] and lines[1] and lines[0].group(1) == lines[1].group(1)  # the same step on both ranks
    assert "continuing the stopped validation of val after batch 1 of" in (tmp_path / "logs3" / "worker_0.log").read_text()
    assert "received " + str(par / "checkpoints" / "last.ckpt") + " from rank 0" in (
        tmp_path / "logs3" / "worker_1.log").read_text()  # one read of the shared file system, not one per rank
    assert 0 < load_checkpoint(str(par / "checkpoints" / "last.ckpt"))[2]["step_in_epoch"] < 16

    final = launch(common_args(par, DEMO_TRAIN, **extra) + ["--resume", "auto"], tmp_path / "logs4", cwd=ROOT)
    out, _ = final.communicate(timeout=420)
    assert final.returncode == 0 and "resumed from" in out, out[-3000:]
    out, _ = straight.communicate(timeout=420)
    assert straight.returncode == 0, out[-3000:]
    (wa, oa), (wb, ob) = weights(par), weights(tmp_path / "straight")
    for got, expected in ((wa, wb), (oa, ob)):
        assert set(got) == set(expected)
        for key in expected:
            np.testing.assert_array_equal(got[key], expected[key], err_msg=key)
    assert records_without_timing(par) == records_without_timing(tmp_path / "straight")


def test_orb_v3_two_workers_stopped_and_resumed_equal_one_device(tmp_path, nine_rows, monkeypatch):
    """orb-v3: a small conservative model (forces and stress by autodiff, so its training step is a
    gradient of a gradient) on 2 workers with Adam's state sharded (optimizer_shard: each rank keeps half of it),
    stopped (SIGTERM) at the last step of the first epoch and resumed, ends with the weights, optimizer state and
    normalisers of one device's uninterrupted, unsharded two epochs: the saved state is complete (gathered) and a
    resume continues it, with every rank's graphs from the compile cache."""
    extra = {"model.name": "orb_v3_conservative_20_omat",
             "num_buckets": 1}  # one compilation of the double backward per process (bucket agreement: tests above)
    # the ranks count the neighbours, then read them back; the resume loads the graphs the first job kept
    cache = {"ORB_CACHE_DIR": str(tmp_path / "cache")}
    stop = dict(cache, PYTHONPATH=os.path.join(ROOT, "tests"))
    first = launch(common_args(tmp_path / "par", nine_rows, optimizer_shard="true",
                               callbacks="[stop_callbacks:TermAtLastStepOfFirstEpoch]", **extra),
                   tmp_path / "logs1", cwd=ROOT, env_extra=stop)
    one = single(common_args(tmp_path / "one", nine_rows, **extra), timeout=600)
    out, _ = first.communicate(timeout=600)
    assert first.returncode == 75 and one.returncode == 0, out[-2000:] + one.stderr[-2000:]
    for r in (0, 1):
        assert "neighbours of 9 structures counted for the batch shapes" in (
            tmp_path / "logs1" / f"worker_{r}.log").read_text()
    _, saved = weights(tmp_path / "par")
    trained = [k for k in saved if k.startswith("moment1.")]
    assert trained and all(saved[k].shape == saved["moment2." + k[8:]].shape for k in trained)  # gathered, whole
    resumed = launch(common_args(tmp_path / "par", nine_rows, optimizer_shard="true", **extra)
                     + ["--resume", str(tmp_path / "par")], tmp_path / "logs2", cwd=ROOT, env_extra=cache)
    out, _ = resumed.communicate(timeout=600)
    assert resumed.returncode == 0 and "resumed from" in out, out[-3000:]
    for r in (0, 1):
        log = (tmp_path / "logs2" / f"worker_{r}.log").read_text()
        assert "neighbour counts of 9 structures for the batch shapes read from" in log
        compiled = len(re.findall(r"compiling the \w+ step for batch shape", log))
        assert compiled and len(re.findall(r"the \w+ step's graph came from the compile cache", log)) == compiled, r
    from orb.data.dataset import AseDbDataset
    from orb.models.config import ModelConfig

    monkeypatch.setenv("ORB_CACHE_DIR", cache["ORB_CACHE_DIR"])
    settings = ModelConfig.from_dict(dict(name="orb_v3_conservative_20_omat")).graph_settings()
    for path in (nine_rows, DEMO_VAL):  # what the two ranks counted together, each its share: the serial count
        kept = AseDbDataset(path, settings=settings)
        np.testing.assert_array_equal(kept.edge_capacities(), kept.count_edge_capacities(0, len(kept)))
        assert kept.capacities_read_from is not None
    from orb.io.checkpoint import to_torch_state_dict
    from orb.models import create

    par, par_opt = weights(tmp_path / "par")
    ref, ref_opt = weights(tmp_path / "one")
    start = to_torch_state_dict(create("orb_v3_conservative_20_omat", seed=1234, **SMALL_MODEL))
    assert set(ref) == set(start)
    moved = [np.linalg.norm(ref[k] - start[k]) / max(np.linalg.norm(start[k]), 1e-3) for k in ref
             if "normalizer" not in k]
    assert np.median(moved) > 1e-3
    assert_same_weights(par, ref)
    for key in ref_opt:  # Adam's moments: sums of two ranks' gradients in another order than one device's, so an
        if key.startswith("moment"):  # element that cancels to near 0 is compared at its tensor's scale
            np.testing.assert_allclose(par_opt[key], ref_opt[key], rtol=1e-4,
                                       atol=max(1e-9, 1e-5 * float(np.abs(ref_opt[key]).max())), err_msg=key)
    last_par, last_one = epochs(tmp_path / "par")[-1], epochs(tmp_path / "one")[-1]
    assert last_par["epoch"] == last_one["epoch"] == 2
    for key, value in last_one["val"].items():
        if key not in TIMING:
            assert last_par["val"][key] == pytest.approx(value, rel=1e-4, abs=2e-3 if "cosine" in key else 1e-6), key


def test_bad_input_stops_every_worker_with_one_line(tmp_path, nine_rows):
    """A setting that does not fit the job (refused by the launcher before msrun starts; each rank refuses it alike
    when started otherwise), and a bad row that only rank 1 finds: each job ends with one line. (Other settings
    refused alike on every rank, a set smaller than the workers and buckets too small for a rank's share:
    test_pieces, each rank built alone.)"""
    bad_row = str(tmp_path / "bad_row.db")  # row 9 (in rank 1's share of the rows' check): a singular cell
    with ase.db.connect(nine_rows) as src, ase.db.connect(bad_row) as dst:
        for i, row in enumerate(src.select()):
            atoms = row.toatoms()
            if i == 8:
                atoms.set_cell([atoms.cell[0], atoms.cell[1], atoms.cell[0]])
                atoms.calc = SinglePointCalculator(atoms, energy=row.energy, forces=row.forces, stress=row.stress)
            dst.write(atoms)
    cases = ((dict(batch_size=1), "'batch_size' (1) is the global batch and must be at least the number of workers"),
             ({"train_data_path": bad_row, "model.name": "orb_v3_direct_20_omat"},
              "bad_row.db: another rank found bad input (a bad row or a damaged file) while checking the rows"))
    for i, (extra, message) in enumerate(cases):
        job = launch(common_args(tmp_path / f"bad{i}", nine_rows, **extra), tmp_path / f"logs{i}", cwd=ROOT,
                     env_extra=FAST_FAILURE)
        out, _ = job.communicate(timeout=300)
        assert job.returncode == 2 and message in out, out[-2000:]  # bad input, as finetune.py (msrun says 1)
        assert "Traceback" not in out
    assert "rank 1 failed" in out and "bad_row.db, row 9, key 'cell'" in out  # the launcher shows rank 1's line


def test_killed_worker_ends_the_job(tmp_path, nine_rows):
    """A worker killed mid-training fails the job, which ends within seconds: msrun kills the other worker, and its
    scheduler waited for that one until MindSpore's node timeout (30 s by default; here 300 s, so waiting fails). A
    stop that comes once the workers are gone is no stop of this job: exit 1, not 75 (a requeue would resume into
    the same kill), and the scheduler is ended all the same."""
    from conftest import signal_every_process

    args = common_args(tmp_path / "kill", nine_rows, num_buckets=1, val_data_path="") + ["--max_epochs", "50"]
    job = launch(args, tmp_path / "logs", cwd=ROOT, env_extra={"MS_NODE_TIMEOUT": "300"})
    try:
        deadline = time.time() + 300
        pids = None
        while time.time() < deadline and pids is None:  # wait until the job trains (an epoch done), then kill rank 1
            logs = [tmp_path / "logs" / f"worker_{r}.log" for r in (0, 1)]
            text = [log.read_text() if log.exists() else "" for log in logs]
            found = [re.search(rf"rank {r} of 2 \(pid (\d+)\)", text[r]) for r in (0, 1)]
            if "Epoch: 1/50" in text[0] and all(found):
                pids = [int(f.group(1)) for f in found]
            time.sleep(1)
        assert pids is not None, "rank 1 never started training"
        os.kill(pids[1], signal.SIGKILL)
        killed = time.time()
        while os.path.exists(f"/proc/{pids[0]}") and time.time() < killed + 60:  # msrun kills rank 0
            time.sleep(0.1)
        job.send_signal(signal.SIGTERM)  # (to the launcher)
        out, _ = job.communicate(timeout=400)
        assert job.returncode == 1, out[-2000:]  # a fault
        assert time.time() - killed < 60, out[-2000:]  # (MS_NODE_TIMEOUT: 300 s)
        assert "FAILED" in out and "stopped by" not in out, out[-2000:]
        assert f"run_parallel: rank 1 (pid {pids[1]}) was ended by SIGKILL (the kernel's out-of-memory killer" in out, \
            out[-2000:]  # (its log says nothing of it)
    finally:
        if job.poll() is None:
            signal_every_process(job.pid, signal.SIGKILL)


def test_the_cluster_polls_its_peers_every_second_or_two_unless_the_user_chose():
    """msrun's processes start with MindSpore's cluster retry intervals at 1 and 2 s (a job on one node starts and
    ends about 4 s sooner, docs/benchmarks.md), MindSpore's log at errors, glog's threshold too; a user's own values,
    and their log level, are kept."""
    from orb.training.launch import msrun_environment

    env = msrun_environment({"PATH": "/usr/bin"})
    assert (env["MS_RETRY_INTERVAL_LOWER"], env["MS_RETRY_INTERVAL_UPPER"], env["GLOG_v"]) == ("1", "2", "3")
    assert env["GLOG_minloglevel"] == "2"  # (glog's own threshold: lines MindSpore writes past its GLOG_v check)
    assert "GLOG_minloglevel" not in msrun_environment({"GLOG_v": "1"})  # (the user's info: all of it)
    assert msrun_environment({"GLOG_v": "2"})["GLOG_minloglevel"] == "1"
    assert env["PATH"].split(os.pathsep) == [os.path.dirname(sys.executable), "/usr/bin"]
    mine = msrun_environment({"MS_RETRY_INTERVAL_LOWER": "3", "MS_RETRY_INTERVAL_UPPER": "5", "GLOG_v": "1"})
    assert (mine["MS_RETRY_INTERVAL_LOWER"], mine["MS_RETRY_INTERVAL_UPPER"], mine["GLOG_v"]) == ("3", "5", "1")
    lower = msrun_environment({"MS_RETRY_INTERVAL_LOWER": "5"})  # one of the pair: MindSpore's rule for the other
    assert lower["MS_RETRY_INTERVAL_LOWER"] == "5" and "MS_RETRY_INTERVAL_UPPER" not in lower
    assert msrun_environment({})["PATH"] == os.path.dirname(sys.executable)  # no empty entry (the current folder)


def test_a_collective_whose_peer_is_gone_is_one_line_and_any_other_error_its_traceback():
    """msrun's scheduler killed mid-training: every rank printed MindSpore's traceback of the failed all-reduce (seen
    with the demo on 2 workers and SIGKILL to the scheduler; finetune_parallel.py turns it into this line, exit 1)."""
    from orb.errors import ClusterError
    from orb.training.distributed import lost_peer

    seen = ("Launch kernel failed, name:Default/AllReduce-op0\n\n----------------------------------------------------\n"
            "- C++ Call Stack: (For framework developers)\n")
    error = lost_peer(RuntimeError(seen))
    assert isinstance(error, ClusterError) and str(error) == (
        "the job's communication failed (Launch kernel failed, name:Default/AllReduce-op0): msrun's scheduler or "
        "another worker ended; the last checkpoint is kept (--resume auto continues from it)")
    assert lost_peer(RuntimeError("For 'MatMul', the input shapes must match")) is None  # a fault: its traceback
    assert lost_peer(RuntimeError("")) is None


def test_the_launchers_defaults_follow_the_cpus_it_may_use_and_never_share_a_log_folder(capsys):
    """In a Slurm step or under taskset, the workers and their kernel threads were sized by the host's core count
    (os.cpu_count), not the CPUs the job may use; two launches in the same second (a job array) wrote into one
    LOG_DIR, each reporting the other's errors; --print-config started a 2-worker job and wrote its lines into the
    template (an audit of the data-parallel path)."""
    from orb.training import launch as launcher
    from orb.training.cli import print_template

    one_cpu = subprocess.run([sys.executable, "-c", "import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))});"
                              " from orb.training.launch import count_devices, usable_cpus;"
                              " print(count_devices(), usable_cpus())"], cwd=ROOT, capture_output=True, text=True,
                             timeout=120, env=dict(os.environ, PYTHONPATH=ROOT))
    assert one_cpu.stdout.split() == ["1", "1"], one_cpu.stderr[-2000:]
    assert launcher.settings({})["log_dir"].endswith(f"-{os.getpid()}")
    assert launcher.main(["--print-config", "demo"]) == 0
    printed = capsys.readouterr()
    assert print_template("demo", []) == 0
    assert printed.out == capsys.readouterr().out and "run_parallel" not in printed.out + printed.err
    for args, line in ((["demo", "--resume"], "error: argument --resume: expected one argument"),
                       (["demo", "--confg", "x"], "error: unknown option --confg (did you mean --config?)"),
                       # (a value or a data path: checked by the launcher too, not by each worker once all had started)
                       (["demo", "--max_epochs", "-1"], "error: config key 'max_epochs' must be at least 1, got -1"),
                       (["demo", "--val_data_path", "held_out.db"],
                        "error: config key 'val_data_path': held_out.db: database file does not exist"),
                       (["demo", "--batch_size", "1"], "error: config key 'batch_size' (1) is the global batch and must "
                                                       "be at least the number of workers (2)")):
        refused = subprocess.run([sys.executable, "-m", "orb.training.launch", *args], cwd=ROOT, capture_output=True,
                                 text=True, timeout=120, env=dict(os.environ, PYTHONPATH=ROOT, WORKER_NUM="2"))
        assert refused.returncode == 2 and refused.stderr.strip().splitlines()[-1].endswith(line), refused.stderr
        assert "run_parallel" not in refused.stdout + refused.stderr  # (no job: each worker said it, no rank named)
    by_hand = subprocess.run([sys.executable, "finetune_parallel.py", "--config", "demo"], cwd=ROOT,
                             capture_output=True, text=True, timeout=300,
                             env={k: v for k, v in os.environ.items() if not k.startswith("MS_")})
    assert by_hand.returncode == 2 and by_hand.stderr.strip().splitlines() == [
        "error: finetune_parallel.py is one worker of a job msrun starts: launch the job with orb-finetune-parallel "
        "CONFIG (or bash run_parallel.sh CONFIG); on one device use orb-finetune"], by_hand.stderr[-2000:]


def test_a_stop_before_any_worker_or_to_every_process_saves_and_exits_75(tmp_path, nine_rows):
    """1. SIGTERM to the launcher as msrun starts, before msrun has started a worker: it reached no worker
       (the run went on to the end, exit 0). The launcher passes it to the workers as they appear, and ends msrun's
       scheduler, which would wait for them until CLUSTER_TIME_OUT (600 s here), once they have stopped: 75.
    2. SIGINT to every process of the job while it trains (what a job step's signal does on Slurm): msrun's own
       SIGINT handler SIGKILLed the workers unsaved and msrun exited 0, so the launcher said "finished" (exit 0).
       Now the workers agree on a step, save it and stop: 75."""
    env = dict(CLUSTER_TIME_OUT="600")
    early = launch(common_args(tmp_path / "early", nine_rows, max_epochs=50), tmp_path / "logs0", cwd=ROOT,
                   env_extra=env)
    deadline = time.time() + 120  # msrun started, its workers not yet (the launcher checks its options first)
    while not msrun_started(early.pid) and early.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    early.send_signal(signal.SIGTERM)
    start = time.time()
    out, _ = early.communicate(timeout=300)
    assert early.returncode == 75 and time.time() - start < 120, out[-2000:]
    logs = [(tmp_path / "logs0" / f"worker_{r}.log").read_text() for r in (0, 1)]
    # (a worker the signal reached before it listened, or that msrun killed once another had stopped, ends silently)
    assert any("stopped by SIGTERM during start-up" in log for log in logs), logs
    assert not any("Traceback" in log or "error: " in log for log in logs), logs

    run = tmp_path / "all"
    job = launch(common_args(run, nine_rows, max_epochs=50, num_buckets=1), tmp_path / "logs1", cwd=ROOT, env_extra=env)
    deadline = time.time() + 300
    while not (run / "metrics.jsonl").exists() or '"type": "epoch"' not in (run / "metrics.jsonl").read_text():
        assert job.poll() is None and time.time() < deadline, job.communicate()[0][-2000:]
        time.sleep(0.2)
    processes = [job.pid, *descendants(job.pid)]
    assert len(processes) >= 4  # the launcher, msrun, its scheduler, 2 workers
    for pid in processes:
        try:
            os.kill(pid, signal.SIGINT)
        except OSError:
            pass
    out, _ = job.communicate(timeout=300)
    assert job.returncode == 75 and "run_parallel: stopped by SIGINT with the state saved" in out, out[-2000:]
    steps = [re.search(r"stopped by SIG\w+ at .+? \(global step (\d+)\)",  # a step, an epoch's end or validation
                       (tmp_path / "logs1" / f"worker_{r}.log").read_text()) for r in (0, 1)]
    assert steps[0] and steps[1] and steps[0].group(1) == steps[1].group(1), [m and m.group(0) for m in steps]
    from orb.io.checkpoint import load_checkpoint

    assert load_checkpoint(str(run / "checkpoints" / "last.ckpt"))[2]["global_step"] == int(steps[0].group(1))


def test_a_launcher_killed_or_hung_up_ends_its_job_which_saves_and_resumes(tmp_path, nine_rows):
    """The launcher killed (SIGKILL; or SIGHUP, its terminal or a salloc's ssh session gone): msrun and the workers
    trained on with no one to report it, and --resume auto was refused ("being written by another command"). msrun
    now stops its workers when its launcher is gone: they save and stop, and --resume auto continues."""
    run = tmp_path / "run"
    job = launch(common_args(run, nine_rows, max_epochs=40, num_buckets=1), tmp_path / "logs0", cwd=ROOT)
    deadline = time.time() + 300
    while not (run / "metrics.jsonl").exists() or '"type": "epoch"' not in (run / "metrics.jsonl").read_text():
        assert job.poll() is None and time.time() < deadline, job.communicate()[0][-2000:]
        time.sleep(0.2)
    processes = descendants(job.pid)
    assert len(processes) >= 3  # msrun, its scheduler, 2 workers
    job.kill()
    job.communicate(timeout=60)
    deadline = time.time() + 120
    while any(alive(pid) for pid in processes):
        assert time.time() < deadline, [pid for pid in processes if alive(pid)]
        time.sleep(0.5)
    logs = [(tmp_path / "logs0" / f"worker_{r}.log").read_text() for r in (0, 1)]
    assert all(re.search(r"stopped by SIGTERM at .+ \(global step \d+\)", log) for log in logs), logs[0][-2000:]
    resumed = launch(common_args(run, nine_rows, max_epochs=40, num_buckets=1) + ["--resume", "auto"],
                     tmp_path / "logs1", cwd=ROOT)
    out, _ = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, out[-3000:]
    epochs = [json.loads(line)["epoch"] for line in open(run / "metrics.jsonl") if '"type": "epoch"' in line]
    assert epochs == list(range(1, 41)), epochs


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, ended but not reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class TwoHosts:
    """Two network namespaces joined by a veth pair: node 0 at 10.213.0.1, node 1 at 10.213.0.2."""

    def __init__(self):
        tag = str(os.getpid() % 100000)
        self.names = (f"orb{tag}a", f"orb{tag}b")
        self.addresses = ("10.213.0.1", "10.213.0.2")

    def _ip(self, *args):
        subprocess.run(["ip", *args], check=True, capture_output=True, text=True)

    def __enter__(self):
        a, b = self.names
        for ns in self.names:
            self._ip("netns", "add", ns)
        self._ip("link", "add", f"{a}v", "type", "veth", "peer", "name", f"{b}v")
        for ns, address in zip(self.names, self.addresses):
            self._ip("link", "set", f"{ns}v", "netns", ns)
            self._ip("-n", ns, "addr", "add", f"{address}/24", "dev", f"{ns}v")
            self._ip("-n", ns, "link", "set", f"{ns}v", "up")
            self._ip("-n", ns, "link", "set", "lo", "up")
        return self

    def __exit__(self, *exc):
        for ns in self.names:
            subprocess.run(["ip", "netns", "delete", ns], capture_output=True)

    def prefix(self, node: int):
        return ("ip", "netns", "exec", self.names[node])


def namespaces_unavailable():
    if shutil.which("ip") is None:
        return "the 'ip' command (iproute2) is not installed"
    probe = subprocess.run(["ip", "netns", "add", f"orbprobe{os.getpid() % 100000}"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"network namespaces cannot be created here: {probe.stderr.strip()}"
    subprocess.run(["ip", "netns", "delete", f"orbprobe{os.getpid() % 100000}"], capture_output=True)
    return ""


def test_two_nodes_in_network_namespaces(tmp_path, runs, nine_rows):
    """Two 'hosts' (network namespaces, one worker each, msrun on each with node 0 as master) sharing the
    output folder: both exit 0, one metrics file, and the same weights and metrics as the 2-worker job on
    one host -- bit for bit: same batches, same collectives, same order."""
    reason = namespaces_unavailable()
    if reason:
        pytest.skip(reason)
    out = tmp_path / "two_nodes"
    with TwoHosts() as hosts:
        port = str(free_port())
        # one thread per worker, as each of the one-host job's two workers gets on this 2-core machine: with
        # one local worker the launcher would give it both cores, and a weight gradient's matrix product
        # split over two threads sums in another order (seen: 1 element of 6,144 one ulp off on AMD EPYC)
        env = dict(WORKER_NUM="2", LOCAL_WORKER_NUM="1", MASTER_ADDR=hosts.addresses[0], MASTER_PORT=port,
                   OMP_NUM_THREADS="1")
        nodes = [launch(common_args(out, nine_rows), tmp_path / f"logs{n}", cwd=ROOT, prefix=hosts.prefix(n),
                        env_extra=dict(env, NODE_RANK=str(n), **runs["cache"])) for n in (0, 1)]
        outputs = [node.communicate(timeout=480)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs[0][-2000:] + outputs[1][-2000:]
    assert (tmp_path / "logs1" / "worker_1.log").exists()  # rank 1 ran on node 1
    assert "rank 1 of 2" in outputs[1] and "rank 0 of 2" not in outputs[1]  # its console shows its own worker (none)
    assert len(epochs(out)) == 2 and not os.path.exists(tmp_path / "logs0" / "worker_1.log")
    two_nodes, _ = weights(out)
    one_host, _ = weights(runs["par"])
    for key in one_host:
        np.testing.assert_array_equal(two_nodes[key], one_host[key], err_msg=key)
    assert [without_timing(r) for r in epochs(out)] == [without_timing(r) for r in epochs(runs["par"])]


def test_a_second_job_loads_every_ranks_graphs_from_the_compile_cache(tmp_path, runs, nine_rows):
    """A second job (a requeue) loads every graph on every rank, and trains what the first trained, value for value.
    The first job is the module's (which compiled each graph on one rank into its own cache, and loaded it on the
    other), the second a job of the same settings started from another folder."""
    assert runs["status"] == 0, runs["output"][-3000:]
    job = launch(common_args(tmp_path / "second", nine_rows), tmp_path / "logs-second", cwd=ROOT,
                 env_extra=runs["cache"])
    out, _ = job.communicate(timeout=600)
    assert job.returncode == 0, out[-3000:]
    for rank in (0, 1):
        first = (runs["base"] / "logs" / f"worker_{rank}.log").read_text()
        second = (tmp_path / "logs-second" / f"worker_{rank}.log").read_text()
        compiled = len(re.findall(r"compiling the \w+ step for batch shape", second))
        assert compiled >= 2 and len(re.findall(r"compiling the \w+ step for batch shape", first)) == compiled
        assert len(re.findall(r"the \w+ step's graph came from the compile cache", second)) == compiled, rank
    assert records_without_timing(tmp_path / "second") == records_without_timing(runs["par"])
    (a, _), (b, _) = weights(tmp_path / "second"), weights(runs["par"])
    assert all(np.array_equal(a[k], b[k]) for k in b)
