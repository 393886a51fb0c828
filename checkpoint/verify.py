"""Verification of a step directory against its manifest, and the ``corrupt.json`` marker.

Every file is streamed through the manifest's digest algorithm and its size and digest compared
with the manifest. Ranks can split the work with :func:`split_files`. A failed verification is
recorded by :func:`mark_corrupt`, which writes a marker beside the manifest and never deletes
anything: the bytes stay as evidence until retention removes them.

Only problems of the kinds in :data:`CORRUPTION_KINDS` prove a step corrupt. ``unreadable``
(permission denied, not a file) does not; transient storage errors that outlive the retries are
raised, never turned into problems: an unreachable bucket says nothing about the checkpoint.
Only a verified bad byte may mark a step corrupt: every check reads first, outside the ``try``
that judges the bytes.

:func:`check_pickled_items` checks exactly what a load would unpickle (``.metadata`` and every
non-tensor item of every shard) with the same restricted loaders the load uses, so a step that
verifies here also loads, and one that would run code on load never verifies.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from ftrain.checkpoint.catalog import read_manifest
from ftrain.checkpoint.digest import new_hasher
from ftrain.checkpoint.errors import FatalStorageError, ManifestError, UnsafePickleError
from ftrain.checkpoint.manifest import CORRUPT_NAME, MANIFEST_NAME, Manifest, parse_step_dir
from ftrain.checkpoint.problems import CORRUPTION_KINDS, Problem
from ftrain.checkpoint.storage import Storage

METADATA_NAME = ".metadata"
log = logging.getLogger(__name__)


@dataclass(slots=True)
class VerifyReport:
    """The outcome of :func:`verify_step`."""

    step: int
    ok: bool
    problems: list[Problem]
    dirname: str = ""
    manifest: Manifest | None = None
    """The manifest that was verified against, when it parsed."""
    files_checked: int = 0
    bytes_checked: int = 0

    @property
    def corrupt(self) -> bool:
        """True when some problem proves corruption (not merely an unreadable file)."""
        return any(p.kind in CORRUPTION_KINDS for p in self.problems)


@dataclass(slots=True)
class _Tally:
    files: int = 0
    size_bytes: int = 0
    problems: list[Problem] = field(default_factory=list)


def _check_file(
    storage: Storage, rel: str, algorithm: str, chunk_bytes: int, max_bytes: int | None = None
) -> tuple[int, str]:
    """Stream ``rel`` through a hasher, retrying the whole read on transient errors; stops once
    more than ``max_bytes`` arrived (the size is then wrong anyway, and a file grown huge is not
    read to its end)."""

    def read() -> tuple[int, str]:
        hasher = new_hasher(algorithm)
        size_bytes = 0
        for chunk in storage.iter_chunks(rel, chunk_bytes):
            hasher.update(chunk)
            size_bytes += len(chunk)
            if max_bytes is not None and size_bytes > max_bytes:
                break
        return size_bytes, hasher.hexdigest()

    return storage.retry(read, f"verify {rel}")


def _verify(
    storage: Storage, dirname: str, manifest: Manifest, names: Iterable[str] | None, chunk_bytes: int
) -> _Tally:
    tally = _Tally()
    for name in sorted(manifest.files) if names is None else list(names):
        entry = manifest.files.get(name)
        if entry is None:
            tally.problems.append(Problem(name, "manifest", "not listed in the manifest"))
            continue
        try:
            size_bytes, digest = _check_file(
                storage, f"{dirname}/{name}", manifest.digest_algorithm, chunk_bytes, entry.size_bytes
            )
        except FileNotFoundError:
            tally.problems.append(
                Problem(name, "missing", f"listed in the manifest ({entry.size_bytes} bytes) but not in storage")
            )
            continue
        except (FatalStorageError, IsADirectoryError, PermissionError) as e:
            tally.problems.append(Problem(name, "unreadable", str(e)))
            continue
        tally.files += 1
        tally.size_bytes += size_bytes
        if size_bytes > entry.size_bytes:
            tally.problems.append(Problem(name, "size", f"expected {entry.size_bytes} bytes, found more"))
        elif size_bytes != entry.size_bytes:
            tally.problems.append(Problem(name, "size", f"expected {entry.size_bytes} bytes, found {size_bytes}"))
        elif digest != entry.digest:
            tally.problems.append(
                Problem(name, "digest", f"{manifest.digest_algorithm} expected {entry.digest}, computed {digest}")
            )
    return tally


def verify_files(
    storage: Storage,
    dirname: str,
    manifest: Manifest,
    names: Iterable[str] | None = None,
    *,
    chunk_bytes: int = 8 << 20,
) -> list[Problem]:
    """Problems with the files of ``dirname`` (all in the manifest, or just ``names``)."""
    return _verify(storage, dirname, manifest, names, chunk_bytes).problems


def split_files(manifest: Manifest, rank: int, world_size: int, names: Iterable[str] | None = None) -> list[str]:
    """The files ``rank`` of ``world_size`` verifies: every file (of ``names``, default all the
    manifest's) goes to exactly one rank.

    Deterministic greedy balancing by size: files largest first (ties by name), each to the rank
    with the fewest bytes so far (ties to the lowest rank). Returned sorted by name.
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"split_files: need 0 <= rank < world_size, got rank={rank} world_size={world_size}")
    wanted = set(manifest.files) if names is None else set(names)
    loads = [0] * world_size
    mine: list[str] = []
    chosen = ((n, e) for n, e in manifest.files.items() if n in wanted)
    for name, entry in sorted(chosen, key=lambda kv: (-kv[1].size_bytes, kv[0])):
        # +1 per file so zero-byte files spread out too
        target = min(range(world_size), key=lambda r: (loads[r], r))
        loads[target] += entry.size_bytes + 1
        if target == rank:
            mine.append(name)
    return sorted(mine)


