"""Strict reading of decoded JSON into the job's record dataclasses (:mod:`ftrain.agents.records`).

What must stay true: a value of the wrong type is refused with a TypeError naming the field
(ints are widened to floats; bools are never numbers; floats are finite); unknown keys are
ignored (old agents read new records); a missing required field is refused. Each type hint's
checker is built once (building it per record, ``typing.get_type_hints`` above all, cost ~1 ms
a record and made reading a 1,024-node job take ~2 s).
"""

from __future__ import annotations

import functools
import math
import types
import typing
from collections.abc import Callable
from dataclasses import fields
from typing import Any

#: a checker: the value if it has the hinted type (ints widened to floats), else TypeError naming ``where``
Checker = Callable[[Any, str], Any]


def _scalar(accept: Callable[[Any], bool], convert: Callable[[Any], Any], name: str) -> Checker:
    def check(value: Any, where: str) -> Any:
        if accept(value):
            return convert(value)
        raise TypeError(f"{where}: {value!r} is not {name}")

    return check


def _identity(value: Any) -> Any:
    return value


_SCALARS: dict[Any, Checker] = {
    type(None): _scalar(lambda v: v is None, _identity, "None"),
    bool: _scalar(lambda v: isinstance(v, bool), _identity, "bool"),
    int: _scalar(lambda v: isinstance(v, int) and not isinstance(v, bool), _identity, "int"),
    float: _scalar(
        lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v), float, "float"
    ),
    str: _scalar(lambda v: isinstance(v, str), _identity, "str"),
}


@functools.cache
def checker(hint: Any) -> Checker:
    """The checker of one type hint, built once per hint (records are read on every change of
    every key: building it per record cost ~1 ms each, mostly ``typing.get_type_hints``)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint in _SCALARS:
        return _SCALARS[hint]
    if origin in (typing.Union, types.UnionType):
        options = [checker(option) for option in args]

        def union(value: Any, where: str) -> Any:
            for option in options:
                try:
                    return option(value, where)
                except TypeError:
                    continue
            raise TypeError(f"{where}: {value!r} is not {hint}")

        return union
    if origin is list:
        item = checker(args[0])

        def listed(value: Any, where: str) -> Any:
            if not isinstance(value, list):
                raise TypeError(f"{where}: {value!r} is not a list")
            return [item(v, f"{where}[]") for v in value]

        return listed
    if origin is dict:
        key_check, value_check = checker(args[0]), checker(args[1])

        def mapping(value: Any, where: str) -> Any:
            if not isinstance(value, dict):
                raise TypeError(f"{where}: {value!r} is not an object")
            return {key_check(k, f"{where} key"): value_check(v, f"{where}[{k!r}]") for k, v in value.items()}

        return mapping
    if isinstance(hint, type) and hasattr(hint, "__dataclass_fields__"):
        return lambda value, where: from_dict(hint, value)
    raise TypeError(f"no checker for type hint {hint!r}")


@functools.cache
def _field_checkers(cls: type) -> tuple[tuple[str, Checker], ...]:
    hints = typing.get_type_hints(cls)
    return tuple((f.name, checker(hints[f.name])) for f in fields(cls))


def from_dict(cls: type, d: Any) -> Any:
    """An instance of dataclass ``cls`` from a decoded JSON object: unknown keys ignored, missing
    required fields and wrong types refused (TypeError/ValueError)."""
    if not isinstance(d, dict):
        raise TypeError(f"{cls.__name__}: expected a JSON object, got {type(d).__name__}")
    name = cls.__name__
    kwargs = {f: check(d[f], f"{name}.{f}") for f, check in _field_checkers(cls) if f in d}
    try:
        return cls(**kwargs)
    except TypeError as e:  # a required field is missing
        raise TypeError(f"{name}: {e}") from e


__all__ = ["Checker", "checker", "from_dict"]
