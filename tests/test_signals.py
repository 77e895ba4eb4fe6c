"""A stop signal sent to every process of a run, as Slurm's --signal (or scancel --signal) sends it to every process of
a job step: the training process, its data workers, Python's multiprocessing resource tracker, and for 2 workers the
launcher, msrun and all it starts. The run saves and exits 75, resumes to the uninterrupted result, prints no
traceback and no "might leak" warning, and leaves nothing in /dev/shm. (The helpers died on SIGUSR1: the tracker's
successor printed a KeyError traceback for every semaphore, and what a dead tracker had tracked stayed in /dev/shm
once its program was killed.)"""

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from conftest import (DEMO_TRAIN, DEMO_VAL, ROOT, descendants, own_compile_cache, shm_left_behind,
                      signal_every_process)
from test_parallel import common_args, launch, records_without_timing, weights
from test_preemption import assert_same_run, last_weights, run_args, straight_run, wait_for_step_record  # noqa: F401

STOPS = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM, signal.SIGINT)


def assert_quiet(*texts, leak="leak"):
    """No traceback and no resource tracker's warning ("Some resources might leak", "leaked semaphore objects")."""
    for text in texts:
        assert "Traceback" not in text and leak not in text, text[-4000:]


def helpers(signalled):
    """The data workers and resource trackers among the signalled command lines."""
    return (sum("multiprocessing.spawn" in c for c in signalled), sum("resource_tracker" in c for c in signalled))


def blocked_in(status: str) -> set:
    """The stop signals a /proc/<pid>/status text says are blocked."""
    mask = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigBlk:")), 16)
    return {s for s in STOPS if mask >> (int(s) - 1) & 1}


def test_children_start_with_the_stop_signals_blocked_and_the_parent_keeps_its_mask():
    """What every helper relies on: a process started inside children_start_blocked() (fork and exec) begins with the
    four stop signals blocked; the starting thread's mask is restored as it was after, also when code inside unblocked
    some (a data worker's start launches the resource tracker inside, whose launch unblocks SIGINT and SIGTERM:
    the worker itself must still start with them blocked)."""
    from orb.signals import children_start_blocked

    show = [sys.executable, "-c", "print(open('/proc/self/status').read())"]
    with children_start_blocked():
        with children_start_blocked():
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
        inside = subprocess.run(show, capture_output=True, text=True, check=True).stdout
    assert blocked_in(inside) == set(STOPS)
    assert not set(STOPS) & signal.pthread_sigmask(signal.SIG_BLOCK, [])
    assert not blocked_in(subprocess.run(show, capture_output=True, text=True, check=True).stdout)


HELPERS = """
import os, sys, time
import numpy as np
sys.path.insert(0, {root!r})
from orb.signals import listen
listen()
from orb.data.buckets import Bucket
from orb.data.dataset import AseDbDataset
from orb.data.loader import BatchLoader, Step, prepare

if __name__ == "__main__":
    data = AseDbDataset({db!r})
    steps = [Step(0, (2 * k, 2 * k + 1), Bucket(40, 800, 3), 2) for k in range(8)]
    loader = BatchLoader({{"val": data}}, workers=2)
    got = list(loader.iterate("val", steps, None, True))
    same = all(all(np.array_equal(a, b) for a, b in zip(arrays, prepare(data, step, None, True)))
               for step, arrays in got)
    print("prepared", len(got), same, flush=True)
    time.sleep(600)  # until killed, as a scheduler kills a job some time after its signal
"""


