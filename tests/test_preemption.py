"""Runs that survive a cluster: a stop signal saves and exits 75, a resume continues mid-epoch to the uninterrupted
result (one device and 2 workers), step checkpoints, --resume auto, and faults that end with one line and lose
nothing: a dead data worker, a full disk, a folder that cannot be synced, non-finite steps, bad launch settings."""

import errno
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import DEMO_TRAIN, DEMO_VAL, ROOT, SMALL_MODEL, wait_until_handling

TIMING = ("train_time", "val_time", "compile_time", "data_wait")
SMALL = sum((["--model." + k, str(v)] for k, v in SMALL_MODEL.items()), [])


def run_args(out, **extra):
    """A small demo run, deterministic (on the CPU one kernel thread), so that every run compared bit for bit rounds
    alike: MindSpore 2.10's CPU kernels round the last bit differently on one thread than on several (the
    portable profile does not), and once, in a suite run beside the other worker's data-parallel jobs, a run with
    the default pool came out with the one-thread rounding (its metrics equal digit for digit), so a busy host
    can change it mid-run. One thread computes alike under any load (measured: 9 runs, 3 at a time)."""
    values = dict(config="configs/demo.yaml", checkpoint_path="", output_dir=str(out), device_target="CPU",
                  max_epochs=2, batch_size=2, log_every_n_steps=4, buckets="[[40,800]]", progress_bar="false",
                  lr_schedule="constant", deterministic="true")
    values.update(extra)
    return sum(([f"--{k}", str(v)] for k, v in values.items()), []) + SMALL


def records(run):
    return [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]


def without_timing(record):
    return {k: ({m: v for m, v in val.items() if m not in TIMING} if isinstance(val, dict) else val)
            for k, val in record.items() if k not in TIMING}


def last_weights(run):
    from orb.io.checkpoint import load_checkpoint

    weights, optimizer, meta = load_checkpoint(os.path.join(run, "checkpoints", "last.ckpt"))
    return weights, optimizer, meta


def assert_same_run(a, b):
    """Bit-identical weights and optimizer state, and the same metrics records (timings aside)."""
    wa, oa, _ = last_weights(a)
    wb, ob, _ = last_weights(b)
    for key in wa:
        np.testing.assert_array_equal(wa[key], wb[key], err_msg=key)
    for key in oa:
        np.testing.assert_array_equal(oa[key], ob[key], err_msg=key)
    ra, rb = records(a), records(b)
    assert [(r["type"], r["step"]) for r in ra] == [(r["type"], r["step"]) for r in rb]  # no line twice
    assert [without_timing(r) for r in ra] == [without_timing(r) for r in rb]


def wait_for_step_record(path, process, timeout=300):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if os.path.exists(path) and '"type": "step"' in open(path).read():
            return
        assert process.poll() is None, process.stdout.read()[-3000:]
        time.sleep(0.2)
    raise AssertionError("no step record appeared")


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory):
    """``run_args``' run without interruption: what every stopped and resumed run of it must equal."""
    out = tmp_path_factory.mktemp("straight") / "run"
    straight = subprocess.run([sys.executable, "finetune.py", *run_args(out)], cwd=ROOT, capture_output=True,
                              text=True, timeout=300)
    assert straight.returncode == 0, straight.stderr[-2000:]
    return out


