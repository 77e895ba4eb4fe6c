"""Launch data-parallel fine-tuning with msrun: one ``finetune_parallel.py`` worker per device.

    run_parallel.sh [CONFIG] [--key value ...]          (from a checkout)
    orb-finetune-parallel [CONFIG] [--key value ...]    (installed)

CONFIG is found as orb-finetune's --config (a YAML file, else a packaged template by name; --config CONFIG works
too) and defaults to configs/config_parallel.yaml. Paths in it are relative to the folder you run from (a packaged
template's bundled demo data excepted). The options and --key value overrides are passed to every worker. The
launch is set by environment variables:

  WORKER_NUM        total workers over all nodes   (default: this node's devices: Ascend NPUs, GPUs,
                                                    or on CPU the number of cores, at most 8)
  LOCAL_WORKER_NUM  workers on this node            (default: WORKER_NUM)
  MASTER_ADDR       scheduler host (node 0)         (default: 127.0.0.1)
  MASTER_PORT       scheduler port                  (default: a free port; set it on multi-node runs)
  NODE_RANK         this node's rank                (default: 0)
  LOG_DIR           worker logs                     (default: msrun_logs/<date-time>-<pid>)
  CLUSTER_TIME_OUT  seconds to wait for all workers (default: 600)
  MS_RETRY_INTERVAL_LOWER, MS_RETRY_INTERVAL_UPPER
                    seconds between the cluster's polls of its peers (default: 1 and 2, unless either
                                                    is set; MindSpore's own polling is as slow as at 3 and 5)

msrun assigns each worker its device: the config's device_id is not used. On CPU each worker gets
OMP_NUM_THREADS = cores / LOCAL_WORKER_NUM unless it is set. The console
shows this node's first worker; every worker's log is in LOG_DIR. The exit status is 0 when every worker
finished, 2 when a worker refused its input (as finetune.py), 1 for a fault, 75 after a stop (below); on failure
the failed rank and its last error are printed. On one node a failed job ends within seconds of its last worker
(msrun's scheduler would wait MS_NODE_TIMEOUT, 30 s, for each worker msrun killed).

Stop signals (SIGTERM, SIGINT, SIGUSR1, SIGUSR2: a scheduler's preemption or time limit, Ctrl-C)
are passed to this node's workers, also to those msrun starts after the signal came; they finish their step,
save and stop together. msrun itself does nothing on them (its own SIGINT handler would kill the workers
unsaved), and once the workers have stopped its scheduler is ended if it still waits for workers that never
joined. Exit status 75 then means "stopped with the state saved": run the same command with --resume auto to
continue. msrun and every process it starts begin with the stop signals blocked, so a signal sent to every
process of the job (Slurm's --signal) ends none of them: a worker receives it once it listens, its data workers
and msrun's log tail never.
"""

import glob
import logging
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from typing import Dict, List, Optional, Sequence, Tuple

from orb.bundled import find_config
from orb.device import quiet_environment
from orb.errors import ConfigError, OrbInputError
from orb.files import free_port
from orb.signals import RESUME_HINT, STOP, STOPPED_STATUS, children_start_blocked, run_command
from orb.training.run_checks import check_job_size
from orb.training.job_watch import (WORKER_EXIT_LINE, FailedJobEnd, SignalRelay, failures, log_stamps, log_text,
                                    report_failures, report_killed, reported_exit_codes, stopped_with_state_saved,
                                    training_finished, worker_logs, worker_rank)

DEFAULT_CONFIG = os.path.join("configs", "config_parallel.yaml")
# msrun as it is run (orb/training/msrun_main.py: deaf to the stops, patient with the workers after one), from this
# launcher's own package: with -m the working folder came first on the path (an `orb` there, another checkout)
MSRUN = (f"import sys; sys.path[0] = {os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))!r}; "
         "from orb.training.msrun_main import main; sys.exit(main())")