def test_helpers_ignore_stop_signals_from_their_first_moment(tmp_path):
    """Every stop signal, again and again, to every process a loader starts, from the moment each exists (a data
    worker still importing, the resource tracker, the C++ compiler building the neighbour search into an empty
    cache): none dies, every step is prepared as inline, no worker is replaced; the program then killed (SIGKILL),
    its resource tracker unlinks its semaphores: nothing is left in /dev/shm. (A worker signalled before it ignored
    the signals died, twice: "data workers died twice"; the tracker died, with "might leak" and KeyError tracebacks,
    and the killed program's semaphores stayed in /dev/shm.)"""
    script = tmp_path / "loader.py"
    script.write_text(HELPERS.format(root=ROOT, db=DEMO_VAL))
    before = set(os.listdir("/dev/shm"))
    process = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env=dict(os.environ, **own_compile_cache(tmp_path / "cache")))
    lines = []
    reader = threading.Thread(target=lambda: lines.extend(iter(process.stdout.readline, "")), daemon=True)
    reader.start()
    seen, sent = {}, 0  # process id: its command line
    deadline = time.time() + 300
    while not lines and process.poll() is None and time.time() < deadline:
        for pid in descendants(process.pid):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    command = f.read().replace(b"\0", b" ").decode(errors="replace")
                os.kill(pid, STOPS[sent % len(STOPS)])
                seen[pid] = command or seen.get(pid, "")  # (empty once it has ended)
            except OSError:
                continue
            sent += 1
        time.sleep(0.002)
    process.kill()
    _, err = process.communicate(timeout=60)
    reader.join(timeout=10)
    assert lines and lines[0].split() == ["prepared", "8", "True"], err[-3000:]
    workers, trackers = helpers(seen.values())  # (a worker's child read before its exec counts as a worker too)
    assert workers >= 2 and trackers == 1 and any("g++" in c for c in seen.values()), seen
    assert "died" not in err and "building" not in err, err[-3000:]
    assert_quiet(err, leak="might leak")  # (killed, the program leaves its semaphores to its tracker, which says so)
    assert not shm_left_behind(before)


