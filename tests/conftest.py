"""Shared fixtures: paths to the bundled test data and the PyTorch parity reference."""

import contextlib
import fcntl
import os
import subprocess
import sys
import tempfile

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
DATA = os.path.join(ROOT, "tests", "data")
MPTRJ_DB = os.path.join(DATA, "10_mptraj_systems.db")
MPTRJ_THIN_DB = os.path.join(DATA, "10_thin_mp_traj_systems.db")
REFERENCE_NPZ = os.path.join(DATA, "orb_v2_parity.npz")
TORCH_SAMPLE = os.path.join(DATA, "torch_format_sample.ckpt")
STATE_DICT_KEYS = os.path.join(DATA, "state_dict_keys.txt")
DEMO_TRAIN = os.path.join(ROOT, "data", "demo_train.db")
DEMO_VAL = os.path.join(ROOT, "data", "demo_val.db")

# Compiled graphs and native libraries: one folder for the whole suite, the tests whose data caches are their own
# (ORB_CACHE_DIR in tmp_path) included, so tests that compile the same graph load it; a test of compilation itself
# gives it a folder of its own (own_compile_cache).
from orb.cache import cache_dirs  # noqa: E402  (once the checkout is on the path)
from orb.device import resident_gb  # noqa: E402

os.environ.setdefault("ORB_COMPILE_CACHE_DIR", cache_dirs()[0])  # (the data caches' default folder)


def own_compile_cache(folder) -> dict:
    """The environment of a process whose data caches and compiled code are all in ``folder`` (empty at first): for
    tests of what a first start compiles or builds. Its temporary folder too: the caches' fallback
    ($TMPDIR/orb_mindspore-<uid>, where a run with a read-only cache kept its own) is read like any cache folder."""
    env = {"ORB_CACHE_DIR": str(folder), "ORB_COMPILE_CACHE_DIR": str(folder)}
    try:
        os.makedirs(os.path.join(str(folder), "tmp"), exist_ok=True)
    except OSError:  # (a folder that cannot be made, on purpose: the test sets TMPDIR itself)
        return env
    return dict(env, TMPDIR=os.path.join(str(folder), "tmp"))


# Small architecture for fast tests (the orb-v2 layout with fewer/smaller layers).
SMALL_MODEL = dict(latent_dim=32, mlp_hidden_dim=64, num_message_passing_steps=2, head_mlp_hidden_dim=32)


def said_by_a_census_in_workers(path, words: str, caplog) -> list:
    """The warnings holding ``words`` that a start says of data ``path`` whose rows two data workers check (their own
    warnings are not shown) or whose check it reads from the cache: what each process says once, forgotten first."""
    import logging

    from orb.data.dataset import AseDbDataset
    from orb.data.labels import _SAID
    from orb.data.loader import BatchLoader

    _SAID.clear()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="orb"):
        loader = BatchLoader({"train": AseDbDataset(path)}, workers=2)
        loader.census("train")
        loader.close()
    return [r.getMessage() for r in caplog.records if words in r.getMessage()]


@pytest.fixture(scope="session")
def reference():
    return np.load(REFERENCE_NPZ)


def reference_graph(z, i):
    """The stored reference graph and labels of structure ``i`` as AtomGraphs."""
    from orb.data.graphs import AtomGraphs

    p = f"s{i}/"
    return AtomGraphs(
        positions=z[p + "positions"], numbers=z[p + "numbers"], cell=z[p + "cell"][None],
        senders=z[p + "senders"], receivers=z[p + "receivers"], vectors=z[p + "vectors"],
        n_node=np.array([len(z[p + "numbers"])]), n_edge=np.array([len(z[p + "senders"])]),
        energy=z[p + "label_energy"], forces=z[p + "label_forces"], stress=z[p + "label_stress"],
    )


@contextlib.contextmanager
def op_by_op():
    """Run the cells called inside op by op (PyNative), then in the mode before. For checks that call a model's
    layers one at a time: in graph mode each layer's first call on each input shape is a compilation of its own
    (a full-size model's 15 layers: 15 compilations), which is all such a check would spend its time on; the whole
    model's compiled graph is checked by the prediction tests."""
    import mindspore as ms

    before = ms.get_context("mode")
    ms.set_context(mode=ms.PYNATIVE_MODE)
    try:
        yield
    finally:
        ms.set_context(mode=before)


NOTING_MINDSPORE = ("import runpy, sys\nsys.argv = sys.argv[1:]\ntry:\n    runpy.run_path(sys.argv[0], run_name='__main__')\n"
                    "except SystemExit as stop:\n    print('mindspore' in sys.modules)\n    sys.exit(stop.code)\n")


def noting_mindspore(command: list) -> list:
    """``command`` (``[python, script, args ...]``) run so that its last line of output says whether MindSpore was
    imported: a command's errors in its options come before that 1 s import."""
    return [command[0], "-c", NOTING_MINDSPORE, *command[1:]]