def count_devices() -> int:
    """This node's devices: those a scheduler made visible (ASCEND_RT_VISIBLE_DEVICES, CUDA_VISIBLE_DEVICES), else
    every Ascend NPU or GPU present, else on CPU the cores (at most 8)."""
    for variable in ("ASCEND_RT_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES"):
        visible = [d for d in os.environ.get(variable, "").split(",") if d.strip()]
        if visible:
            return len(visible)
    npus = glob.glob("/dev/davinci[0-9]*")
    if npus:
        return len(npus)
    if shutil.which("nvidia-smi"):
        with children_start_blocked():  # (a job's signal to every process: not counted as no GPU)
            out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout
        gpus = len([line for line in out.splitlines() if line.strip()])
        if gpus:
            return gpus
    return min(usable_cpus(), 8)


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity: a Slurm step's, taskset's), not the host's count."""
    try:
        return max(len(os.sched_getaffinity(0)), 1)
    except (AttributeError, OSError):  # (not Linux)
        return os.cpu_count() or 1


def worker_script() -> str:
    """finetune_parallel.py beside the orb package (the checkout's, or the installed one)."""
    from orb.commands import script_path

    return script_path("finetune_parallel")


def find_msrun() -> Optional[str]:
    return shutil.which("msrun") or shutil.which("msrun", path=os.path.dirname(sys.executable))


class LaunchError(ValueError):
    """A launch setting that cannot work, named."""


def _count(env: Dict[str, str], name: str, default: str, least: int, most: int = 0) -> str:
    value = env.get(name) or default
    if not value.isdigit() or int(value) < least or (most and int(value) > most):
        bounds = f"from {least} to {most}" if most else f">= {least}"
        raise LaunchError(f"{name} must be a whole number {bounds}, got {value!r}")
    return str(int(value))


def settings(env: Dict[str, str]) -> Dict[str, str]:
    workers = _count(env, "WORKER_NUM", str(count_devices()), 1)
    local = _count(env, "LOCAL_WORKER_NUM", workers, 1)
    if int(local) > int(workers):
        raise LaunchError(f"LOCAL_WORKER_NUM ({local}) exceeds WORKER_NUM ({workers}), the workers of all nodes")
    if int(local) < int(workers) and not env.get("MASTER_PORT"):
        raise LaunchError(f"a launch over several nodes ({local} of {workers} workers here) needs the same "
                          "MASTER_PORT on every node (e.g. MASTER_PORT=8118); each node would pick its own")
    return {
        "worker_num": workers,
        "local_worker_num": local,
        "master_addr": env.get("MASTER_ADDR") or "127.0.0.1",
        "master_port": _count(env, "MASTER_PORT", str(free_port()), 1, 65535),  # (msrun: a page of C++ errors)
        "node_rank": _count(env, "NODE_RANK", "0", 0),
        # (with the process id: two launches in the same second, a job array's, wrote into each other's logs)
        "log_dir": env.get("LOG_DIR") or os.path.join("msrun_logs", time.strftime("%Y%m%d-%H%M%S-") + str(os.getpid())),
        "cluster_time_out": _count(env, "CLUSTER_TIME_OUT", "600", 1),
    }


def build_parser(prog: Optional[str] = None):
    """The launcher's command line, for --help and the command reference (main splits it itself: every option but
    CONFIG goes to the workers, which parse it as orb-finetune does)."""
    from orb.commands import HelpFormatter, Parser
    from orb.training.cli import add_run_options

    doc = __doc__.split("\n\n", 2)
    parser = Parser(prog=prog, allow_abbrev=False, formatter_class=HelpFormatter,
                                     usage="%(prog)s [CONFIG] [--resume DIR_OR_FILE|auto] [--overwrite] "
                                           "[--accept_config_changes] [--key value ...]",
                                     description=doc[0], epilog=doc[2])
    parser.add_argument("config", nargs="?", default=DEFAULT_CONFIG, metavar="CONFIG",
                        help="YAML config file, or a packaged template's name")
    add_run_options(parser)
    return parser


def split_config(args: List[str]) -> Tuple[str, List[str]]:
    """(CONFIG, the workers' other arguments): CONFIG is the first argument when it is no option, or --config's
    value (as orb-finetune takes it), else DEFAULT_CONFIG."""
    rest = list(args)
    found = [rest.pop(0)] if rest and not rest[0].startswith("-") else []
    i = 0
    while i < len(rest):
        if rest[i] == "--config" and i + 1 < len(rest):
            found.append(rest[i + 1])
            del rest[i:i + 2]
        elif rest[i].startswith("--config="):
            found.append(rest.pop(i)[len("--config="):])
        else:
            i += 1
    if len(found) > 1:
        raise ConfigError(f"the config is given twice ({found[0]}, {found[1]}): name one")
    return (found[0] if found else DEFAULT_CONFIG), rest