def test_a_stop_to_every_process_of_a_run_saves_and_resumes_to_the_uninterrupted_run(tmp_path, straight_run):
    """SIGUSR1 to the training process, its 2 data workers and the resource tracker, mid-epoch: one stop line, exit
    75, nothing else said; --resume auto ends bit for bit at the uninterrupted run; nothing left in /dev/shm."""
    run = tmp_path / "stopped"
    before = set(os.listdir("/dev/shm"))
    process = subprocess.Popen([sys.executable, "finetune.py", *run_args(run)], cwd=ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    wait_for_step_record(run / "metrics.jsonl", process)
    signalled = signal_every_process(process.pid, signal.SIGUSR1)
    assert helpers(signalled) == (2, 1), signalled
    out, err = process.communicate(timeout=300)
    assert process.returncode == 75, out[-2000:] + err[-3000:]
    assert err.strip().splitlines()[-1].startswith("stopped by SIGUSR1 at epoch 1, step"), err[-3000:]
    assert_quiet(out, err)
    assert not shm_left_behind(before)
    _, _, meta = last_weights(run)
    assert meta["epoch"] == 0 and 0 < meta["step_in_epoch"] < 32
    resumed = subprocess.run([sys.executable, "finetune.py", *run_args(run), "--resume", "auto"], cwd=ROOT,
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert_same_run(run, straight_run)


@pytest.mark.alone  # its 2-worker jobs beside another fine-tuning, late in the run: 5.2-6.1 GB (three suites, 11-30)
def test_a_stop_to_every_process_of_a_two_worker_job_saves_and_resumes_to_the_uninterrupted_job(tmp_path):
    """2 workers with a data worker each: SIGUSR1 to the launcher, msrun and everything below it (scheduler, workers,
    msrun's log tail, data workers, resource trackers) mid-epoch: exit 75 with the launcher's stop line, no traceback
    or leak warning on the console or in any msrun log; --resume auto ends at the uninterrupted job's weights,
    optimizer state and metrics, value for value; nothing left in /dev/shm."""
    extra = dict(train_data_path=DEMO_TRAIN, max_epochs=1, log_every_n_steps=2, num_buckets=1, record_batches="false",
                 data_workers=1)
    before = set(os.listdir("/dev/shm"))
    run = tmp_path / "stopped"
    job = launch(common_args(run, DEMO_TRAIN, **extra), tmp_path / "logs1", cwd=ROOT)
    wait_for_step_record(run / "metrics.jsonl", job, timeout=420)
    signalled = signal_every_process(job.pid, signal.SIGUSR1)
    # the uninterrupted job starts once the graphs are compiled and kept: it loads them (started together, both jobs
    # compiled the same graphs at once, four workers on the suite's two cores)
    straight = launch(common_args(tmp_path / "straight", DEMO_TRAIN, **extra), tmp_path / "logs0", cwd=ROOT)
    assert helpers(signalled) == (2, 2) and sum(c.startswith("/usr/bin/tail") for c in signalled) == 1, signalled
    out, _ = job.communicate(timeout=300)
    assert job.returncode == 75 and "run_parallel: stopped by SIGUSR1 with the state saved" in out, out[-3000:]
    logs = [(tmp_path / "logs1" / name).read_text() for name in sorted(os.listdir(tmp_path / "logs1"))]
    assert len(logs) == 3  # the scheduler's and the two workers'
    assert_quiet(out, *logs)
    assert 0 < last_weights(run)[2]["step_in_epoch"] < 16
    resumed = launch(common_args(run, DEMO_TRAIN, **extra) + ["--resume", "auto"], tmp_path / "logs2", cwd=ROOT)
    out, _ = resumed.communicate(timeout=420)
    assert resumed.returncode == 0 and "resumed from" in out, out[-3000:]
    out, _ = straight.communicate(timeout=420)
    assert straight.returncode == 0, out[-3000:]
    import numpy as np

    (wa, oa), (wb, ob) = weights(run), weights(tmp_path / "straight")
    for got, expected in ((wa, wb), (oa, ob)):
        assert set(got) == set(expected)
        for key in expected:
            np.testing.assert_array_equal(got[key], expected[key], err_msg=key)
    assert records_without_timing(run) == records_without_timing(tmp_path / "straight")
    assert not shm_left_behind(before)


def use_command(name, tmp_path):
    """orb-md, orb-relax or orb-evaluate on demo data, and a function that is true once it is at work."""
    if name == "md":
        import ase.db
        import ase.io

        frames = [ase.db.connect(DEMO_VAL).get(row).toatoms() for row in (1, 5, 9)]
        for atoms in frames:
            atoms.calc = None
        ase.io.write(tmp_path / "start.extxyz", frames, format="extxyz")
        log = tmp_path / "md" / "log_2.csv"
        return (["scripts/md.py", "--checkpoint", "data/demo_v3_pretrained.ckpt", "--data",
                 str(tmp_path / "start.extxyz"), "--output", str(tmp_path / "md"), "--timestep", "1", "--steps", "400",
                 "--write_every", "5"],
                lambda out: log.exists() and len(log.read_text().splitlines()) >= 3)
    if name == "relax":
        from test_relax import rows_in

        output = tmp_path / "relaxed.db"
        return (["scripts/relax.py", "--checkpoint", "data/demo_pretrained.ckpt", "--data", DEMO_TRAIN, "--output",
                 str(output), "--batch_size", "1", "--steps", "60"],
                lambda out: len(rows_in(str(output))) >= 2)
    return (["scripts/evaluate.py", "--checkpoint", "data/demo_v3_pretrained.ckpt", "--data", DEMO_TRAIN,
             "--output_dir", str(tmp_path / "evaluation"), "--batch_size", "1"],
            lambda out: "device:" in "".join(out))


@pytest.mark.parametrize("name, number", [("md", signal.SIGINT), ("relax", signal.SIGINT),
                                          ("evaluate", signal.SIGUSR1)])
def test_a_stop_to_every_process_of_a_use_command_is_one_line_and_75(tmp_path, name, number):
    """orb-md, orb-relax and orb-evaluate at work, a stop signal to every process they have (the command itself: they
    start no helper process; a future pool or worker would be signalled too): exit 75, the stop line last naming the
    signal, no traceback, nothing left in /dev/shm. (Ctrl-C, SIGINT, was said as SIGTERM once a graph had run:
    MindSpore's handler for it sends the process SIGTERM.)"""
    command, at_work = use_command(name, tmp_path)
    before = set(os.listdir("/dev/shm"))
    process = subprocess.Popen([sys.executable, *command, "--device_target", "CPU", "--progress_bar", "false"],
                               cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=dict(os.environ, ORB_CACHE_DIR=str(tmp_path / "cache")))
    out = []
    reader = threading.Thread(target=lambda: out.extend(iter(process.stdout.readline, "")), daemon=True)
    reader.start()
    deadline = time.time() + 600
    while not at_work(out):
        assert process.poll() is None and time.time() < deadline, process.stderr.read()[-3000:]
        time.sleep(0.05)
    signal_every_process(process.pid, number)
    _, err = process.communicate(timeout=300)
    reader.join(timeout=10)
    assert process.returncode == 75, "".join(out)[-2000:] + err[-3000:]
    assert err.strip().splitlines()[-1].startswith(f"stopped by {signal.Signals(number).name}"), err[-3000:]
    assert_quiet("".join(out), err)
    assert not shm_left_behind(before)


INTERRUPTED_READ = """
import os, signal, sys
from orb.signals import run_command

def body():
    import mindspore.train.serialization as serialization

    check = serialization._check_checkpoint_protobuf_size  # called in MindSpore's reader, after the file's read

    def interrupted(*args):
        if sys._getframe(1).f_code.co_name == "_parse_ckpt_proto":  # (inside its try: except BaseException)
            os.kill(os.getpid(), signal.SIGTERM)
        return check(*args)

    serialization._check_checkpoint_protobuf_size = interrupted
    from orb.io.checkpoint import load_checkpoint

    load_checkpoint("data/demo_pretrained.ckpt")
    print("read, then going on")
    return 0

sys.exit(run_command(body))
"""


def test_a_stop_while_mindspore_reads_a_checkpoint_is_a_stop():
    """A stop signal while MindSpore reads a checkpoint (the first seconds of orb-evaluate, orb-md, orb-relax and of a
    resume; what signalling every process of orb-evaluate found): the read completes, then the command stops with its
    start-up line and status 75. Raised inside MindSpore's reader, which turns any BaseException into its own error, it
    was "cannot read MindSpore checkpoint (Failed to read the checkpoint file ...)" and status 2: bad input."""
    result = subprocess.run([sys.executable, "-c", INTERRUPTED_READ], cwd=ROOT, capture_output=True, text=True,
                            timeout=300, env=dict(os.environ, PYTHONPATH=ROOT))
    assert result.returncode == 75 and "going on" not in result.stdout, result.stdout + result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1].startswith("stopped by SIGTERM during start-up"), result.stderr
    assert_quiet(result.stderr)


EXTENSION_LIKE = '''
import os, signal, time
try:
    os.kill(os.getpid(), signal.SIGTERM)  # a job's stop landing during this module's initialisation
    time.sleep(30)
except BaseException:  # what an extension's initialisation made of it (scipy's, under ASE's row decoders): its error
    raise ImportError("initialization of extension_like raised unreported exception") from None
'''

CONVERTED_STOP = """
import os, sys
import numpy as np
from orb.cache import CacheEntry, load_values
from orb.errors import DatasetError
from orb.signals import run_command

entry = CacheEntry("demo", ("orb.cache",), ("a stop in a read",), ".npz")
path = entry.write(lambda tmp: np.savez(tmp, values=np.arange(5)), "demo values")

def body():
    if sys.argv[1] == "import":
        import extension_like
    elif sys.argv[1] == "bad input":  # (a row decoder's import, reported as a damaged row)
        try:
            import extension_like
        except Exception as exc:
            raise DatasetError("rows.db", f"cannot decode it ({exc})", 3) from None
    elif sys.argv[1] == "swallowed":  # (a finaliser's "Exception ignored", a library's bare except)
        try:
            import extension_like
        except BaseException:
            pass
    elif sys.argv[1] == "cache":
        def load(path):
            import extension_like
            return load_values(path)
        entry.read(load)
    print("went on")
    return 0

if sys.argv[1] == "entry imports":  # (an entry script's module-level imports: finetune.py's)
    from orb.signals import listen
    with listen().exit_on_stop():
        import extension_like
if sys.argv[1] == "training":
    from orb.training.cli import run
    def fine_tune(cfg, args):
        import extension_like
    status = run(["--config", "configs/demo.yaml"], None, fine_tune)
else:
    status = run_command(body)
print("cache file kept" if os.path.exists(path) else "cache file removed")
sys.exit(status)
"""


@pytest.mark.parametrize("case", ["import", "bad input", "swallowed", "cache", "training", "entry imports"])
def test_a_stop_an_extensions_initialisation_turns_into_its_error_is_still_the_stop(tmp_path, case):
    """A stop landing while an extension initialises comes back as the extension's ImportError (the Stopped is lost).
    It was a traceback and status 1 (a command, fine-tuning), a damaged row (status 2), or a cache file removed as
    damaged, after which the command went on as if no signal had come (as after code that swallows it: status 0).
    Now each is the start-up line and status 75, with the cache file kept."""
    (tmp_path / "extension_like.py").write_text(EXTENSION_LIKE)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, str(tmp_path)]), ORB_CACHE_DIR=str(tmp_path / "cache"))
    result = subprocess.run([sys.executable, "-c", CONVERTED_STOP, case], cwd=ROOT, capture_output=True, text=True,
                            timeout=120, env=env)
    assert result.returncode == 75, result.stdout + result.stderr[-3000:]
    assert ("went on" in result.stdout) == (case == "swallowed"), result.stdout  # (what it did after: kept)
    assert case == "entry imports" or result.stdout.strip().splitlines()[-1] == "cache file kept", result.stdout
    assert result.stderr.strip().splitlines()[-1].startswith("stopped by SIGTERM during start-up"), result.stderr
    assert_quiet(result.stderr)


