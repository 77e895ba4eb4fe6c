"""MindSpore start-up for training and inference: device, execution mode, kernel threads, quiet logs."""

import argparse
import contextlib
import ctypes
import logging
import os
import threading
from typing import Optional

from orb.errors import ConfigError
from orb.host_blas import set_host_blas_threads
from orb.signals import STOP

log = logging.getLogger("orb")


def omp_threads(name: str = "OMP_NUM_THREADS") -> int:
    """The kernel threads ``OMP_NUM_THREADS`` (or another such variable, ``name``) asks for (0: unset, or a value that
    names none). OpenMP allows a list, one count per nesting level (``4,2``): the first is the kernels' (it was a
    traceback)."""
    text = os.environ.get(name, "").split(",")[0].strip()
    return int(text) if text.isdigit() else 0


# glog's own threshold (GLOG_minloglevel: 0 info, 1 warning, 2 error) for MindSpore's GLOG_v levels 2 and 3: lines
# MindSpore writes without its GLOG_v check (its MSLOG_IF, as "[INFO] DISTRIBUTED ... Event base dispatch success!"
# from every worker's TCP client and server as a data-parallel job ends) are held to it by glog alone
GLOG_THRESHOLDS = {"2": "1", "3": "2"}


def quiet_mindspore() -> None:
    """Keep MindSpore's C++ log to errors (its warnings are about backends that are not installed, retries of
    the cluster's TCP connections, ...), unless the user set ``GLOG_v`` themselves. Call before importing it."""
    quiet_environment(os.environ)


def quiet_environment(env) -> None:
    """``GLOG_v`` 3 (errors) in the environment ``env`` unless set, and glog's threshold to match (unless set)."""
    env.setdefault("GLOG_v", "3")
    if env["GLOG_v"].strip() in GLOG_THRESHOLDS:
        env.setdefault("GLOG_minloglevel", GLOG_THRESHOLDS[env["GLOG_v"].strip()])


def import_mindspore() -> None:
    """Import MindSpore (quietly) with stop signals only noted meanwhile, then honoured: a signal that interrupts the
    import of its C++ extension leaves an interpreter that aborts when it exits (measured: SIGTERM 1 s into
    orb-convert ended it with SIGABRT, not status 75). Every command calls this before anything imports MindSpore.

    The garbage collector is off meanwhile: the import makes 160,000 objects and no garbage, and its full
    collections walked them again and again. In a command's program (:func:`orb.signals.run_program`) what exists
    then is frozen out of the collector (``gc.freeze``), so that the run's full collections and the interpreter's
    teardown no longer walk MindSpore's modules. orb used as a library (``ORBCalculator`` in a script or notebook,
    a command's ``main`` called from Python) leaves its caller's objects to the collector."""
    import gc
    import sys

    quiet_mindspore()
    if "mindspore" in sys.modules:
        return
    from orb.signals import STOP, is_program

    collecting = gc.isenabled()
    try:
        gc.disable()
        with STOP.held():
            import mindspore  # noqa: F401
    finally:
        if is_program():
            gc.freeze()
        if collecting:
            gc.enable()


DEVICE_TARGETS = ("auto", "Ascend", "GPU", "CPU")


def device_name(text: str) -> str:
    """A device_target as typed, in any case, spelt as MindSpore spells it (``cpu`` -> ``CPU``); ValueError naming
    the valid ones. The config, every command's ``--device_target`` and the calculator take names through it."""
    names = {name.lower(): name for name in DEVICE_TARGETS}
    if str(text).lower() not in names:
        raise ValueError(f"must be one of {', '.join(DEVICE_TARGETS)}, got {text!r}")
    return names[str(text).lower()]


