"""File digests for checkpoint files: xxh3-128 (default) or CRC32C, streamed.

Digests are lower-case hex strings; the algorithm name is recorded in the manifest so a reader
always knows how to recompute them. Writers feed bytes as they stream out (no second read).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import xxhash

ALGORITHMS = ("xxh3_128", "crc32c")
DEFAULT_ALGORITHM = "xxh3_128"


class Hasher(Protocol):
    """The part of the hashlib interface checkpoint code uses."""

    def update(self, data: bytes | bytearray | memoryview, /) -> None: ...

    def hexdigest(self) -> str: ...


class _Crc32cHasher:
    """CRC32C as 8 hex digits (big-endian), like ``google-crc32c`` and S3's checksum value."""

    __slots__ = ("_crc", "_value")

    def __init__(self) -> None:
        try:
            import crc32c  # the PyPI package: hardware CRC32C with a software fallback
        except ImportError as e:
            raise ValueError(
                "checkpoint.digest: digest algorithm 'crc32c' needs the 'crc32c' package (pip install crc32c)"
            ) from e
        self._crc = crc32c.crc32c
        self._value = 0

    def update(self, data: bytes | bytearray | memoryview, /) -> None:
        self._value = self._crc(data, self._value)

    def hexdigest(self) -> str:
        return f"{self._value:08x}"


def new_hasher(algorithm: str) -> Hasher:
    """A fresh incremental hasher for ``algorithm`` (one of :data:`ALGORITHMS`)."""
    if algorithm == "xxh3_128":
        return xxhash.xxh3_128()
    if algorithm == "crc32c":
        return _Crc32cHasher()
    raise ValueError(
        f"checkpoint.digest: unknown digest algorithm {algorithm!r}; choose one of {', '.join(ALGORITHMS)}"
    )


def digest_bytes(data: bytes | bytearray | memoryview, algorithm: str) -> str:
    """Hex digest of ``data``."""
    hasher = new_hasher(algorithm)
    hasher.update(data)
    return hasher.hexdigest()


def digest_stream(chunks: Iterable[bytes], algorithm: str) -> tuple[int, str]:
    """``(size_bytes, hex digest)`` of the concatenation of ``chunks``."""
    hasher = new_hasher(algorithm)
    size_bytes = 0
    for chunk in chunks:
        hasher.update(chunk)
        size_bytes += len(chunk)
    return size_bytes, hasher.hexdigest()
