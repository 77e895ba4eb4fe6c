"""Write the command reference (docs/commands.md) from every command's argument parser and the config reference
(docs/config.md) from the templates' source (scripts/make_templates.py): no flag or key lands undocumented.

    python scripts/make_references.py           # write them
    python scripts/make_references.py --check   # exit 1, naming the files, if a checked-in page differs

tests/test_docs.py fails when a page differs from what this writes.
"""

import argparse
import os
import re
import sys
import textwrap
from typing import Any, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import make_templates  # noqa: E402
from orb.commands import COMMANDS, SCRIPTS, parser  # noqa: E402

GENERATED = "<!-- Written by scripts/make_references.py from {source}: edit that, then run the script. -->"


def cell(text: Any) -> str:
    """Text for a Markdown table cell."""
    return " ".join(str(text).split()).replace("|", "\\|")


STATED = re.compile(r"\s*\(default: ([^()]*(?:\([^()]*\)[^()]*)*)\)")  # a default a help says itself


def prose(text: str) -> List[str]:
    return textwrap.wrap(" ".join(text.split()), 120, break_on_hyphens=False)


def default_of(action: argparse.Action) -> str:
    stated = STATED.search(action.help or "")
    if stated:
        return cell(stated.group(1))
    if action.required:
        return "required"
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        return "off" if action.default is False else "on"
    if action.default in (None, "", [], argparse.SUPPRESS):
        return "none"
    return f"`{action.default}`"


def help_of(action: argparse.Action, prog: str) -> str:
    text = action.help or ""
    if "%(" in text:
        text = text % dict(vars(action), prog=prog)
    return cell(STATED.sub("", text.replace(" (required)", "")))


def option_name(action: argparse.Action) -> str:
    names = ", ".join(action.option_strings) or action.metavar or action.dest
    if action.option_strings and action.nargs != 0:
        metavar = action.metavar or action.dest.upper()
        names += f" {metavar}" + (" ..." if action.nargs in ("+", "*") else "")
    return f"`{names}`"


def command_section(program: str) -> List[str]:
    built = parser(program)
    checkout = [script for script, name in SCRIPTS.items() if name == program]
    run = (f"`python {checkout[0]}`" if checkout[0].endswith(".py") else f"`bash {checkout[0]}`") if checkout else ""
    usage = built.format_usage().strip()
    lines = [f"## {program}", ""]
    description = (built.description or "").strip().split("\n\n")[0]
    lines += prose(description) + [""] if description else []
    lines += ["```text", usage, "```", ""]
    if run:
        lines += [f"In a checkout: {run}.", ""]
    lines += ["| option | default | what |", "|---|---|---|"]
    for action in built._actions:
        if isinstance(action, argparse._HelpAction) or action.help == argparse.SUPPRESS:  # (hidden from --help)
            continue
        lines.append(f"| {option_name(action)} | {default_of(action)} | {help_of(action, program)} |")
    return lines + [""]


def commands_page() -> str:
    lines = ["# Command reference", "", "```bash", "orb-finetune --help", "```", "",
             GENERATED.format(source="the commands' parsers (orb/commands.py)"), ""]
    lines += prose("Every installed command, its options and their defaults, as `--help` prints them. `orb-finetune` "
                   "and `orb-finetune-parallel` also take any config key as `--key value` after their options "
                   "([config reference](config.md)).") + [""]
    lines += [f"- [{program}](#{program})" for program in COMMANDS] + [""]
    for program in COMMANDS:
        lines += command_section(program)
    return "\n".join(lines).rstrip("\n") + "\n"


def yaml_text(value: Any) -> str:
    return f"`{make_templates.yaml_value(value)}`"


def config_page() -> str:
    from orb.training.config import TrainConfig, flatten

    defaults = flatten(TrainConfig().to_dict())
    families = {name: make_templates.TEMPLATES[name].values for name in ("finetune_orb_v3", "finetune_orb_v2")}
    lines = ["# Config reference", "", "```bash", "orb-finetune --print-config finetune_orb_v3 > my.yaml", "```", "",
             GENERATED.format(source="the templates' source, scripts/make_templates.py"), ""]
    lines += prose("Every key a config takes (a YAML file, or `--key value` on the command line; nested keys with "
                   "dots: `--loss_weights.stress 0`), its built-in default, and the value the family templates "
                   "`finetune_orb_v3` and `finetune_orb_v2` give it where that differs. An unknown or ill-typed key "
                   "is refused in one line naming it.") + [""]
    for title, keys in make_templates.SECTIONS:
        heading = title.split(":")[0].split(" (")[0].split(". ")[0]
        lines += [f"## {heading}", ""] + (prose(title) + [""] if title != heading else [])
        lines += ["| key | default | templates | what |", "|---|---|---|---|"]
        for key, comment in keys:
            shown = [f"{name.split('_')[-1]}: {yaml_text(values[key][0])}" for name, values in families.items()
                     if key in values and values[key][0] != defaults[key]]
            lines.append(f"| `{key}` | {yaml_text(defaults[key])} | {', '.join(shown)} | {cell(comment)} |")
        lines.append("")
    lines += ["## Model", ""] + prose("`model.name` sets every other `model.*` key to the published architecture of "
                                      "that name; set one only to train another architecture from scratch.")
    lines += ["", "| key | orb_v2 | orb-v3 | what |", "|---|---|---|---|"]
    from orb.models.config import ModelConfig

    v2, v3 = ModelConfig.defaults("orb_v2"), ModelConfig.defaults(make_templates.V3)
    for key, comment in make_templates.MODEL_KEYS:
        lines.append(f"| `model.{key}` | {yaml_text(v2[key])} | {yaml_text(v3[key])} | {cell(comment)} |")
    lines += ["", "| `model.name` | what |", "|---|---|"]
    lines += [f"| `{name}` | {cell(what)} |" for name, what in make_templates.MODELS.items()]
    return "\n".join(lines) + "\n"


PAGES = {"docs/commands.md": commands_page, "docs/config.md": config_page}


def build_parser() -> argparse.ArgumentParser:
    """This script's command line (the docs test parses its documented commands with it)."""
    args_parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                          formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    args_parser.add_argument("--check", action="store_true", help="compare the checked-in pages, write nothing")
    return args_parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return make_templates.write_generated({os.path.join(ROOT, page): make() for page, make in PAGES.items()},
                                          args.check, "scripts/make_references.py")


if __name__ == "__main__":
    from orb.signals import run_program

    run_program(main)
