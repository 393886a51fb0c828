"""A loop's non-tensor state as JSON that comes back exactly: what :class:`ftrain.Session` writes
into a step's ``user_state.json`` (and hands a live peer), for the objects of a state that are
neither the model nor an optimizer (LR schedulers, ``GradScaler``, samplers, a Trainer's state,
counters).

**What round-trips exactly** (type and value): ``None``, ``bool``, ``int`` (up to
:data:`MAX_INT_DIGITS` digits), ``float`` (every bit of a finite one; ``inf``, ``-inf`` and
``nan`` too), ``str``, ``bytes``, ``list``, ``tuple``, ``dict`` with keys of any of these
hashable kinds (``{0: ...}`` comes back with the int key), ``collections.Counter``,
``collections.OrderedDict``, ``set`` and ``frozenset``, nested up to :data:`MAX_STATE_DEPTH`
levels. Subclasses of these come back as the base kind (``numpy.float64`` as ``float``, a
namedtuple as ``tuple``, a ``defaultdict`` as ``dict``), as plain JSON always did. Anything else (a
tensor, a NumPy array or integer, an arbitrary object) is refused, naming where it is and the fix.

**The encoding** is plain JSON where plain JSON is exact: finite numbers, strings, lists, and
objects whose keys are strings not starting with ``$``. Everything else is a one-key object whose
key names what it is: ``{"$float": "inf"}``, ``{"$tuple": [...]}``, ``{"$dict": [[key, value],
...]}`` (keys encoded like values), ``{"$counter": [[key, count], ...]}``, ``{"$ordereddict":
[...]}``, ``{"$set": [...]}``, ``{"$frozenset": [...]}``, ``{"$bytes": "<base64>"}``. Nothing
is pickled: decoding builds only the kinds above.

**Bounds** (what a save refuses is exactly what a reader would refuse): a state file of at most
:data:`MAX_STATE_BYTES`, values nested at most :data:`MAX_STATE_DEPTH` levels, integers of at most
:data:`MAX_INT_DIGITS` digits. A file read back (from storage, digest-verified, or from a peer) is
parsed within the same bounds (integers within Python's own limit of int conversion, which is
:data:`MAX_INT_DIGITS` unless the program changed it), with no NaN/Infinity literals; anything else
is a :class:`StateDecodeError`. The file is digest-checked against its manifest before it is parsed:
what is read is what its writer wrote, or the step is corrupt.
"""

from __future__ import annotations

import base64
import binascii
import collections
import json
import math
from collections.abc import Mapping
from typing import Any

#: the largest state file a save writes and a reader accepts
MAX_STATE_BYTES = 256 << 20
#: the deepest nesting of a value a save writes (a reader accepts what the encoding makes of it)
MAX_STATE_DEPTH = 100
#: the longest integer, in decimal digits (Python's own limit for int <-> str conversion)
MAX_INT_DIGITS = 4300
#: the largest bit length an integer of MAX_INT_DIGITS digits can have
_MAX_INT_BITS = math.floor(MAX_INT_DIGITS * math.log2(10))
#: a state file's format
FORMAT = 1
#: nesting of the encoded JSON: a ``$dict`` level is three JSON levels (object, pairs, pair)
_MAX_JSON_DEPTH = 3 * MAX_STATE_DEPTH + 4

_TAGS = ("$float", "$tuple", "$dict", "$counter", "$ordereddict", "$set", "$frozenset", "$bytes")
_NONFINITE = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}


class StateEncodeError(ValueError):
    """A value that cannot be stored: ``where`` is its path inside the entry (``['a'][3]``)."""

    def __init__(self, why: str, where: str = ""):
        super().__init__(why)
        self.why = why
        self.where = where

    def __str__(self) -> str:
        where = self.where if len(self.where) <= 120 else self.where[:117] + "..."
        return f"at {where}: {self.why}" if where else self.why


class StateDecodeError(ValueError):
    """Bytes that are not a state this module wrote (the step that holds them is corrupt)."""


def _key_text(key: Any) -> str:
    return f"[{key!r}]" if isinstance(key, (str, int, float, bool, type(None), bytes, tuple)) else "[<key>]"


def _refuse(value: Any) -> StateEncodeError:
    kind = f"{type(value).__module__}.{type(value).__qualname__}".removeprefix("builtins.")
    if kind.startswith("torch."):
        fix = "tensors belong to the model or an optimizer (DCP saves them); keep numbers here (tensor.item())"
    elif kind.startswith("numpy."):
        fix = "convert it to Python's own kind (value.item() or array.tolist())"
    else:
        fix = (
            "the session stores None, bool, int, float, str, bytes, list, tuple, dict, Counter, OrderedDict, set "
            "and frozenset"
        )
    return StateEncodeError(f"{kind} values cannot be stored: {fix}")


