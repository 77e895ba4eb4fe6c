"""The signals that ask a run to stop (schedulers, Ctrl-C), shared by the training loop and its helper processes."""

import signal
import sys

STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2")


def ignore_stop_signals() -> None:
    """For helper processes (data workers): the training process decides when the run stops, and saves first."""
    for name in STOP_SIGNALS:
        signal.signal(getattr(signal, name), signal.SIG_IGN)


def die_with_parent() -> None:
    """For helper processes: killed when the process that started them dies, even by SIGKILL (Linux; elsewhere a
    no-op), so no worker outlives a killed training process holding its pipes and memory."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def exit_on_stop_signals() -> None:
    """Until training starts there is nothing to save: a stop signal ends the process at once, with one line."""

    def leave(number, _frame):
        print(f"stopped by {signal.Signals(number).name} before training started (nothing to save)", file=sys.stderr)
        raise SystemExit(128 + number)

    for name in STOP_SIGNALS:
        signal.signal(getattr(signal, name), leave)
