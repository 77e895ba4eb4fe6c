"""What the launcher watches while msrun runs (orb.training.launch): msrun's worker and scheduler processes, the
workers' logs (how each ended), and the two ways a job's scheduler is ended early: after a stop (SignalRelay) and
after a failure on one node (FailedJobEnd). Nothing here starts a process."""

import glob
import os
import re
import signal
import sys
import time
from typing import Callable, Dict, List, Optional

from orb.signals import RESUME_HINT, STOP_SIGNALS


def _parent_and_role(pid: int):
    """(parent pid, MindSpore role) of a process, or (None, None) if it is gone or unreadable."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            parent = int(f.read().rsplit(")", 1)[1].split()[1])
        with open(f"/proc/{pid}/environ", "rb") as f:
            environ = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
        return parent, environ.get(b"MS_ROLE", b"").decode()
    except (OSError, ValueError, IndexError):
        return None, None


def processes_under(root: int, role: str = "MS_WORKER") -> List[int]:
    """msrun's Python processes of ``role`` (MS_ROLE: MS_WORKER, or MS_SCHED for its scheduler): the children of
    ``root`` (msrun) that run Python. Not the ``tail`` msrun runs to show a worker's log, nor a worker's own children
    (data workers): both inherit MS_ROLE, and a stop relayed to ``tail`` ended the console's view of the save."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            parent, found_role = _parent_and_role(int(name))
            if parent == root and found_role == role and _runs_python(int(name)):
                found.append(int(name))
    return sorted(found)


