"""The config file's machinery: typed sections, a TOML file, dotted CLI overrides.

One config file serves every process of a job; each package owns the sections it reads (a
dataclass per section, built with :func:`opt`) and whoever composes them calls
:func:`load_sections`. Precedence is CLI > file > defaults. Bad input fails at start with a
:class:`ConfigError` that names the key and, where it helps, the file and the fix.

What must stay true: every float key is finite (TOML's ``nan``/``inf`` are refused, whether from
the file, an override or a dataclass built in code: sections call :func:`check_floats`), and a
section of the file that no loaded schema knows is an error unless the caller declares it
``opaque`` (read and validated by another process).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import field
from typing import Any


class ConfigError(ValueError):
    """A configuration problem, reported with the offending key."""

    def __init__(self, key: str, message: str):
        super().__init__(f"{key}: {message}" if key else message)
        self.key = key


def opt(default: Any, help: str, choices: tuple[str, ...] | None = None) -> Any:
    """A config key: its default, the help text of the reference, and its allowed values."""
    meta: dict[str, Any] = {"help": help}
    if choices is not None:
        meta["choices"] = choices
    return field(default=default, metadata=meta)


#: the annotation of a free table (``[model.args]``: any keys, read by whoever the section calls)
TABLE = "dict[str, Any]"
#: the annotation of an array of tables (``[[data.sources]]``: each checked by its section)
TABLES = "list[dict[str, Any]]"


def opt_table(help: str) -> Any:
    """A free table key (annotate it :data:`TABLE`): ``[section.key]`` in the file, ``--section.key.name=value``
    on the command line; its entries are the section's (or its consumer's) to check."""
    return field(default_factory=dict, metadata={"help": help})


def opt_tables(help: str) -> Any:
    """An array-of-tables key (annotate it :data:`TABLES`): ``[[section.key]]`` in the file,
    ``--section.key=[{a = 1}, {a = 2}]`` (TOML inline tables) on the command line."""
    return field(default_factory=list, metadata={"help": help})


def positive(key: str, value: int | float) -> None:
    if not value > 0:  # "not >" so that NaN fails too
        raise ConfigError(key, f"must be > 0, got {value}")


def at_least(key: str, value: int | float, minimum: int | float) -> None:
    if not value >= minimum:
        raise ConfigError(key, f"must be >= {minimum}, got {value}")


def int_range(key: str, value: int, low: int, high: int) -> None:
    if not low <= value <= high:
        raise ConfigError(key, f"must be in [{low}, {high}], got {value}")


def check_floats(section: str, obj: Any) -> None:
    """Every float field of ``obj`` is finite (a section built in code skips the loader's checks)."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if f.type == "float" and not (isinstance(value, (int, float)) and math.isfinite(value)):
            raise ConfigError(f"{section}.{f.name}", f"must be a finite number, got {value!r}")


def parse_nnodes(text: str, key: str = "--nnodes") -> tuple[int, int]:
    """``"N"`` or ``"MIN:MAX"`` -> (min, max)."""
    try:
        lo, _, hi = text.partition(":")
        low, high = int(lo), int(hi or lo)
    except ValueError:
        raise ConfigError(key, f"expected N or MIN:MAX, got {text!r}") from None
    if not 1 <= low <= high:
        raise ConfigError(key, f"need 1 <= MIN <= MAX, got {text!r}")
    return low, high


def suggest(name: str, options: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(options), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


_TYPES = {"int": int, "float": float, "str": str, "bool": bool}


def _check_type(key: str, f: dataclasses.Field, value: Any) -> Any:
    if f.type == TABLE:
        if not isinstance(value, dict):
            raise ConfigError(key, f"expected a table ([{key}] in the file), got {type(value).__name__} {value!r}")
        return dict(value)
    if f.type == TABLES:
        if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
            raise ConfigError(
                key, f"expected an array of tables ([[{key}]] in the file, or [{{...}}, ...]), got {value!r}"
            )
        return [dict(v) for v in value]
    expected = _TYPES[str(f.type)]
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if (expected is int and isinstance(value, bool)) or not isinstance(value, expected):
        raise ConfigError(key, f"expected {expected.__name__}, got {type(value).__name__} {value!r}")
    if isinstance(value, float) and not math.isfinite(value):  # only a float field gets this far with a float
        raise ConfigError(key, f"must be a finite number, got {value!r}")
    choices = f.metadata.get("choices")
    if choices and value not in choices:
        raise ConfigError(key, f"{value!r} is not one of {', '.join(choices)}")
    return value


def _parse_override(arg: str) -> tuple[str, str, str, str]:
    """``--section.key=value`` or ``--section.key.entry=value`` (an entry of a free table) ->
    (section, key, entry or "", value text)."""
    if not arg.startswith("--") or "=" not in arg:
        raise ConfigError("", f"bad override {arg!r}: expected --section.key=value")
    key, _, raw = arg[2:].partition("=")
    parts = key.split(".")
    if len(parts) not in (2, 3) or not all(parts):
        raise ConfigError(key, f"bad override {arg!r}: expected --section.key=value")
    return parts[0], parts[1], parts[2] if len(parts) == 3 else "", raw


def _toml_value(raw: str) -> Any:
    """An override's text as a TOML value; the text itself (a bare string) if it is not one."""
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw  # a bare string; reported as a type error naming the key where one is not allowed


def _coerce_raw(f: dataclasses.Field, raw: str) -> Any:
    """Turn an override's text into a value of the field's type (TOML syntax, strings bare)."""
    return raw if f.type == "str" else _toml_value(raw)


def read_file(path: str | os.PathLike | None) -> dict[str, Any]:
    """The TOML file's tables (empty without a file)."""
    if path is None:
        return {}
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError("", f"config file {str(path)!r} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError("", f"{path}: invalid TOML: {e}") from None


def load_sections(
    schema: Mapping[str, type],
    path: str | os.PathLike | None = None,
    overrides: Iterable[str] = (),
    *,
    opaque: Iterable[str] = (),
) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """Resolve defaults < TOML file < ``--section.key=value`` overrides.

    Returns one validated instance per section of ``schema`` and, for every ``opaque`` section
    (one another process owns), its raw table: file values with overrides applied as text.
    """
    values = read_file(path)
    origin = str(path) if path is not None else "defaults"
    opaque = tuple(opaque)
    known = [*schema, *opaque]
    typed: dict[str, dict[str, Any]] = {}
    raw: dict[str, dict[str, Any]] = {name: {} for name in opaque}
    for section, body in values.items():
        if section not in known:
            raise ConfigError(section, f"unknown section in {origin}{suggest(section, known)}")
        if not isinstance(body, dict):
            raise ConfigError(section, f"expected a [{section}] table in {origin}")
        if section in raw:
            raw[section].update(body)
            continue
        fields = {f.name: f for f in dataclasses.fields(schema[section])}
        for name, value in body.items():
            key = f"{section}.{name}"
            if name not in fields:
                raise ConfigError(key, f"unknown key in {origin}{suggest(name, fields)}")
            typed.setdefault(section, {})[name] = _check_type(key, fields[name], value)
    for arg in overrides:
        section, name, entry, text = _parse_override(arg)
        key = f"{section}.{name}"
        if section not in known:
            raise ConfigError(key, f"unknown section {section!r}{suggest(section, known)}")
        if section in raw:
            if entry:
                raise ConfigError(f"{key}.{entry}", f"bad override {arg!r}: expected --{section}.key=value")
            raw[section][name] = text
            continue
        fields = {f.name: f for f in dataclasses.fields(schema[section])}
        if name not in fields:
            raise ConfigError(key, f"unknown key{suggest(name, fields)}")
        if entry:  # one entry of a free table, merged into what the file gave
            if fields[name].type != TABLE:
                raise ConfigError(f"{key}.{entry}", f"{key} is not a table: expected --{key}=value")
            table = typed.setdefault(section, {}).setdefault(name, {})
            table[entry] = _toml_value(text)
            continue
        typed.setdefault(section, {})[name] = _check_type(key, fields[name], _coerce_raw(fields[name], text))
    return {s: cls(**typed.get(s, {})) for s, cls in schema.items()}, raw


def reference_markdown(schema: Mapping[str, type]) -> str:
    """Every key of ``schema`` (type, default, meaning) as Markdown."""
    lines = []
    for section, cls in schema.items():
        lines += [f"## `[{section}]`", "", "| key | type | default | meaning |", "|---|---|---|---|"]
        for f in dataclasses.fields(cls):
            made = f.default_factory() if callable(f.default_factory) else None
            default = json.dumps(f.default if f.default is not dataclasses.MISSING else made)
            help_ = f.metadata["help"].replace("|", "\\|")
            lines.append(f"| `{section}.{f.name}` | {f.type} | `{default}` | {help_} |")
        lines.append("")
    return "\n".join(lines)