def _pairs(items: Any, depth: int) -> list[list[Any]]:
    out = []
    for key, value in items:
        try:
            out.append([_encode(key, depth + 1), _encode(value, depth + 1)])
        except StateEncodeError as e:
            e.where = _key_text(key) + e.where
            raise
    return out


#: ints inside this range need no digit check (int64's). The loops below check plain scalars
#: inline (a call per value would double the time of a long metrics log).
_SMALL_INT = 1 << 63


def _encode(value: Any, depth: int) -> Any:
    """``value`` as JSON-able data (plain parts returned as they are, not copied)."""
    if value is None or isinstance(value, (str, bool)):
        return value
    if isinstance(value, int):
        if value.bit_length() > _MAX_INT_BITS:
            raise StateEncodeError(f"an int of more than {MAX_INT_DIGITS} digits cannot be stored")
        return value
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        return {"$float": "nan" if math.isnan(value) else "inf" if value > 0 else "-inf"}
    if depth >= MAX_STATE_DEPTH:  # containers only: the levels of nesting are containers in containers
        raise StateEncodeError(f"nested deeper than {MAX_STATE_DEPTH} levels (or a structure that contains itself)")
    if isinstance(value, list):
        out: list[Any] | None = None
        for i, item in enumerate(value):
            kind = type(item)
            if kind is str or kind is bool or item is None or (kind is float and item - item == 0.0):
                got = item  # a plain scalar: exact in JSON as it is
            elif kind is int and -_SMALL_INT < item < _SMALL_INT:
                got = item
            else:
                try:
                    got = _encode(item, depth + 1)
                except StateEncodeError as e:
                    e.where = f"[{i}]{e.where}"
                    raise
            if out is None and got is not item:
                out = list(value[:i])
            if out is not None:
                out.append(got)
        return value if out is None and type(value) is list else (out if out is not None else list(value))
    if isinstance(value, tuple):
        return {"$tuple": _encode(list(value), depth)}
    if isinstance(value, collections.Counter):
        return {"$counter": _pairs(value.items(), depth)}
    if isinstance(value, collections.OrderedDict):
        return {"$ordereddict": _pairs(value.items(), depth)}
    if isinstance(value, Mapping):
        for key in value:
            if type(key) is not str or key[:1] == "$":
                return {"$dict": _pairs(value.items(), depth)}
        copy: dict[str, Any] | None = None
        for key, item in value.items():
            kind = type(item)
            if kind is str or kind is bool or item is None or (kind is float and item - item == 0.0):
                got = item  # a plain scalar: exact in JSON as it is
            elif kind is int and -_SMALL_INT < item < _SMALL_INT:
                got = item
            else:
                try:
                    got = _encode(item, depth + 1)
                except StateEncodeError as e:
                    e.where = f"[{key!r}]{e.where}"
                    raise
            if copy is None and got is not item:
                copy = {}
            if copy is not None:
                copy[key] = got
        if copy is None:
            return value if type(value) is dict else dict(value)
        return {key: copy.get(key, item) for key, item in value.items()}
    if isinstance(value, (set, frozenset)):
        return {"$frozenset" if isinstance(value, frozenset) else "$set": _encode(list(value), depth)}
    if isinstance(value, (bytes, bytearray)):
        return {"$bytes": base64.b64encode(bytes(value)).decode("ascii")}
    raise _refuse(value)


def encode(value: Any) -> str:
    """``value`` as the JSON text of this module's encoding (:class:`StateEncodeError` naming
    where the first thing that cannot be stored is)."""
    try:
        return json.dumps(_encode(value, 0), ensure_ascii=True, allow_nan=False, separators=(",", ":"))
    except StateEncodeError:
        raise
    except ValueError as e:  # Python's own int <-> str limit set lower than MAX_INT_DIGITS
        raise StateEncodeError(str(e)) from e
    except RecursionError as e:  # a plain subtree the walk returned whole is nested past Python's limit
        raise StateEncodeError(f"nested deeper than {MAX_STATE_DEPTH} levels") from e


def check(value: Any) -> None:
    """:class:`StateEncodeError` where :func:`encode` would raise one, without writing the text
    (half the time): whether a state can be stored at all, checked before the work it would hold."""
    try:
        _encode(value, 0)
    except RecursionError as e:
        raise StateEncodeError(f"nested deeper than {MAX_STATE_DEPTH} levels") from e


def file_bytes(entries: Mapping[str, str]) -> bytes:
    """A state file: ``entries`` (name -> :func:`encode` text) and the format."""
    body = ",".join(f"{json.dumps(name, ensure_ascii=True)}:{text}" for name, text in entries.items())
    return f'{{"entries":{{{body}}},"format":{FORMAT}}}'.encode("ascii")


def entries_size_bytes(entries: Mapping[str, str]) -> int:
    """The size of :func:`file_bytes` of ``entries`` (without building it)."""
    overhead = len(file_bytes({}))
    return (
        overhead
        + sum(len(json.dumps(n, ensure_ascii=True)) + 1 + len(t) for n, t in entries.items())
        + max(0, len(entries) - 1)
    )