LARGE_MEMORY = "needs ~9 GB of memory, more than CI's 6 GB: run it with ORB_LARGE_MEMORY=1"


def wait_until_handling(process, signum, timeout=120.0) -> None:
    """Until ``process`` has installed its own handler of ``signum`` (Linux: its SigCgt mask): a command's stop
    listener is in place, so a signal sent now reaches it in its next start-up step (loading MindSpore)."""
    import time

    deadline = time.time() + timeout
    while time.time() < deadline:
        assert process.poll() is None, "the process ended before it listened"
        try:
            with open(f"/proc/{process.pid}/status") as f:
                caught = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
        except (OSError, StopIteration):
            caught = 0
        if caught >> (int(signum) - 1) & 1:
            return
        time.sleep(0.005)
    raise AssertionError("the process never installed its handler")


def descendants(root: int):
    """Every process below ``root`` (from /proc)."""
    parents = {}
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/stat") as f:
                parents[int(name)] = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    found, frontier = set(), {root}
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier and pid not in found}
        found |= frontier
    return sorted(found)


def signal_every_process(root: int, signum) -> list:
    """``signum`` to ``root`` and every process below it, as a scheduler signals every process of a job step (Slurm's
    --signal, scancel --signal); returns their command lines (what was signalled)."""
    signalled = []
    for pid in [root, *descendants(root)]:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            os.kill(pid, signum)
        except OSError:
            continue
        signalled.append(command)
    return signalled


SHM = "/dev/shm"


def shm_in_use() -> set:
    """The /dev/shm entries some living process maps or holds open (its own semaphores and shared memory)."""
    used = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/maps") as f:
                used.update(line.split(SHM + "/", 1)[1].split()[0] for line in f if SHM + "/" in line)
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith(SHM + "/"):
                    used.add(target[len(SHM) + 1:].split()[0])
        except OSError:
            continue
    return used


def shm_left_behind(before: set, timeout: float = 30.0) -> set:
    """Entries of /dev/shm that appeared since ``before`` (a listing taken before the run) and that no living process
    uses, still there after a few seconds: what the run left (other processes on the host map theirs, or unlink them
    as they end; a resource tracker cleans up after its program within moments)."""
    import time

    deadline = time.time() + timeout
    while True:
        left = set(os.listdir(SHM)) - before - shm_in_use()
        if not left or time.time() > deadline:
            return left
        time.sleep(0.5)


def pytest_configure(config):
    config.addinivalue_line("markers", "large_memory: " + LARGE_MEMORY)
    config.addinivalue_line("markers", "isolated: runs in a fresh Python process of its own (gradients: a process that "
                                       "computed one keeps 0.3-0.9 GB after every model is freed)")
    config.addinivalue_line("markers", "alone: too large to share the machine (full-size models, 1.7-8 GB; late in "
                                       "the run, 0.7 GB beside two grown workers): under -n 2 the other worker waits")
    config.addinivalue_line("markers", "beside_light: an alone run measured under 4 GB: the other worker may run the "
                                       "LIGHT files meanwhile")


def module_name(item) -> str:
    return getattr(item.module, "__name__", "")


def is_full_size(item) -> bool:
    return ((module_name(item) == "test_orb_v3_parity"
             and item.name.startswith(("test_matches_pytorch", "test_large_memory")))
            or item.name == "test_smoke_test_passes_and_prints_a_report")


# Files whose tests hold only small models (the 2-layer test model; formats' and install's subprocesses the demo's):
# each peaks under 0.9 GB over its processes, run alone with CI's environment (2026-11-26: graphs 0.11, optimizer
# 0.54, blocks 0.47, pieces 0.84, cache 0.10, dataset 0.10, schedule_config 0.43 GB, one process each; formats 0.70
# and install 0.59 GB summed over the test process and its children). They run beside the alone runs marked
# beside_light (peaks measured under 4 GB), so the second core works while those compile: under 3.6 + 0.9 GB + the
# first worker's process, which is small then (its first tests). Every other alone run keeps the whole machine.
# Not light: uncertainty (1.4 GB summed), export (1.2 GB), model_names and checkpoint (full-size models and peers).
# LIGHT_LATE (2026-11-30, the same way: templates 0.10, benchmarks 0.27, resume_state 0.47, formats_agree 0.00,
# layout 0.03, own_inputs 0.14 GB; 32 s of tests together) run beside the smoke test: see LONGEST_FIRST.
LIGHT_EARLY = ("test_graphs", "test_optimizer", "test_blocks", "test_pieces", "test_formats", "test_install",
               "test_cache", "test_dataset", "test_schedule_config")
