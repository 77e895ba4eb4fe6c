"""The one way a stop signal ends a run: training, validation, saving, relaxation, dynamics, or start-up.

Schedulers end jobs with a signal (Slurm: SIGTERM at preemption or the time limit, or the one asked
for with ``--signal=USR1@120`` ahead of it; Ctrl-C: SIGINT). :data:`STOP` is the process's one
listener, installed by every command line at its start (:func:`listen`):

* in a phase with nothing to save (start-up: reading data, counting neighbours, building and compiling
  the model) a signal stops the process at once with :class:`Stopped`;
* inside :meth:`StopSignals.deferred` (training, validation, relaxing, dynamics) it is only noted
  (:attr:`StopSignals.received`); the phase finishes the step or batch it is in, saves what it has
  and raises :class:`Stopped` itself.

Either way the command line exits with :data:`STOPPED_STATUS` (75, EX_TEMPFAIL): "run the same
command again with ``--resume`` to continue", which a requeue script can act on. A second SIGINT
more than a second after the first ends the process at once (Ctrl-C twice; a copy of the first,
forwarded by the launcher, does not). Helper processes (data workers) ignore the signals: the
process that owns the state decides when to stop.

A scheduler may signal every process of a job step (Slurm's ``--signal``, ``scancel --signal``): the run's helpers
too. Every process the project starts, or causes to be started, therefore starts with the stop signals blocked
(:func:`children_start_blocked`; a blocked mask is inherited across fork and exec), so a signal cannot end it
before it has chosen what to do with them: a data worker ignores them, then unblocks them
(:func:`ignore_stop_signals`); a command (msrun's workers) listens, then unblocks them (:func:`deliver_stop_signals`:
what came meanwhile is handled then, not lost); a program that does neither (Python's resource tracker for
SIGUSR1/SIGUSR2, msrun's ``tail``, the C++ compiler) never receives them.

While the listener is installed, SIGINT is taken by a thread of its own (:mod:`orb.sigint`): MindSpore's handler for
it, installed by every graph it runs, sends the process SIGTERM, and Ctrl-C was reported as SIGTERM.
"""

import signal
import sys
import threading
import time
from contextlib import contextmanager
from typing import Callable, NoReturn, Optional

from orb.sigint import SigintWatch

STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2")
STOP_NUMBERS = tuple(getattr(signal, name) for name in STOP_SIGNALS)
STOPPED_STATUS = 75  # EX_TEMPFAIL: stopped on request, nothing lost; resuming continues the run
STARTUP_STOP = "during start-up"  # in the line of a stop before the run's work began (msrun_main tells them apart)
RESUME_HINT = "continue with --resume auto"  # the launcher recognises a worker that stopped cleanly by this
RESUME_FLAG = "continue with --resume"  # orb-md's and orb-relax's --resume takes no value
SIGINT_WATCH = SigintWatch()  # SIGINT kept from MindSpore while a listener is installed


class Stopped(BaseException):
    """The run stopped on a signal with everything worth keeping saved.

    A ``BaseException``, as ``KeyboardInterrupt``: a signal arriving inside code that turns any ``Exception`` into
    a message of its own (a cache read treated as damaged, a file ase.io cannot read, a checkpoint MindSpore
    cannot load) must still end the run with status 75, not be reported as bad input or swallowed."""

    status = STOPPED_STATUS