def _runs_python(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            program = f.read().split(b"\0")[0]
    except OSError:
        return False
    return b"python" in os.path.basename(program)


def workers_under(root: int) -> List[int]:
    """The MindSpore worker processes (MS_ROLE=MS_WORKER) among the descendants of ``root``."""
    return processes_under(root, "MS_WORKER")


def end_scheduler(root: int) -> None:
    """SIGKILL to msrun's scheduler under ``root``: it holds nothing to save."""
    for pid in processes_under(root, "MS_SCHED"):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


class SignalRelay:
    """While active, stop signals received here go to the worker processes under ``root``, each worker once,
    also those msrun starts after the signal came (:meth:`follow`, called while the job runs). Once every worker
    has ended after a stop, msrun's scheduler is given ``scheduler_grace`` seconds to end too, then killed: after a
    stop during start-up it would wait for the workers that never joined until MindSpore's cluster timeout
    (CLUSTER_TIME_OUT, 600 s), far past a scheduler's grace period. It holds nothing to save."""

    def __init__(self, root: Optional[int] = None, scheduler_grace: float = 10.0,
                 finished: Callable[[], bool] = lambda: False):
        """``root``: msrun's process id, set once it is started (the relay listens from before: a signal in between
        is passed on by :meth:`follow`). ``finished()``: whether the training finished (a worker's log says so): a
        run that finished as the signal came keeps its scheduler, however long it takes to end. (Not "every worker
        logged its stop": a worker msrun killed while it started ends without a line, and the scheduler waited for
        CLUSTER_TIME_OUT.)"""
        self.root, self.received, self._previous = root, [], {}
        self.scheduler_grace, self.finished = scheduler_grace, finished
        self.signalled: set = set()
        self.workers_ended_at: Optional[float] = None

    def _relay(self, number, _frame):
        self.received.append(signal.Signals(number).name)
        for pid in workers_under(self.root) if self.root is not None else ():
            self._send(pid, number)

    def _send(self, pid: int, number: int) -> None:
        self.signalled.add(pid)
        try:
            os.kill(pid, number)
        except OSError:
            pass

    def follow(self) -> None:
        """After a stop: pass it to workers started since, and end a scheduler the ended workers left waiting."""
        if not self.received or self.root is None:
            return
        number = getattr(signal, self.received[0])
        workers = workers_under(self.root)
        for pid in workers:
            if pid not in self.signalled:
                self._send(pid, number)
        if workers or not self.signalled:
            self.workers_ended_at = None
            return
        now = time.monotonic()
        if self.workers_ended_at is None:
            self.workers_ended_at = now
        elif now - self.workers_ended_at >= self.scheduler_grace and not self.finished():
            self.workers_ended_at = float("inf")  # (once)
            end_scheduler(self.root)

    def __enter__(self):
        for name in STOP_SIGNALS:
            self._previous[name] = signal.signal(getattr(signal, name), self._relay)
        return self

    def __exit__(self, *exc):
        for name, handler in self._previous.items():
            signal.signal(getattr(signal, name), handler)
        return False


class FailedJobEnd:
    """On one node: once msrun has reported a worker's exit with an error code (a failure, or a stop this launcher did
    not pass on) and every worker has ended, msrun's scheduler is ended after ``grace`` seconds. msrun kills the other
    workers when one fails, and the scheduler then waits for each killed one until MindSpore's node timeout
    (MS_NODE_TIMEOUT, 30 s by default): a setting every rank refused ended in 10 s or in 40 s by that race. No worker
    is left for it to coordinate. msrun's report, not a worker's log, decides: it is printed once msrun has given the
    job up (a log's error line may come from a worker that then ends well, and under MindX's recovery,
    MS_ENABLE_TFT, msrun restarts workers without it). (Several nodes: other nodes' workers may still be ending, and
    they hear of the failure from the scheduler.)"""

    def __init__(self, msrun_lines: Callable[[], List[str]], grace: float = 2.0, every: float = 1.0):
        """``msrun_lines()``: msrun's error output so far."""
        self.msrun_lines, self.grace, self.every = msrun_lines, grace, every
        self.since: Optional[float] = None
        self.looked = -float("inf")

    def follow(self, root: int) -> None:
        """(Called while msrun runs.) Looks at most every ``every`` seconds: each look lists the node's processes."""
        now = time.monotonic()
        if now - self.looked < self.every or self.since == float("inf"):
            return
        self.looked = now
        if not reported_exit_codes(self.msrun_lines()) or workers_under(root):
            self.since = None
            return
        if self.since is None:
            self.since = now
        elif now - self.since >= self.grace:
            self.since = float("inf")  # (once)
            end_scheduler(root)


def reported_exit_codes(msrun_lines: List[str]) -> List[int]:
    """The exit codes msrun reported for workers that ended with an error, in its order."""
    return [int(found.group(2)) for found in map(WORKER_EXCEPTION.search, msrun_lines) if found]


WORKER_EXCEPTION = re.compile(r"Worker process (\d+) exit with exception\. Error code: (-?\d+)")  # msrun's report
WORKER_PID = re.compile(r"data parallel: rank (\d+) of \d+ \(pid (\d+)\)")  # each worker's own line (setup.py)
WORKER_EXIT_LINE = "finetune_parallel: exit status"  # a failed worker's last line (msrun reports the first it saw)


def log_text(path: str) -> str:
    with open(path, errors="replace") as f:
        return f.read()


def log_stamps(log_dir: str) -> Dict[str, tuple]:
    """Each worker log's (modification time, size), as the file system records them."""
    stamps = {}
    for path in glob.glob(os.path.join(log_dir, "worker_*.log")):
        try:
            stat = os.stat(path)
        except OSError:
            continue
        stamps[path] = (stat.st_mtime_ns, stat.st_size)
    return stamps


def worker_logs(log_dir: str, before: Optional[Dict[str, tuple]] = None) -> List[str]:
    """The worker logs of this launch: those not there, or not as they were, ``before`` it (:func:`log_stamps`), so
    that a LOG_DIR reused by a run with more workers, whose logs stay beside this one's, does not decide how this
    one ended (compared by the file system's own stamps: no clock of this host against a file server's)."""
    before = before or {}
    return sorted(path for path, stamp in log_stamps(log_dir).items() if before.get(path) != stamp)


def stopped_with_state_saved(log_dir: str, before: Optional[Dict[str, tuple]] = None) -> bool:
    """Whether every worker's log ends the run with the training loop's stop line (its state saved)."""
    logs = worker_logs(log_dir, before)
    if not logs:
        return False
    return all(RESUME_HINT in log_text(path) for path in logs)


def training_finished(log_dir: str, before: Optional[Dict[str, tuple]] = None) -> bool:
    """Whether a worker log of this launch says the training finished (rank 0's, on node 0 with the scheduler)."""
    return any("training finished in" in log_text(path) for path in worker_logs(log_dir, before))


def failures(log_dir: str, before: Optional[Dict[str, tuple]] = None) -> Dict[str, List[str]]:
    """This launch's worker logs that hold error lines (a one-line error, a Python error, a traceback): their lines."""
    found = {}
    for log in worker_logs(log_dir, before):
        with open(log, errors="replace") as f:
            lines = [line.rstrip() for line in f if not line.startswith(("[WARNING", "[INFO"))]
        errors = [line for line in lines if re.match(r"^(error: |\w*Error: |Traceback)", line)]
        if errors:
            found[log] = errors
    return found


def worker_rank(log: str) -> int:
    """The rank of a worker log (``worker_<rank>.log``), -1 for another name."""
    name = os.path.basename(log)[len("worker_"):-len(".log")]
    return int(name) if name.isdigit() else -1


def report_killed(msrun_lines: List[str], logs: List[str]) -> None:
    """One line for each worker msrun saw end by a signal (a negative exit code): its log says nothing of it (the
    kernel's out-of-memory killer sends SIGKILL), so this is the only trace the user gets of which rank it was.
    ``logs``: this launch's worker logs on this node (a process id means nothing on another host)."""
    ranks = {}
    for log in logs:
        for rank, pid in WORKER_PID.findall(log_text(log)):
            ranks[int(pid)] = (rank, log)
    for found in filter(None, map(WORKER_EXCEPTION.search, msrun_lines)):
        pid, code = int(found.group(1)), int(found.group(2))
        if code >= 0:
            continue
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        rank, log = ranks.get(pid, ("unknown", None))
        why = (" (the kernel's out-of-memory killer sends it: see `dmesg` or your scheduler's report of the job)"
               if -code == signal.SIGKILL else "")
        print(f"run_parallel: rank {rank} (pid {pid}) was ended by {name}{why}" + (f"; its log: {log}" if log else ""),
              file=sys.stderr)


def report_failures(log_dir: str, before: Optional[Dict[str, tuple]] = None) -> None:
    for log, errors in failures(log_dir, before).items():
        print(f"run_parallel: rank {worker_rank(log)} failed, see {log}:", file=sys.stderr)
        for line in errors[-3:]:
            print(f"  {line}", file=sys.stderr)