def main(argv: Optional[List[str]] = None, prog: Optional[str] = None) -> int:
    """Listening from the first moment: a stop signal before msrun starts is one line and exit status 75."""
    return run_command(lambda: launch(argv, prog), RESUME_HINT)


@contextmanager
def logging_at(level: int):
    """The project's log (``orb``) says only what is at ``level`` or above meanwhile."""
    log = logging.getLogger("orb")
    before = log.level
    log.setLevel(level)
    try:
        yield
    finally:
        log.setLevel(before)


def _no_run(cfg, args) -> None:
    raise ConfigError("--print-config prints a template and runs nothing: give it without other options")


def launch(argv: Optional[List[str]], prog: Optional[str] = None) -> int:
    """Check the launch (config, msrun, the environment's settings), start msrun and follow it to the end."""
    args = list(sys.argv[1:] if argv is None else argv)
    if any(arg in ("-h", "--help") for arg in args):
        build_parser(prog).print_help()
        return 0
    if any(arg.split("=")[0] in ("--print-config", "--print_config") for arg in args):
        from orb.training.cli import run  # a template to stdout, as orb-finetune prints it: no job (msrun's lines
        # went into the file, and two workers' copies)

        return run(args, None, _no_run)
    try:
        s = settings(os.environ)  # (the launch's environment first: it decides what fits, the workers' number)
        config, args = split_config(args)
        config = find_config(config)
        from orb.training.cli import checked_config, parse_command_line

        # (a bad option or value: each worker said it, after msrun had started them all); its warnings are rank 0's
        # to say, whose log the console shows: not twice
        with logging_at(logging.ERROR):
            cfg = checked_config(*parse_command_line(["--config", config] + args, None))
        check_job_size(cfg, int(s["worker_num"]))
    except (OrbInputError, LaunchError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    msrun = find_msrun()
    if msrun is None:
        print("error: msrun not found; activate the environment where mindspore is installed", file=sys.stderr)
        return 2
    env = msrun_environment(os.environ)
    if not env.get("OMP_NUM_THREADS"):
        env["OMP_NUM_THREADS"] = str(max(usable_cpus() // int(s["local_worker_num"]), 1))
    try:
        os.makedirs(s["log_dir"], exist_ok=True)
    except OSError as exc:  # (a file of that name, no permission: it was a traceback)
        print(f"error: LOG_DIR {s['log_dir']}: cannot make the worker logs' folder ({exc.strerror or exc})",
              file=sys.stderr)
        return 2
    print(f"run_parallel: {s['worker_num']} worker(s) ({s['local_worker_num']} on this node, node rank "
          f"{s['node_rank']}), master {s['master_addr']}:{s['master_port']}")
    print(f"run_parallel: config {config} {' '.join(args)}".rstrip())
    print(f"run_parallel: worker logs in {s['log_dir']}/worker_<rank>.log; the console shows this node's first worker")
    sys.stdout.flush()
    first_here = int(s["node_rank"]) * int(s["local_worker_num"])  # (msrun's ranks: node rank x local workers + i)
    command = [sys.executable, "-c", MSRUN, *(f"--{k}={v}" for k, v in s.items()), "--join=True",
               f"--tail_worker_log={first_here}", worker_script(), "--config", os.path.abspath(config), *args]
    earlier_logs = log_stamps(s["log_dir"])
    several_nodes = int(s["local_worker_num"]) < int(s["worker_num"])  # other nodes' workers may still be ending
    with SignalRelay(scheduler_grace=60.0 if several_nodes else 2.0,
                     finished=lambda: training_finished(s["log_dir"], earlier_logs)) as relay:
        # its own session: a terminal's Ctrl-C reaches this process only, which passes it on to the workers
        with children_start_blocked():
            job = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True, start_new_session=True)
        relay.root = job.pid
        errors = collect(job.stderr)
        failed = None if several_nodes else FailedJobEnd(errors.so_far)
        while job.poll() is None:
            relay.follow()
            if failed is not None and not relay.signalled:  # (a stop passed on to workers: the relay's own grace)
                failed.follow(job.pid)
            time.sleep(0.2)
        status = job.wait()
    STOP.stand_down()  # msrun has ended: a signal now (as the job ends) is no stop to report
    if status != 0 and (stopped_with_state_saved(s["log_dir"], earlier_logs)
                        or (relay.received and not failures(s["log_dir"], earlier_logs)
                            and set(reported_exit_codes(errors())) <= {STOPPED_STATUS})):
        # (a stop during start-up: each worker stops at once, and msrun kills those still starting, whose logs then
        # end without a line; nothing was saved that a resume cannot redo. Not a worker killed before the stop came:
        # msrun reported its exit code, and its job is no stop to resume into the same kill)
        print(f"run_parallel: stopped by {relay.received[0] if relay.received else 'a signal'} with the state "
              f"saved; run the same command with --resume auto to continue (exit status {STOPPED_STATUS})",
              file=sys.stderr)
        return STOPPED_STATUS
    if status != 0:
        # msrun's own traceback ("Distributed job exited with exception") says no more than the report below, unless
        # no worker started or ended to report on (msrun itself failed: its last lines are the cause)
        logs = worker_logs(s["log_dir"], earlier_logs)
        if not logs and not reported_exit_codes(errors()):
            sys.stderr.write("".join(errors()[-20:]))
        status = failed_workers_status(errors(), status, logs)
        print(f"run_parallel: FAILED with status {status}", file=sys.stderr)
        first, count = int(s["node_rank"]) * int(s["local_worker_num"]), int(s["local_worker_num"])
        report_killed(errors(), [log for log in logs if first <= worker_rank(log) < first + count])
        report_failures(s["log_dir"], earlier_logs)
    else:
        sys.stderr.write("".join(errors()))
        print(f"run_parallel: finished; logs in {s['log_dir']}")
    return status


# MindSpore's cluster polls its peers (workers registering, the CPU collectives' start, the scheduler's wait for
# the workers to leave) as slowly when these are unset as with 3 and 5 s; at 1 and 2 s a 2-worker job on one node
# starts and ends about 4 s sooner (docs/benchmarks.md, "A data-parallel job's start and end"), and 16 ranks
# polling every second are no load. A user's own values are kept.
RETRY_INTERVALS = {"MS_RETRY_INTERVAL_LOWER": "1", "MS_RETRY_INTERVAL_UPPER": "2"}


def msrun_environment(environ) -> Dict[str, str]:
    """The environment msrun and its processes start with: this Python's folder first on PATH (the workers run this
    interpreter), MindSpore's C++ log at errors only (no connection-retry chatter) unless set, and its cluster's
    retry intervals (RETRY_INTERVALS) unless either is set."""
    env = dict(environ)
    env["PATH"] = os.pathsep.join(p for p in (os.path.dirname(sys.executable), env.get("PATH")) if p)
    quiet_environment(env)  # (msrun's own process too, which imports MindSpore before any worker starts)
    if not any(name in env for name in RETRY_INTERVALS):  # (one of the two set: the user's pair, as MindSpore reads it)
        env.update(RETRY_INTERVALS)
    return env


def failed_workers_status(msrun_errors: List[str], status: int, logs: Sequence[str] = ()) -> int:
    """2 when a worker refused its input (any of this launch's worker ``logs`` says so: msrun reports only the first
    worker it saw fail, which may be one that stopped because of another's bad row), else the exit status of the
    worker msrun saw fail first (1: a fault; msrun itself exits 1 for either), else msrun's ``status``: a script
    tells bad input from a fault as with finetune.py."""
    if any(re.search(rf"^{re.escape(WORKER_EXIT_LINE)} 2$", log_text(log), re.MULTILINE) for log in logs):
        return 2
    codes = reported_exit_codes(msrun_errors)
    if codes:
        return codes[0] if codes[0] in (1, 2) else status
    return status


def collect(stream):
    """Read ``stream`` in a thread (so the child never blocks on a full pipe); returns a getter of its lines (and
    ``.so_far()``, those read until now)."""
    lines: List[str] = []
    reader = threading.Thread(target=lambda: lines.extend(stream), daemon=True)
    reader.start()

    def get() -> List[str]:
        reader.join()
        return lines

    get.so_far = lambda: list(lines)  # (while the child runs)
    return get


if __name__ == "__main__":
    from orb.signals import run_program

    run_program(main)