def verify_step(
    storage: Storage, dirname: str, hmac_key: bytes | None = None, *, job: str | None = None, chunk_bytes: int = 8 << 20
) -> VerifyReport:
    """Verify the manifest of ``dirname`` (written by job ``job`` unless it is None), then every
    file it lists, then (when the bytes are what the manifest says) everything a load would
    unpickle (:func:`check_pickled_items`)."""
    step = parse_step_dir(dirname)
    if step is None:
        raise ValueError(f"{dirname!r} is not a step directory name")
    try:
        manifest = read_manifest(storage, dirname, hmac_key, job=job)
    except FileNotFoundError:
        return VerifyReport(step, False, [Problem(MANIFEST_NAME, "missing", "step is not committed")], dirname)
    except ManifestError as e:
        return VerifyReport(step, False, [Problem(MANIFEST_NAME, "manifest", str(e))], dirname)
    tally = _verify(storage, dirname, manifest, None, chunk_bytes)
    if not tally.problems:
        tally.problems.extend(check_pickled_items(storage, dirname, manifest))
    return VerifyReport(step, not tally.problems, tally.problems, dirname, manifest, tally.files, tally.size_bytes)


def _read_metadata(storage: Storage, dirname: str, manifest: Manifest | None) -> bytes:
    """``.metadata``'s bytes; with a manifest, at most its recorded size + 1 (a file grown since
    is refused by the digest check, not read whole)."""
    rel = f"{dirname}/{METADATA_NAME}"
    entry = manifest.files.get(METADATA_NAME) if manifest is not None else None
    if entry is None:
        return storage.read_bytes(rel)

    def read() -> bytes:
        parts, size_bytes = [], 0
        for chunk in storage.iter_chunks(rel, min(entry.size_bytes + 1, 8 << 20)):
            parts.append(chunk)
            size_bytes += len(chunk)
            if size_bytes > entry.size_bytes:
                break
        return b"".join(parts)

    return storage.retry(read, f"read {rel}")


def _digest_problem(data: bytes, manifest: Manifest | None) -> Problem | None:
    """A size/digest problem when ``data`` is not the ``.metadata`` the manifest lists."""
    if manifest is None:
        return None
    entry = manifest.files.get(METADATA_NAME)
    if entry is None:
        return Problem(METADATA_NAME, "manifest", "not listed in the manifest")
    if len(data) != entry.size_bytes:
        return Problem(
            METADATA_NAME,
            "size",
            f"expected {entry.size_bytes} bytes, found {'more' if len(data) > entry.size_bytes else len(data)}",
        )
    hasher = new_hasher(manifest.digest_algorithm)
    hasher.update(data)
    if hasher.hexdigest() != entry.digest:
        return Problem(
            METADATA_NAME,
            "digest",
            f"{manifest.digest_algorithm} expected {entry.digest}, computed {hasher.hexdigest()}",
        )
    return None


def _parse_metadata(storage: Storage, dirname: str, manifest: Manifest | None = None) -> tuple[Any, list[Problem]]:
    """``(metadata, [])`` or ``(None, problems)``: ``.metadata`` (checked against ``manifest``
    when given: the very bytes parsed are the ones digested) parsed with the allow-list
    unpickler, never plain pickle. Only the bytes decide: the read happens outside the parse's
    ``try``, so a storage error propagates instead of becoming a corruption kind."""
    from ftrain.checkpoint.dcp_read import load_metadata  # torch: only when it is needed

    try:
        data = _read_metadata(storage, dirname, manifest)
    except FileNotFoundError:
        return None, [Problem(METADATA_NAME, "missing", "no .metadata")]
    except (FatalStorageError, IsADirectoryError, PermissionError) as e:
        return None, [Problem(METADATA_NAME, "unreadable", str(e))]
    wrong = _digest_problem(data, manifest)
    if wrong is not None:
        return None, [wrong]
    try:
        return load_metadata(data), []
    except MemoryError:
        raise
    except UnsafePickleError as e:
        return None, [Problem(METADATA_NAME, "unsafe", str(e))]
    except Exception as e:  # noqa: BLE001 - in-memory bytes: whatever fails to parse is a bad byte
        return None, [Problem(METADATA_NAME, "unsafe", f"not loadable DCP metadata: {type(e).__name__}: {e}")]


