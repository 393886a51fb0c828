"""Reading JSON that another process wrote: etcd records, datagrams, files in shared directories,
event logs, a peer's bytes. One definition, used by every reader of untrusted JSON.

:func:`loads` bounds the input before anything is built: at most ``max_bytes`` bytes, brackets
nested at most :data:`MAX_DEPTH` deep (a deep list would otherwise exhaust the recursion of the
parser, or of whoever prints or walks it later), number literals of at most
:data:`MAX_NUMBER_CHARS` characters (a 400-digit integer is not a time, a count or a step, and
``math.isfinite``/``float`` raise ``OverflowError`` on it), no ``NaN``/``Infinity`` and no
float that overflows to one, and no key repeated in an object (two readers could take different
values).

What must stay true:

- :func:`loads` raises :class:`JsonInputError` (a ``ValueError``) for anything wrong with the
  input, and nothing else; invalid UTF-8 is one of those.
- A decoder of untrusted input turns every exception a *value* can raise (:data:`VALUE_ERRORS`:
  overflow, recursion, wrong types, missing keys, bad text) into its own "bad record" path;
  it never lets one escape to the loop that called it.
- :func:`short` describes a hostile value in an error message in bounded space and never
  raises; :func:`printable` makes decoded text safe to print and encode (a lone surrogate that
  ``"\\udc80"`` decodes to raises ``UnicodeEncodeError`` in every ``print`` and ``.encode()``).
"""

from __future__ import annotations

import functools
import json
import math
import re
import reprlib
from typing import Any

#: Deepest nesting of brackets accepted (every record of ftrain nests a few levels).
MAX_DEPTH = 64
#: Longest number literal accepted: int64 has 19 digits; a float prints in at most 24 characters.
MAX_NUMBER_CHARS = 40
#: What a value can raise in a decoder (``math.isfinite`` of a huge int, a recursion, a wrong
#: type, a missing key, undecodable text): each is a bad record, never a crash.
VALUE_ERRORS: tuple[type[Exception], ...] = (
    ValueError,  # UnicodeError and json.JSONDecodeError among them
    TypeError,
    ArithmeticError,  # OverflowError
    LookupError,  # KeyError, IndexError
    AttributeError,
    RecursionError,
)


class JsonInputError(ValueError):
    """The input is not JSON within the bounds of :func:`loads`."""


def loads(
    data: bytes | str,
    *,
    max_bytes: int,
    what: str = "JSON",
    max_depth: int = MAX_DEPTH,
    max_number_chars: int = MAX_NUMBER_CHARS,
    nonfinite: bool = False,
) -> Any:
    """``json.loads(data)`` within the bounds of the module doc; :class:`JsonInputError` naming
    ``what`` for anything else. ``nonfinite``: ``NaN``, ``Infinity`` and ``-Infinity`` (and a
    float literal that overflows) are read as the floats they name, as Python's ``json`` writes
    them (a metrics line's NaN loss); their readers must expect non-finite numbers."""
    if len(data) > max_bytes:
        raise JsonInputError(f"{what} is {len(data)} bytes, more than the {max_bytes} a reader accepts")
    if nesting_exceeds(data, max_depth):
        raise JsonInputError(f"{what} nests deeper than {max_depth} levels")
    try:
        text = data if isinstance(data, str) else data.decode(json.detect_encoding(data), "surrogatepass")
        return _decoder(max_number_chars, nonfinite).decode(text)
    except _Refused as e:
        raise JsonInputError(f"{what}: {e}{_near(text, e.token)}") from None
    except (ValueError, RecursionError) as e:  # not JSON, not UTF-8 (UnicodeDecodeError is a ValueError)
        raise JsonInputError(f"{what} is not valid JSON: {e}") from e


class _Refused(ValueError):
    """A bound of :func:`loads` was crossed (raised inside the parser's hooks, which see a
    number's text but not where it is: ``token`` is looked up for the message)."""

    def __init__(self, message: str, token: str = ""):
        super().__init__(message)
        self.token = token