LIGHT_LATE = ("test_resume_state", "test_benchmarks", "test_templates", "test_own_inputs", "test_formats_agree",
              "test_layout")
LIGHT = LIGHT_EARLY + LIGHT_LATE

# The README's command runs two pytest-xdist workers, each taking whole files in this order (--dist loadfile
# --no-loadscope-reorder: a file's module-scoped runs happen once): the full-size parity runs first (3.2 min), while
# both workers are small, the early light files beside them on the other worker (about as long), then the smoke test
# (the suite's largest process, 3.1 GB; 1.1 min) on the worker the parity runs leave, the late light files beside it
# on the other. Before the parity runs had a file of their own, the worker that ran them went on with the rest of
# test_orb_v3 and waited through the smoke test: 65-80 idle core-seconds a run. Then the others longest first (their
# test time in a full run, 2026-11-30: parallel 366 s ...), so that the two workers end together. Late in the run
# each worker holds 2.1-2.3 GB: a test whose processes add over 0.7 GB then runs alone (the README's quick start,
# a fine-tuning by name), or the host reaches CI's 6 GB beside another. (Running the short files of such tests right
# after the light files instead grew a worker to 2.7 GB for the rest of the run, and other pairs reached 6.4 GB.)
LONGEST_FIRST = ("test_orb_v3_parity",) + LIGHT_EARLY + ("test_smoke",) + LIGHT_LATE + (
    "test_parallel", "test_replay", "test_odd_structures", "test_precision", "test_orb_v3", "test_preemption",
    "test_md", "test_training", "test_sums", "test_relax", "test_properties", "test_use", "test_graph_cache",
    "test_tradeoff", "test_val_split", "test_signals", "test_model", "test_edge_input", "test_strategies",
    "test_pretrained", "test_export", "test_model_names", "test_docs", "test_checkpoint", "test_uncertainty",
    "test_mixed_stress")


def pytest_collection_modifyitems(config, items):
    # The full-size subprocesses (the parity runs, up to 5.0 GB in the portable profile; the smoke test's training
    # step) go first in their files, while the test process is small (later tests leave it holding 2-3 GB).
    rank = {name: k for k, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: (rank.get(module_name(item), len(rank)), not is_full_size(item)))
    for item in items:
        if is_full_size(item):
            item.add_marker(pytest.mark.alone)
    if os.environ.get("ORB_LARGE_MEMORY") != "1":
        for item in items:
            if "large_memory" in item.keywords:
                item.add_marker(pytest.mark.skip(reason=LARGE_MEMORY))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Under pytest-xdist a test marked ``alone`` runs while the other worker waits (from the setup of its fixtures,
    module-scoped ones included, to their teardown), so a full-size model's memory never adds to another test's: a
    turnstile lock orders the turns, a shared/exclusive lock on a second file lets other tests overlap each other
    only. A test of a LIGHT file takes neither, only a third lock shared with the other light tests, which an alone
    run holds exclusively unless it is marked ``beside_light``."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        yield
        return
    run = run_files()
    with open(run + ".turnstile", "a") as turnstile, open(run + ".memory", "a") as memory, \
            open(run + ".light", "a") as light:
        if module_name(item) in LIGHT:
            lock_or_release_first(light, fcntl.LOCK_SH)  # (an alone test not beside_light holds it)
            try:
                yield
            finally:
                fcntl.flock(light, fcntl.LOCK_UN)
            return
        lock_or_release_first(turnstile, fcntl.LOCK_EX)  # (the other worker's alone test holds it)
        alone = "alone" in item.keywords
        fcntl.flock(memory, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        if alone and "beside_light" not in item.keywords:
            fcntl.flock(light, fcntl.LOCK_EX)
        if not alone:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(light, fcntl.LOCK_UN)
            fcntl.flock(memory, fcntl.LOCK_UN)
            fcntl.flock(turnstile, fcntl.LOCK_UN)


def run_files() -> str:
    """The prefix of this run's lock files (one run of pytest-xdist's workers)."""
    return os.path.join(tempfile.gettempdir(), f"orb-tests-{os.environ.get('PYTEST_XDIST_TESTRUNUID', 'run')}")


def took(lock_file, mode) -> bool:
    """Whether ``lock_file`` was taken at once (False: the other worker holds it)."""
    try:
        fcntl.flock(lock_file, mode | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def lock_or_release_first(lock_file, mode) -> None:
    """Take ``lock_file``; if the other worker holds it (its alone test runs or waits for this worker), hand this
    worker's memory back before waiting."""
    if not took(lock_file, mode):
        release_memory()
        fcntl.flock(lock_file, mode)


ISOLATED_CHILD = "ORB_TEST_ISOLATED_CHILD"


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    """A test marked ``isolated`` runs in a fresh pytest process (its own fixtures; what it computes and what
    MindSpore keeps afterwards go when that process ends), which must pass; the worker stays small. The child is
    not a pytest-xdist worker: this worker already holds the test's turn (pytest_runtest_protocol)."""
    if "isolated" not in pyfuncitem.keywords or os.environ.get(ISOLATED_CHILD) == "1":
        return None
    import subprocess

    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST") and k != "PYTEST_ADDOPTS"}
    env[ISOLATED_CHILD] = "1"
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "-rfEs",
                             pyfuncitem.nodeid], cwd=str(pyfuncitem.config.rootpath), env=env, capture_output=True,
                            text=True, timeout=3600)
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    if result.returncode == 0 and " skipped" in summary and " passed" not in summary:  # skipped there: here too
        reasons = [line for line in result.stdout.splitlines() if line.startswith("SKIPPED")]
        pytest.skip(f"in its own process: {reasons[0] if reasons else summary}")
    if result.returncode != 0 or " passed" not in summary:
        pytest.fail(f"in its own process (exit status {result.returncode}):\n{result.stdout[-6000:]}"
                    f"{result.stderr[-2000:]}", pytrace=False)
    return True


