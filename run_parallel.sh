#!/usr/bin/env bash
# Data-parallel fine-tuning of orb-v2 with msrun (one finetune_parallel.py worker per device).
#
#   bash run_parallel.sh [CONFIG] [--key value ...]
#
# CONFIG defaults to configs/config_parallel.yaml; --key value overrides are passed to every worker,
# exactly as finetune.py takes them. The launch is set by environment variables:
#   WORKER_NUM        total workers over all nodes   (default: this node's devices: Ascend NPUs, GPUs,
#                                                     or on CPU the number of cores, at most 8)
#   LOCAL_WORKER_NUM  workers on this node            (default: WORKER_NUM)
#   MASTER_ADDR       scheduler host                  (default: 127.0.0.1)
#   MASTER_PORT       scheduler port                  (default: a free port)
#   NODE_RANK         this node's rank (multi-node)   (default: 0)
#   LOG_DIR           worker logs                     (default: msrun_logs/<date-time>)
#   CLUSTER_TIME_OUT  seconds to wait for all workers (default: 600)
# On CPU each worker gets OMP_NUM_THREADS = cores / LOCAL_WORKER_NUM unless OMP_NUM_THREADS is set (the
# workers also size MindSpore's CPU kernel thread pool from it).
# The exit status is msrun's (non-zero if any worker failed).
set -u
cd "$(dirname "$0")" || exit 1

CONFIG=configs/config_parallel.yaml
if [ $# -gt 0 ] && [[ "$1" != --* ]]; then
  CONFIG=$1
  shift
fi
if [ ! -f "$CONFIG" ]; then
  echo "error: config file $CONFIG not found" >&2
  exit 2
fi

PYTHON=${PYTHON:-python}
if ! command -v msrun >/dev/null 2>&1; then
  echo "error: msrun not found; activate the environment where mindspore is installed" >&2
  exit 2
fi

count_devices() {
  local n
  n=$(ls /dev/davinci[0-9]* 2>/dev/null | wc -l)
  if [ "$n" -gt 0 ]; then echo "$n"; return; fi
  if command -v nvidia-smi >/dev/null 2>&1; then
    n=$(nvidia-smi -L 2>/dev/null | wc -l)
    if [ "$n" -gt 0 ]; then echo "$n"; return; fi
  fi
  n=$(nproc)
  echo $(( n > 8 ? 8 : n ))
}

free_port() {
  "$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()'
}

WORKER_NUM=${WORKER_NUM:-$(count_devices)}
LOCAL_WORKER_NUM=${LOCAL_WORKER_NUM:-$WORKER_NUM}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-$(free_port)}
NODE_RANK=${NODE_RANK:-0}
LOG_DIR=${LOG_DIR:-msrun_logs/$(date +%Y%m%d-%H%M%S)}
CLUSTER_TIME_OUT=${CLUSTER_TIME_OUT:-600}
if [ -z "${OMP_NUM_THREADS:-}" ]; then
  threads=$(( $(nproc) / LOCAL_WORKER_NUM ))
  export OMP_NUM_THREADS=$(( threads > 0 ? threads : 1 ))
fi
mkdir -p "$LOG_DIR"

echo "run_parallel: $WORKER_NUM worker(s) ($LOCAL_WORKER_NUM on this node, node rank $NODE_RANK), master $MASTER_ADDR:$MASTER_PORT"
echo "run_parallel: config $CONFIG $*"
echo "run_parallel: worker logs in $LOG_DIR/worker_<rank>.log"

msrun --worker_num="$WORKER_NUM" --local_worker_num="$LOCAL_WORKER_NUM" --master_addr="$MASTER_ADDR" \
  --master_port="$MASTER_PORT" --node_rank="$NODE_RANK" --log_dir="$LOG_DIR" --join=True \
  --cluster_time_out="$CLUSTER_TIME_OUT" finetune_parallel.py --config "$CONFIG" "$@"
status=$?

if [ "$status" -ne 0 ]; then
  echo "run_parallel: FAILED with status $status" >&2
  for log in "$LOG_DIR"/worker_*.log; do
    [ -f "$log" ] || continue
    if grep -q -E "^error: |Traceback|RuntimeError|Error:" "$log"; then
      rank=${log##*worker_}
      rank=${rank%.log}
      echo "run_parallel: rank $rank failed, see $log:" >&2
      grep -E "^error: |Error" "$log" | grep -v "^\[WARNING" | tail -n 3 >&2
    fi
  done
else
  echo "run_parallel: finished; logs in $LOG_DIR"
fi
exit "$status"
