"""Every command's argument parser in one table, and the help format they share.

:data:`COMMANDS` maps each installed program to the function building its parser (``module:function``, imported
only when asked: building a parser runs nothing and imports no MindSpore), so ``--help``, a generated command
reference and a test of it read the same parsers. :data:`SCRIPTS` names the checkout's scripts that run them.
"""

import argparse
import difflib
import importlib
import os
import sys
from typing import Dict, List, Optional

COMMANDS: Dict[str, str] = {
    "orb-finetune": "orb.training.cli:finetune_parser",
    "orb-finetune-parallel": "orb.training.launch:build_parser",
    "orb-evaluate": "orb.inference.evaluate:build_parser",
    "orb-relax": "orb.inference.relax:build_parser",
    "orb-md": "orb.inference.md:build_parser",
    "orb-properties": "orb.inference.properties:build_parser",
    "orb-export": "orb.inference.export:build_parser",
    "orb-convert": "orb.io.convert:build_parser",
    "orb-download": "orb.io.download:build_parser",
    "orb-plot": "orb.reports.curves:build_parser",
    "orb-smoke-test": "orb.smoke_test:build_parser",
}
# the same programs run from a checkout (paths from its top)
SCRIPTS: Dict[str, str] = {
    "finetune.py": "orb-finetune",
    "run_parallel.sh": "orb-finetune-parallel",
    "scripts/evaluate.py": "orb-evaluate",
    "scripts/relax.py": "orb-relax",
    "scripts/md.py": "orb-md",
    "scripts/properties.py": "orb-properties",
    "scripts/export.py": "orb-export",
    "scripts/convert_checkpoint.py": "orb-convert",
    "scripts/download.py": "orb-download",
    "scripts/plot_metrics.py": "orb-plot",
    "scripts/smoke_test.py": "orb-smoke-test",
}


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Every option's help ends with its default, ``(default: X)`` (none for an empty one), or ``(required)``; a
    help that says its default itself is kept as written. Descriptions keep their line breaks."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "(default" in text or "(required" in text or action.default is argparse.SUPPRESS:
            return text
        if action.required and action.nargs != "*":  # (argparse marks a '*' positional required; it may be empty)
            return f"{text} (required)"
        if not action.option_strings and action.nargs not in ("?", "*"):
            return text  # a positional argument that must be given
        if action.default is None or action.default == "" or action.default == []:
            return f"{text} (default: none)"
        return f"{text} (default: %(default)s)"


def version_line() -> str:
    """orb-mindspore's version and MindSpore's (from its installed metadata: no import), for ``--version`` and the
    reports a user pastes into an issue."""
    from importlib import metadata

    from orb import __version__

    try:
        mindspore = metadata.version("mindspore")
    except metadata.PackageNotFoundError:
        mindspore = "not installed"
    return f"orb-mindspore {__version__} (MindSpore {mindspore})"


def add_version_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--version", action="version", version=f"%(prog)s: {version_line()}",
                        help="print the versions of orb-mindspore and MindSpore, and exit")


class Parser(argparse.ArgumentParser):
    """A command's argument parser: a mistake is one line naming it, exit status 2. argparse printed its usage block
    first, and for a misspelt required flag (``--chekpoint``) only that ``--checkpoint`` was missing: a flag it does
    not know is named now, with the closest one it does. Every command has ``--version``."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        add_version_option(self)

    def parse_known_args(self, args=None, namespace=None):
        self._given = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def error(self, message: str):
        known = [flag for action in self._actions for flag in action.option_strings if flag.startswith("--")]
        unknown = [token.split("=", 1)[0] for token in getattr(self, "_given", []) if looks_like_a_flag(token)
                   and token.split("=", 1)[0] not in known]
        if unknown:
            message = f"unrecognized arguments: {', '.join(flag + closest(flag, known) for flag in unknown)}"
        self.exit(2, f"{self.prog}: error: {message}; {self.prog} --help lists the options\n")


def looks_like_a_flag(token: str) -> bool:
    """``--name``, or a flag typed with one dash or a word processor's dash (``-checkpoint``, ``—checkpoint``: pasted
    from a document), not a negative number nor a lone ``--``."""
    name = token.lstrip("-\u2013\u2014")
    if token == name or len(name) < 2 or not name[0].isalpha():
        return False
    return token.startswith("--") or token[0] in "\u2013\u2014" or len(name) > 2


def closest(flag: str, known: List[str]) -> str:
    """`` (did you mean --x?)`` for a misspelt ``flag``: the one option it begins (``--temp``: --temperature), else the
    closest by spelling, never --help; else ''."""
    options = [k for k in known if k != "--help"]
    flag = "--" + flag.lstrip("-\u2013\u2014")  # (-checkpoint, —checkpoint: --checkpoint)
    begun = [k for k in options if k.startswith(flag)]
    close = begun if len(begun) == 1 else difflib.get_close_matches(flag, options, n=1)
    return f" (did you mean {close[0]}?)" if close else ""


def script_path(name: str) -> str:
    """``<name>.py`` (finetune.py, finetune_parallel.py) beside the orb package: the checkout's top, an editable
    install's checkout, or site-packages (pyproject.toml's py-modules). Found by its file, never by a top-level
    module name, which a ``finetune.py`` of the user's on the path would answer."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), name + ".py")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{name}.py is not beside the orb package ({path}): reinstall the package")
    return path


def load_script(name: str):
    """The module of :func:`script_path` ``name``, loaded from its file."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"orb_script_{name}", script_path(name))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def parser(program: str, prog: Optional[str] = None) -> argparse.ArgumentParser:
    """The parser of ``program`` (a name in COMMANDS or SCRIPTS), showing ``prog`` (default: the program's name)."""
    command = SCRIPTS.get(program, program)
    module, function = COMMANDS[command].split(":")
    return getattr(importlib.import_module(module), function)(prog=prog or os.path.basename(program))
