"""What ``finetune.py`` and ``finetune_parallel.py`` share: the command line, and running a fine-tuning
so that a mistake in the input ends in one clear line (on the console and in train.log), never a traceback."""

import argparse
import logging
import sys
from typing import Callable, List, Optional, Tuple

from orb.errors import ConfigError, OrbInputError, RunError
from orb.training.config import TrainConfig, load_config
from orb.training.outputs import discard_unstarted
from orb.signals import Stopped, ignore_stop_signals, listen
from orb.training.checkpointing import checkpoint_to_resume

USAGE = """%(prog)s [--config PATH] [--resume DIR_OR_FILE|auto] [--overwrite] [--accept_config_changes] [--key value ...]

Any config key can be overridden, nested keys with dots:
  --max_epochs 3 --device_target CPU --model.num_message_passing_steps 2 --loss_weights.stress 0"""


def parse_command_line(argv: Optional[List[str]], default_config: str) -> Tuple[argparse.Namespace, List[str]]:
    parser = argparse.ArgumentParser(allow_abbrev=False, usage=USAGE, description="Fine-tune orb on an ASE database.")
    parser.add_argument("--config", default=default_config, help=f"YAML config (default: {default_config})")
    parser.add_argument("--resume", default="", help="training checkpoint, or an output_dir, to continue from; "
                        "'auto': output_dir's last.ckpt if it has one, else a fresh start (for requeued jobs)")
    parser.add_argument("--overwrite", action="store_true",
                        help="start a fresh run in an output_dir that holds an earlier run (deletes its files)")
    parser.add_argument("--accept_config_changes", action="store_true",
                        help="resume although settings that fix the schedule or data order changed")
    return parser.parse_known_args(argv)


def run(argv: Optional[List[str]], default_config: str, fine_tune: Callable[[TrainConfig, argparse.Namespace], None],
        is_main: Callable[[], bool] = lambda: True) -> int:
    """Parse arguments, load the config and call ``fine_tune``; bad input -> ``error: ...`` and exit status 2."""
    args, overrides = parse_command_line(argv, default_config)
    log = logging.getLogger("orb")
    listen()  # a stop signal during start-up exits 75 at once; the training loop saves first
    cfg = None
    try:
        if not args.config.strip():
            raise ConfigError("--config is empty: name a YAML config file (configs/config.yaml documents every key)")
        cfg = load_config(args.config, overrides)
        if args.resume == "auto":
            args.resume = checkpoint_to_resume(cfg.output_dir, args.resume, args.overwrite)
            args.overwrite = args.overwrite or not args.resume  # no checkpoint there: records of unsaved steps
        fine_tune(cfg, args)
        ignore_stop_signals()  # finished: a signal now (a scheduler's, as the job ends) is no stop to report
    except Stopped as stop:
        print(f"{stop}", file=sys.stderr)
        return stop.status
    except OrbInputError as exc:
        if is_main():  # into train.log too, when it is open (a resumed run keeps it)
            record = log.makeRecord("orb", logging.ERROR, __file__, 0, "%s", (exc,), None)
            for handler in log.handlers:
                if isinstance(handler, logging.FileHandler):
                    handler.emit(record)
            if cfg is not None:  # a run that never trained a step leaves nothing behind
                discard_unstarted(cfg.output_dir)
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except RunError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0
