"""Read a ``.safetensors`` file as untrusted input: its header alone (names, dtypes, shapes), or
the whole file read once, hashed as it is read, and its tensors taken from those same bytes.

The format: 8 bytes (little-endian u64) giving the header's length, the header (a JSON object
``{name: {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}, "__metadata__": {..}}``),
then the data, each tensor at ``data_offsets`` relative to the data's start. Everything in it is
checked before a tensor is built: the header's length against the file's, every dtype known,
every shape a list of non-negative ints, every span inside the data, as long as its shape and
dtype say, and no two spans overlapping. A file that fails is a :class:`SafetensorsFileError`
naming the file and what is wrong with it.

What must stay true: the sha256 :func:`read_file` returns is of exactly the bytes its tensors
were built from (one read; a file changed afterwards changes neither), so a logged digest names
the weights that were loaded.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

#: the format's dtype names -> torch's
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U64": torch.uint64,
    "U32": torch.uint32,
    "U16": torch.uint16,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
#: the reference implementation refuses headers longer than this
MAX_HEADER_BYTES = 100_000_000
METADATA_KEY = "__metadata__"


class SafetensorsFileError(ValueError):
    """A file that is not a well-formed safetensors file (damaged, truncated, or something else)."""


@dataclass(frozen=True, slots=True)
class Entry:
    """One tensor as the header describes it."""

    dtype: str  #: the format's name (``F32``, ``BF16``, ``I8``, ...)
    shape: tuple[int, ...]
    begin: int  #: offset of its first byte in the data section
    end: int

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


@dataclass(frozen=True, slots=True)
class Loaded:
    """A whole file, read once: its tensors (views of the bytes read) and the sha256 of those bytes."""

    tensors: dict[str, torch.Tensor]
    entries: dict[str, Entry]
    sha256: str
    size_bytes: int


def _fail(path: Path, why: str) -> SafetensorsFileError:
    return SafetensorsFileError(f"{str(path)!r} is not a valid safetensors file: {why}")


def _header_length(path: Path, prefix: bytes, size_bytes: int) -> int:
    if len(prefix) < 8:
        raise _fail(path, f"it is {size_bytes} bytes long, shorter than the 8-byte header length")
    (length,) = struct.unpack("<Q", prefix[:8])
    if length > MAX_HEADER_BYTES or 8 + length > size_bytes:
        raise _fail(path, f"its header claims {length} bytes but the file holds {size_bytes} (truncated?)")
    return length


def parse_header(path: Path, header: bytes, data_bytes: int) -> dict[str, Entry]:
    """The entries of a header (the JSON after the length), checked against a data section of
    ``data_bytes``; :class:`SafetensorsFileError` naming ``path`` and the first problem."""
    try:
        obj = json.loads(header.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise _fail(path, f"its header is not JSON ({type(e).__name__}: {str(e)[:200]})") from None
    if not isinstance(obj, dict):
        raise _fail(path, f"its header is a JSON {type(obj).__name__}, not an object")
    entries: dict[str, Entry] = {}
    for name, spec in obj.items():
        if name == METADATA_KEY:
            continue
        entries[name] = _entry(path, name, spec, data_bytes)
    spans = sorted((e.begin, e.end, n) for n, e in entries.items() if e.end > e.begin)
    for (_, end_a, a), (begin_b, _, b) in zip(spans, spans[1:], strict=False):
        if begin_b < end_a:
            raise _fail(path, f"the bytes of {a!r} and {b!r} overlap")
    return entries


def _entry(path: Path, name: str, spec: object, data_bytes: int) -> Entry:
    where = f"tensor {name[:200]!r}"
    if not isinstance(spec, dict):
        raise _fail(path, f"{where} is described by a {type(spec).__name__}, not an object")
    dtype, shape, offsets = spec.get("dtype"), spec.get("shape"), spec.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise _fail(path, f"{where} has dtype {str(dtype)[:40]!r}, not one of {', '.join(DTYPES)}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise _fail(path, f"{where} has shape {str(shape)[:80]}, not a list of non-negative integers")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1] <= data_bytes
    ):
        raise _fail(path, f"{where} has data_offsets {str(offsets)[:80]} outside the {data_bytes} bytes of data")
    expected = math.prod(shape) * DTYPES[dtype].itemsize
    if offsets[1] - offsets[0] != expected:
        raise _fail(
            path, f"{where} spans {offsets[1] - offsets[0]} bytes but {dtype} {shape} needs {expected} (damaged?)"
        )
    return Entry(dtype, tuple(shape), offsets[0], offsets[1])


def read_header(path: Path) -> dict[str, Entry]:
    """The tensors ``path`` holds (names, dtypes, shapes), from its header alone."""
    with path.open("rb") as f:
        size_bytes = f.seek(0, 2)
        f.seek(0)
        length = _header_length(path, f.read(8), size_bytes)
        header = f.read(length)
    if len(header) != length:
        raise _fail(path, "it ended inside its header (truncated, or changed while it was read)")
    return parse_header(path, header, size_bytes - 8 - length)


def read_rows(path: Path, entry: Entry, first: int, count: int) -> torch.Tensor:
    """Rows ``first .. first + count - 1`` (along dim 0) of the tensor ``entry`` describes in
    ``path``, read alone; a 0-dim tensor is read whole (``first`` 0, ``count`` 1)."""
    if sys.byteorder != "little":
        raise SafetensorsFileError("safetensors files are little-endian; this host is not")
    rows = entry.shape[0] if entry.shape else 1
    if not 0 <= first <= first + count <= rows:
        raise ValueError(f"rows {first}..{first + count} of a tensor of {rows}")
    row_bytes = (entry.end - entry.begin) // max(rows, 1)
    with path.open("rb") as f:
        size_bytes = f.seek(0, 2)
        f.seek(0)
        start = 8 + _header_length(path, f.read(8), size_bytes)
        f.seek(start + entry.begin + first * row_bytes)
        data = bytearray(count * row_bytes)
        if f.readinto(data) != len(data):
            raise _fail(path, "it ended inside a tensor's data (truncated, or changed while it was read)")
    shape = (count, *entry.shape[1:]) if entry.shape else ()
    if not data:
        return torch.empty(shape, dtype=entry.torch_dtype)
    return torch.frombuffer(data, dtype=entry.torch_dtype).view(shape)


def read_file(path: Path) -> Loaded:
    """All of ``path``, read once and hashed (sha256) as read; its tensors are views of those bytes."""
    if sys.byteorder != "little":
        raise SafetensorsFileError("safetensors files are little-endian; this host is not")
    digest = hashlib.sha256()
    with path.open("rb") as f:
        size_bytes = f.seek(0, 2)
        f.seek(0)
        data = bytearray(size_bytes)
        view = memoryview(data)
        got = 0
        while got < size_bytes:
            n = f.readinto(view[got : got + (64 << 20)])
            if not n:
                raise _fail(path, f"it shrank to {got} bytes while it was read (changed by another process?)")
            digest.update(view[got : got + n])
            got += n
        if f.read(1):
            raise _fail(path, f"it grew past {size_bytes} bytes while it was read (changed by another process?)")
    length = _header_length(path, bytes(view[:8]), size_bytes)
    start = 8 + length
    entries = parse_header(path, bytes(view[8:start]), size_bytes - start)
    tensors: dict[str, torch.Tensor] = {}
    for name, e in entries.items():
        if e.end == e.begin:
            tensors[name] = torch.empty(e.shape, dtype=e.torch_dtype)
        else:
            flat = torch.frombuffer(data, dtype=e.torch_dtype, count=math.prod(e.shape), offset=start + e.begin)
            tensors[name] = flat.view(e.shape)
    return Loaded(tensors, entries, digest.hexdigest(), size_bytes)