class StopSignals:
    """The process's stop-signal listener (see the module's docstring)."""

    def __init__(self):
        self.received: Optional[str] = None
        self._when = 0.0
        self._depth = 0  # nesting of deferred() phases
        self._installed = False
        self.resume_hint = RESUME_HINT  # how this command continues a run (orb-md, orb-relax: a bare --resume)
        self.raised: Optional[str] = None  # a start-up stop raised and not yet reported (:meth:`raise_if_raised`)
        self.commands = 0  # run_command's nesting: a command run inside another (a study's in-process evaluations)
        self.finished = False  # the command's work is done and saved (:meth:`finish`)
        self.stopping = False  # a phase ended by a stop (one the ranks agreed on: no signal of this rank's noted)
        self._host_handlers: dict = {}  # what listened before the command's listener (:meth:`stand_down`)

    def _note(self, number, _frame):
        name = signal.Signals(number).name
        if name == "SIGINT" and self.received is not None and time.monotonic() - self._when > 1.0:
            SIGINT_WATCH.stop()  # (a third one ends the process, as Python's default)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            raise KeyboardInterrupt
        if self._depth == 0 and not self._under_way():  # the exception carries it, and :attr:`raised` until reported
            self.raised = name
            raise Stopped(self.startup_message(name))
        if self.received is None:
            self.received, self._when = name, time.monotonic()

    def _under_way(self) -> bool:
        """Whether a command's stop is already under way (a start-up stop raised, a phase's signal noted: a second
        signal, Slurm's to every process beside the launcher's copy, raised again in the clean-up, a traceback from
        a ``__del__`` or an ``atexit`` callback and status 1) or its work is done (:meth:`finish`): a signal is then
        only noted."""
        return self._installed and (self.raised is not None or self.received is not None or self.finished
                                    or self.stopping)

    def finish(self) -> None:
        """The run's work is done and saved: a stop signal from now on (a scheduler's as the job ends, while compiled
        cells are freed, the output folder's lock released and a data-parallel job's communication ends) is noted, not
        raised: the command exits 0 (a traceback and status 75 made a scheduler requeue a finished job). A later
        phase of the same process (:meth:`reset`) stops at its first check for a signal noted meanwhile."""
        if self._installed:
            self.finished = True

    def startup_message(self, name: str) -> str:
        again = f", or {self.resume_hint}" if self.resume_hint else ""
        return (f"stopped by {name} {STARTUP_STOP} (nothing to save yet): run the same command again to start it"
                f"{again} (exit status {STOPPED_STATUS})")

    def stop_if_received(self) -> None:
        """After a start-up step run deferred (:meth:`held`): stop now if a signal came -- unless inside a deferred
        phase, which stops at its own point, after saving. The signal is consumed: a notebook that catches the stop
        computes on (every later compilation stopped again)."""
        if self.received is not None and self._depth == 0:
            name, self.received = self.received, None
            if self._installed:  # a command's listener (a notebook that catches the stop computes on clean)
                self.raised = name
            raise Stopped(self.startup_message(name))

    def raise_if_raised(self) -> None:
        """For code that turns any ``Exception`` into its own handling (a cache file read as damaged and removed, a
        file reported unreadable, a backend counted as unavailable, a command's traceback): a start-up stop that
        landed inside it, which an extension's initialisation turns into its own ``ImportError`` or
        ``SystemError`` (the :class:`Stopped` itself is lost), is the stop, not that error."""
        if self.raised is not None:
            raise Stopped(self.startup_message(self.raised))

    def reported(self) -> None:
        """The start-up stop was reported (a command's last line): code run afterwards in this process (a test's,
        a notebook's) is not stopping."""
        self.raised = None

    @contextmanager
    def exit_on_stop(self):
        """For an entry script's module-level imports, which run before its main catches anything: a stop signal
        there is the start-up line and exit status 75 (it was an uncaught exception: a traceback, status 1)."""
        try:
            try:
                yield
            except Exception:
                self.raise_if_raised()  # (an extension's ImportError for it)
                raise
            self.raise_if_raised()  # (one swallowed by the imported code)
        except Stopped as stop:
            self.stand_down(exiting=True)  # (the process ends: another signal as the interpreter exits is no second
            self.reported()                # stop; run_program has not marked it yet: a 143 was no requeue)
            print(str(stop), file=sys.stderr)
            sys.exit(stop.status)

    def install(self) -> dict:
        """Listen from now on (main thread only: Python delivers signals there); returns the handlers replaced."""
        if threading.current_thread() is not threading.main_thread():
            return {}
        if not self._installed:  # (a second listen() of the same command keeps a stop raised under the first;
            # a new command forgets the last one's: a signal it handled left noted made this one's start-up go on)
            self.raised, self.finished, self.stopping, self.received = None, False, False, None
        previous = {name: signal.signal(getattr(signal, name), self._note) for name in STOP_SIGNALS}
        if not self._installed:
            self._host_handlers = previous
        self._installed = True
        SIGINT_WATCH.start()
        return previous

    @contextmanager
    def deferred(self):
        """A phase that saves before it stops: signals are only noted while it runs. Used without :func:`listen`
        (a script or a notebook driving a trainer), the listener is installed for the phase only."""
        if self._depth == 0:
            self.raise_if_raised()  # a start-up stop that code before this phase swallowed: no phase begins after it
        self._depth += 1  # (first: a signal landing while a phase's own listener installs is noted, not raised)
        try:
            previous = {} if self._installed else self.install()
        except BaseException:
            self._depth -= 1
            raise
        try:
            yield self
        except Stopped:
            self.stopping = True  # (its own copy of the signal, coming while the stop unwinds, is the same stop)
            raise
        finally:
            if previous:  # (before the depth falls: a signal meanwhile is noted, not raised)
                SIGINT_WATCH.stop()
                for name, handler in previous.items():
                    signal.signal(getattr(signal, name), handler)
                self._installed = False
            self._depth -= 1

    @contextmanager
    def held(self):
        """A start-up step no signal may interrupt, as :func:`orb.device.import_mindspore` and compilations: signals
        are noted meanwhile, and honoured after it (:meth:`stop_if_received`). For code that turns any exception,
        ``BaseException`` too, into its own error: MindSpore's checkpoint reader said "Failed to read the checkpoint
        file" for a stop (exit 2, not 75). A signal noted before it (by a phase that stops at its own point, or one
        a session caught and went on from) is not this step's to raise."""
        earlier = self.received
        with self.deferred():
            yield
        if earlier is None:
            self.stop_if_received()

    def stand_down(self, exiting: bool = False) -> None:
        """The command has finished: a stop signal from now on (a scheduler's, as the job ends) is no stop to report,
        nor an end by the signal as the interpreter exits (it resets Python's handlers to the default then: status
        128 + n). Ignored in a command's program (:func:`run_program`); a command called in a process of its own
        (a notebook's, a test's) gives the stop signals back to the handlers it found: left ignored, Ctrl-C no longer
        interrupted the notebook, and every process it started afterwards began deaf to SIGTERM until it listened
        (a stop sent to ``bash run_parallel.sh`` then was lost); ``exiting``: the process ends now whatever ran it.
        A later deferred phase listens again for itself."""
        if threading.current_thread() is not threading.main_thread():  # (no handler was installed from there)
            self._installed = False
        elif exiting or is_program():
            ignore_stop_signals()
            self._installed = False
        else:
            self.give_back()

    def give_back(self) -> None:
        """A command called in a process of its own has ended, however (its status, a traceback, Ctrl-C): the stop
        signals go back to the handlers its listener found (once; a command's program keeps its own to the end)."""
        if self._host_handlers and threading.current_thread() is threading.main_thread():
            SIGINT_WATCH.stop()
            for name, handler in self._host_handlers.items():
                signal.signal(getattr(signal, name), handler if handler is not None else signal.SIG_DFL)
            self._installed = False
        self._host_handlers = {}

    def reset(self) -> None:
        """Forget a signal that was handled (another run in the same process starts clean). Not a start-up stop
        raised and not yet reported (:attr:`raised`): that one is the command's, still to end it; nor one noted after
        the previous run finished (:meth:`finish`): this run stops at its first check."""
        if not self.finished:
            self.received = None
        self.finished = self.stopping = False


