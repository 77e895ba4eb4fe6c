"""Ctrl-C (SIGINT) kept from MindSpore, so that a command's stop names it (:mod:`orb.signals`).

MindSpore turns SIGINT into SIGTERM: every graph it compiles or runs installs a C++ handler of its own for SIGINT
(``SignalGuard``, left installed afterwards) that sends the process SIGTERM. Ctrl-C during a fine-tuning, a relaxation
or dynamics was reported as "stopped by SIGTERM", and a second Ctrl-C no longer ended the process at once. No setting
turns the handler off, and a handler cannot be put back while MindSpore's C++ code runs.

While :class:`SigintWatch` is on, SIGINT is blocked in the main thread, and so in every thread started afterwards
(MindSpore's among them: a thread starts with the mask of the thread that starts it), so no handler, MindSpore's or
Python's, ever runs for it: a thread of the watch's own takes it (``sigtimedwait``) and has the main thread run
Python's handler for SIGINT (``_thread.interrupt_main``), as the signal itself would; then it interrupts the main
thread's blocking call, if any (SIGURG, whose handler does nothing), as the signal would have. Linux only (elsewhere
SIGINT is left as it is).
"""

import _thread
import signal
import threading
from typing import Optional

WAKE_EVERY = 0.5  # seconds: how often the watch's thread looks whether it is to end


def _interrupted(_number, _frame) -> None:
    """SIGURG's handler while the watch is on: nothing; its arrival makes the main thread's blocking call return
    (EINTR) and Python run the SIGINT handler the watch tripped."""


class SigintWatch:
    """SIGINT taken by a thread of its own and handed to the main thread's Python handler (see the module's
    docstring). :meth:`start` and :meth:`stop` are called from the main thread."""

    def __init__(self):
        self._thread: Optional[threading.Thread] = None
        self._stopping = threading.Event()  # (each thread its own: one stopped may still be waiting after a new start)
        self._previous_urgent = None

    @property
    def on(self) -> bool:
        return self._thread is not None

    def start(self, blocked_before: bool = False) -> None:
        """Take SIGINT from now on. Not when it is blocked already (by whoever started the process, until it chooses
        what to do with the stop signals: a data worker ignores them, one pending must stay so), unless
        ``blocked_before``: the process listens now, and a SIGINT pending is taken at once."""
        if self._thread is not None or not hasattr(signal, "sigtimedwait"):
            return
        if signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, []) and not blocked_before:
            return
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})  # (first: the watch's thread inherits the block)
        self._previous_urgent = signal.signal(signal.SIGURG, _interrupted)
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._wait, args=(threading.main_thread().ident, self._stopping),
                                        daemon=True, name="orb-sigint")
        self._thread.start()

    def stop(self) -> None:
        """SIGINT to the main thread again, as before :meth:`start` (its handlers, the caller's to set)."""
        if self._thread is None:
            return
        self._stopping.set()  # (its thread ends at its next look; a SIGINT it takes meanwhile is still handed on)
        self._thread = None
        signal.signal(signal.SIGURG, self._previous_urgent if self._previous_urgent is not None else signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # (one that came meanwhile: handled now)

    @staticmethod
    def _wait(main: int, stopping: threading.Event) -> None:
        while True:
            if signal.sigtimedwait({signal.SIGINT}, WAKE_EVERY) is None:
                if stopping.is_set():
                    return
                continue
            _thread.interrupt_main()  # (Python's SIGINT handler, in the main thread; none if it is SIG_DFL or SIG_IGN)
            try:
                signal.pthread_kill(main, signal.SIGURG)
            except OSError:  # (the main thread has ended: the interpreter is exiting)
                return