def _near(text: str, token: str) -> str:
    """`` (after '"taken_at":')``: what precedes the first ``token`` in ``text``, which names
    the key in all but contrived cases ("" if it is not found)."""
    at = text.find(token) if token else -1
    return f" (after {short(text[max(0, at - 40) : at])})" if at > 0 else ""


@functools.cache
def _decoder(max_number_chars: int, nonfinite: bool) -> json.JSONDecoder:
    """The parser with the number bound (built once: building one per call doubled the cost of
    reading a small record)."""

    def bounded_int(text: str) -> int:  # called for every int: the common case costs one len()
        if len(text) > max_number_chars and len(text.lstrip("-")) > max_number_chars:
            raise _Refused(f"number {text[:20]}... has more than {max_number_chars} digits", text)
        return int(text)

    def bounded_float(text: str) -> float:
        value = float(text) if len(text) <= max_number_chars else math.inf
        if value - value != 0.0 and not nonfinite:  # inf or nan
            raise _Refused(f"number {text[:20]!r} is too long or not finite", text)
        return value

    def no_constant(text: str) -> Any:
        if nonfinite:
            return float(text)  # NaN, Infinity, -Infinity
        raise _Refused(f"holds {text}, which JSON does not allow", text)

    def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        obj = dict(pairs)
        if len(obj) != len(pairs):
            seen: set[str] = set()
            for key, _ in pairs:
                if key in seen:
                    raise _Refused(f"repeats the key {short(key)}")
                seen.add(key)
        return obj

    return json.JSONDecoder(
        parse_int=bounded_int, parse_float=bounded_float, parse_constant=no_constant, object_pairs_hook=unique_keys
    )


_OPENERS = b"[{"
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
#: a JSON string, or an unterminated one to the end of the input: every search from a quote
#: succeeds, so the substitution is linear (a failed match would be retried from each quote inside)
_STRINGS = re.compile(rb'"(?:[^"\\]|\\.)*+(?:"|\\?\Z)', re.DOTALL)


def nesting_exceeds(data: bytes | str, limit: int) -> bool:
    """True if ``data``'s brackets nest deeper than ``limit`` (strings skipped). Linear, no
    recursion; stops at the first bracket past the limit."""
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else bytes(data)
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False
    brackets = _STRINGS.sub(b"", raw).translate(None, _NOT_BRACKETS)
    depth = 0
    for byte in brackets:
        depth += 1 if byte in _OPENERS else -1
        if depth > limit:
            return True
    return False


_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxstring, _SHORT.maxother, _SHORT.maxlong = 2, 60, 60, 40
_SHORT.maxlist = _SHORT.maxdict = _SHORT.maxtuple = _SHORT.maxset = 4


def short(value: Any) -> str:
    """A bounded ``repr`` of ``value`` for an error message (a 10 MB string, a 400-digit number
    or a list nested 900 deep are shown in a few dozen characters); never raises."""
    try:
        return _SHORT.repr(value)[:120]
    except Exception:  # noqa: BLE001 - a description must never fail (an int past str()'s digit limit)
        return f"<{type(value).__name__}>"


#: past this magnitude an int has no float (``float()`` and ``math.isfinite`` raise OverflowError)
_FLOAT_INT_LIMIT = 2**1023


def is_finite_number(value: Any) -> bool:
    """``value`` is an int or float (never a bool) that a finite float holds: a NaN, an infinity
    and a 400-digit integer are not; never raises."""
    if isinstance(value, float):
        return math.isfinite(value)
    return isinstance(value, int) and not isinstance(value, bool) and -_FLOAT_INT_LIMIT < value < _FLOAT_INT_LIMIT


def printable(text: str) -> str:
    """``text`` with every lone surrogate written as its escape (``\\udc80``): safe to print,
    log, encode and write as UTF-8. ASCII text is returned as it is, at no cost."""
    if text.isascii():
        return text
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


__all__ = [
    "MAX_DEPTH",
    "MAX_NUMBER_CHARS",
    "VALUE_ERRORS",
    "JsonInputError",
    "is_finite_number",
    "loads",
    "nesting_exceeds",
    "printable",
    "short",
]