def add_device_argument(parser) -> None:
    """``--device_target`` of a command (argparse refuses a wrong name in one line, naming the valid ones)."""
    def parse(text: str) -> str:
        try:
            return device_name(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parser.add_argument("--device_target", default="auto", type=parse, metavar="{auto,Ascend,GPU,CPU}",
                        help="auto: Ascend, then GPU, then CPU, whichever MindSpore can use here")


def add_ops_profile_argument(parser) -> None:
    """``--ops_profile`` of a command that builds a model."""
    parser.add_argument("--ops_profile", default="auto", choices=OPS_PROFILES,
                        help="operators the model is built with: auto (cpu on the CPU, else portable); ORB_OPS_PROFILE "
                        "overrides (docs/install.md, \"The operator profile\")")


def select_device(requested: str) -> str:
    """``auto`` picks Ascend, then GPU, then CPU (whichever MindSpore can use here); a named accelerator that
    MindSpore cannot use here is one line (it was MindSpore's RuntimeError with a C++ stack)."""

    try:
        requested = device_name(requested)
    except ValueError as exc:
        raise ConfigError(f"device_target {exc}") from None
    if requested == "CPU":
        return requested
    for target in (("Ascend", "GPU") if requested == "auto" else (requested,)):
        if device_available(target):
            return target
    if requested != "auto":
        raise ConfigError(f"device_target {requested}: MindSpore cannot use {requested} devices on this machine (none "
                          "here, or a MindSpore build without its backend); use CPU, or auto to take what there is")
    return "CPU"


def device_available(target: str) -> bool:
    import mindspore as ms

    try:
        return bool(ms.hal.is_available(target))
    except Exception:  # a backend plug-in that fails to load counts as unavailable
        STOP.raise_if_raised()  # (not a stop that landed in its loading)
        return False


MATMUL_PRECISIONS = ("highest", "high")


OPS_PROFILES = ("auto", "portable", "cpu")  # how a few primitives are written (orb.models.ops_profile)
OPS_PROFILE_VARIABLE = "ORB_OPS_PROFILE"
_configured_profile: Optional[str] = None


COMPILE_CACHE_VARIABLE = "ORB_COMPILE_CACHE"  # compiled graphs kept between processes (orb.graph_cache)
COMPILE_CACHE_SWITCH = {"1": True, "true": True, "on": True, "yes": True,
                        "0": False, "false": False, "off": False, "no": False}


def compile_cache_on() -> bool:
    """``ORB_COMPILE_CACHE`` (on when unset or empty); another value is refused as ``ORB_OPS_PROFILE``'s is (a typo
    was read as on)."""
    value = os.environ.get(COMPILE_CACHE_VARIABLE, "")
    if value.strip().lower() not in COMPILE_CACHE_SWITCH and value.strip():
        raise ConfigError(f"{COMPILE_CACHE_VARIABLE} must be one of 1, true, on, yes (keep compiled graphs) or 0, "
                          f"false, off, no (compile afresh), got {value!r}")
    return COMPILE_CACHE_SWITCH.get(value.strip().lower(), True)


def _checked_profile(name: str, source: str) -> str:
    if name not in OPS_PROFILES:
        raise ConfigError(f"{source} must be one of {', '.join(OPS_PROFILES)}, got {name!r}")
    return name


def set_ops_profile(name: str) -> None:
    """The configured operator profile for cells built from now on (``ORB_OPS_PROFILE``, if set, still wins)."""
    global _configured_profile
    _configured_profile = _checked_profile(name, "ops_profile")


def configured_profile() -> str:
    """The configured operator profile (``auto`` if none), the environment aside: what to put back after a change."""
    return _configured_profile or "auto"


def requested_profile() -> str:
    """``auto``, ``portable`` or ``cpu``: the environment's choice, else the configured one, else ``auto``."""
    from_environment = os.environ.get(OPS_PROFILE_VARIABLE, "")
    if from_environment:
        return _checked_profile(from_environment, OPS_PROFILE_VARIABLE)
    return _configured_profile or "auto"


def choose_profile(requested: str, device_target: str) -> str:
    """``portable`` or ``cpu`` for a requested profile on a device: ``auto`` is ``cpu`` on the CPU and ``portable``
    elsewhere; ``cpu`` anywhere but the CPU is refused (its forms are measured on, and its custom kernels
    compiled for, the CPU backend: they must never reach an NPU or a GPU)."""
    if requested == "auto":
        return "cpu" if device_target == "CPU" else "portable"
    if requested == "cpu" and device_target != "CPU":
        variable = os.environ.get(OPS_PROFILE_VARIABLE)
        source = f"{OPS_PROFILE_VARIABLE}=cpu (environment)" if variable else "ops_profile: cpu"
        unset = f" and unset {OPS_PROFILE_VARIABLE}" if variable else ""
        raise ConfigError(f"{source} is for the CPU only, and this run is on {device_target}: use ops_profile auto "
                          f"or portable{unset}")
    return requested


def ops_profile() -> str:
    """The operator profile cells are built with now (:mod:`orb.models.ops_profile`): ``portable`` or ``cpu``."""
    import mindspore as ms

    return choose_profile(requested_profile(), ms.get_context("device_target"))


def configure_mindspore(device_target: str = "auto", device_id: int = 0, num_threads: int = 0,
                        parallel: bool = False, precision: str = "float32-high", deterministic: bool = False,
                        host_blas: bool = True) -> str:
    """Graph mode on the device (in an msrun job each worker gets its local device); returns the target.

    ``precision`` (:mod:`orb.precision`): what models built from now on compute in; checked against the
    device (float64 is refused on Ascend), and only ``float32-high`` lets float32 matrix products use HF32 on
    Ascend and TF32 on GPU (:func:`set_matmul_precision`). The CPU has one float32 precision.

    ``num_threads`` (0: ``OMP_NUM_THREADS`` if set) also sizes MindSpore's own CPU kernel pool,
    which otherwise starts 25 threads whatever the core count.

    ``host_blas``: numpy's and SciPy's BLAS pools take the kernel threads' count, one if unset
    (:mod:`orb.host_blas`: their workers only spin on this project's small host-side solves). The commands' own
    processes; the calculator, built in a user's script, leaves the user's numpy as it is.

    ``deterministic``: every run of the same inputs computes the same bits, for resumes and reruns that must match
    exactly. On the CPU one kernel thread (``OMP_NUM_THREADS`` is overridden; a ``num_threads`` above 1 is refused):
    MindSpore 2.10's CPU kernels round the last bit differently on one thread than on several, and a busy host can
    change which (measured: tests/test_preemption.py). Elsewhere MindSpore's deterministic computing
    (``set_deterministic``; on Ascend also deterministic HCCL reductions), set before the workers' communication
    starts. A process whose CPU kernel pool already has another size cannot become deterministic: refused.
    """
    from orb import precision as numerics

    compile_cache_on()  # (read at the first compilation: a bad value is said before any work)
    import_mindspore()
    import mindspore as ms

    numerics.check_precision(precision)
    target = select_device(device_target)
    numerics.check_device(precision, target)
    if deterministic and target == "CPU" and num_threads > 1:
        raise ConfigError(f"config key 'num_threads' ({num_threads}): a deterministic run on the CPU uses one kernel "
                          f"thread; set it to 0 or 1, or deterministic: false")
    ms.set_context(mode=ms.GRAPH_MODE)
    threads = num_threads or omp_threads()
    if deterministic and target == "CPU":
        threads = 1
    elif deterministic:
        set_deterministic()
    if target == "CPU" and threads:
        set_kernel_threads(threads, deterministic)
    if host_blas:
        import scipy.linalg  # noqa: F401  (its BLAS loaded now, so sized with numpy's; MindSpore imports it today)

        set_host_blas_threads(threads or 1)
    try:
        if parallel:
            ms.set_device(target)
        else:
            ms.set_device(target, device_id)
    except RuntimeError:  # already running (a second run in the same process) on the same device is fine
        if ms.get_context("device_target") != target:
            raise
    set_matmul_precision(target, numerics.matmul_precision(precision))
    numerics.set_precision(precision)
    numerics.set_sum_form(numerics.sum_form_for_device(target))
    return target


_kernel_threads: Optional[int] = None  # the CPU kernel pool's size once this module set it (MindSpore takes one)


def set_kernel_threads(threads: int, deterministic: bool) -> None:
    """MindSpore's CPU kernel pool (and OpenMP's) at ``threads``; a second call in the process keeps the first size,
    except that a deterministic run refuses a pool of another size (it would not be deterministic)."""
    global _kernel_threads
    import mindspore as ms

    os.environ["OMP_NUM_THREADS"] = str(threads)
    try:
        ms.device_context.cpu.op_tuning.threads_num(threads)
        _kernel_threads = threads
    except RuntimeError:  # already set in this process
        if deterministic and _kernel_threads != 1:
            raise ConfigError(f"deterministic: this process's CPU kernel pool already has "
                              f"{_kernel_threads or 'another number of'} threads, set by an earlier run in it; a "
                              f"deterministic run needs one: start it in a new process") from None


def set_deterministic() -> None:
    """MindSpore's deterministic computing on an accelerator (the CPU's is one kernel thread: the caller's)."""
    import mindspore as ms

    try:
        ms.set_deterministic(True)
    except RuntimeError:  # "can not be set repeatedly": a second run in this process, already deterministic
        pass


def set_matmul_precision(target: str, precision: str) -> None:
    """How float32 matrix products are computed on an accelerator, as PyTorch's ``set_float32_matmul_precision``.

    ``high`` (orb-models' own default, "float32-high"): TF32 on GPU, HF32 on Ascend -- 10-bit
    mantissa inputs, float32 accumulation, several times the throughput of float32. ``highest``:
    float32 throughout, as the parity references were computed. On Ascend, CANN is also told to keep
    float32 operators in float32 (``must_keep_origin_dtype``): it may otherwise run them in float16
    (the default of earlier MindSpore releases on Atlas training products), which moves orb's
    energies by far more than the parity tolerances. Chips whose matrix unit has no float32
    (Ascend 910A) still use float16. Call after ``set_device``, before anything compiles.
    """
    if precision not in MATMUL_PRECISIONS:
        raise ValueError(f"matmul_precision must be one of {MATMUL_PRECISIONS}, got {precision!r}")
    if target not in ("Ascend", "GPU"):
        return
    try:
        if target == "Ascend":
            from mindspore.device_context.ascend import op_precision

            op_precision.precision_mode("must_keep_origin_dtype")
            op_precision.matmul_allow_hf32(precision == "high")
        elif target == "GPU":
            from mindspore.device_context.gpu import op_precision

            op_precision.matmul_allow_tf32(precision == "high")
        _MATMUL["in_force"] = precision
    except RuntimeError as err:  # configured differently earlier in this process (by the caller)
        STOP.raise_if_raised()
        log.warning("%s matrix-product precision was already set elsewhere and is kept (%s)", target, err)


_MATMUL = {"in_force": None}


def matmul_precision_in_force() -> Optional[str]:
    """The float32 matrix-product precision this process set on its accelerator (device-wide), None before any
    (and on the CPU, which has one)."""
    return _MATMUL["in_force"]


def resident_gb() -> float:
    """This process's resident memory now (VmRSS), in GB; 0 where /proc has none."""
    try:
        with open("/proc/self/status") as f:
            return next((int(line.split()[1]) / 1e6 for line in f if line.startswith("VmRSS:")), 0.0)
    except OSError:
        return 0.0


def release_host_memory() -> None:
    """Hand the C heap's freed pages back to the operating system (glibc's ``malloc_trim``).

    Compiling a step frees most of the memory the compiler used, but glibc keeps it mapped, where
    it would add to the process's peak (docs/benchmarks.md, orb-v2 memory). Elsewhere (no glibc)
    this does nothing.
    """
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def recycle_compiled_memory() -> None:
    """MindSpore's ``ms_memory_recycle`` (every compiled graph's runtime memory handed back), past its failure when
    a freed cell with a bprop of its own drops out of the dict of cells it walks ("dictionary changed size during
    iteration", MindSpore 2.10): each attempt clears at least one cell's graphs before it can fail."""
    import mindspore as ms

    for attempt in range(1000):
        try:
            ms.ms_memory_recycle()
            return
        except RuntimeError as exc:
            if "changed size during iteration" not in str(exc) or attempt == 999:
                raise


_MODE = threading.RLock()  # the execution mode is process-wide: one block at a time switches it and runs in it


@contextlib.contextmanager
def graph_mode():
    """Graph mode inside the block, the caller's mode after it: a script that never set graph mode (PyNative is
    MindSpore's default) still runs the compiled graph, and gets it from the compile cache. Blocks in other threads
    wait (one thread's return to PyNative mode must not land inside another's compilation)."""
    import mindspore as ms

    with _MODE:
        before = ms.get_context("mode")
        if before == ms.GRAPH_MODE:
            yield
            return
        ms.set_context(mode=ms.GRAPH_MODE)
        try:
            yield
        finally:
            ms.set_context(mode=before)