STOP = StopSignals()


def listen(resume_hint: str = RESUME_HINT) -> StopSignals:
    """Install the process's listener (command lines call this first) and return it. ``resume_hint``: what the
    start-up message tells the user to run to continue (empty for commands with nothing to continue)."""
    STOP.resume_hint = resume_hint
    STOP.install()
    return STOP


def run_command(body: Callable[[], int], resume_hint: str = "") -> int:
    """A command line's main: stop signals listened to from its first moment (before its arguments are parsed and
    anything heavy is imported: a signal there ended the process with status 143, not 75), then ``body()`` (parse,
    work, report; returns the exit status), with one line and an exit status for what stops it: a stop signal
    (75), bad input (2), a failure of the run or of the file system (1; what it wrote stays whole)."""
    from orb.errors import OrbInputError, RunError

    inner = STOP.commands > 0  # a command run inside another (a study's evaluations): the outer one listens, stops
    STOP.commands += 1
    try:
        try:
            if not inner:
                listen(resume_hint)  # (inside: a signal landing while the handlers install raised past this, status 1)
                deliver_stop_signals()
            status = body()
            STOP.raise_if_raised()  # (a start-up stop some code swallowed: still a stop, what was done kept)
            if inner:
                STOP.stop_if_received()  # (noted while it finished its work: the outer command stops now)
            else:
                STOP.stand_down()
            return status
        except Exception:
            STOP.raise_if_raised()  # a start-up stop an extension's import turned into its error: the stop
            raise
    except Stopped as stop:
        if inner:
            raise
        STOP.stand_down()  # (the command ends: another signal, as the interpreter exits, is no second stop)
        STOP.reported()
        print(str(stop), file=sys.stderr)
        return stop.status
    except OrbInputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except RunError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        line = file_system_failure(exc, resume_hint)
        if line is None:
            raise  # anything else is a fault the traceback must show
        print(line, file=sys.stderr)
        return 1
    finally:
        STOP.commands -= 1
        if not inner and not is_program():
            STOP.give_back()  # (an error's status, a traceback: the handlers were left to the next command)


