"""One read per byte: the parts of a step's files that a rank needs, fetched once each, by
concurrent ranged GETs, and verified against the manifest before any byte of them is used.

A manifest lists, for every file, its digest, and for a large one the file beside it that lists
the digest of each of its blocks (:data:`ftrain.checkpoint.digest.BLOCK_BYTES`). A rank asks for byte
ranges (what its DCP load plan reads); :func:`fetch_files` reads the block listings it needs
(verified whole), then the blocks that cover the ranges — whole files where a manifest lists no
blocks — adjacent blocks coalesced into GETs of up to :data:`RANGE_BYTES`, in batches of at most
:data:`BATCH_BYTES` (one ``cat_ranges`` call each: fsspec runs up to
:data:`MAX_CONCURRENT_RANGES` of them at once; a batch that fails on a transient error is read
again, not the whole step), and checks every block. A block that does
not match is read once more (bytes damaged in flight are not the storage's); only a second
mismatch is a problem. Before anything is read, each file's size is checked (a missing or
resized file is a problem, and nothing is read of it).

It returns the problems (:class:`~ftrain.checkpoint.problems.Problem`, the kinds :mod:`ftrain.checkpoint.verify`
reports), and for the files asked to be kept a :class:`SparseFile`: the verified blocks, read
like a file (DCP reads from it; touching a byte of a block that was not fetched raises). A caller
knows that a step is corrupt before it copies a single tensor out of it.

With a local cache (:mod:`ftrain.checkpoint.local_cache`), a file cached at its listed size is read
from there instead, block by block, checked the same way; a cached block that does not match
drops the cached file and is read from storage (a cache mismatch is never a problem of the
step). Storage is not asked about a file the cache serves.

What must stay true: bytes are handed out only from blocks whose digest matched, in files whose
size matched; a storage error that outlives the retries is raised (a fatal one: a problem of kind
``unreadable``), never a problem that would mark the step corrupt.
"""

from __future__ import annotations

import io
import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from fsspec.asyn import AsyncFileSystem

from ftrain.checkpoint.digest import new_hasher
from ftrain.checkpoint.errors import ChecksumMismatchError, FatalStorageError, ManifestError
from ftrain.checkpoint.local_cache import StepCache
from ftrain.checkpoint.manifest import FileEntry, Manifest, parse_json_bounded
from ftrain.checkpoint.problems import Problem
from ftrain.checkpoint.storage import Storage

log = logging.getLogger(__name__)

#: bytes asked for by one ranged GET at most (adjacent blocks are coalesced up to this)
RANGE_BYTES = 16 << 20
#: bytes asked for by one batch of ranged GETs (what a retry re-reads; bounds the bytes in flight)
BATCH_BYTES = 256 << 20
#: ranged GETs in flight at once within a batch
MAX_CONCURRENT_RANGES = 8

#: what a rank wants of one file: byte ranges ``(start, end)``, or None for all of it
Wanted = list[tuple[int, int]] | None


