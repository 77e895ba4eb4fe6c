"""The config templates and demo data shipped with the package, found from any folder.

A checkout keeps them at its top (``configs/``, ``data/`` beside ``orb/``); a wheel installs the same two folders
as ``orb/_bundle/configs`` and ``orb/_bundle/data`` (pyproject.toml). Either way :func:`bundle_root` holds both,
so a template's relative path to the demo data (``data/demo_train.db``) names the same file in both.

The rule for a config's relative paths: in a packaged template (a file in the bundle's ``configs/``), a path to a
file the bundle ships under ``data/`` is that bundled file; every other relative path (your data, ``output_dir``)
is relative to the folder you run from, as in any config file of yours. On a command's line, a data path or
checkpoint (``--data data/demo_val.db``) that does not exist in the folder you run from but names a bundled file is
that file (:func:`command_path`).
"""

import json
import os
import re
from typing import Any, Dict, List, Optional

from orb.errors import ConfigError

_PACKAGE = os.path.dirname(os.path.abspath(__file__))
TEMPLATES = "configs"
DATA = "data"
# the config keys that hold paths a packaged template may point into the bundle's data/ (dotted: nested keys)
PATH_KEYS = ("train_data_path", "val_data_path", "checkpoint_path", "replay.data_path", "replay.val_data_path",
             "reference_energies.file")
PRINT_HINT = "orb-finetune --print-config NAME > my.yaml writes one to edit"


def bundle_root() -> str:
    """The folder holding ``configs/`` and ``data/``: the installed package's ``_bundle``, else the checkout."""
    installed = os.path.join(_PACKAGE, "_bundle")
    if os.path.isdir(os.path.join(installed, TEMPLATES)):
        return installed
    return os.path.dirname(_PACKAGE)


def templates_dir() -> str:
    return os.path.join(bundle_root(), TEMPLATES)


def template_names() -> List[str]:
    """The packaged templates' names (their file names without ``.yaml``), sorted."""
    try:
        files = os.listdir(templates_dir())
    except OSError:
        return []
    return sorted(name[:-len(".yaml")] for name in files if name.endswith(".yaml"))


def template_path(name: str) -> Optional[str]:
    """The packaged template ``name`` names (``demo``, ``demo.yaml`` or ``configs/demo.yaml``), else None."""
    stem = name[len(TEMPLATES) + 1:] if name.startswith(TEMPLATES + "/") else name
    stem = stem[:-len(".yaml")] if stem.endswith(".yaml") else stem
    if not stem or "/" in stem or os.sep in stem or stem not in template_names():
        return None
    return os.path.join(templates_dir(), stem + ".yaml")


def templates_line() -> str:
    return f"packaged templates: {', '.join(template_names()) or '(none found)'}; {PRINT_HINT}"


def find_config(name: str) -> str:
    """The file ``--config name`` means: that file if it exists, else the packaged template of that name; neither is
    one line naming the working folder and listing the templates."""
    if os.path.isfile(name):
        return name
    packaged = template_path(name)
    if packaged is not None:
        return packaged
    if os.path.isdir(name):
        raise ConfigError(f"config file {name} is a folder, not a YAML file")
    where = "" if os.path.isabs(name) else f" in {os.getcwd()}"
    template = "" if os.sep in name or "/" in name else ", and no packaged template is called that"
    raise ConfigError(f"config file {name} not found{where}{template} ({templates_line()})")


def is_packaged(path: str) -> bool:
    """``path`` is one of the bundle's templates (relative paths in it may point into the bundle)."""
    return os.path.dirname(os.path.realpath(path)) == os.path.realpath(templates_dir())


def bundled_file(path: Any) -> Optional[str]:
    """The absolute path of the bundled file the relative ``path`` (under ``data/``) names, else None."""
    if not isinstance(path, str) or not path or os.path.isabs(path):
        return None
    parts = os.path.normpath(path).split(os.sep)
    if parts[0] != DATA or ".." in parts:
        return None
    absolute = os.path.join(bundle_root(), *parts)
    return absolute if os.path.isfile(absolute) else None


def command_path(text: str) -> str:
    """A command's data or checkpoint argument (argparse's ``type``): ``text`` when such a file is here, else the
    bundled file it names, as an absolute path (``--data data/demo_val.db`` from any folder: the demo's data and
    weights, as the docs' commands name them; every later check and message then sees that file), else ``text``
    (for the command's own "does not exist")."""
    return text if os.path.exists(text) else bundled_file(text) or text


def with_bundled_paths(values: Dict[str, Any]) -> Dict[str, Any]:
    """A packaged template's settings with each relative path to a bundled file made that file's absolute path."""
    out = dict(values)
    for key in PATH_KEYS:
        parent, _, leaf = key.rpartition(".")
        block = out.get(parent) if parent else out
        if not isinstance(block, dict) or leaf not in block:
            continue
        value = block[leaf]
        if isinstance(value, list):
            resolved = [bundled_file(v) or v for v in value]
        else:
            resolved = bundled_file(value) or value
        if parent:
            out[parent] = block = dict(block)
        block[leaf] = resolved
    return out


_PATH_LINE = re.compile(r"^(\s*)(%s):([ \t]+)([^\s#'\"\[{][^#]*?)([ \t]*(?:#.*)?)$"
                        % "|".join(sorted({k.rpartition(".")[2] for k in PATH_KEYS})))


def _yaml_text(path: str) -> str:
    """``path`` as a YAML scalar: plain when it reads back as itself, else double-quoted (JSON's quoting is YAML's)."""
    return path if re.fullmatch(r"[A-Za-z0-9_./~+@-]+", path) else json.dumps(path)


def printable_template(name: str) -> str:
    """The packaged template ``name``'s text to edit and run from any folder: each relative path to a bundled file
    made absolute; comments and every other line as they are. An unknown name lists the templates."""
    path = template_path(name)
    if path is None:
        raise ConfigError(f"--print-config {name}: no packaged template is called that ({templates_line()})")
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines(keepends=True)
    out = []
    for line in lines:
        found = _PATH_LINE.match(line.rstrip("\n"))
        absolute = bundled_file(found.group(4)) if found else None
        if absolute is not None:
            indent, key, space, _, comment = found.groups()
            line = f"{indent}{key}:{space}{_yaml_text(absolute)}{comment}" + ("\n" if line.endswith("\n") else "")
        out.append(line)
    return "".join(out)