NESTED = """
import os, signal, sys, time
from orb.signals import run_command

def noted():  # a stop while the inner command finished its work (orb-evaluate writing its files)
    from orb.signals import STOP
    with STOP.deferred():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)
    return 0

def outer():
    assert run_command(lambda: 0) == 0  # a command run inside this one (a study's in-process orb-evaluate)
    if sys.argv[1] == "noted inside":
        run_command(noted)
    else:
        os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(5)
    print("went on")
    return 0

sys.exit(run_command(outer))
"""


@pytest.mark.parametrize("when", ["after it", "noted inside"])
def test_a_command_run_inside_another_leaves_the_outer_one_listening(when):
    """compare_strategies.py runs orb-evaluate in its own process between fine-tunings: the evaluation's end set the
    stop signals to ignored, and the study could no longer be stopped (a scheduler's SIGTERM, Ctrl-C). A stop the
    evaluation noted while it wrote its files stops the study when the evaluation ends."""
    result = subprocess.run([sys.executable, "-c", NESTED, when], cwd=ROOT, capture_output=True, text=True, timeout=120,
                            env=dict(os.environ, PYTHONPATH=ROOT))
    assert result.returncode == 75 and "went on" not in result.stdout, result.stdout + result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1].startswith("stopped by SIGTERM during start-up"), result.stderr
    assert_quiet(result.stderr)