def blocks_of(entry: FileEntry) -> int:
    """How many verifiable pieces ``entry`` has: its blocks, or one (the whole file)."""
    if entry.block_bytes:
        return -(-entry.size_bytes // entry.block_bytes)
    return 1 if entry.size_bytes else 0


def piece_span(entry: FileEntry, index: int) -> tuple[int, int]:
    """Byte range of verifiable piece ``index`` of ``entry`` (a block, or the whole file)."""
    return entry.block_span(index) if entry.block_bytes else (0, entry.size_bytes)


def pieces_for(entry: FileEntry, wanted: Wanted) -> list[int]:
    """The pieces of ``entry`` that cover ``wanted``, ascending."""
    count = blocks_of(entry)
    if wanted is None or not entry.block_bytes:
        return list(range(count)) if wanted is None or any(e > s for s, e in wanted) else []
    out: set[int] = set()
    for start, end in wanted:
        if end > start:
            out.update(range(start // entry.block_bytes, min(count, -(-end // entry.block_bytes))))
    return sorted(out)


class SparseFile:
    """The verified pieces of one file, read like a (read-only, seekable) file."""

    def __init__(self, name: str, entry: FileEntry, pieces: dict[int, bytes | memoryview]):
        self.name = name
        self.entry = entry
        self.pieces = pieces

    def open(self) -> io.RawIOBase:
        return _SparseReader(self)

    def whole(self) -> bytes:
        """All of it (every piece must be present)."""
        with self.open() as fh:
            return fh.read()


class _SparseReader(io.RawIOBase):
    def __init__(self, sparse: SparseFile):
        super().__init__()
        self._f = sparse
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._f.entry.size_bytes}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer: bytearray | memoryview) -> int:  # type: ignore[override]
        out = memoryview(buffer).cast("B")
        entry, done = self._f.entry, 0
        while done < out.nbytes and self._pos < entry.size_bytes:
            index = self._pos // entry.block_bytes if entry.block_bytes else 0
            piece = self._f.pieces.get(index)
            if piece is None:
                raise ChecksumMismatchError(
                    f"{self._f.name}: bytes at {self._pos} were not fetched and verified (block {index}); refusing them"
                )
            start, _ = piece_span(entry, index)
            at = self._pos - start
            take = min(out.nbytes - done, len(piece) - at)
            out[done : done + take] = memoryview(piece)[at : at + take]
            done += take
            self._pos += take
        return done


@dataclass(slots=True)
class Fetched:
    """What :func:`fetch_files` found."""

    data: dict[str, SparseFile] = field(default_factory=dict)
    """The verified parts of the files asked to be kept, by name."""
    problems: list[Problem] = field(default_factory=list)
    bytes_read: int = 0
    """From storage and the local cache together."""
    bytes_cached: int = 0
    """Of ``bytes_read``, those read from the local cache."""
    seconds: float = 0.0


@dataclass(frozen=True, slots=True)
class _Piece:
    """One ranged GET: consecutive pieces ``first .. first+count-1`` of file ``name``."""

    name: str
    first: int
    count: int
    start: int
    end: int


def _ranges(name: str, entry: FileEntry, indices: list[int]) -> list[_Piece]:
    """``indices`` of ``entry`` as GETs: runs of adjacent pieces, each at most RANGE_BYTES."""
    out: list[_Piece] = []
    for i in indices:
        start, end = piece_span(entry, i)
        last = out[-1] if out else None
        if last is not None and last.first + last.count == i and end - last.start <= RANGE_BYTES:
            out[-1] = _Piece(name, last.first, last.count + 1, last.start, end)
        else:
            out.append(_Piece(name, i, 1, start, end))
    return out


def fetch_files(
    storage: Storage,
    dirname: str,
    manifest: Manifest,
    wanted: Mapping[str, Wanted],
    *,
    keep: Iterable[str] = (),
    cache: StepCache | None = None,
) -> Fetched:
    """Fetch and verify what ``wanted`` names of step directory ``dirname`` (every byte once);
    keep the verified parts of the files in ``keep`` (the others are only verified). ``cache``:
    this step's local cache, read first."""
    began = time.monotonic()
    keep = set(keep)
    out = Fetched()
    cached = _cached(cache, manifest, wanted)
    sound = [name for name in sorted(wanted) if name in cached or _size_ok(storage, dirname, manifest, name, out)]
    listings = _block_listings(storage, dirname, manifest, sound, out, cache)
    indices: dict[str, list[int]] = {}
    for name in sound:
        entry = manifest.files[name]
        if entry.block_bytes and name not in listings:
            continue  # its listing is missing or bad: a problem already
        if name in keep:
            out.data[name] = SparseFile(name, entry, {})
        indices[name] = pieces_for(entry, wanted[name])
    source = _Source(storage, dirname, cache, cached)
    bad = _fetch_and_check(source, manifest, listings, indices, out)
    from_cache = {name for name, _ in bad if name in cached}
    if from_cache and cache is not None:  # the cache's copy is wrong: storage has the say
        log.warning("%s: the local cache's copy of %s did not match; reading storage", dirname, sorted(from_cache))
        for name in from_cache:
            cache.discard(name)
        source = _Source(storage, dirname, None, set())
        again = _pieces_by_file(k for k in bad if k[0] in from_cache)
        bad = {k: p for k, p in bad.items() if k[0] not in from_cache}
        bad.update(_fetch_and_check(source, manifest, listings, again, out))
    if bad:  # damaged in flight or in storage? A second read tells: only a repeat is a problem
        log.warning("%s: %d block(s) did not match the manifest; reading them once more", dirname, len(bad))
        for (name, _), problem in _fetch_and_check(source, manifest, listings, _pieces_by_file(bad), out).items():
            out.problems.append(problem)
            out.data.pop(name, None)
    out.seconds = time.monotonic() - began
    return out


def verification_share(
    manifest: Manifest,
    everyone: list[dict[str, list[int]]],
    rank: int,
    world: int,
    merge: dict[str, list[tuple[int, int]]],
    skip: Iterable[str] = (),
) -> dict[str, list[tuple[int, int]]]:
    """The byte ranges ``rank`` verifies of the blocks that no rank's load reads (``everyone``:
    by rank, the blocks each reads), merged with the ranges it reads itself (``merge``): every
    block of every data file is then verified by some rank, the unread ones split by size
    (largest first, each to the rank with the fewest bytes so far). A file's block listing is
    verified by whoever reads a block of it; the files in ``skip`` are read apart."""
    skip = set(skip)
    read = {(name, i) for pieces in everyone for name, indices in pieces.items() for i in indices}
    listings = {e.blocks_file for e in manifest.files.values() if e.block_bytes}  # read with their file's blocks
    unread = [
        (name, i)
        for name, entry in manifest.files.items()
        if name not in skip and name not in listings
        for i in range(blocks_of(entry))
        if (name, i) not in read
    ]
    loads = [0] * world
    out: dict[str, list[tuple[int, int]]] = {}
    for name, i in sorted(unread, key=lambda p: (-_span_bytes(manifest, p), p)):
        target = min(range(world), key=lambda r: (loads[r], r))
        loads[target] += _span_bytes(manifest, (name, i)) + 1
        if target == rank:
            out.setdefault(name, list(merge.get(name, []))).append(piece_span(manifest.files[name], i))
    return out


def _span_bytes(manifest: Manifest, piece: tuple[str, int]) -> int:
    start, end = piece_span(manifest.files[piece[0]], piece[1])
    return end - start


def _pieces_by_file(keys: Iterable[tuple[str, int]]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for name, i in keys:
        out.setdefault(name, []).append(i)
    return out


def _cached(cache: StepCache | None, manifest: Manifest, wanted: Iterable[str]) -> set[str]:
    """The files of ``wanted`` that ``cache`` holds at their listed sizes."""
    if cache is None:
        return set()
    return {n for n in wanted if n in manifest.files and cache.size_bytes(n) == manifest.files[n].size_bytes}


@dataclass(frozen=True, slots=True)
class _Source:
    """Where pieces are read from: the cached files from the cache, the rest from storage."""

    storage: Storage
    dirname: str
    cache: StepCache | None
    cached: set[str]


def _size_ok(storage: Storage, dirname: str, manifest: Manifest, name: str, out: Fetched) -> bool:
    """Whether ``name`` is listed and has its listed size in storage (else a problem in ``out``)."""
    entry = manifest.files.get(name)
    if entry is None:
        out.problems.append(Problem(name, "manifest", "not listed in the manifest"))
        return False
    try:
        size = storage.size_bytes(f"{dirname}/{name}")
    except FileNotFoundError:
        out.problems.append(
            Problem(name, "missing", f"listed in the manifest ({entry.size_bytes} bytes) but not in storage")
        )
        return False
    except (FatalStorageError, IsADirectoryError, PermissionError) as e:
        out.problems.append(Problem(name, "unreadable", str(e)))
        return False
    if size != entry.size_bytes:
        more = "more" if size > entry.size_bytes else str(size)
        out.problems.append(Problem(name, "size", f"expected {entry.size_bytes} bytes, found {more}"))
        return False
    return True


def _block_listings(
    storage: Storage, dirname: str, manifest: Manifest, names: list[str], out: Fetched, cache: StepCache | None
) -> dict[str, list[str]]:
    """The block digests of each of ``names`` that has them (its listing fetched and verified
    whole, then parsed with bounds); a listing that is missing, damaged or malformed is a problem."""
    files = {manifest.files[n].blocks_file: n for n in names if manifest.files[n].block_bytes}
    if not files:
        return {}
    listed = fetch_files(storage, dirname, manifest, dict.fromkeys(files), keep=files, cache=cache)
    out.problems += listed.problems
    out.bytes_read += listed.bytes_read
    out.bytes_cached += listed.bytes_cached
    listings = {}
    for listing_name, data_name in files.items():
        if listing_name not in listed.data:
            continue
        entry = manifest.files[data_name]
        try:
            digests = parse_json_bounded(listed.data[listing_name].whole(), listing_name)
        except ManifestError as e:
            out.problems.append(Problem(listing_name, "manifest", str(e)))
            continue
        if (
            not isinstance(digests, list)
            or len(digests) != blocks_of(entry)
            or not all(isinstance(d, str) for d in digests)
        ):
            detail = f"does not list {blocks_of(entry)} block digests for {data_name}"
            out.problems.append(Problem(listing_name, "manifest", detail))
            continue
        listings[data_name] = digests
    return listings


def _fetch_and_check(
    source: _Source,
    manifest: Manifest,
    listings: dict[str, list[str]],
    indices: dict[str, list[int]],
    out: Fetched,
) -> dict[tuple[str, int], Problem]:
    """Fetch the pieces ``indices`` names, check each against its digest, keep the good ones of
    kept files in ``out``; returns each piece that did not match, with its problem."""
    bad: dict[tuple[str, int], Problem] = {}
    gets = [g for name in sorted(indices) for g in _ranges(name, manifest.files[name], indices[name])]
    for batch in _batches(gets):
        for get, (data, from_cache) in zip(batch, _read_batch(source, batch), strict=True):
            out.bytes_read += len(data)
            out.bytes_cached += len(data) if from_cache else 0
            entry = manifest.files[get.name]
            view = memoryview(data)
            for i in range(get.first, get.first + get.count):
                start, end = piece_span(entry, i)
                chunk = view[start - get.start : end - get.start]
                expected = listings[get.name][i] if entry.block_bytes else entry.digest
                hasher = new_hasher(manifest.digest_algorithm)
                hasher.update(chunk)
                digest = hasher.hexdigest()
                where = f"block {i} (bytes {start}..{end})" if entry.block_bytes else "the file"
                if len(chunk) != end - start:  # it shrank between the size query and the read
                    bad[(get.name, i)] = Problem(get.name, "size", f"{where}: read {len(chunk)} bytes")
                elif digest != expected:
                    detail = f"{where}: {manifest.digest_algorithm} expected {expected}, computed {digest}"
                    bad[(get.name, i)] = Problem(get.name, "digest", detail)
                elif get.name in out.data:
                    out.data[get.name].pieces[i] = chunk
    return bad


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


def _read_batch(source: _Source, batch: list[_Piece]) -> list[tuple[bytes, bool]]:
    """The bytes of every piece in ``batch``, and whether they came from the cache: the cached
    ones from there, the others fetched concurrently from storage (the batch is read again on a
    transient error). A piece that comes back short is returned short (the size check names it)."""
    got: dict[int, tuple[bytes, bool]] = {}
    remote = [(i, piece) for i, piece in enumerate(batch) if piece.name not in source.cached]
    for i, piece in enumerate(batch):
        if piece.name in source.cached and source.cache is not None:
            try:
                got[i] = source.cache.read_range(piece.name, piece.start, piece.end), True
            except OSError:  # gone since it was found: read storage instead
                remote.append((i, piece))
    if remote:
        for (i, _), data in zip(remote, _read_remote(source, [p for _, p in remote]), strict=True):
            got[i] = data, False
    return [got[i] for i in range(len(batch))]


def _read_remote(source: _Source, batch: list[_Piece]) -> list[bytes]:
    storage, dirname = source.storage, source.dirname
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


__all__ = [
    "fetch_files",
    "verification_share",
    "Fetched",
    "SparseFile",
    "Wanted",
    "blocks_of",
    "piece_span",
    "pieces_for",
    "RANGE_BYTES",
    "BATCH_BYTES",
    "MAX_CONCURRENT_RANGES",
]
