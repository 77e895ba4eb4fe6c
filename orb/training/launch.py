"""Launch data-parallel fine-tuning with msrun: one ``finetune_parallel.py`` worker per device.

    run_parallel.sh [CONFIG] [--key value ...]          (from a checkout)
    orb-finetune-parallel [CONFIG] [--key value ...]    (installed)

CONFIG defaults to configs/config_parallel.yaml; paths are relative to the directory you run
from. The launch is set by environment variables:

  WORKER_NUM        total workers over all nodes   (default: this node's devices: Ascend NPUs, GPUs,
                                                    or on CPU the number of cores, at most 8)
  LOCAL_WORKER_NUM  workers on this node            (default: WORKER_NUM)
  MASTER_ADDR       scheduler host (node 0)         (default: 127.0.0.1)
  MASTER_PORT       scheduler port                  (default: a free port; set it on multi-node runs)
  NODE_RANK         this node's rank                (default: 0)
  LOG_DIR           worker logs                     (default: msrun_logs/<date-time>)
  CLUSTER_TIME_OUT  seconds to wait for all workers (default: 600)

On CPU each worker gets OMP_NUM_THREADS = cores / LOCAL_WORKER_NUM unless it is set. The console
shows this node's first worker; every worker's log is in LOG_DIR. The exit status is msrun's
(non-zero if any worker failed), and on failure the failed rank and its last error are printed.
"""

import glob
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from typing import Dict, List, Optional

DEFAULT_CONFIG = os.path.join("configs", "config_parallel.yaml")


def count_devices() -> int:
    npus = glob.glob("/dev/davinci[0-9]*")
    if npus:
        return len(npus)
    if shutil.which("nvidia-smi"):
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout
        gpus = len([line for line in out.splitlines() if line.strip()])
        if gpus:
            return gpus
    return min(os.cpu_count() or 1, 8)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_script() -> str:
    """finetune_parallel.py beside the checkout's orb/ package, else the installed module."""
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    local = os.path.join(here, "finetune_parallel.py")
    if os.path.exists(local):
        return local
    import importlib.util

    spec = importlib.util.find_spec("finetune_parallel")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("finetune_parallel.py is neither beside the orb package nor installed")
    return spec.origin


def find_msrun() -> Optional[str]:
    return shutil.which("msrun") or shutil.which("msrun", path=os.path.dirname(sys.executable))


def settings(env: Dict[str, str]) -> Dict[str, str]:
    workers = env.get("WORKER_NUM") or str(count_devices())
    return {
        "worker_num": workers,
        "local_worker_num": env.get("LOCAL_WORKER_NUM") or workers,
        "master_addr": env.get("MASTER_ADDR") or "127.0.0.1",
        "master_port": env.get("MASTER_PORT") or str(free_port()),
        "node_rank": env.get("NODE_RANK") or "0",
        "log_dir": env.get("LOG_DIR") or os.path.join("msrun_logs", time.strftime("%Y%m%d-%H%M%S")),
        "cluster_time_out": env.get("CLUSTER_TIME_OUT") or "600",
    }


def report_failures(log_dir: str) -> None:
    for log in sorted(glob.glob(os.path.join(log_dir, "worker_*.log"))):
        with open(log, errors="replace") as f:
            lines = [line.rstrip() for line in f if not line.startswith(("[WARNING", "[INFO"))]
        errors = [line for line in lines if re.match(r"^(error: |\w*Error: |Traceback)", line)]
        if errors:
            rank = os.path.basename(log)[len("worker_"):-len(".log")]
            print(f"run_parallel: rank {rank} failed, see {log}:", file=sys.stderr)
            for line in errors[-3:]:
                print(f"  {line}", file=sys.stderr)


def main(argv: Optional[List[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in ("-h", "--help"):
        print(f"usage: {os.path.basename(sys.argv[0])} [CONFIG] [--key value ...]\n\n{__doc__}")
        return 0
    config = DEFAULT_CONFIG
    if args and not args[0].startswith("--"):
        config = args.pop(0)
    if not os.path.isfile(config):
        print(f"error: config file {config} not found (paths are relative to {os.getcwd()})", file=sys.stderr)
        return 2
    msrun = find_msrun()
    if msrun is None:
        print("error: msrun not found; activate the environment where mindspore is installed", file=sys.stderr)
        return 2
    s = settings(os.environ)
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")  # workers run this python
    env.setdefault("GLOG_v", "3")  # MindSpore's C++ log: errors only (no connection-retry chatter)
    if not env.get("OMP_NUM_THREADS"):
        env["OMP_NUM_THREADS"] = str(max((os.cpu_count() or 1) // int(s["local_worker_num"]), 1))
    os.makedirs(s["log_dir"], exist_ok=True)
    print(f"run_parallel: {s['worker_num']} worker(s) ({s['local_worker_num']} on this node, node rank "
          f"{s['node_rank']}), master {s['master_addr']}:{s['master_port']}")
    print(f"run_parallel: config {config} {' '.join(args)}".rstrip())
    print(f"run_parallel: worker logs in {s['log_dir']}/worker_<rank>.log; the console shows this node's first worker")
    sys.stdout.flush()
    command = [msrun, *(f"--{k}={v}" for k, v in s.items()), "--join=True", "--tail_worker_log=0",
               worker_script(), "--config", os.path.abspath(config), *args]
    job = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
    errors = collect(job.stderr)
    status = job.wait()
    if status != 0:
        # msrun's own traceback ("Distributed job exited with exception") says no more than the report below
        print(f"run_parallel: FAILED with status {status}", file=sys.stderr)
        report_failures(s["log_dir"])
    else:
        sys.stderr.write("".join(errors()))
        print(f"run_parallel: finished; logs in {s['log_dir']}")
    return status


def collect(stream):
    """Read ``stream`` in a thread (so the child never blocks on a full pipe); returns a getter of its lines."""
    lines: List[str] = []
    reader = threading.Thread(target=lambda: lines.extend(stream), daemon=True)
    reader.start()

    def get() -> List[str]:
        reader.join()
        return lines

    return get


if __name__ == "__main__":
    sys.exit(main())