SECOND_SIGNAL = """
import os, signal, sys
from orb.signals import STOP, Stopped, run_command

class Cell:  # as MindSpore's Cell.__del__ runs while a stop unwinds a command
    def __del__(self):
        os.kill(os.getpid(), signal.SIGUSR1)

def phase_stopped(signalled):
    cell = Cell()
    try:
        with STOP.deferred():
            if signalled:
                os.kill(os.getpid(), signal.SIGTERM)  # noted
            raise Stopped("stopped: saved")  # the phase saves and stops (or the ranks agreed to, on another's signal)
    finally:
        del cell  # this rank's own copy of the signal lands while the stop unwinds, past the phase

def body():
    if sys.argv[1] == "agreed":
        phase_stopped(False)
    if sys.argv[1] == "next command":  # (its first command ran before it)
        os.kill(os.getpid(), signal.SIGTERM)  # this command's start-up: stopped, not carried on
        print("went on")
        return 0
    if sys.argv[1] == "start-up":
        cell = Cell()
        try:
            os.kill(os.getpid(), signal.SIGTERM)  # a stop in start-up: Stopped, raised here
        finally:
            del cell  # the job's second copy of it (Slurm's, beside the launcher's) lands in the clean-up
    with STOP.deferred():
        STOP.finish()  # the run's work is done and saved
    os.kill(os.getpid(), signal.SIGTERM)  # the scheduler's, as the job ends: while compiled cells are freed
    print("torn down")
    return 0

if sys.argv[1] == "next command":  # a driver (a notebook) running one command after another in one process
    print(run_command(lambda: phase_stopped(True)), flush=True)  # 75, the signal noted in its phase
sys.exit(run_command(body))
"""


