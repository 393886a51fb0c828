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
#: Files are also digested in blocks of this many bytes (listed in a file beside each: see
#: :class:`ftrain.checkpoint.manifest.FileEntry`), so that a reader can verify the part of a file it
#: needs without reading all of it: a rank of a sharded job reads a few small items of its
#: peers' files (replicated scalars written once), scattered through them.
BLOCK_BYTES = 64 << 10
#: the name of a file's block digests beside it: ``<name>.blocks``
BLOCKS_SUFFIX = ".blocks"


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


class BlockHasher:
    """A file's digest and the digests of its consecutive ``block_bytes`` blocks, fed once."""

    def __init__(self, algorithm: str, block_bytes: int = BLOCK_BYTES):
        if block_bytes < 1:
            raise ValueError(f"block_bytes must be >= 1, got {block_bytes}")
        self._algorithm = algorithm
        self.block_bytes = block_bytes
        self._whole = new_hasher(algorithm)
        self._block = new_hasher(algorithm)
        self._in_block = 0
        self.size_bytes = 0
        self._blocks: list[str] = []

    def update(self, data: bytes | bytearray | memoryview, /) -> None:
        view = memoryview(data).cast("B")
        self._whole.update(view)
        self.size_bytes += view.nbytes
        while view.nbytes:
            take = min(view.nbytes, self.block_bytes - self._in_block)
            self._block.update(view[:take])
            self._in_block += take
            view = view[take:]
            if self._in_block == self.block_bytes:
                self._blocks.append(self._block.hexdigest())
                self._block, self._in_block = new_hasher(self._algorithm), 0

    def hexdigest(self) -> str:
        return self._whole.hexdigest()

    def block_digests(self) -> list[str]:
        """Every block's digest, the last (partial) one included; none for an empty file."""
        return self._blocks + ([self._block.hexdigest()] if self._in_block else [])