def pytest_runtest_logreport(report):
    """With ORB_NO_SKIP=1 (set by .ci/run) a skipped test fails the run: CI must run every supported path
    (the one exception, said in the summary line: tests marked large_memory, above CI's memory)."""
    if "large_memory" in report.keywords:
        return
    if os.environ.get("ORB_NO_SKIP") == "1" and report.skipped and report.when in ("setup", "call"):
        report.outcome = "failed"
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.longrepr = f"skipped while ORB_NO_SKIP=1: {reason}"


@pytest.fixture(autouse=True)
def _default_precision_for_each_test():
    """Each test starts in the default precision, whatever the one before it set (the precision in force when a
    model is built is the one it computes in)."""
    from orb import precision

    precision.set_precision(precision.DEFAULT)
    yield
    precision.set_precision(precision.DEFAULT)


def release_memory() -> None:
    """Hand back what the finished tests' models and compiled steps held (MindSpore keeps each compiled model's
    runtime memory until asked). MindSpore then lets go of every compiled graph still alive (the next call of a kept
    calculator loads its graph again from the compile cache: orb.graph_cache.CompiledThroughCache), so it is done
    only where memory matters: see pytest_runtest_teardown, and a fixture that built full-size models before its
    tests start processes of their own (tests/test_precision.py's float64 predictions)."""
    if "mindspore" in sys.modules:
        import gc

        gc.collect()
        from orb.device import recycle_compiled_memory, release_host_memory

        recycle_compiled_memory()
        release_host_memory()
        _RELEASED_AT[0] = resident_gb()


def is_alone(item) -> bool:
    return item is not None and "alone" in item.keywords


KEPT_GB = 1.0  # what a worker may keep, beyond its size after the last release, between two tests of a file
_RELEASED_AT = [0.0]  # the worker's resident size after its last release_memory


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After the last test of a file (its module-scoped fixtures gone), around a test marked ``alone`` (this worker's,
    or the other's, waiting for this test to end), at the end and in a worker grown by KEPT_GB since its last release,
    the memory is handed back (release_memory), so the suite's peak stays that of its largest test; otherwise,
    between two tests of one file, a module-scoped calculator or step keeps its compiled graphs (which the release
    would drop: the suite compiled 150 s of graphs again, before they were loaded from the cache). A worker about to
    wait for a lock the other's alone test holds releases first (lock_or_release_first)."""
    yield
    if (nextitem is None or module_name(nextitem) != module_name(item) or is_alone(item) or is_alone(nextitem)
            or resident_gb() > _RELEASED_AT[0] + KEPT_GB or other_worker_waits_alone()):
        release_memory()


def other_worker_waits_alone() -> bool:
    """Whether the other worker holds the turnstile: about to run an alone test, it waits for this worker's test to
    end (checked before this worker lets its turn go, so that its memory is handed back before the alone test
    starts); a non-alone test holds it for an instant only."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return False
    with open(run_files() + ".turnstile", "a") as turnstile:
        if not took(turnstile, fcntl.LOCK_EX):
            return True
        fcntl.flock(turnstile, fcntl.LOCK_UN)
        return False


@pytest.fixture
def small_disk(tmp_path):
    """A folder on a tmpfs of a chosen size (a real full disk): mount needs root, as CI runs."""
    mounted = []

    def make(size_bytes):
        folder = tmp_path / f"disk{len(mounted)}"
        folder.mkdir()
        result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(folder)],
                                capture_output=True, text=True)
        if result.returncode:
            pytest.skip(f"cannot mount a tmpfs to fill (needs root): {result.stderr.strip()}")
        mounted.append(folder)
        return folder

    yield make
    for folder in mounted:
        subprocess.run(["umount", str(folder)], capture_output=True)