def test_ctrl_c_saves_and_a_resume_continues_to_the_uninterrupted_run(tmp_path, straight_run):
    """SIGINT (Ctrl-C; a scheduler's SIGTERM takes the same way) in the middle of an epoch: the step finishes,
    last.ckpt is saved at it, one line naming SIGINT, exit 75; `--resume auto` continues there and ends bit for bit
    at the uninterrupted run, with no metric line twice. (MindSpore's own SIGINT handler, installed by every graph
    it runs, turned Ctrl-C into SIGTERM: the line said "stopped by SIGTERM".)"""
    run = tmp_path / "stopped"
    proc = subprocess.Popen([sys.executable, "finetune.py", *run_args(run)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    wait_for_step_record(run / "metrics.jsonl", proc)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 75, out[-3000:]
    assert "stopped by SIGINT at epoch 1, step" in out and "continue with --resume auto" in out
    _, _, meta = last_weights(run)
    assert meta["epoch"] == 0 and 0 < meta["step_in_epoch"] < 32  # inside the first epoch
    resumed = subprocess.run([sys.executable, "finetune.py", *run_args(run), "--resume", "auto"], cwd=ROOT,
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert f"and {meta['step_in_epoch']} of 32 steps done" in resumed.stdout
    assert_same_run(run, straight_run)


def test_a_deterministic_run_computes_as_one_cpu_kernel_thread(tmp_path, straight_run):
    """deterministic: true on the CPU is one kernel thread: the same bits as num_threads 1 with deterministic off
    (with the default pool the weights differ in the last bit after these 64 steps, measured; not asserted here,
    since a busy host can give the default pool the one-thread rounding)."""
    run = tmp_path / "one_thread"
    one = subprocess.run([sys.executable, "finetune.py", *run_args(run, deterministic="false", num_threads=1)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr[-2000:]
    assert ", deterministic" in (straight_run / "train.log").read_text().splitlines()[0]
    assert_same_run(run, straight_run)


def test_resume_auto_starts_fresh_when_nothing_was_saved(tmp_path):
    """A requeued job that always passes --resume auto: with no last.ckpt (the first attempt died before its first
    save) it starts over instead of refusing the folder."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "metrics.jsonl").write_text(json.dumps({"type": "step", "epoch": 1, "step": 4}) + "\n")
    result = subprocess.run([sys.executable, "finetune.py", *run_args(run, max_epochs=1), "--resume", "auto"],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert [r["type"] for r in records(run)][0] == "initial" and records(run)[-1]["type"] == "epoch"


# (a crash after a step save, resumed equal to the uninterrupted run: tests/test_parallel.py, on 2 workers)


def test_keep_checkpoints_prunes_the_oldest_periodic_ones(tmp_path):
    from orb.training.checkpointing import prune_checkpoints

    folder = tmp_path / "checkpoints"
    folder.mkdir()
    for name in ("epoch_0001.ckpt", "epoch_0002.ckpt", "epoch_0003.ckpt", "last.ckpt", "best.ckpt"):
        (folder / name).write_text("x")
    assert prune_checkpoints(str(folder), 2) == ["epoch_0001.ckpt"]
    assert sorted(os.listdir(folder)) == ["best.ckpt", "epoch_0002.ckpt", "epoch_0003.ckpt", "last.ckpt"]
    assert prune_checkpoints(str(folder), 0) == []
    for name in ("epoch_9998.ckpt", "epoch_9999.ckpt", "epoch_10000.ckpt"):  # max_epochs may reach 1e6
        (folder / name).write_text("x")
    assert prune_checkpoints(str(folder), 2) == ["epoch_0002.ckpt", "epoch_0003.ckpt", "epoch_9998.ckpt"]
    assert sorted(os.listdir(folder)) == ["best.ckpt", "epoch_10000.ckpt", "epoch_9999.ckpt", "last.ckpt"]


# ------------------------------------------------------------------ faults
def test_a_full_disk_stops_with_one_line_and_keeps_the_previous_checkpoint(tmp_path, small_disk):
    """output_dir on a disk that fills up during epoch 2's save: one line naming the file, exit 1, the epoch-1
    checkpoints intact, and no temporary left behind -- ours nor MindSpore's own (.last.ckpt.tmp-PID.tmp)."""
    sized = tmp_path / "sized"
    first = subprocess.run([sys.executable, "finetune.py", *run_args(sized, max_epochs=1)], cwd=ROOT,
                           capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]
    folder = sized / "checkpoints"
    used = sum(f.stat().st_size for f in folder.iterdir() if not f.name.startswith("epoch_")) + sum(
        f.stat().st_size for f in sized.iterdir() if f.is_file())  # what a 2-epoch run holds after epoch 1
    last = (folder / "last.ckpt").stat().st_size
    disk = small_disk(used + last // 2 + 64 * 1024)  # epoch 1 fits, epoch 2's new last.ckpt does not
    run = disk / "run"
    result = subprocess.run([sys.executable, "finetune.py", *run_args(run, max_epochs=2)], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[-1].startswith(f"error: could not write {run / 'checkpoints'}"), \
        result.stderr[-2000:]
    assert "the previous checkpoint there is unchanged" in result.stderr
    names = sorted(os.listdir(run / "checkpoints"))
    assert all(not name.startswith(".") for name in names), names  # no temporary of any writer
    _, _, meta = last_weights(run)
    assert meta["epoch"] == 1
    assert records(run)[-1]["type"] == "step"  # epoch 2's steps were recorded, no epoch line: it was not saved


def test_a_folder_that_cannot_be_synced_warns_once_and_saves(tmp_path, monkeypatch, caplog):
    from orb.io.checkpoint import load_checkpoint, save_checkpoint
    from orb.models.orb_v2 import orb_v2

    original = os.fsync

    def fsync(fd):
        if os.path.isdir(f"/proc/self/fd/{fd}"):
            raise OSError(errno.EINVAL, "Invalid argument")
        return original(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    model = orb_v2(**SMALL_MODEL)
    for _ in range(2):
        save_checkpoint(str(tmp_path / "a.ckpt"), model, {"i": 1})
    assert load_checkpoint(str(tmp_path / "a.ckpt"))[2] == {"i": 1}
    assert caplog.text.count("cannot sync a folder") == 1


def test_non_finite_steps_are_skipped_counted_and_stop_the_run_naming_them(tmp_path):
    """A step with a NaN/inf gradient changes nothing (weights, normalisers, optimizer) and is counted; a finite
    step after it trains as usual; max_nonfinite_steps in a row stop the run with its epoch, step and rows."""
    import mindspore as ms

    from orb.data.dataset import AseDbDataset
    from orb.data.batching import batch_graphs, pad_batch
    from orb.data.tensors import loss_inputs
    from orb.errors import DivergedError
    from orb.models.orb_v2 import orb_v2
    from orb.training.loss_v2 import OrbLoss
    from orb.training.optimizer import FlatAdam
    from orb.training.schedule import constant
    from orb.training.steps import TrainStep, read_nonfinite
    from test_training import make_cfg, trainer_for

    ms.set_context(mode=ms.GRAPH_MODE)
    data = AseDbDataset(DEMO_TRAIN)
    model = orb_v2(**SMALL_MODEL)
    step = TrainStep(OrbLoss(model), FlatAdam(model.trainable_params(), constant(1e-3, 8)))
    good = pad_batch(batch_graphs([data[i] for i in range(3)]), 64, 1280, 4)
    bad = pad_batch(batch_graphs([data[i] for i in range(3)]), 64, 1280, 4)
    bad.energy = bad.energy.copy()
    bad.energy[1] = np.inf
    state = {n: p.asnumpy().copy() for n, p in model.parameters_and_names()}
    step(*loss_inputs(bad))
    for name, param in model.parameters_and_names():
        np.testing.assert_array_equal(param.asnumpy(), state[name], err_msg=name)  # nothing changed
    assert int(step.optimizer.step.asnumpy()) == 0 and read_nonfinite(step).tolist() == [1, 1, 1, 1]
    step(*loss_inputs(good))
    assert int(step.optimizer.step.asnumpy()) == 1 and read_nonfinite(step).tolist() == [0, 1, 1, 0]
    assert not np.array_equal(model.graph_head.mlp.layer(0).weight.asnumpy(), state["graph_head.mlp.NN-0.weight"])

    # steps no run survives (plain SGD at the largest lr, unclipped, on a loss a million times too large): the first
    # step (finite) throws every weight far out, every later step overflows; 3 in a row stop the run, naming the
    # latest one's rows
    trainer = trainer_for(make_cfg(tmp_path, max_epochs=1, batch_size=4, log_every_n_steps=2, max_nonfinite_steps=3,
                                   optimizer="sgd", lr=1.0, gradient_clip_mode="none", lr_schedule="constant",
                                   ema_decay=0.0, loss_weights=dict(energy=1e6, forces=1e6, stress=1e6)))
    with pytest.raises(DivergedError, match=r"[34] training steps in a row had a non-finite .* \(the latest: epoch 1, "
                                            r"step (\d+) \(global step \1\), rows \[\d+, \d+, \d+, \d+\]\); the run "
                                            r"stops \(max_nonfinite_steps: 3\); nothing was saved yet: lower lr or "
                                            r"check those rows, and start again"):  # (read at the 2-step log boundary;
        trainer.fit()                                                      # it named a last.ckpt that did not exist)


class DyingDataset:
    """A dataset whose worker dies (as the out-of-memory killer would kill it) on ``die_at`` rows."""

    has_stress = True

    def __init__(self, path, die_at=(), once_flag=""):
        from orb.data.dataset import AseDbDataset

        self.data, self.die_at, self.once_flag = AseDbDataset(path), set(die_at), once_flag

    def get_many(self, indices, rotation_seeds):
        if set(indices) & self.die_at and (not self.once_flag or not os.path.exists(self.once_flag)):
            if self.once_flag:
                open(self.once_flag, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        return self.data.get_many(indices, rotation_seeds)


def test_a_dead_data_worker_is_replaced_and_dying_again_is_one_line(tmp_path):
    from orb.data.buckets import Bucket
    from orb.data.loader import BatchLoader, Step, prepare
    from orb.errors import DataWorkerError

    steps = [Step(0, (2 * k, 2 * k + 1), Bucket(40, 800, 3), 2) for k in range(6)]
    once = BatchLoader({"d": DyingDataset(DEMO_VAL, die_at={4}, once_flag=str(tmp_path / "died"))}, workers=2)
    got = list(once.iterate("d", steps, None, True))
    once.close()
    assert (tmp_path / "died").exists() and [s for s, _ in got] == steps
    inline = DyingDataset(DEMO_VAL)
    for (_, arrays), step in zip(got, steps):  # the replacement prepared exactly what was asked
        for a, b in zip(arrays, prepare(inline, step, None, True)):
            np.testing.assert_array_equal(a, b)
    always = BatchLoader({"d": DyingDataset(DEMO_VAL, die_at={4})}, workers=2)
    with pytest.raises(DataWorkerError, match="died twice while preparing epoch 1's steps .*lack of memory"):
        list(always.iterate("d", steps, None, True))
    always.close()


# ------------------------------------------------------------------ the launcher
KILLED_PARENT = """
import os, sys, time
sys.path.insert(0, {root!r})
from orb.data.dataset import AseDbDataset
from orb.data.loader import BatchLoader

if __name__ == "__main__":
    loader = BatchLoader({{"val": AseDbDataset({db!r})}}, workers=2)
    pool = loader._ensure_pool()
    for future in [pool.submit(time.sleep, 1) for _ in range(2)]:  # both workers started and busy once
        future.result()
    print(" ".join(str(p) for p in pool._processes), flush=True)
    time.sleep(600)
"""


CLOSE_WHILE_SENDING = """
import sys, time
import numpy as np
from orb.data.loader import BatchLoader

def block(n):
    return np.ones(n, np.uint8)

if __name__ == "__main__":
    loader = BatchLoader({}, workers=1)
    pool = loader._ensure_pool()
    results = [pool.submit(block, 150_000_000) for _ in range(3)]
    results[0].result()  # the next is being made or sent
    time.sleep(float(sys.argv[1]))
    loader.close()
"""


def test_a_process_whose_data_workers_are_stopped_while_sending_a_batch_ends(tmp_path):
    """Closing the data workers (a failed or stopped run) killed a worker halfway through sending a batch: the pool's
    thread reading the results waited for the rest of it for ever, and the interpreter's exit for that thread, so the
    process never ended (4 of these 6 moments hung). Each now ends at once."""
    script = tmp_path / "close_while_sending.py"
    script.write_text(CLOSE_WHILE_SENDING)
    for delay in ("0.05", "0.1", "0.15", "0.2", "0.25", "0.3"):
        result = subprocess.run([sys.executable, str(script), delay], cwd=ROOT, capture_output=True, text=True,
                                timeout=60, env=dict(os.environ, PYTHONPATH=ROOT))
        assert result.returncode == 0, (delay, result.stderr[-2000:])


CLOSE_THEN_EXIT = """
import time
import concurrent.futures.process as futures_process
from orb.data.loader import BatchLoader

def wide_wakeup(self):  # the standard library's wakeup, its check-then-write window made wide
    if not self._closed:
        time.sleep(0.5)
        self._writer.send_bytes(b"")

if __name__ == "__main__":
    futures_process._ThreadWakeup.wakeup = wide_wakeup
    loader = BatchLoader({}, workers=1)
    loader._ensure_pool().submit(time.sleep, 0.1).result()
    loader.close()
"""


def test_a_process_that_exits_right_after_closing_its_data_workers_prints_nothing(tmp_path):
    """A stopped rank closed its data workers and exited: the pool's thread, still running, closed its wake-up pipe
    while the interpreter's exit wrote to it, and a traceback ended the console (CI, 1 run in many). The window is
    made wide here; closing now waits for that thread, so the exit finds the pipe closed and writes nothing."""
    script = tmp_path / "close_then_exit.py"
    script.write_text(CLOSE_THEN_EXIT)
    result = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=60,
                            env=dict(os.environ, PYTHONPATH=ROOT))
    assert result.returncode == 0 and result.stderr == "", result.stderr[-2000:]


def test_data_workers_die_with_a_killed_training_process(tmp_path):
    """SIGKILL (the out-of-memory killer, scancel -s KILL) gives the training process no chance to stop its data
    workers: they go with it instead of lingering with its pipes and memory."""
    script = tmp_path / "parent.py"
    script.write_text(KILLED_PARENT.format(root=ROOT, db=DEMO_VAL))
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, ORB_CACHE_DIR=str(tmp_path / "cache")))
    workers = [int(p) for p in parent.stdout.readline().split()]
    assert len(workers) == 2 and all(os.path.exists(f"/proc/{p}") for p in workers)
    parent.kill()
    parent.wait()
    deadline = time.time() + 10
    while time.time() < deadline and any(os.path.exists(f"/proc/{p}") for p in workers):
        time.sleep(0.1)
    assert not any(os.path.exists(f"/proc/{p}") for p in workers)


def test_launcher_settings_are_checked_and_scheduler_devices_counted(monkeypatch):
    from orb.training import launch

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "4,5,6")
    assert launch.count_devices() == 3
    monkeypatch.delenv("ASCEND_RT_VISIBLE_DEVICES")
    for env, message in (({"WORKER_NUM": "0"}, "WORKER_NUM must be a whole number >= 1, got '0'"),
                         ({"WORKER_NUM": "two"}, "WORKER_NUM must be"),
                         ({"WORKER_NUM": "4", "LOCAL_WORKER_NUM": "8"}, "exceeds WORKER_NUM"),
                         ({"WORKER_NUM": "16", "LOCAL_WORKER_NUM": "8"}, "needs the same MASTER_PORT on every node"),
                         ({"WORKER_NUM": "2", "MASTER_PORT": "70000"},
                          "MASTER_PORT must be a whole number from 1 to 65535, got '70000'")):
        with pytest.raises(launch.LaunchError, match=message):
            launch.settings(env)
    assert launch.settings({"WORKER_NUM": "16", "LOCAL_WORKER_NUM": "8", "MASTER_PORT": "8118"})["master_port"] == \
        "8118"
    result = subprocess.run(["bash", os.path.join(ROOT, "run_parallel.sh")], env=dict(os.environ, WORKER_NUM="0"),
                            capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 2 and result.stderr.strip() == "error: WORKER_NUM must be a whole number >= 1, got '0'"
    not_a_folder = os.path.join(ROOT, "README.md")  # (a file where the worker logs' folder goes: a traceback)
    result = subprocess.run(["bash", os.path.join(ROOT, "run_parallel.sh"), "configs/demo.yaml"], cwd=ROOT,
                            env=dict(os.environ, WORKER_NUM="2", LOG_DIR=not_a_folder), capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2 and result.stderr.strip() == (
        f"error: LOG_DIR {not_a_folder}: cannot make the worker logs' folder (File exists)"), result.stderr[-2000:]


def test_a_reused_log_dir_does_not_decide_how_a_launch_ended(tmp_path):
    """LOG_DIR reused by a requeued job (as a Slurm script sets it): an earlier run's logs with more workers stay
    beside this launch's, which overwrites its own. Only this launch's logs decide whether every worker stopped
    with its state saved (the earlier run's worker_2.log turned a clean stop, exit 75, into FAILED, exit 1: the
    requeue script dropped the job) and what a failure reports."""
    from orb.signals import RESUME_HINT
    from orb.training.job_watch import log_stamps, stopped_with_state_saved, worker_logs

    for rank in (0, 1, 2):  # the earlier run's, with three workers
        (tmp_path / f"worker_{rank}.log").write_text("Traceback (most recent call last):\nRuntimeError: failed\n")
        os.utime(tmp_path / f"worker_{rank}.log", (time.time() - 3600, time.time() - 3600))
    before = log_stamps(str(tmp_path))
    for rank in (0, 1):  # this launch's two workers overwrite their own
        (tmp_path / f"worker_{rank}.log").write_text(f"stopped by SIGTERM at epoch 2, step 5; {RESUME_HINT}\n")
    assert worker_logs(str(tmp_path), before) == [str(tmp_path / f"worker_{r}.log") for r in (0, 1)]
    assert stopped_with_state_saved(str(tmp_path), before)
    assert not stopped_with_state_saved(str(tmp_path))  # every log, the stale one too: what it decided before
    # a stop during start-up: msrun kills the workers still starting, whose logs end without a line; no error in
    # this launch's logs then lets the launcher say 75 (it said FAILED, status 1), the earlier run's errors aside
    from orb.training.job_watch import failures

    (tmp_path / "worker_1.log").write_text("[WARNING] a worker still starting when msrun killed it\n")
    assert not stopped_with_state_saved(str(tmp_path), before) and failures(str(tmp_path), before) == {}
    assert list(failures(str(tmp_path))) == [str(tmp_path / "worker_2.log")]


def test_a_worker_ended_by_a_signal_is_named_by_rank(tmp_path, capsys):
    """A worker the kernel's out-of-memory killer ends writes no line: the launcher's report said only "FAILED with
    status 1". msrun's report of its exit names the process; the worker's own start-up line, its rank."""
    from orb.training.job_watch import report_killed, reported_exit_codes

    for rank, pid in ((0, 4242), (1, 4343)):
        (tmp_path / f"worker_{rank}.log").write_text(f"2026-11-30 [INFO] data parallel: rank {rank} of 2 (pid {pid})\n")
    msrun = ["[ERROR] ME(1:2,MainProcess):2026-11-30 [_api.py:365] Worker process 4343 exit with exception. "
             "Error code: -9.", "[ERROR] ... Worker process 4242 exit with exception. Error code: -11.",
             "[ERROR] ... Worker process 4444 exit with exception. Error code: 2."]
    assert reported_exit_codes(msrun) == [-9, -11, 2]
    report_killed(msrun, [str(tmp_path / f"worker_{rank}.log") for rank in (0, 1)])
    assert capsys.readouterr().err.splitlines() == [
        "run_parallel: rank 1 (pid 4343) was ended by SIGKILL (the kernel's out-of-memory killer sends it: see "
        f"`dmesg` or your scheduler's report of the job); its log: {tmp_path / 'worker_1.log'}",
        f"run_parallel: rank 0 (pid 4242) was ended by SIGSEGV; its log: {tmp_path / 'worker_0.log'}"]


def test_a_signal_after_a_run_has_finished_is_no_stop(tmp_path):
    """A signal after the run has finished (a scheduler's, as the job ends) is ignored by the command's program: it
    printed a traceback from an exit handler, or, landing in the run's last moments, turned a finished run into a
    stop during start-up. (Called from Python instead, the caller's own handlers are back: tests/test_signals.py.)"""
    script = ("import os, signal, sys, time\n"
              "from orb.signals import run_program\n"
              "from orb.training.cli import run\n"
              "def main():\n"
              "    status = run(['--config', 'configs/demo.yaml', '--output_dir', sys.argv[1]], 'configs/demo.yaml',\n"
              "                 lambda cfg, args: None)\n"
              "    os.kill(os.getpid(), signal.SIGTERM)\n"
              "    time.sleep(0.2)\n"
              "    print('finished', status)\n"
              "    return 0\n"
              "run_program(main)\n")
    result = subprocess.run([sys.executable, "-c", script, str(tmp_path / "run")], cwd=ROOT, capture_output=True,
                            text=True, timeout=300, env=dict(os.environ, PYTHONPATH=ROOT))
    assert result.returncode == 0 and result.stdout.strip() == "finished 0", result.stdout + result.stderr[-2000:]
    assert "Traceback" not in result.stderr


def test_after_a_stop_msrun_lets_the_other_workers_end_on_their_own(tmp_path):
    """msrun SIGKILLs every worker's process group as soon as one exits non-zero: after a stop in training (exit 75,
    the stop line saying the state was saved) rank 0, still ending, lost its stop line and left its data workers'
    semaphores in /dev/shm. The launcher's msrun waits for the others then, at most STOP_GRACE seconds; after a stop
    during start-up (a rank may be blocked in a collective it cannot leave) and after a failure it kills at once.
    (Two stand-in workers: rank 1 ends at once, rank 0 some seconds later, past msrun's one-second poll.)"""
    from orb.files import free_port
    from orb.signals import RESUME_HINT, StopSignals
    from orb.training.launch import MSRUN
    from orb.training.msrun_main import STOP_GRACE

    worker = tmp_path / "worker.py"
    worker.write_text("import os, sys, time\n"
                      "if os.environ.get('MS_ROLE') == 'MS_SCHED': sys.exit(0)\n"
                      "code, line, after, mark = int(sys.argv[1]), sys.argv[2], float(sys.argv[3]), sys.argv[4]\n"
                      "print(line, flush=True)\n"
                      "if os.environ['DEVICE_ID'] == '0':\n"
                      "    time.sleep(after)\n"
                      "    open(mark, 'w').write('ended')\n"
                      "sys.exit(code)\n")
    saved = f"stopped by SIGTERM with the state saved: {RESUME_HINT}"
    startup = StopSignals().startup_message("SIGTERM")  # (it names --resume auto too: not a saved state)
    assert RESUME_HINT in startup
    cases = {"a stop in training": (75, saved, 2.5, True), "a stop during start-up": (75, startup, 2.5, False),
             "a failure": (1, "error: bad", 2.5, False), "a rank that never ends after a stop": (75, saved, 300, False)}
    for name, (code, line, rank0_ends_after, ended) in cases.items():
        mark = tmp_path / name.replace(" ", "_")
        start = time.monotonic()
        subprocess.run([sys.executable, "-c", MSRUN, "--worker_num=2", "--local_worker_num=2",
                        "--master_addr=127.0.0.1", f"--master_port={free_port()}", "--node_rank=0",
                        f"--log_dir={tmp_path / ('logs-' + mark.name)}", "--join=True", "--tail_worker_log=0",
                        str(worker), str(code), line, str(rank0_ends_after), str(mark)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
        assert mark.exists() == ended, name
        assert time.monotonic() - start < STOP_GRACE + 15, name  # (the last case: killed after STOP_GRACE)


def test_relay_finds_the_workers_below_msrun(tmp_path):
    """Only MindSpore workers (MS_ROLE=MS_WORKER) below the launched process get the relayed signals."""
    from orb.training.job_watch import processes_under, workers_under

    code = ("import os, subprocess, sys, time\n"
            "kids = [subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)'],"
            " env=dict(os.environ, MS_ROLE=role)) for role in ('MS_WORKER', 'MS_SCHED', 'MS_WORKER')]\n"
            "kids.append(subprocess.Popen(['tail', '-f', '/dev/null'], env=dict(os.environ, MS_ROLE='MS_WORKER')))\n"
            "kids.append(subprocess.Popen([sys.executable, '-c', 'import subprocess, sys, time; subprocess.Popen("
            "[sys.executable, \"-c\", \"import time; time.sleep(30)\"]); time.sleep(30)'],"
            " env=dict(os.environ, MS_ROLE='MS_WORKER')))\n"
            "print(' '.join(str(k.pid) for k in kids), flush=True)\n"
            "time.sleep(30)\n")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        kids = [int(p) for p in parent.stdout.readline().split()]
        time.sleep(0.5)
        # msrun's `tail` of a worker's log and a worker's own children inherit MS_ROLE: not workers (the relay's
        # SIGTERM ended the tail, and with it the console's view of the save)
        assert workers_under(parent.pid) == sorted([kids[0], kids[2], kids[4]])
        assert processes_under(parent.pid, "MS_SCHED") == [kids[1]]
    finally:
        for pid in kids:
            os.kill(pid, signal.SIGKILL)
        parent.kill()


def test_a_copy_of_the_training_data_elsewhere_resumes_and_changed_data_is_refused(tmp_path):
    """The training data is compared by content, not path: a copy (new path, new modification time, as a copy to a
    node's scratch disk) resumes; a copy with one structure's elements changed is refused, naming it."""
    import shutil

    import ase.db
    from ase.calculators.singlepoint import SinglePointCalculator

    from orb.errors import ConfigError
    from test_training import make_cfg, trainer_for

    first = trainer_for(make_cfg(tmp_path, max_epochs=2))
    first.fit(until_epoch=1)
    copy = tmp_path / "scratch" / "train.db"
    copy.parent.mkdir()
    shutil.copy(DEMO_TRAIN, copy)  # not copy2: the modification time changes
    resumed = trainer_for(make_cfg(tmp_path, max_epochs=2, train_data_path=str(copy)), resume=str(tmp_path / "run"))
    assert resumed.progress.epochs_done == 1
    changed = tmp_path / "changed.db"
    with ase.db.connect(DEMO_TRAIN) as src, ase.db.connect(str(changed)) as dst:
        for row in src.select():
            atoms = row.toatoms()  # with its labels
            if row.id == 3:
                results = dict(atoms.calc.results)
                atoms.numbers[0] = 79 if atoms.numbers[0] != 79 else 29
                atoms.calc = SinglePointCalculator(atoms, **results)
            dst.write(atoms)
    with pytest.raises(ConfigError, match="train_data_path: the rows' ids, atom counts or elements differ"):
        trainer_for(make_cfg(tmp_path, max_epochs=2, train_data_path=str(changed)), resume=str(tmp_path / "run"))


def test_a_damaged_database_is_one_line_naming_it(tmp_path):
    """A database with a damaged page (a copy cut short or overwritten): one line naming the file, exit 2, no
    output folder; rows read later name the row too."""
    import shutil

    from orb.data.sqlite_rows import RowReader
    from orb.errors import DatasetError

    damaged = tmp_path / "damaged.db"
    shutil.copy(DEMO_TRAIN, damaged)
    size = os.path.getsize(damaged)
    with open(damaged, "r+b") as f:
        f.seek(size // 2)
        f.write(b"\xff" * 4096)
    result = subprocess.run([sys.executable, "finetune.py", *run_args(tmp_path / "out", train_data_path=damaged)],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert str(damaged) in lines[0] and "malformed" in lines[0] and not (tmp_path / "out").exists()
    reader = RowReader(str(damaged))
    with pytest.raises(DatasetError, match=r"damaged.db, row \d+: cannot read the database .*malformed"):
        for row_id in range(1, 65):
            reader.read(row_id)


def test_an_output_dir_that_cannot_be_made_is_one_line(tmp_path):
    result = subprocess.run([sys.executable, "finetune.py", *run_args("/proc/orb_run")], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert lines[0].startswith("error: config key 'output_dir': cannot create /proc/orb_run")


@pytest.fixture
def read_only_copy(tmp_path):
    """The demo's validation database on a read-only file system (a read-only bind mount: needs root, as CI has)."""
    import shutil

    source, mount = tmp_path / "src", tmp_path / "ro"
    source.mkdir()
    mount.mkdir()
    shutil.copy(DEMO_VAL, source / "val.db")
    made = subprocess.run(["mount", "--bind", str(source), str(mount)], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot make a read-only mount here ({made.stderr.strip()}): needs root")
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(mount)], check=True, capture_output=True)
        yield str(mount / "val.db")
    finally:
        import gc

        gc.collect()  # the test's open database connections, which would keep the mount busy
        if subprocess.run(["umount", str(mount)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def test_a_database_on_a_read_only_file_system_trains(tmp_path, read_only_copy):
    """Shared read-only storage: the rows are checked, counted and read without writing anything there."""
    from orb.data.dataset import AseDbDataset

    with pytest.raises(OSError):
        open(os.path.join(os.path.dirname(read_only_copy), "probe"), "w")
    data = AseDbDataset(read_only_copy)
    assert data.census().shape == (len(data), 3) and data.has_stress
    np.testing.assert_array_equal(data.get(3).positions, AseDbDataset(DEMO_VAL).get(3).positions)
    result = subprocess.run([sys.executable, "finetune.py", *run_args(tmp_path / "run", max_epochs=1,
                                                                       train_data_path=read_only_copy,
                                                                       val_data_path=read_only_copy)],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]


def test_resume_auto_never_overwrites_a_run_without_last_ckpt(tmp_path):
    """--resume auto in a folder whose last.ckpt is gone but which holds other checkpoints of an earlier run (best,
    best weights, periodic) refuses with one line naming them; nothing is deleted. --overwrite starts over."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    kept = {}
    for name in ("best.ckpt", "best_weights.ckpt", "epoch_0001.ckpt"):
        (run / "checkpoints" / name).write_bytes(name.encode())
        kept[name] = name.encode()
    (run / "metrics.jsonl").write_text(json.dumps({"type": "epoch", "epoch": 1, "step": 32}) + "\n")
    result = subprocess.run([sys.executable, "finetune.py", *run_args(run, max_epochs=1), "--resume", "auto"],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stdout[-2000:]
    assert result.stderr.strip().splitlines() == [
        f"error: --resume auto: {run} has no checkpoints/last.ckpt but holds an earlier run ("
        "checkpoints/best.ckpt, checkpoints/best_weights.ckpt, checkpoints/epoch_0001.ckpt); continue from one of "
        "its checkpoints with --resume PATH, start over with --overwrite (deletes those files), or choose another "
        "--output_dir"]
    for name, content in kept.items():
        assert (run / "checkpoints" / name).read_bytes() == content
    assert records(run) == [{"type": "epoch", "epoch": 1, "step": 32}]


def test_a_resume_path_that_names_no_checkpoint_is_said_with_the_configs_checks(tmp_path, capsys):
    """--resume of a missing file or folder was said after the starting weights were read (a download for a published
    model) and the data counted: now with the config's checks, before any of that; so is a path with --overwrite,
    which it ignored."""
    import finetune

    for given, said in ((tmp_path / "nope.ckpt", "checkpoint file does not exist"),
                        (tmp_path, f"no checkpoint {tmp_path / 'last.ckpt'} there")):
        status = finetune.main(run_args(tmp_path / "run") + ["--resume", str(given), "--train_data_path",
                                                             str(tmp_path / "missing.db")])
        assert status == 2
        assert capsys.readouterr().err.strip() == f"error: --resume {given}: {said}"  # (not the missing data first)
    (tmp_path / "last.ckpt").write_bytes(b"a checkpoint")
    status = finetune.main(run_args(tmp_path / "run") + ["--resume", str(tmp_path), "--overwrite", "--train_data_path",
                                                         str(tmp_path / "missing.db")])
    assert status == 2  # (--overwrite was ignored: the run resumed)
    assert capsys.readouterr().err.strip() == (f"error: --resume {tmp_path} continues the earlier run and --overwrite "
                                               "replaces it: give one of them (--resume auto --overwrite: last.ckpt "
                                               "if there is one, else start over)")


def test_resume_auto_starts_again_after_a_kill_in_the_first_epochs_save(tmp_path):
    """A kill (a node failure, SIGKILL) during the first epoch's save, after best.ckpt and best_weights.ckpt and
    before last.ckpt, left a folder --resume auto refused (exit 2): the requeued job failed. The files are this
    run's first save (epoch 1, this config): it starts again and ends where an uninterrupted run does."""
    run = tmp_path / "run"
    first = subprocess.run([sys.executable, "finetune.py", *run_args(run, max_epochs=1)], cwd=ROOT,
                           capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-2000:]
    expected = {**last_weights(run)[0], **{"opt/" + k: v for k, v in last_weights(run)[1].items()}}
    os.remove(run / "checkpoints" / "last.ckpt")  # (killed before it was written, and the epoch's record after it)
    kept = [line for line in open(run / "metrics.jsonl") if json.loads(line).get("type") != "epoch"]
    with open(run / "metrics.jsonl", "w") as f:
        f.writelines(kept)
    finished = (run / "checkpoints" / "best.ckpt").read_bytes()
    (run / "metrics.jsonl").write_text("".join(kept) + json.dumps({"type": "epoch", "epoch": 1}) + "\n")
    refused = subprocess.run([sys.executable, "finetune.py", *run_args(run, max_epochs=1), "--resume", "auto"],
                             cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert refused.returncode == 2 and "holds an earlier run" in refused.stderr, refused.stderr[-2000:]  # finished
    assert (run / "checkpoints" / "best.ckpt").read_bytes() == finished  # (a finished run's last.ckpt deleted later)
    (run / "metrics.jsonl").write_text("".join(kept) + '{"type": "step", "ste\n')  # (the kill cut its last line)
    again = subprocess.run([sys.executable, "finetune.py", *run_args(run, max_epochs=1), "--resume", "auto"],
                           cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "holds only what the first epoch's save of this run wrote before it was cut short" in again.stderr
    got = {**last_weights(run)[0], **{"opt/" + k: v for k, v in last_weights(run)[1].items()}}
    assert set(got) == set(expected) and all(np.array_equal(got[k], expected[k]) for k in expected)
    os.remove(run / "checkpoints" / "last.ckpt")
    (run / "metrics.jsonl").write_text("".join(line for line in open(run / "metrics.jsonl")
                                               if json.loads(line).get("type") != "epoch"))
    other = subprocess.run([sys.executable, "finetune.py", *run_args(run, max_epochs=1, lr="5e-4"), "--resume",
                            "auto"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert other.returncode == 2 and "holds an earlier run" in other.stderr, other.stderr[-2000:]  # another config's


CALLBACKS = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "tests"))  # stop_callbacks.py, for every process


# (SIGTERM in validation: tests/test_parallel.py, on 2 workers, whose ranks must also agree to stop there)
@pytest.mark.parametrize("where, line", [("TermAtLastStepOfFirstEpoch", "at epoch 1, step 32 of 32")])
def test_a_signal_in_validation_or_the_last_interval_saves_the_epochs_training(tmp_path, where, line, straight_run):
    """SIGTERM during the validation after an epoch, or in its last logging interval, is honoured there (it waited
    for every validation set and the epoch save; the last interval took no step save): last.ckpt holds the
    epoch's training, exit 75; --resume auto validates it and ends equal to the uninterrupted run."""
    run = tmp_path / "stopped"
    stopped = subprocess.run([sys.executable, "finetune.py", *run_args(run), "--callbacks",
                              f"[stop_callbacks:{where}]"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                             env=CALLBACKS)
    assert stopped.returncode == 75, stopped.stdout[-3000:] + stopped.stderr[-2000:]
    assert f"stopped by SIGTERM {line} (global step 32); state saved in" in stopped.stderr
    _, _, meta = last_weights(run)
    assert (meta["epoch"], meta["step_in_epoch"], meta["global_step"]) == (0, 32, 32)
    assert "epoch" not in [r["type"] for r in records(run)]
    resumed = subprocess.run([sys.executable, "finetune.py", *run_args(run), "--resume", "auto"], cwd=ROOT,
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "and 32 of 32 steps done" in resumed.stdout
    assert_same_run(run, straight_run)


def test_a_signal_in_the_starting_models_validation_is_continued_on_resume(tmp_path, straight_run):
    """SIGTERM in the middle of the starting model's validation: last.ckpt keeps its sums so far (it threw them away:
    a long validation set was redone at every preemption in it), exit 75; --resume auto continues it at the next
    batch (recorded) and ends equal to the uninterrupted run, the starting model's metrics included."""
    run, seen = tmp_path / "stopped", tmp_path / "batches.txt"
    stopped = subprocess.run([sys.executable, "finetune.py", *run_args(run), "--callbacks",
                              "[stop_callbacks:TermInStartingValidation]"], cwd=ROOT, capture_output=True, text=True,
                             timeout=300, env=CALLBACKS)
    assert stopped.returncode == 75, stopped.stdout[-3000:] + stopped.stderr[-2000:]
    assert "stopped by SIGTERM at the validation of the starting model (global step 0); state saved in" in stopped.stderr
    _, _, meta = last_weights(run)
    assert (meta["global_step"], meta["validation"]["name"], meta["validation"]["batches"]) == (0, "val", 3)
    batches = meta["validation"]["of"]
    resumed = subprocess.run([sys.executable, "finetune.py", *run_args(run), "--resume", "auto", "--callbacks",
                              "[stop_callbacks:RecordValidationBatches]"], cwd=ROOT, capture_output=True, text=True,
                             timeout=300, env=dict(CALLBACKS, ORB_VALIDATION_BATCHES=str(seen)))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    starting = [int(line.split()[2]) for line in seen.read_text().splitlines() if line.startswith("0 val ")]
    assert starting == list(range(3, batches))
    assert_same_run(run, straight_run)


def test_a_signal_during_start_up_exits_75(tmp_path):
    """Before the first step there is nothing to save: a stop signal ends the run at once with one line and exit
    status 75 (it was 128 + n, which a requeue script reads as a failure and drops the job)."""
    run = tmp_path / "run"
    process = subprocess.Popen([sys.executable, "finetune.py", *run_args(run)], cwd=ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    for line in process.stdout:
        if "device:" in line:  # the first line of start-up
            break
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 75, err[-2000:]
    assert err.strip().splitlines()[-1].startswith("stopped by SIGTERM")
    assert "exit status 75" in err and "Traceback" not in err


def test_a_signal_while_mindspore_loads_exits_75(tmp_path):
    """A stop signal in the seconds MindSpore takes to load (the first start-up step after the listener is in place;
    a preemption right after a job starts): one line and status 75 (the interrupted import of its C++ extension
    aborted the process as it exited, SIGABRT, or failed it with an ImportError)."""
    process = subprocess.Popen([sys.executable, "finetune.py", *run_args(tmp_path / "run")], cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_until_handling(process, signal.SIGTERM)
    time.sleep(0.5)  # into the import (0.2-2.2 s after listening, it ended with SIGABRT or an ImportError: exit 1)
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 75, err[-2000:]
    assert err.strip().splitlines()[-1].startswith("stopped by SIGTERM during start-up") and "Traceback" not in err
    assert "device:" not in out  # stopped before the device was chosen: while MindSpore loaded


COMMANDS = ("orb.inference.md", "orb.inference.relax", "orb.inference.evaluate", "orb.inference.export",
            "orb.io.convert")


def test_every_command_listens_before_it_parses_or_imports_anything_heavy():
    """Each command's listener is in place before its arguments are parsed (and before the imports its parser needs:
    0.3 s on a quiet host in which a SIGTERM ended orb-md and orb-relax with status 143, not 75): a command whose
    arguments are refused has already installed it. Then a signal in its first moments is one line and 75."""
    script = ("import argparse, importlib, signal, sys\n"
              "parse = argparse.ArgumentParser.parse_known_args\n"
              "seen = []\n"
              "def parsing(self, *args, **kwargs):  # what listens as the arguments are parsed\n"
              "    seen.append((signal.getsignal(signal.SIGTERM), 'mindspore' in sys.modules))\n"
              "    return parse(self, *args, **kwargs)\n"
              "argparse.ArgumentParser.parse_known_args = parsing\n"
              "for name in sys.argv[1:]:\n"
              "    seen.clear()\n"
              "    try:\n"
              "        importlib.import_module(name).main(['--no-such-argument'])\n"
              "    except SystemExit:\n"
              "        pass\n"
              "    handler, heavy = seen[0]\n"
              "    print(name, getattr(handler, '__qualname__', handler), heavy)\n")
    result = subprocess.run([sys.executable, "-c", script, *COMMANDS], cwd=ROOT, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split("\n")[:len(COMMANDS)] == [f"{name} StopSignals._note False" for name in COMMANDS]
    # the entry scripts: listening before their first heavy import (finetune.py and finetune_parallel.py imported
    # the trainer's modules first: a SIGTERM in their first 0.3 s exited 143, and a requeue script dropped the job)
    probe = ("import runpy, signal, sys\n"
             "HEAVY = ('scipy', 'mindspore', 'matplotlib', 'ase.io', 'ase.db', 'orb.training.config')\n"
             "class Probe:\n"
             "    seen = []\n"
             "    def find_spec(self, name, path=None, target=None):\n"
             "        if not Probe.seen and name in HEAVY:\n"
             "            Probe.seen.append(getattr(signal.getsignal(signal.SIGTERM), '__qualname__', None))\n"
             "sys.meta_path.insert(0, Probe())\n"
             "sys.argv = sys.argv[1:] if len(sys.argv) > 2 else [sys.argv[1], '--no-such-argument']\n"
             "try:\n"
             "    runpy.run_path(sys.argv[0], run_name='__main__')\n"
             "except SystemExit:\n"
             "    pass\n"
             "print(Probe.seen)\n")
    # and a signal at that import is the start-up line and 75 (at module level it was a traceback and status 1)
    kill = probe.replace("Probe.seen.append(getattr(signal.getsignal(signal.SIGTERM), '__qualname__', None))",
                         "Probe.seen.append(1); import os; os.kill(os.getpid(), signal.SIGTERM)")
    kill = kill.replace("except SystemExit:\n    pass\n", "finally:\n    print(Probe.seen)\n")
    # (the tools parse their options without a heavy import: their probes run on, to the missing checkpoint)
    missing = ["--checkpoint", "/nonexistent/model.ckpt", "--data", DEMO_VAL]
    tools = {"scripts/evaluate.py": missing + ["--output_dir", "/nonexistent/eval"],
             "scripts/md.py": missing + ["--output", "/nonexistent/md", "--timestep", "1", "--steps", "1"],
             "scripts/relax.py": missing + ["--output", "/nonexistent/relaxed.db"]}
    for script in ("finetune.py", "finetune_parallel.py", "scripts/evaluate.py", "scripts/md.py", "scripts/relax.py"):
        args = [script] + tools.get(script, [])
        seen = subprocess.run([sys.executable, "-c", probe, *args], cwd=ROOT, capture_output=True, text=True,
                              timeout=300)
        assert seen.stdout.strip().splitlines()[-1] == "['StopSignals._note']", (script, seen.stdout,
                                                                                   seen.stderr[-2000:])
        stopped = subprocess.run([sys.executable, "-c", kill, *args], cwd=ROOT, capture_output=True, text=True,
                                 timeout=300)
        assert stopped.returncode == 75 and stopped.stdout.startswith("[1]"), (script, stopped.stdout,
                                                                              stopped.stderr[-2000:])
        lines = stopped.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("stopped by SIGTERM during start-up"), (script, stopped.stderr)
    process = subprocess.Popen([sys.executable, "scripts/md.py", "--checkpoint", "data/demo_v3_pretrained.ckpt",
                                "--data", DEMO_VAL, "--output", "/nonexistent/md", "--timestep", "1", "--steps", "1"],
                               cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_until_handling(process, signal.SIGTERM)
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 75 and err.strip().splitlines() == [
        "stopped by SIGTERM during start-up (nothing to save yet): run the same command again to start it, or "
        "continue with --resume (exit status 75)"], err[-2000:]


COMPILE_AND_STOP = """
import os, signal, threading
from orb.signals import Stopped  # (a notebook: no command's listener; each held step listens for itself)
from orb.device import configure_mindspore
from orb.graph_cache import compile_cell
configure_mindspore("CPU")
from ase.build import bulk
from orb.data.batching import pad_batch
from orb.data.graphs import graph_from_arrays
from orb.data.tensors import model_inputs
from orb.models import create
from orb.models.cells import PredictCell
atoms = bulk("Cu", "fcc", a=3.6, cubic=True)
inputs = model_inputs(pad_batch(graph_from_arrays(atoms.positions, atoms.numbers, atoms.cell.array), 8, 200, 2))
cell = PredictCell(create("orb_v2", latent_dim=16, mlp_hidden_dim=32, num_message_passing_steps=2))
timer = threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGTERM))  # compiling takes ~1 s here
timer.daemon = True
timer.start()
try:
    compile_cell(cell, *inputs)
    print("not stopped")
except Stopped as stop:
    print(stop)
compile_cell(cell, *model_inputs(pad_batch(graph_from_arrays(atoms.positions, atoms.numbers, atoms.cell.array),
                                           16, 400, 2)))  # a session that caught the stop compiles on
print("compiled again")
"""


def test_a_signal_while_compiling_stops_after_the_compilation_without_mindsporess_report(tmp_path):
    """A stop signal while MindSpore compiles a model (the first seconds of orb-evaluate, orb-relax, orb-md and of
    training) is honoured when the compilation ends: raised inside MindSpore's parser, it printed MindSpore's
    error report and a Python stack, and left rank_0/om/analyze_fail.ir in the working folder. The signal is
    consumed: a notebook that caught the stop compiles on (under a command's listener a caught stop still ends the
    command: tests/test_signals.py, "swallowed")."""
    result = subprocess.run([sys.executable, "-c", COMPILE_AND_STOP], cwd=tmp_path, capture_output=True, text=True,
                            timeout=300, env=dict(os.environ, PYTHONPATH=ROOT))
    assert result.returncode == 0 and result.stdout.startswith("stopped by SIGTERM during start-up"), (
        result.stdout + result.stderr[-3000:])
    assert result.stdout.splitlines()[-1] == "compiled again"  # (every later compilation stopped again)
    assert "ERROR" not in result.stderr and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert not os.path.exists(tmp_path / "rank_0")


SIGNAL_WHILE_LISTENING = """
import os, signal, sys
real = signal.signal

def install_then_receive(number, handler):  # a job's signal landing while the handlers are being installed
    previous = real(number, handler)
    if number == signal.SIGTERM:
        os.kill(os.getpid(), signal.SIGTERM)
    return previous

signal.signal = install_then_receive
if sys.argv[1] == "command":
    from orb.signals import run_command
    sys.exit(run_command(lambda: 0))
from orb.training.cli import run
sys.exit(run(["configs/demo.yaml"], None, lambda cfg, args: None))
"""


@pytest.mark.parametrize("entry", ["command", "training"])
def test_a_signal_while_the_listener_installs_is_a_stop(entry):
    """A SIGTERM between two handlers' installation (the orb-properties stop test caught it once) raised its Stopped
    before the command's handling began: a traceback and status 1. Now the start-up line and 75."""
    result = subprocess.run([sys.executable, "-c", SIGNAL_WHILE_LISTENING, entry], cwd=ROOT, capture_output=True,
                            text=True, timeout=120, env=dict(os.environ, PYTHONPATH=ROOT))
    assert result.returncode == 75 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[-1].startswith("stopped by SIGTERM during start-up"), result.stderr
