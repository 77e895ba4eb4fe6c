"""What ``finetune.py`` and ``finetune_parallel.py`` share: the command line, and running a fine-tuning
so that a mistake in the input ends in one clear line (on the console and in train.log), never a traceback."""

import argparse
import logging
import os
import sys
import textwrap
from typing import Callable, List, Optional, Tuple

from orb.bundled import printable_template, templates_line
from orb.errors import ConfigError, OrbInputError, OutputBusy, RunError, StartupError
from orb.training.config import TrainConfig, load_config
from orb.training.run_checks import check_training_data
from orb.training.outputs import check_outputs_apart, discard_unstarted
from orb.signals import STOP, Stopped, deliver_stop_signals, file_system_failure, is_program, listen
from orb.training.checkpointing import checkpoint_to_resume

USAGE = """%(prog)s --config FILE_OR_TEMPLATE [--resume DIR_OR_FILE|auto] [--overwrite] [--accept_config_changes]
       [--key value ...]
       %(prog)s --print-config TEMPLATE > my.yaml"""
DESCRIPTION = """Fine-tune an orb model on your DFT data: extxyz or any file ase.io reads, ASE SQLite or .aselmdb
databases, folders of these, or a list of them.

--config names your YAML file, or a packaged template by name; --print-config TEMPLATE writes one to edit.
{templates}
Relative paths in a config are relative to the folder you run from, except that in a packaged template a
relative path to the bundled demo data (data/...) is that bundled file. After the options, any config key can be
given as --key value (nested keys with dots), on top of the file:
  --max_epochs 3 --device_target CPU --model.num_message_passing_steps 2 --loss_weights.stress 0"""


def add_run_options(parser: argparse.ArgumentParser) -> None:
    """The options of a fine-tuning run, on one device or data-parallel (the launcher passes them to its workers)."""
    parser.add_argument("--resume", default="", metavar="DIR_OR_FILE", help="a training checkpoint, or an "
                        "output_dir, to continue from; 'auto': output_dir's last.ckpt if it has one, else a fresh "
                        "start (for requeued jobs) (default: a fresh start)")
    parser.add_argument("--overwrite", action="store_true",
                        help="start a fresh run in an output_dir that holds an earlier run (deletes its files)")
    parser.add_argument("--accept_config_changes", action="store_true",
                        help="resume although settings that fix the schedule or data order changed")


def finetune_parser(prog: Optional[str] = None, default_config: Optional[str] = None) -> argparse.ArgumentParser:
    """orb-finetune's (finetune.py's) options; the ``--key value`` config overrides are what it leaves unparsed."""
    from orb.bundled import template_names
    from orb.commands import HelpFormatter, add_version_option

    parser = argparse.ArgumentParser(prog=prog, allow_abbrev=False, usage=USAGE, formatter_class=HelpFormatter,
                                     description=DESCRIPTION.format(templates=textwrap.fill(
                                         "Packaged templates: " + ", ".join(template_names()), 116,
                                         initial_indent="  ", subsequent_indent="    ")))
    parser.add_argument("--config", default=default_config, metavar="FILE_OR_TEMPLATE",
                        help="YAML config file, or a packaged template's name" +
                        ("" if default_config else " (required)"))
    parser.add_argument("--print-config", "--print_config", dest="print_config", default=None, metavar="TEMPLATE",
                        help="write the packaged template TEMPLATE to the output, its bundled paths absolute, and "
                        "exit (default: none)")
    add_run_options(parser)
    add_version_option(parser)
    return parser


def parse_command_line(argv: Optional[List[str]], default_config: Optional[str]
                       ) -> Tuple[argparse.Namespace, List[str]]:
    """The command's own options, and the config overrides (``--key value``). A token that is no config key but close
    to an option of the command's (``--over``, ``--confg demo``) is named as that mistake ("override '--over' has
    no value" and "no --config" left the user guessing)."""
    import dataclasses

    from orb.commands import closest
    from orb.training.config import TrainConfig

    parser = finetune_parser(default_config=default_config)
    args, overrides = parser.parse_known_args(argv)
    own = [flag for action in parser._actions for flag in action.option_strings if flag.startswith("--")]
    keys = {field.name for field in dataclasses.fields(TrainConfig)}
    for token in overrides:
        if not token.startswith("--") or token[2:].split("=")[0].split(".")[0] in keys:
            continue  # (a config key, with or without its value: said so by the overrides' own check)
        hint = closest(token.split("=")[0], own)
        if hint:
            raise ConfigError(f"unknown option {token}{hint}")
    return args, overrides


