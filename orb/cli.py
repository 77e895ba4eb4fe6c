"""Command line of ``finetune.py`` and ``finetune_parallel.py`` (one implementation for both)."""

import argparse
import hashlib
import logging
import os
import sys
from importlib import metadata
from typing import List, Optional

from orb.config import TrainConfig, load_config
from orb.errors import OrbInputError

USAGE = """%(prog)s [--config PATH] [--resume DIR_OR_FILE] [--key value ...]

Any config key can be overridden, nested keys with dots:
  --max_epochs 3 --device_target CPU --model.num_message_passing_steps 2 --loss_weights.stress 0"""


def parse_args(argv: Optional[List[str]], default_config: str):
    parser = argparse.ArgumentParser(usage=USAGE, description="Fine-tune orb-v2 on an ASE database.")
    parser.add_argument("--config", default=default_config, help=f"YAML config (default: {default_config})")
    parser.add_argument("--resume", default="", help="training checkpoint, or an output_dir, to continue from")
    return parser.parse_known_args(argv)


def code_fingerprint() -> str:
    """Hash of this package's sources and the MindSpore version (MindSpore's compile cache cannot tell
    that the code behind a cached graph changed, so each code version gets its own cache folder)."""
    digest = hashlib.sha256(metadata.version("mindspore").encode())
    package = os.path.dirname(os.path.abspath(__file__))
    for name in sorted(os.listdir(package)):
        if name.endswith(".py"):
            with open(os.path.join(package, name), "rb") as f:
                digest.update(name.encode() + f.read())
    return digest.hexdigest()[:16]


def set_environment(cfg: TrainConfig) -> None:
    """Settings MindSpore reads when it starts: kernel threads and the compile cache."""
    if cfg.num_threads:
        os.environ["OMP_NUM_THREADS"] = str(cfg.num_threads)
    if cfg.compile_cache:
        base = cfg.compile_cache_dir or os.path.join(cfg.output_dir, "compile_cache")
        os.environ["MS_COMPILER_CACHE_ENABLE"] = "1"
        os.environ["MS_COMPILER_CACHE_PATH"] = os.path.join(os.path.abspath(base), code_fingerprint())


def main(argv: Optional[List[str]] = None, parallel: bool = False) -> int:
    default = "configs/config_parallel.yaml" if parallel else "configs/config.yaml"
    args, overrides = parse_args(argv, default)
    try:
        cfg = load_config(args.config, overrides)
        set_environment(cfg)
        from orb.distributed import Distributed, init_data_parallel
        from orb.trainer import Trainer, configure_mindspore, setup_logging

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
