#!/usr/bin/env bash
# Data-parallel fine-tuning with msrun, one finetune_parallel.py worker per device:
#
#   bash run_parallel.sh [CONFIG] [--key value ...]
#
# CONFIG (a YAML file, or a packaged template's name) defaults to configs/config_parallel.yaml; paths are relative
# to where you run it from. Environment: WORKER_NUM, LOCAL_WORKER_NUM, MASTER_ADDR, MASTER_PORT, NODE_RANK, LOG_DIR,
# CLUSTER_TIME_OUT, PYTHON (bash run_parallel.sh --help describes them).
# Exit status: 0 finished, 2 bad input, 1 a fault, 75 stopped with the state saved (--resume auto continues).
# (no subshell before the exec: a stop signal to bash while it waited for one was lost at times, and the job ran on)
here=.; [[ ${BASH_SOURCE[0]} == */* ]] && here=${BASH_SOURCE[0]%/*}
[[ -n $here ]] || here=/  # (a checkout at /: /run_parallel.sh)
[[ $here == /* ]] || here=$PWD/$here
exec env PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}" "${PYTHON:-python}" \
    -c "from orb.signals import run_program; from orb.training.launch import main; run_program(lambda: main(prog='run_parallel.sh'))" "$@"