def print_template(name: str, overrides: List[str]) -> int:
    """--print-config: the packaged template ``name`` to standard output; a mistake is one line and status 2."""
    try:
        if overrides:
            raise ConfigError(f"--print-config writes a template as it is; edit the file it writes instead of "
                              f"giving {overrides[0]}")
        sys.stdout.write(printable_template(name))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def check_resume_path(resume: Optional[str], overwrite: bool = False) -> None:
    """A ``--resume`` path that names no checkpoint, said with the config's checks (it came after the weights' download
    and the data's census), or given with ``--overwrite`` (which it ignored), as orb-relax and orb-md refuse the pair;
    ``--resume auto --overwrite`` has a meaning: resume from last.ckpt, else start over."""
    from orb.training.checkpointing import resolve

    if resume and resume != "auto" and overwrite:
        raise ConfigError(f"--resume {resume} continues the earlier run and --overwrite replaces it: give one of them "
                          "(--resume auto --overwrite: last.ckpt if there is one, else start over)")
    if resume and resume != "auto":
        path = resolve(resume)
        if not os.path.isfile(path):
            raise ConfigError(f"--resume {resume}: " + (f"no checkpoint {path} there" if path != resume else
                                                        "checkpoint file does not exist"))


def config_given_bare(overrides: List[str]) -> Optional[str]:
    """A word of the command line, no option's value, that names a packaged template or an existing YAML file
    (``orb-finetune demo``, as orb-finetune-parallel takes it): the config meant, which --config must name."""
    from orb.bundled import template_path

    for before, word in zip([""] + overrides, overrides):
        if word.startswith("-") or (before.startswith("--") and "=" not in before):
            continue  # (an option, or an override's value)
        if template_path(word) or (os.path.isfile(word) and word.lower().endswith((".yaml", ".yml"))):
            return word
    return None


def checked_config(args: argparse.Namespace, overrides: List[str]) -> TrainConfig:
    """The run's config from its command line (:func:`parse_command_line`), every value and path checked: by the
    command, and by the data-parallel launcher before msrun starts a worker (a typo was each worker's line, after
    every rank had imported MindSpore and joined the job)."""
    if args.config is None:
        word = config_given_bare(overrides)
        if word is not None:
            raise ConfigError(f"no --config (did you mean --config {word}?)")
        raise ConfigError(f"no --config: name your YAML config file or a packaged template ({templates_line()})")
    cfg = load_config(args.config, overrides)
    check_resume_path(args.resume, args.overwrite)
    check_training_data(cfg)
    check_outputs_apart(cfg)
    return cfg


def run(argv: Optional[List[str]], default_config: Optional[str],
        fine_tune: Callable[[TrainConfig, argparse.Namespace], None],
        is_main: Callable[[], bool] = lambda: True) -> int:
    """Parse arguments, load the config and call ``fine_tune``; bad input -> ``error: ...`` and exit status 2."""
    try:
        return _run(argv, default_config, fine_tune, is_main)
    finally:
        if STOP.commands == 0 and not is_program():
            STOP.give_back()  # (called from Python: however it ended, the signals go back to the caller's handlers)


def _run(argv, default_config, fine_tune, is_main) -> int:
    log = logging.getLogger("orb")
    cfg = None
    try:
        try:
            listen()  # a stop signal during start-up exits 75 at once (also while this installs); the loop saves first
            deliver_stop_signals()  # (msrun's workers start with them blocked: one that came before is handled now)
            args, overrides = parse_command_line(argv, default_config)  # (inside: the entry's listener is live)
            if args.print_config is not None:
                return print_template(args.print_config, overrides)
            cfg = checked_config(args, overrides)
            if args.resume == "auto":
                args.resume = checkpoint_to_resume(cfg.output_dir, args.resume, args.overwrite, cfg.to_dict())
                args.overwrite = args.overwrite or not args.resume  # no checkpoint there: records of unsaved steps
            fine_tune(cfg, args)
            STOP.raise_if_raised()  # (a start-up stop some code swallowed: a stop, the run's saves kept)
            STOP.stand_down()  # finished: a signal now (a scheduler's, as the job ends) is no stop to report
        except Exception:
            STOP.raise_if_raised()  # a start-up stop an extension's import turned into its error (a "bad row"): 75
            raise
    except Stopped as stop:
        STOP.stand_down()  # (the run ends: another signal, as the interpreter exits, is no second stop)
        STOP.reported()
        print(f"{stop}", file=sys.stderr)
        return stop.status
    except (OrbInputError, RunError) as exc:  # (a RunError: weights that could not be downloaded, a fault)
        if is_main() and not isinstance(exc, OutputBusy):  # into train.log too, when open (a resumed run keeps it);
            # (refused because another run writes output_dir: that run's files, not this one's to touch)
            record = log.makeRecord("orb", logging.ERROR, __file__, 0, "%s", (exc,), None)
            for handler in log.handlers:
                if isinstance(handler, logging.FileHandler):
                    handler.emit(record)
            # a run refused, or failing before any work, leaves nothing behind (a fault later keeps everything: a run
            # that diverged before its first metrics record lost its log)
            if cfg is not None and isinstance(exc, (OrbInputError, StartupError)):
                discard_unstarted(cfg.output_dir)
        print(f"error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, OrbInputError) else 1
    except OSError as exc:  # the file system's failure outside a save (which says so itself): one line
        line = file_system_failure(exc, "continue with --resume auto")
        if line is None:
            raise
        print(line, file=sys.stderr)
        return 1
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    """orb-finetune: finetune.py's main, loaded from its file (orb.commands.script_path)."""
    from orb.commands import load_script

    return load_script("finetune").main(argv)