@pytest.mark.parametrize("case", ["start-up", "finished", "agreed", "next command"])
def test_a_second_signal_during_a_stop_or_any_signal_after_the_work_is_done_ends_nothing(case):
    """A stop raised again by a second signal in the clean-up (a ``__del__``, an ``atexit`` callback) printed
    "Exception ignored" with a traceback, or ended a run with status 1, which a Slurm recipe does not requeue; a
    signal after the run had finished and saved everything exited 75 with a traceback, and the recipe requeued a
    finished job. Now the first stop's line and 75, and 0 after the work is done (a user-data audit's findings)."""
    result = subprocess.run([sys.executable, "-c", SECOND_SIGNAL, case],
                            cwd=ROOT, capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONPATH=ROOT))
    assert_quiet(result.stderr)
    if case == "start-up":
        assert result.returncode == 75, result.stderr
        assert result.stderr.strip().splitlines() == [STOP_LINE], result.stderr
    elif case == "agreed":
        assert result.returncode == 75 and result.stderr.strip().splitlines() == ["stopped: saved"], result.stderr
    elif case == "next command":  # (a stop noted by the first command made the second's start-up go on)
        assert result.returncode == 75 and result.stdout.split() == ["75"], result.stdout + result.stderr
        assert result.stderr.strip().splitlines() == ["stopped: saved", STOP_LINE], result.stderr
    else:
        assert result.returncode == 0 and result.stdout.strip() == "torn down", result.stdout + result.stderr


CTRL_C = """
import os, signal, sys, time
from orb.signals import STOP, run_command

def body():
    from orb.device import import_mindspore
    import_mindspore()
    import mindspore as ms, numpy as np
    from mindspore import nn, ops
    ms.set_context(mode=ms.GRAPH_MODE)

    class Step(nn.Cell):
        def construct(self, x):
            return ops.matmul(x, x) * 1e-3

    step, x = Step(), ms.Tensor(np.ones((64, 64), np.float32))
    with STOP.deferred():  # (a training loop's)
        step(x).asnumpy()  # MindSpore's SIGINT handler is installed from here on
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C
        while STOP.received is None:
            step(x).asnumpy()
        print("noted", STOP.received, flush=True)
        again = time.monotonic() + 1.2
        while time.monotonic() < again:  # (the run saving)
            step(x).asnumpy()
        try:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C again: quit at once
            while time.monotonic() < again + 20:
                step(x).asnumpy()
            print("went on", flush=True)
        except KeyboardInterrupt:
            print("quit", flush=True)
    return 0

sys.exit(run_command(body))
"""


