"""msrun as the launcher runs it (``python -m orb.training.msrun_main`` and msrun's own arguments; orb.training.launch).

* Deaf to the stop signals: the launcher passes them to the workers, which save before they stop. msrun is started
  with them blocked (``children_start_blocked``) and caught here by a handler that does nothing should a thread of its
  own unblock them (not ignored: an ignored signal stays ignored in the processes msrun starts, and a worker would
  never hear a scheduler's stop); msrun's own SIGINT handler, which SIGKILLs every worker unsaved, is never installed.
* msrun SIGKILLs every worker's process group as soon as one worker exits non-zero. After a stop in training, every
  rank has saved together and exits 75; the others are then given :data:`STOP_GRACE` seconds to end on their own
  first: rank 0, killed while it ended, lost its stop line and left its data workers' semaphores in /dev/shm. Not
  after a stop during start-up (no stop line saying the state was saved): a rank there may be blocked in a
  collective it cannot leave, and msrun kills it at once, as before.
"""

import glob
import os
import signal
import sys
import time

from orb.signals import RESUME_HINT, STOP_SIGNALS, STOPPED_STATUS

STOP_GRACE = 10.0  # seconds: the ranks' teardown after their common save takes a few (under Slurm's KillWait, 30 s)


def deaf_to_stops() -> None:
    stops = [getattr(signal, name) for name in STOP_SIGNALS]
    install = signal.signal
    for number in stops:
        install(number, lambda *_: None)
    signal.signal = lambda number, handler: (signal.getsignal(number) if number in stops else install(number, handler))


def saved_after_a_stop(log_dir: str) -> bool:
    """Whether a worker log in ``log_dir`` ends a run stopped with its state saved (the line the launcher reads)."""
    for path in glob.glob(os.path.join(log_dir, "worker_*.log")):
        try:
            with open(path, errors="replace") as f:
                if RESUME_HINT in f.read():
                    return True
        except OSError:
            continue
    return False


def patient_after_a_stop(kill):
    """msrun's ``kill_worker_processes`` waiting first for the other workers after a stop in training (above)."""

    def kill_worker_processes(self, *args, **kwargs):
        try:
            workers = list(getattr(self, "cgn_processes", ()))
            if (not getattr(self, "enable_mindx", False)  # (MindX's recovery kills and restarts workers itself)
                    and any(p.poll() == STOPPED_STATUS for p in workers)
                    and saved_after_a_stop(getattr(self, "log_dir", "") or "")):
                deadline = time.monotonic() + STOP_GRACE
                while any(p.poll() is None for p in workers) and time.monotonic() < deadline:
                    time.sleep(0.1)
        finally:
            kill(self, *args, **kwargs)

    return kill_worker_processes


def main() -> int:
    deaf_to_stops()
    try:
        from mindspore.parallel.cluster.process_entity import _api

        _api._ProcessManager.kill_worker_processes = patient_after_a_stop(_api._ProcessManager.kill_worker_processes)
    except (ImportError, AttributeError) as exc:  # another MindSpore: msrun as it is
        print(f"run_parallel: warning: msrun kills every worker at a worker's first non-zero exit, after a stop too "
              f"(this MindSpore has no {exc.name if isinstance(exc, ImportError) else exc})", file=sys.stderr)
    from mindspore.parallel.cluster.run import main as msrun

    sys.argv[0] = "msrun"
    return msrun()


if __name__ == "__main__":
    sys.exit(main())
