"""Reading a config: YAML text as a config means it, config files (yours, or a packaged template by name) and
``--key value`` overrides. What the values may be is checked in :mod:`orb.training.config`."""

import re
from contextlib import contextmanager
from typing import Any, Dict, Optional, Sequence, Tuple

import yaml

from orb.bundled import PRINT_HINT, find_config, is_packaged, with_bundled_paths
from orb.errors import ConfigError


class ConfigLoader(yaml.SafeLoader):
    """YAML as a config means it: a key given twice, or a key that is not a name, is refused (PyYAML keeps the last
    silently), and only plain forms become numbers, booleans and nulls. PyYAML's YAML 1.1 turned ``0123`` into 83
    (octal), ``12:30`` into 750 (base 60), ``2024-01-01`` into a date and ``yes``/``on`` into true, so an
    ``output_dir`` of ``0123`` trained into ``83/``; such text now stays text."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # '<<: *defaults': PyYAML merges it below
                continue
            key = self.construct_object(key_node, deep=deep)
            where = f"line {key_node.start_mark.line + 1}"
            if not isinstance(key, str):
                raise ConfigError(f"{where}: config key {key!r} is not a name")
            if key in seen:
                raise ConfigError(f"{where}: config key '{key}' is given twice")
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


ConfigLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers
            if tag not in ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float", "tag:yaml.org,2002:bool",
                           "tag:yaml.org,2002:timestamp")]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
ConfigLoader.add_implicit_resolver(  # decimal notation only (1:30.5 was 90.5, 1_000.5 was 1000.5); 1e-3 is a number
    "tag:yaml.org,2002:float",
    re.compile(r"^(?:[-+]?(?:[0-9]+\.[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?|[-+]?[0-9]+[eE][-+]?[0-9]+"
               r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"),
    list("-+0123456789."))
ConfigLoader.add_implicit_resolver("tag:yaml.org,2002:int", re.compile(r"^[-+]?(?:0|[1-9][0-9]*)$"),
                                   list("-+0123456789"))
ConfigLoader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                                   list("tTfF"))


def read_yaml(text: str, source: str) -> Any:
    """``text`` parsed by :class:`ConfigLoader`; a syntax error is one line naming ``source`` and the line."""
    try:
        return yaml.load(text, Loader=ConfigLoader)
    except ConfigError as exc:
        raise ConfigError(f"{source}, {exc}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f", line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{source} is not valid YAML{where}: {problem}") from None


def _set_dotted(tree: Dict, key: str, value: Any) -> None:
    parts = key.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"config key '{key}': '{part}' is not a block of settings")
        node = child
    node[parts[-1]] = value


class TypedNumber(float):
    """A number given on the command line, with the text it was typed as (a key that takes text takes that)."""

    def __new__(cls, value: float, text: str):
        number = super().__new__(cls, value)
        number.text = text
        return number


def parse_overrides(args: Sequence[str]) -> Dict[str, Any]:
    """``['--max_epochs', '3', '--model.latent_dim', '64']`` -> nested dict (values parsed as YAML)."""
    tree: Dict[str, Any] = {}
    i = 0
    args = list(args)
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or len(arg) <= 2:
            raise ConfigError(f"expected '--key value', got '{arg}'")
        key = arg[2:]
        if "=" in key:
            key, raw = key.split("=", 1)
            i += 1
        else:
            if i + 1 >= len(args):
                raise ConfigError(f"override '--{key}' has no value")
            raw = args[i + 1]
            i += 2
        try:
            value = read_yaml(raw, f"--{key}") if raw != "" else ""
        except ConfigError:
            value = raw
        if isinstance(value, float):  # a number, or text for a key that takes text (--output_dir 2.0)
            value = TypedNumber(value, raw)
        _set_dotted(tree, key, value)
    return tree


def _merge(base: Dict, update: Dict) -> Dict:
    out = dict(base)
    for k, v in update.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def read_config_file(name: str) -> Tuple[Dict[str, Any], str]:
    """The settings of the config file ``name`` names (a file, else a packaged template by name: orb.bundled) and
    that file's path. In a packaged template a relative path to bundled demo data is that file's absolute path."""
    path = find_config(name)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {path} is not UTF-8 text (byte {exc.start})") from None
    values = read_yaml(text, f"config file {path}")
    if values is None:
        raise ConfigError(f"config file {path} is empty (it must hold a mapping of settings)")
    if not isinstance(values, dict):
        raise ConfigError(f"config file {path} must hold a mapping of settings, got {str(values)[:40]!r}")
    return (with_bundled_paths(values) if is_packaged(path) else values), path


class Settings(dict):
    """A config's settings, the command line's on top of its file's, knowing which are the file's: an error about a
    key of the file names the file and the key's line (it named the key alone, as if typed on the command line)."""

    def __init__(self, values: Dict[str, Any], file: Optional[str] = None, file_values: Optional[Dict] = None,
                 given: Optional[Dict] = None):
        super().__init__(values)
        self.file, self.file_values, self.given = file, file_values or {}, given or {}

    @contextmanager
    def naming_its_file(self):
        try:
            yield
        except ConfigError as exc:
            where = self.where(exc.key)
            if where is None:
                raise
            raise ConfigError(f"{where}: {exc}", exc.key) from None

    def where(self, key: Optional[str]) -> Optional[str]:
        """``config file PATH, line N`` for a dotted ``key`` the file sets and the command line does not, else None."""
        if key is None or self.file is None or not _sets(self.file_values, key) or _sets(self.given, key):
            return None
        line = key_line(self.file, key)
        return f"config file {self.file}" + (f", line {line}" if line else "")


def _sets(tree: Dict, key: str) -> bool:
    """Whether the nested settings ``tree`` hold the dotted ``key``."""
    for part in key.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return False
        tree = tree[part]
    return True


def key_line(path: str, key: str) -> Optional[int]:
    """The line of the config file ``path`` where the dotted ``key`` is written; None when it cannot be told (a key
    merged in from an anchor, a file changed meanwhile)."""
    try:
        with open(path, encoding="utf-8") as f:
            node = yaml.compose(f.read(), Loader=ConfigLoader)
    except (OSError, UnicodeDecodeError, yaml.YAMLError, ConfigError):
        return None
    line = None
    for part in key.split("."):
        if not isinstance(node, yaml.MappingNode):
            return None
        found = next(((k, v) for k, v in node.value if isinstance(k, yaml.ScalarNode) and k.value == part), None)
        if found is None:
            return None
        line, node = found[0].start_mark.line + 1, found[1]
    return line


def merged_settings(name: Optional[str], overrides: Sequence[str]) -> Settings:
    """The config file's settings (none without ``name``) with the command line's ``--key value`` on top."""
    if name is not None and not name.strip():
        raise ConfigError(f"--config is empty: name a YAML config file or a packaged template ({PRINT_HINT})")
    values, path = read_config_file(name) if name else ({}, None)
    given = parse_overrides(overrides)
    if "matmul_precision" in given and "precision" not in given:  # the old key typed now overrides the file's new one
        values.pop("precision", None)
    return Settings(_merge(values, given), path, values, given)
