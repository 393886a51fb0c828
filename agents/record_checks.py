"""Strict reading of decoded JSON into the job's record dataclasses (:mod:`ftrain.agents.records`).

What must stay true: a value of the wrong type is refused with a TypeError naming the field
(ints are widened to floats; bools are never numbers; floats are finite: a 400-digit integer in a
float field is "not a finite float", never the ``OverflowError`` that ``math.isfinite`` raises on
it; ints fit in int64, as every writer's do); unknown keys are ignored (old agents read new
records); a missing required field is refused. Text is kept printable: a lone surrogate (JSON's
``"\udc80"``) is written as its escape, so that printing or encoding a record never raises. An
error message shows a hostile value in bounded space (:func:`ftrain.contract.bounded_json.short`).
Each type hint's checker is built once (building it per record, ``typing.get_type_hints`` above
all, cost ~1 ms a record and made reading a 1,024-node job take ~2 s).
"""

from __future__ import annotations

import functools
import types
import typing
from collections.abc import Callable
from dataclasses import fields
from typing import Any

from ftrain.contract.bounded_json import is_finite_number, printable, short

#: a checker: the value if it has the hinted type (ints widened to floats), else TypeError naming ``where``
Checker = Callable[[Any, str], Any]


def _scalar(accept: Callable[[Any], bool], convert: Callable[[Any], Any], name: str) -> Checker:
    def check(value: Any, where: str) -> Any:
        if accept(value):
            return convert(value)
        raise TypeError(f"{where}: {short(value)} is not {name}")

    return check


def _identity(value: Any) -> Any:
    return value


#: the largest int a field holds (ints are int64: what every writer's values fit in)
MAX_INT = 2**63 - 1


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and -MAX_INT - 1 <= v <= MAX_INT


_SCALARS: dict[Any, Checker] = {
    type(None): _scalar(lambda v: v is None, _identity, "None"),
    bool: _scalar(lambda v: isinstance(v, bool), _identity, "bool"),
    int: _scalar(_is_int, _identity, "an int64"),
    float: _scalar(is_finite_number, float, "a finite float"),
    str: _scalar(lambda v: isinstance(v, str), printable, "str"),
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
            raise TypeError(f"{where}: {short(value)} is not {hint}")

        return union
    if origin is list:
        item = checker(args[0])

        def listed(value: Any, where: str) -> Any:
            if not isinstance(value, list):
                raise TypeError(f"{where}: {short(value)} is not a list")
            return [item(v, f"{where}[]") for v in value]

        return listed
    if origin is dict:
        key_check, value_check = checker(args[0]), checker(args[1])

        def mapping(value: Any, where: str) -> Any:
            if not isinstance(value, dict):
                raise TypeError(f"{where}: {short(value)} is not an object")
            return {key_check(k, f"{where} key"): value_check(v, f"{where}[{k!r:.60}]") for k, v in value.items()}

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


__all__ = ["MAX_INT", "Checker", "checker", "from_dict"]