def check_metadata_safe(storage: Storage, dirname: str) -> list[Problem]:
    """Parse ``.metadata`` with the allow-list unpickler (never plain pickle): even a file whose
    digest matches an attacker-edited manifest cannot run code here. Storage errors propagate
    (or are ``unreadable``), never ``unsafe``. Prefer :func:`check_pickled_items`, which also
    checks what ``.metadata`` points at."""
    return _parse_metadata(storage, dirname)[1]


def _read_items(
    storage: Storage, dirname: str, name: str, items: dict[str, Any], span_limit_bytes: int
) -> dict[str, bytes]:
    """The bytes of each item (fqn -> _StorageInfo) inside file ``name``: one ranged read of the
    span covering them all when it is at most ``span_limit_bytes``, else one read per item."""
    start = min(info.offset for info in items.values())
    end = max(info.offset + info.length for info in items.values())
    if end - start <= span_limit_bytes:
        span = storage.read_range(f"{dirname}/{name}", start, end - start)
        return {fqn: span[info.offset - start : info.offset - start + info.length] for fqn, info in items.items()}
    return {fqn: storage.read_range(f"{dirname}/{name}", info.offset, info.length) for fqn, info in items.items()}


def _check_items_in_file(
    storage: Storage, dirname: str, name: str, items: dict[str, Any], span_limit_bytes: int
) -> list[Problem]:
    from ftrain.checkpoint.safe_pickle import load_bytes_item

    try:
        data = _read_items(storage, dirname, name, items, span_limit_bytes)
    except FileNotFoundError:
        return [Problem(name, "missing", f"holds {len(items)} pickled items but is not in storage")]
    except EOFError as e:
        return [Problem(name, "size", str(e))]
    except (FatalStorageError, IsADirectoryError, PermissionError) as e:
        return [Problem(name, "unreadable", str(e))]
    problems: list[Problem] = []
    for fqn in sorted(data):
        try:
            load_bytes_item(data[fqn], fqn=fqn, file=name)
        except UnsafePickleError as e:
            problems.append(Problem(name, "unsafe", str(e).removeprefix(f"{name}: ")))
    return problems


def check_pickled_items(
    storage: Storage, dirname: str, manifest: Manifest, *, span_limit_bytes: int = 64 << 20, metadata: Any = None
) -> list[Problem]:
    """Everything a full DCP load of ``dirname`` would unpickle, unpickled the safe way.

    ``.metadata`` is checked against the manifest and parsed with the allow-list unpickler
    (both on the same bytes); every storage reference in it must
    point inside a file the manifest lists (:func:`ftrain.checkpoint.safe_pickle.metadata_problems`);
    then every non-tensor ("bytes") item, read from exactly the byte range DCP would read, goes
    through :func:`ftrain.checkpoint.safe_pickle.load_bytes_item` (torch's weights-only unpickler).
    A refusal is a problem of kind ``unsafe`` naming the file and the item. Storage errors
    propagate (transient) or are ``unreadable`` (fatal, permissions): never corruption.

    One call covers the load path's check of ``.metadata`` (it replaces
    :func:`check_metadata_safe`); ``metadata``: already parsed by the allow-list unpickler from
    bytes the caller checked against the manifest (not read again). Tensor items are not
    unpickled here: DCP itself loads them with ``weights_only=True``, and their bytes are
    covered by the digests.
    """
    from ftrain.checkpoint.safe_pickle import bytes_items, metadata_problems

    problems: list[Problem] = []
    if metadata is None:  # else: parsed by the caller from bytes it checked against the manifest
        metadata, problems = _parse_metadata(storage, dirname, manifest)
        if metadata is None:
            return problems
    wrong = metadata_problems(metadata, manifest.files)
    if wrong:
        return [Problem(METADATA_NAME, "unsafe", why) for why in wrong]
    by_file: dict[str, dict[str, Any]] = {}
    for fqn, info in bytes_items(metadata).items():
        by_file.setdefault(info.relative_path, {})[fqn] = info
    for name in sorted(by_file):
        problems.extend(_check_items_in_file(storage, dirname, name, by_file[name], span_limit_bytes))
    return problems


def mark_corrupt(
    storage: Storage, dirname: str, problems: list[Problem], reason: str, *, now_s: float | None = None
) -> None:
    """Write ``<dirname>/corrupt.json`` = ``{"time", "reason", "problems"}``. Deletes nothing.

    Readers then treat the step as corrupt (see :mod:`ftrain.checkpoint.catalog`) and fall back.
    """
    record = {
        "time": time.time() if now_s is None else now_s,
        "reason": reason,
        "problems": [asdict(p) for p in problems],
    }
    storage.write_bytes(f"{dirname}/{CORRUPT_NAME}", json.dumps(record, indent=2, sort_keys=True).encode())
    log.warning("checkpoint %s marked corrupt: %s (%s)", dirname, reason, "; ".join(map(str, problems)) or "-")
