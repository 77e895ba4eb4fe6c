"""msrun as the launcher runs it (``launch.MSRUN``, from the launcher's own package, and msrun's own arguments).

* Deaf to the stop signals: the launcher passes them to the workers, which save before they stop. msrun is started
  with them blocked (``children_start_blocked``) and caught here by a handler that does nothing should a thread of its
  own unblock them (not ignored: an ignored signal stays ignored in the processes msrun starts, and a worker would
  never hear a scheduler's stop); msrun's own SIGINT handler, which SIGKILLs every worker unsaved, is never installed.
* msrun SIGKILLs every worker's process group as soon as one worker exits non-zero. After a stop in training, every
  rank has saved together and exits 75; the others are then given :data:`STOP_GRACE` seconds to end on their own
  first: rank 0, killed while it ended, lost its stop line and left its data workers' semaphores in /dev/shm. Only
  when a worker that exited 75 says so in its log (the training loop's stop line, not a stop during start-up, where
  a rank may be blocked in a collective it cannot leave: msrun kills it at once, as before).
"""

import os
import signal
import sys
import time

from orb.signals import RESUME_HINT, STARTUP_STOP, STOP_SIGNALS, STOPPED_STATUS

STOP_GRACE = 10.0  # seconds: the ranks' teardown after their common save takes a few (under Slurm's KillWait, 30 s)
TAIL = 1 << 16  # bytes of a worker log read for its last lines


def deaf_to_stops() -> None:
    stops = [getattr(signal, name) for name in STOP_SIGNALS]
    install = signal.signal
    for number in stops:
        install(number, lambda *_: None)
    signal.signal = lambda number, handler: (signal.getsignal(number) if number in stops else install(number, handler))


def stopped_in_training(log_path: str) -> bool:
    """Whether the end of a worker's log is the training loop's stop line (a run stopped with its state saved)."""
    try:
        with open(log_path, "rb") as f:
            f.seek(max(os.path.getsize(log_path) - TAIL, 0))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return False
    return any(RESUME_HINT in line and STARTUP_STOP not in line for line in lines)


def stopped_workers_in_training(manager) -> bool:
    """Whether a worker of msrun's ``manager`` exited 75 after a stop in training (its own log says so)."""
    for local_rank, process in dict(getattr(manager, "proc_rank_map", {})).items():
        if process.poll() == STOPPED_STATUS and stopped_in_training(manager._get_node_id_and_log_path(local_rank)[1]):
            return True
    return False


def patient_after_a_stop(kill):
    """msrun's ``kill_worker_processes`` waiting first for the other workers after a stop in training (above)."""

    def kill_worker_processes(self, *args, **kwargs):
        try:
            workers = list(getattr(self, "cgn_processes", ()))
            # (MindX's recovery kills and restarts workers itself)
            if not getattr(self, "enable_mindx", False) and stopped_workers_in_training(self):
                deadline = time.monotonic() + STOP_GRACE
                while any(p.poll() is None for p in workers) and time.monotonic() < deadline:
                    time.sleep(0.1)
        except Exception:  # (another MindSpore's manager: msrun's own kill, at once)
            pass
        finally:
            kill(self, *args, **kwargs)

    return kill_worker_processes


def stop_workers_when_orphaned(interval: float = 1.0) -> None:
    """A thread that, should the launcher die (SIGKILL; a SIGHUP when the terminal or the ssh session of a
    ``salloc`` goes away), sends SIGTERM to msrun's own children: the workers save and exit 75 and the job ends,
    instead of training on with no one to report it (and ``--resume auto`` refused: "being written by another
    command")."""
    import threading

    launcher = os.getppid()

    def watch() -> None:
        while os.getppid() == launcher:
            time.sleep(interval)
        me = str(os.getpid())
        for pid in os.listdir("/proc"):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    parent = f.read().rsplit(")", 1)[1].split()[1]
                if pid.isdigit() and parent == me:
                    os.kill(int(pid), signal.SIGTERM)
            except (OSError, IndexError, ValueError):
                continue

    if sys.platform.startswith("linux"):
        threading.Thread(target=watch, name="orb-launcher-watch", daemon=True).start()


def main() -> int:
    deaf_to_stops()
    stop_workers_when_orphaned()
    try:
        from mindspore.parallel.cluster.process_entity import _api

        _api._ProcessManager.kill_worker_processes = patient_after_a_stop(_api._ProcessManager.kill_worker_processes)
    except (ImportError, AttributeError) as exc:  # another MindSpore: msrun as it is (said on the console)
        print(f"run_parallel: warning: msrun kills every worker at a worker's first non-zero exit, after a stop too "
              f"({type(exc).__name__}: {exc})", flush=True)
    from mindspore.parallel.cluster.run import main as msrun

    sys.argv[0] = "msrun"
    return msrun()