# -- reading ---------------------------------------------------------------------------------
def _constant(text: str) -> Any:
    raise StateDecodeError(f"{text} is not JSON (non-finite floats are written as {{'$float': ...}})")


def _parse(data: bytes | str, what: str) -> Any:
    if len(data) > MAX_STATE_BYTES:
        raise StateDecodeError(f"{what} is {len(data)} bytes, more than the {MAX_STATE_BYTES} a state may have")
    try:
        # only NaN/Infinity literals call back into Python: a hook per number or object would
        # triple the time of a long metrics log; an int past MAX_INT_DIGITS digits fails in int()
        return json.loads(data, parse_constant=_constant)
    except StateDecodeError:
        raise
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise StateDecodeError(f"{what} is not valid JSON: {str(e)[:200]}") from e


def _decode(node: Any, depth: int) -> Any:
    if depth > _MAX_JSON_DEPTH:
        raise StateDecodeError(f"nested deeper than {MAX_STATE_DEPTH} levels")
    if isinstance(node, list):
        return [_decode(item, depth + 1) for item in node]
    if not isinstance(node, dict):
        return node
    tagged = [k for k in node if k.startswith("$")]
    if not tagged:
        return {key: _decode(item, depth + 1) for key, item in node.items()}
    if len(node) != 1 or tagged[0] not in _TAGS:
        raise StateDecodeError(f"an object with the key {tagged[0][:40]!r} is not of this encoding")
    tag, body = tagged[0], node[tagged[0]]
    if tag == "$float":
        if not isinstance(body, str) or body not in _NONFINITE:
            raise StateDecodeError(f"$float holds {str(body)[:40]!r}, not inf, -inf or nan")
        return _NONFINITE[body]
    if tag == "$bytes":
        try:
            return base64.b64decode(body, validate=True) if isinstance(body, str) else _bad(tag)
        except binascii.Error as e:
            raise StateDecodeError(f"$bytes is not base64: {e}") from e
    if not isinstance(body, list):
        return _bad(tag)
    if tag in ("$tuple", "$set", "$frozenset"):
        items = [_decode(item, depth + 2) for item in body]
        kind = {"$tuple": tuple, "$set": set, "$frozenset": frozenset}[tag]
        try:
            return kind(items)
        except TypeError as e:  # an unhashable member of a set
            raise StateDecodeError(f"{tag}: {e}") from e
    out: dict[Any, Any] = {"$dict": {}, "$counter": collections.Counter(), "$ordereddict": collections.OrderedDict()}[
        tag
    ]
    for pair in body:
        if not isinstance(pair, list) or len(pair) != 2:
            return _bad(tag)
        key = _decode(pair[0], depth + 3)
        try:
            if key in out:
                raise StateDecodeError(f"{tag} repeats the key {key!r}"[:200])
            out[key] = _decode(pair[1], depth + 3)
        except TypeError as e:  # an unhashable key
            raise StateDecodeError(f"{tag}: {e}") from e
    return out


def _bad(tag: str) -> Any:
    raise StateDecodeError(f"{tag} does not hold what this encoding writes there")


def _tagged(data: bytes | str) -> bool:
    """Whether ``data`` may hold a tag (an object key starting with ``$``): without one, what JSON
    parses is the value itself, and the walk that decodes tags is skipped."""
    return b'"$' in data if isinstance(data, bytes) else '"$' in data


def decode(text: bytes | str) -> Any:
    """The value :func:`encode` made ``text`` of (:class:`StateDecodeError` for anything else)."""
    parsed = _parse(text, "a state value")
    return _decode(parsed, 0) if _tagged(text) else parsed


def load_file(data: bytes) -> dict[str, Any]:
    """The entries of a state file (:func:`file_bytes`), decoded: name -> value."""
    obj = _parse(data, "the state file")
    if not isinstance(obj, dict) or set(obj) != {"entries", "format"}:
        raise StateDecodeError("the state file is not an object of 'entries' and 'format'")
    if obj["format"] != FORMAT or isinstance(obj["format"], bool):
        raise StateDecodeError(f"the state file is of format {str(obj['format'])[:20]}, this reader knows {FORMAT}")
    entries = obj["entries"]
    if not isinstance(entries, dict):
        raise StateDecodeError("the state file's 'entries' is not an object")
    if not _tagged(data):
        return entries
    return {name: _decode(node, 1) for name, node in entries.items()}


__all__ = [
    "FORMAT",
    "MAX_INT_DIGITS",
    "MAX_STATE_BYTES",
    "MAX_STATE_DEPTH",
    "StateDecodeError",
    "StateEncodeError",
    "check",
    "decode",
    "encode",
    "entries_size_bytes",
    "file_bytes",
    "load_file",
]