def run_program(main: Callable[[], int]) -> NoReturn:
    """A command's program (its ``__main__`` and the installed commands, :mod:`orb.programs`; ``main`` itself returns
    its status, for callers in Python): ``sys.exit(main())``, the process marked as the command's own first
    (:func:`is_program`), so that MindSpore's objects are frozen out of the garbage collector once imported
    (:func:`orb.device.import_mindspore`). Not when it runs inside another program (``runpy`` from a driver):
    that one's objects are not the command's to freeze."""
    PROGRAM[0] = _the_program(sys._getframe(1))
    sys.exit(main())


PROGRAM = [False]  # whether this process is a command's program (run_program)


def program_starts() -> None:
    """A command's program, before it imports its command (orb.programs, scripts/*.py; finetune.py listens first):
    SIGINT is taken from MindSpore from now on (:mod:`orb.sigint`), so that the threads those imports start (numpy's
    BLAS threads) start with it blocked too; one that did not ran MindSpore's handler for it, which sent SIGTERM."""
    SIGINT_WATCH.start()


def is_program() -> bool:
    """Whether this process runs a command as its program (:func:`run_program`), not orb as a library."""
    return PROGRAM[0]


def _the_program(frame) -> bool:
    """Whether ``frame`` (run_program's caller) runs as the process's program: below it only one module's top level
    (``python script.py``; an installed command's wrapper) and the frames ``python -m`` and orb.programs add."""
    modules = 0
    while frame is not None:
        name, module = frame.f_code.co_name, frame.f_globals.get("__name__")
        if name == "<module>":
            modules += 1
        elif not ((module == "runpy" and name in ("_run_code", "_run_module_as_main"))
                  or (module == "orb.programs" and name == "run")):
            return False
        frame = frame.f_back
    return modules == 1


def out_of_space(exc: OSError) -> bool:
    """A full disk, a quota or a failing disk: the file system's failure (status 1, :func:`file_system_failure`'s
    line, which says to free space), not an output the user chose wrong (a read-only or missing folder: status 2)."""
    import errno

    return exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EIO)


def file_system_failure(exc: OSError, resume_hint: str = "") -> Optional[str]:
    """The one line (``error: ...``) for a full disk, a quota, a failing or read-only file system; None for another
    OSError (a fault whose traceback must show)."""
    import errno

    if not out_of_space(exc) and exc.errno != errno.EROFS:
        return None
    where = f" ({exc.filename})" if exc.filename else ""
    advice = ("free space, then run the same command again" + (f" ({resume_hint})" if resume_hint else "")
              if exc.errno in (errno.ENOSPC, errno.EDQUOT) else "")
    return f"error: {exc.strerror or exc}{where}" + (f": {advice}" if advice else "")


