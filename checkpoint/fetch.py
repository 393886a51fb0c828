"""One read per byte: the files of a step that a rank needs, fetched once each, by concurrent
ranged GETs, and verified whole against the manifest before any byte of them is used.

:func:`fetch_files` asks the storage for each file's size (a missing or resized file is a
problem, nothing is read of it), splits every file into pieces of :data:`RANGE_BYTES`, fetches
them in batches of at most :data:`BATCH_BYTES` (one ``cat_ranges`` call each: fsspec runs up to
:data:`MAX_CONCURRENT_RANGES` of them at once; a batch that fails on a transient error is read
again, not the whole step), hashes each file's pieces in order, and compares size and digest with
the manifest; a file that does not match is read once more (bytes damaged in flight are not
the storage's), and only a second mismatch is a problem. It returns the verified bytes of the
files it was asked to keep, and the problems
(:class:`~checkpoint.verify.Problem`, the same kinds :mod:`checkpoint.verify` reports): a caller
knows that a step is corrupt before it copies a single tensor out of it.

What must stay true: bytes are handed out only for a file whose size and digest both matched;
a storage error that outlives the retries is raised (or, for a fatal one, a problem of kind
``unreadable``), never a problem that would mark the step corrupt.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from fsspec.asyn import AsyncFileSystem

from checkpoint.digest import new_hasher
from checkpoint.errors import FatalStorageError
from checkpoint.manifest import Manifest
from checkpoint.storage import Storage
from checkpoint.verify import Problem

log = logging.getLogger(__name__)

#: bytes per ranged GET
RANGE_BYTES = 16 << 20
#: bytes asked for by one batch of ranged GETs (what a retry re-reads; bounds the pieces in flight)
BATCH_BYTES = 256 << 20
#: ranged GETs in flight at once within a batch
MAX_CONCURRENT_RANGES = 8


@dataclass(slots=True)
class Fetched:
    """What :func:`fetch_files` found."""

    data: dict[str, bytes] = field(default_factory=dict)
    """Verified contents of the files asked to be kept, by name."""
    problems: list[Problem] = field(default_factory=list)
    bytes_read: int = 0
    seconds: float = 0.0


@dataclass(slots=True)
class _Piece:
    name: str
    start: int
    end: int


def _pieces(name: str, size_bytes: int) -> list[_Piece]:
    return [_Piece(name, start, min(size_bytes, start + RANGE_BYTES)) for start in range(0, size_bytes, RANGE_BYTES)]


def _batches(pieces: list[_Piece]) -> Iterable[list[_Piece]]:
    batch: list[_Piece] = []
    size = 0
    for piece in pieces:
        if batch and size + piece.end - piece.start > BATCH_BYTES:
            yield batch
            batch, size = [], 0
        batch.append(piece)
        size += piece.end - piece.start
    if batch:
        yield batch


def fetch_files(storage: Storage, dirname: str, manifest: Manifest, names: Iterable[str], *, keep: set[str]) -> Fetched:
    """Fetch and verify ``names`` of step directory ``dirname`` (every byte once); keep the
    verified contents of those in ``keep`` (the others are only verified)."""
    began = time.monotonic()
    out = Fetched()
    sizes: dict[str, int] = {}
    for name in sorted(set(names)):
        entry = manifest.files.get(name)
        if entry is None:
            out.problems.append(Problem(name, "manifest", "not listed in the manifest"))
            continue
        try:
            size = storage.size_bytes(f"{dirname}/{name}")
        except FileNotFoundError:
            out.problems.append(
                Problem(name, "missing", f"listed in the manifest ({entry.size_bytes} bytes) but not in storage")
            )
            continue
        except (FatalStorageError, IsADirectoryError, PermissionError) as e:
            out.problems.append(Problem(name, "unreadable", str(e)))
            continue
        if size != entry.size_bytes:
            more = "more" if size > entry.size_bytes else str(size)
            out.problems.append(Problem(name, "size", f"expected {entry.size_bytes} bytes, found {more}"))
            continue
        sizes[name] = size

    again = _fetch_and_check(storage, dirname, manifest, sizes, keep, out)
    if again:  # damaged in flight or in storage? A second read tells: only a repeat is a problem
        log.warning("%s: %s did not match the manifest; reading them once more", dirname, ", ".join(sorted(again)))
        retried = _fetch_and_check(storage, dirname, manifest, {n: sizes[n] for n in again}, keep, out)
        out.problems.extend(retried.values())
    out.seconds = time.monotonic() - began
    return out


def _fetch_and_check(
    storage: Storage, dirname: str, manifest: Manifest, sizes: dict[str, int], keep: set[str], out: Fetched
) -> dict[str, Problem]:
    """Fetch the files ``sizes`` names, check each against the manifest, keep the good ones of
    ``keep`` in ``out``; returns the problem of each file that did not match. Pieces arrive in
    file order and are hashed as they come: a file that is only verified is never held whole."""
    hashers = {name: new_hasher(manifest.digest_algorithm) for name in sizes}
    read = dict.fromkeys(sizes, 0)
    kept: dict[str, list[bytes]] = {name: [] for name in sizes if name in keep}
    pieces = [piece for name in sorted(sizes) for piece in _pieces(name, sizes[name])]
    for batch in _batches(pieces):
        for piece, chunk in zip(batch, _read_batch(storage, dirname, batch), strict=True):
            hashers[piece.name].update(chunk)
            read[piece.name] += len(chunk)
            out.bytes_read += len(chunk)
            if piece.name in kept:
                kept[piece.name].append(chunk)
    bad: dict[str, Problem] = {}
    for name in sizes:
        entry, digest = manifest.files[name], hashers[name].hexdigest()
        chunks = kept.pop(name, [])
        if read[name] != entry.size_bytes:  # it shrank between the size query and the read
            bad[name] = Problem(name, "size", f"expected {entry.size_bytes} bytes, read {read[name]}")
        elif digest != entry.digest:
            bad[name] = Problem(
                name, "digest", f"{manifest.digest_algorithm} expected {entry.digest}, computed {digest}"
            )
        elif name in keep:
            out.data[name] = chunks[0] if len(chunks) == 1 else b"".join(chunks)
    return bad


def _read_batch(storage: Storage, dirname: str, batch: list[_Piece]) -> list[bytes]:
    """The bytes of every piece in ``batch``, fetched concurrently; the batch is read again on a
    transient error. A piece that comes back short is returned short (the size check names it)."""
    paths = [storage.path(dirname, piece.name) for piece in batch]
    starts = [piece.start for piece in batch]
    ends = [piece.end for piece in batch]

    fs = storage.fs
    # an async filesystem (s3fs) runs up to batch_size requests at once; the others read in turn
    concurrency = {"batch_size": MAX_CONCURRENT_RANGES} if isinstance(fs, AsyncFileSystem) else {}

    def read() -> list[bytes]:
        return list(fs.cat_ranges(paths, starts, ends, on_error="raise", **concurrency))

    first, last = batch[0], batch[-1]
    return storage.retry(read, f"read {len(batch)} range(s) of {dirname} ({first.name}..{last.name})")


__all__ = ["fetch_files", "Fetched", "RANGE_BYTES", "BATCH_BYTES", "MAX_CONCURRENT_RANGES"]