def test_ctrl_c_is_sigint_and_a_second_one_quits_once_mindspore_has_run_a_graph(tmp_path):
    """MindSpore's SIGINT handler (installed by every graph it runs) sends the process SIGTERM: Ctrl-C was noted as
    SIGTERM (the stop line said "stopped by SIGTERM") and a second Ctrl-C did nothing. Now SIGINT, and the second one
    quits."""
    script = tmp_path / "ctrl_c.py"  # (MindSpore compiles no class defined in python -c)
    script.write_text(CTRL_C)
    result = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env=dict(os.environ, PYTHONPATH=ROOT))
    assert result.stdout.split("\n")[:2] == ["noted SIGINT", "quit"], result.stdout + result.stderr[-3000:]


IN_PROCESS = """
import os, signal, subprocess, sys
from orb.signals import STOP, Stopped, run_command

def host(number, frame):
    print("host's handler", flush=True)

signal.signal(signal.SIGTERM, host)  # (a notebook's kernel, a test runner: its own handlers)
signal.signal(signal.SIGINT, signal.default_int_handler)  # (a background job starts with SIGINT ignored)

def stopped():
    raise Stopped("stopped: saved")

def refused():
    from orb.errors import OrbInputError
    raise OrbInputError("bad input")

def launcher():  # (the launcher stands down itself once msrun has ended)
    STOP.stand_down()
    return 0

def fault():
    raise RuntimeError("a fault")

# finished, stopped, refused, stood down inside, and a traceback
print(run_command(lambda: 0), run_command(stopped), run_command(refused), run_command(launcher), flush=True)
try:
    run_command(fault)
except RuntimeError:
    pass
from orb.training.cli import run  # orb-finetune's, refused
assert run(["--config", "nope.yaml"], None, lambda cfg, args: None) == 2
os.kill(os.getpid(), signal.SIGTERM)  # the host's handler again
try:
    os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C, or a notebook's "interrupt the kernel"
    signal.sigtimedwait([], 0.5)
    print("not interrupted")
except KeyboardInterrupt:
    print("interrupted", flush=True)
status = open("/proc/self/status").read()
child = subprocess.run([sys.executable, "-c", "print(open('/proc/self/status').read())"], capture_output=True, text=True)
print(*(next(line for line in text.splitlines() if line.startswith("SigIgn:")) for text in (status, child.stdout)))
print(next(line for line in status.splitlines() if line.startswith("SigBlk:")))  # (SIGINT: its watch ended too)
"""


def test_a_command_called_in_a_process_of_its_own_gives_the_signals_back_as_it_found_them():
    """A command's main called from Python (a notebook, a driver, the test suite) left the stop signals ignored when
    it ended: Ctrl-C no longer interrupted the notebook, a scheduler's SIGTERM no longer ended it, and every process
    it started afterwards began with SIGTERM ignored, so a stop sent to ``bash run_parallel.sh`` before its Python
    listened was lost and the job ran to its end (the suite's test of an early stop failed so: exit 0, not 75)."""
    result = subprocess.run([sys.executable, "-c", IN_PROCESS], cwd=ROOT, capture_output=True, text=True,
                            timeout=120, env=dict(os.environ, PYTHONPATH=ROOT))
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    assert lines[:3] == ["0 75 2 0", "host's handler", "interrupted"], result.stdout + result.stderr[-3000:]
    own, child = (int(field, 16) for field in lines[3].split()[1::2])
    assert not any(mask >> (int(s) - 1) & 1 for mask in (own, child) for s in STOPS), lines[3]
    assert not blocked_in(lines[4]), lines[4]


def test_a_stop_during_an_entry_scripts_imports_is_75_also_with_a_second_signal_as_it_exits():
    """finetune.py's module-level imports run before run_program marks the process as a program: a stop there gave the
    signals back to Python's defaults, and the job's second copy of the signal, landing as the interpreter exited,
    killed it (143, which a requeue script does not take for a stop)."""
    script = ("import atexit, os, signal\n"
              "from orb.signals import listen\n"
              "atexit.register(lambda: os.kill(os.getpid(), signal.SIGTERM))  # the second copy, as it exits\n"
              "with listen().exit_on_stop():\n"
              "    os.kill(os.getpid(), signal.SIGTERM)  # during the imports\n")
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120,
                            env=dict(os.environ, PYTHONPATH=ROOT))
    assert result.returncode == 75 and result.stderr.strip().splitlines() == [STOP_LINE.replace(
        "to start it", "to start it, or continue with --resume auto")], result.stderr