def ignore_stop_signals() -> None:
    """For helper processes (data workers): the training process decides when the run stops, and saves first.
    Ignored, then unblocked (a helper starts with them blocked): one that came meanwhile is discarded."""
    for name in STOP_SIGNALS:
        signal.signal(getattr(signal, name), signal.SIG_IGN)
    SIGINT_WATCH.stop()  # (msrun's scheduler process listened first)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_NUMBERS)


def deliver_stop_signals() -> None:
    """For a command's main, once it listens: stop signals blocked by whoever started the process (the launcher
    starts msrun and so its workers with them blocked) are received from now on; one that came meanwhile is
    handled now (:class:`Stopped` at start-up), not lost. SIGINT stays blocked: :data:`SIGINT_WATCH` takes it."""
    if STOP._installed and threading.current_thread() is threading.main_thread():
        SIGINT_WATCH.start(blocked_before=True)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, set(STOP_NUMBERS) - ({signal.SIGINT} if SIGINT_WATCH.on else set()))


def run_to_its_end(command, what: str, **popen) -> int:
    """``command``, a step of this command that saves on a stop itself (a fine-tuning), run to its end; its exit
    status. It starts with the stop signals blocked (it listens for itself); a stop meanwhile is forwarded to it once,
    and once it has ended, having saved, is this command's stop (75): running the same command again continues it."""
    import subprocess

    STOP.stop_if_received()  # (noted by a phase before it, an in-process evaluation's: no step starts to be stopped)
    with STOP.deferred():
        with children_start_blocked():
            process = subprocess.Popen(command, **popen)
        forwarded = None
        try:
            while process.poll() is None:
                if STOP.received is not None and forwarded is None:
                    forwarded = STOP.received
                    process.send_signal(getattr(signal, forwarded))
                time.sleep(0.1)
        except BaseException:  # (Ctrl-C twice: at once)
            process.kill()
            process.wait()
            raise
        status = process.returncode
        stopped = status == STOPPED_STATUS or (forwarded is not None and status == -getattr(signal, forwarded))
        if stopped or (status == 0 and STOP.received is not None):  # (a failure stays one, a stop or not)
            name = STOP.received or forwarded or "a signal of its own"
            raise Stopped(f"stopped by {name}: {what} saved what it had; run the same command again to continue "
                          f"(exit status {STOPPED_STATUS})")
    return status


@contextmanager
def children_start_blocked():
    """Processes started inside (subprocess, multiprocessing, any fork and exec) start with the stop signals blocked:
    a signal to every process of the job cannot end one before it has set what to do with them (see the module's
    docstring). The mask is this thread's own: meanwhile this process receives them in its other threads, or when
    the block ends; none is lost. Restored as it was (nested uses, and code inside that unblocks some, as Python's
    resource tracker does after starting its process)."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_NUMBERS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def guard_resource_tracker() -> None:
    """Python's multiprocessing resource tracker (started by the first pool, queue or lock of a spawned process; it
    unlinks their semaphores and shared memory if the program dies) ignores SIGINT and SIGTERM but dies on SIGUSR1
    and SIGUSR2: the program then starts another with "process died unexpectedly, relaunching. Some resources might
    leak." and a ``KeyError`` traceback per name it unregisters there, and what the dead one tracked stays in
    /dev/shm if the program dies. Every (re)launch here starts it with the stop signals blocked: it unblocks only
    SIGINT and SIGTERM, which it ignores. (A wrapper of its ``ensure_running``, which every use calls. Installed by
    whatever starts processes with multiprocessing, not at every command's start: multiprocessing imported before
    MindSpore makes MindSpore's ``Cell.__del__`` print tracebacks as the interpreter exits.)"""
    from multiprocessing import resource_tracker

    tracker = resource_tracker._resource_tracker
    if getattr(tracker.ensure_running, "stop_signals_blocked", False):
        return
    launch = tracker.ensure_running

    def ensure_running():
        with children_start_blocked():
            return launch()

    ensure_running.stop_signals_blocked = True
    tracker.ensure_running = resource_tracker.ensure_running = ensure_running


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
