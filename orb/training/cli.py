"""Command line of ``finetune.py`` and ``finetune_parallel.py`` (one implementation for both)."""

import argparse
import logging
import os
import sys
from typing import List, Optional

from orb.training.config import TrainConfig, load_config
from orb.errors import OrbInputError

USAGE = """%(prog)s [--config PATH] [--resume DIR_OR_FILE] [--key value ...]

Any config key can be overridden, nested keys with dots:
  --max_epochs 3 --device_target CPU --model.num_message_passing_steps 2 --loss_weights.stress 0"""


def parse_args(argv: Optional[List[str]], default_config: str):
    parser = argparse.ArgumentParser(usage=USAGE, description="Fine-tune orb-v2 on an ASE database.")
    parser.add_argument("--config", default=default_config, help=f"YAML config (default: {default_config})")
    parser.add_argument("--resume", default="", help="training checkpoint, or an output_dir, to continue from")
    return parser.parse_known_args(argv)


def set_environment(cfg: TrainConfig) -> None:
    """Settings MindSpore reads when it starts (kernel threads).

    MindSpore's compile cache (MS_COMPILER_CACHE_ENABLE) is deliberately not used: in 2.10 it
    matches cached graphs by compilation order, not by input shapes, so a run whose batches arrive
    in a different bucket order loads the wrong graph (reproduced here).
    """
    if cfg.num_threads:
        os.environ["OMP_NUM_THREADS"] = str(cfg.num_threads)


def main(argv: Optional[List[str]] = None, parallel: bool = False) -> int:
    default = "configs/config_parallel.yaml" if parallel else "configs/config.yaml"
    args, overrides = parse_args(argv, default)
    try:
        cfg = load_config(args.config, overrides)
        set_environment(cfg)
        from orb.training.distributed import Distributed, init_data_parallel
        from orb.training.trainer import Trainer, configure_mindspore, setup_logging

        target = configure_mindspore(cfg, parallel)
        dist = init_data_parallel(cfg.optimizer_shard and target != "CPU") if parallel else Distributed()
        setup_logging(cfg.output_dir, dist.is_main, dist.rank)
        log = logging.getLogger("orb")
        log.info("device: %s%s", target, " (auto)" if cfg.device_target == "auto" else "")
        if dist.parallel:
            log.info("data parallel: rank %d of %d (pid %d)", dist.rank, dist.world_size, os.getpid())
        Trainer(cfg, dist, resume=args.resume or None).fit()
    except OrbInputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0