STOP_LINE = ("stopped by SIGTERM during start-up (nothing to save yet): run the same command again to start it "
             "(exit status 75)")


def test_a_signal_after_fine_tuning_finished_exits_0(tmp_path):
    """The trainer marks its work done when its last epoch is saved: a stop signal in the teardown that follows (a
    scheduler's as the job ends) exits 0 (it exited 75 with a traceback, and the job was requeued)."""
    script = ("import os, signal, sys\n"
              "import finetune\n"
              "from orb.training import trainer\n"
              "fit = trainer.Trainer.fit\n"
              "def fit_then_signal(self, *args, **kwargs):\n"
              "    out = fit(self, *args, **kwargs)\n"
              "    os.kill(os.getpid(), signal.SIGTERM)\n"
              "    return out\n"
              "trainer.Trainer.fit = fit_then_signal\n"
              "sys.exit(finetune.main(sys.argv[1:]))\n")
    result = subprocess.run([sys.executable, "-c", script] + run_args(tmp_path / "run", max_epochs=1), cwd=ROOT,
                            capture_output=True, text=True, timeout=900,
                            env=dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert_quiet(result.stderr)
    assert os.path.exists(tmp_path / "run" / "checkpoints" / "last.ckpt")


SAVING_STEP = """
import os, sys, time
from orb.signals import STOP, Stopped, run_command

def body():
    with STOP.deferred():
        open(sys.argv[1] + "/started", "w").close()
        while STOP.received is None:
            time.sleep(0.05)
        time.sleep(0.5)  # saving
        if os.path.exists(sys.argv[1] + "/fail"):
            return 1  # (its save failed)
        open(sys.argv[1] + "/saved", "w").close()
        raise Stopped(f"stopped by {STOP.received}: saved")

sys.exit(run_command(body))
"""

RUN_STEP = """
import sys
from orb.signals import run_to_its_end, run_command

sys.exit(run_command(lambda: run_to_its_end([sys.executable, "-c", sys.argv[1], sys.argv[2]], "the step")))
"""


@pytest.mark.parametrize("number, fails", [(signal.SIGTERM, False), (signal.SIGUSR1, False), (signal.SIGTERM, True)])
def test_a_stop_to_a_command_reaches_its_running_step_which_saves_before_the_command_stops(tmp_path, number, fails):
    """orb.signals.run_to_its_end (compare_strategies.py's fine-tunings): a stop sent to the command alone is
    forwarded to the step it runs, which saves; then the command stops, 75. (The study had died at once, its
    fine-tuning left running on its own, or after its first evaluation ignored the signal.) A step that fails meanwhile
    (its save on a full disk) is a failure, not a stop."""
    if fails:
        (tmp_path / "fail").touch()
    process = subprocess.Popen([sys.executable, "-c", RUN_STEP, SAVING_STEP, str(tmp_path)], cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=dict(os.environ, PYTHONPATH=ROOT))
    deadline = time.monotonic() + 60
    while not (tmp_path / "started").exists():
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.05)
    process.send_signal(number)
    _, err = process.communicate(timeout=60)
    if fails:
        assert process.returncode == 1 and not (tmp_path / "saved").exists(), err[-3000:]
        return
    assert process.returncode == 75 and (tmp_path / "saved").exists(), err[-3000:]
    name = signal.Signals(number).name
    assert err.strip().splitlines()[-1] == (f"stopped by {name}: the step saved what it had; run the same command "
                                            f"again to continue (exit status 75)"), err
    assert_quiet(err)
