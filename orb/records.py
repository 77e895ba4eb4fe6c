"""The one reader of the JSON records a resume continues from (orb-md's per-structure states, the settings orb-md
and orb-relax record beside their outputs): each field checked as it is read, so that an empty, cut short, partial
or hand-edited record is one line naming the file, the key and the cause, never a traceback half-way through a
resume that has already cut files back."""

import json
import math
from typing import Callable, Dict, Optional, Sequence

import numpy as np

from orb.errors import OrbInputError

Check = Callable[[object], object]  # a field's value -> the value to use; ValueError or TypeError saying why not


# the records orb-relax, orb-md and orb-evaluate write beside their outputs, by name: run.json and summary.json in
# orb-md's and orb-evaluate's folders, OUTPUT.run.json and OUTPUT.summary.json beside orb-relax's database, and
# orb-md's state_<k>.json per structure (orb.inference.md_setup.Run.path); a data folder holding them is read
# without them (orb.data.formats.source_files: ase.io read them as ASE JSON databases and refused the folder)
RUN_RECORD, SUMMARY = "run.json", "summary.json"


def is_own_record(name: str) -> bool:
    """Whether a file of a folder, by its name, is one of those records."""
    state = name.startswith("state_") and name.endswith(".json") and name[len("state_"):-len(".json")].isdigit()
    return state or name in (RUN_RECORD, SUMMARY) or name.endswith(("." + RUN_RECORD, "." + SUMMARY))


class RecordError(OrbInputError):
    """A record a resume needs that cannot be read or holds a value it cannot use."""


def read_json(path: str, advice: str = "") -> object:
    """The JSON value of ``path``; one line (:class:`RecordError`) naming it when it is empty, cut short or no JSON."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise RecordError(f"{path}: cannot read it ({getattr(exc, 'strerror', None) or exc}){advice}") from None
    if not text.strip():
        raise RecordError(f"{path} is empty{advice}")
    try:
        return json.loads(text)
    except ValueError as exc:
        cut = "cut short" if exc.msg.startswith("Unterminated") or exc.pos >= len(text.rstrip()) else "not valid JSON"
        raise RecordError(f"{path} is {cut} ({exc.msg} at character {exc.pos}){advice}") from None


def read_record(path: str, fields: Dict[str, Check], optional: Sequence[str] = (), advice: str = "") -> Dict:
    """The JSON object of ``path`` with each of ``fields`` checked (and converted) by its check; a key in
    ``optional`` may be absent (an older version did not write it). ``advice`` ends every message."""
    value = read_json(path, advice)
    if not isinstance(value, dict):
        raise RecordError(f"{path} holds a JSON {type(value).__name__}, not the record expected{advice}")
    record = dict(value)
    for key, check in fields.items():
        if key not in value:
            if key in optional:
                continue
            raise RecordError(f"{path}: key '{key}' is missing{advice}")
        try:
            record[key] = check(value[key])
        except (TypeError, ValueError) as exc:
            raise RecordError(f"{path}: key '{key}' {exc}{advice}") from None
    return record


def integer(minimum: int = 0) -> Check:
    def check(value):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"must be a whole number, got {_shown(value)}")
        if value < minimum:
            raise ValueError(f"must be >= {minimum}, got {value}")
        return value
    return check


def number(value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TypeError(f"must be a finite number, got {_shown(value)}")
    return float(value)


def text(value) -> str:
    if not isinstance(value, str):
        raise TypeError(f"must be text, got {_shown(value)}")
    return value


def mapping(value) -> Dict:
    if not isinstance(value, dict):
        raise TypeError(f"must be a JSON object, got {_shown(value)}")
    return value


def optional(check: Check) -> Check:
    """``check``, or null."""
    return lambda value: None if value is None else check(value)


def array(shape: Sequence[Optional[int]]) -> Check:
    """Finite numbers of ``shape`` (None: any length on that axis) as a float64 array."""
    def check(value):
        try:
            values = np.array(value, dtype=np.float64)
        except (TypeError, ValueError):
            raise TypeError(f"must be an array of numbers of shape {_shape(shape)}, got {_shown(value)}") from None
        if values.ndim != len(shape) or any(n is not None and n != m for n, m in zip(shape, values.shape)):
            raise ValueError(f"must have shape {_shape(shape)}, got {values.shape}")
        if not np.all(np.isfinite(values)):
            raise ValueError("holds NaN or inf")
        return values
    return check


def record_of(fields: Dict[str, Check], optional_keys: Sequence[str] = ()) -> Check:
    """A nested JSON object whose ``fields`` are checked as :func:`read_record` checks a file's."""
    def check(value):
        value = mapping(value)
        out = dict(value)
        for key, inner in fields.items():
            if key not in value:
                if key in optional_keys:
                    continue
                raise ValueError(f"lacks its key '{key}'")
            try:
                out[key] = inner(value[key])
            except (TypeError, ValueError) as exc:
                raise type(exc)(f"has '{key}' that {exc}") from None
        return out
    return check


def _shape(shape) -> str:
    return "(" + ", ".join("n" if n is None else str(n) for n in shape) + ")"


def _shown(value) -> str:
    shown = json.dumps(value) if not isinstance(value, float) or math.isfinite(value) else repr(value)
    return shown if len(shown) <= 40 else shown[:37] + "..."
