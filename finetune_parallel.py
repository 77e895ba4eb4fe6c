"""Data-parallel fine-tuning of orb, one worker per device, launched by msrun (see run_parallel.sh):

    bash run_parallel.sh configs/config_parallel.yaml [--key value ...]

The same run as ``finetune.py`` (one shared trainer, built by ``orb.training.setup``); what data parallelism adds is numbered below.
"""

import contextlib
import os
import sys

from orb.signals import ignore_stop_signals, listen

with listen().exit_on_stop():  # the imports take 0.3 s and more on a cold shared file system: a stop there exits 75
    from orb.errors import ClusterError
    from orb.training.cli import run
    from orb.device import configure_mindspore
    from orb.training.distributed import DataParallel, lost_peer
    from orb.training.launch import DEFAULT_CONFIG, WORKER_EXIT_LINE
    from orb.training.outputs import check_output_dir, prepare_output_dir, setup_logging
    from orb.files import sole_writer

_rank = 0


def fine_tune(cfg, args) -> None:
    global _rank
    if not os.environ.get("MS_ROLE"):  # started by hand: MindSpore's init() said to use 'mpirun', exit 1
        from orb.errors import ConfigError

        raise ConfigError("finetune_parallel.py is one worker of a job msrun starts: launch the job with "
                          "orb-finetune-parallel CONFIG (or bash run_parallel.sh CONFIG); on one device use orb-finetune")
    if os.environ.get("MS_ROLE") == "MS_SCHED":  # msrun's scheduler process: it ends when the workers end
        ignore_stop_signals()
    configure_mindspore(cfg.device_target, num_threads=cfg.num_threads, parallel=True,  # msrun assigns the device
                        precision=cfg.precision, deterministic=cfg.deterministic)

    import mindspore as ms
    from mindspore import nn, ops
    from mindspore.communication import get_group_size, get_rank, init

    from orb.training.optimizer import AllReduceSlice

    check_output_dir(cfg.output_dir, resume=bool(args.resume), overwrite=args.overwrite)  # before rank 0 writes
    # 1. Start communication between the workers msrun launched (HCCL on Ascend, NCCL on GPU, TCP on CPU);
    #    init() returns once every worker has joined.
    try:
        init()
    except RuntimeError as exc:  # msrun's scheduler process, or a worker, sees another worker stop
        raise ClusterError(f"the job stopped: {str(exc).strip().splitlines()[0]}") from None
    # 2. This worker's rank and the number of workers (over all nodes).
    rank, world = get_rank(), get_group_size()
    _rank = rank
    ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.DATA_PARALLEL, device_num=world)

    if ms.get_context("device_target") != "CPU":  # Ascend/GPU: MindSpore fuses the gradient all-reduces
        ms.set_auto_parallel_context(comm_fusion={"allreduce": {"mode": "size", "config": 32}})

    data_parallel = DataParallel(
        rank=rank,
        world_size=world,
        # 3. The gradient reducer the shared compiled step applies to the gradients value_and_grad returns:
        #    a sum over all ranks (each structure weighs 1 / (global batch size) in the loss, so the sum is
        #    the global batch's mean gradient). The normalisers' batch statistics are summed in the graph too.
        grad_reducer=lambda params: nn.DistributedGradReducer(params, mean=False, degree=world),
        all_reduce=ops.AllReduce(ops.ReduceOp.SUM),
        # With optimizer_shard, each rank keeps and updates 1/world of Adam's state: the flat gradient is
        # reduce-scattered (each rank receives the sum of its slice) and the updated slices all-gathered.
        # MindSpore 2.10's CPU backend has no ReduceScatter: there, an all-reduce and this rank's slice.
        reduce_scatter=(ops.ReduceScatter(ops.ReduceOp.SUM) if ms.get_context("device_target") != "CPU"
                        else AllReduceSlice(ops.AllReduce(ops.ReduceOp.SUM), rank, world)),
        all_gather=ops.AllGather(),
        shard_optimizer=cfg.optimizer_shard,
    )
    # 4. Each rank's part of every global batch (orb.data.plan): contiguous, sizes differing by at most one.
    #    Every rank computes every part, so all ranks pad each step to the same shape.

    # 5. Rank 0 alone writes train.log, metrics.jsonl and checkpoints (the others log to msrun's worker logs).
    with sole_writer(cfg.output_dir, "output_dir") if data_parallel.is_main else contextlib.nullcontext():
        if data_parallel.is_main:
            prepare_output_dir(cfg.output_dir, resume=bool(args.resume), overwrite=args.overwrite)
        setup_logging(cfg.output_dir, data_parallel.is_main, rank)

        from orb.training.setup import build_trainer

        try:
            build_trainer(cfg, data_parallel, resume=args.resume or None,
                          accept_config_changes=args.accept_config_changes).fit()
        except RuntimeError as exc:  # a collective whose peer is gone (msrun's scheduler killed): it was a traceback
            raise lost_peer(exc) or exc


def main(argv=None) -> int:
    status = run(argv, DEFAULT_CONFIG, fine_tune, is_main=lambda: _rank == 0)
    if status not in (0, 75) and os.environ.get("MS_ROLE"):
        print(f"{WORKER_EXIT_LINE} {status}", file=sys.stderr)  # read by the launcher (msrun's workers only)
    return status


if __name__ == "__main__":
    from orb.signals import run_program

    run_program(main)
