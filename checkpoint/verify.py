"""Verification of a step directory against its manifest, and the ``corrupt.json`` marker.

Every file is streamed through the manifest's digest algorithm and its size and digest compared
with the manifest. Ranks can split the work with :func:`split_files`. A failed verification is
recorded by :func:`mark_corrupt`, which writes a marker beside the manifest and never deletes
anything: the bytes stay as evidence until retention removes them.

Only problems of the kinds in :data:`CORRUPTION_KINDS` prove a step corrupt. ``unreadable``
(permission denied, not a file) does not; transient storage errors that outlive the retries are
raised, never turned into problems: an unreachable bucket says nothing about the checkpoint.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Iterable, Literal

from checkpoint.catalog import read_manifest
from checkpoint.digest import new_hasher
from checkpoint.errors import FatalStorageError, ManifestError
from checkpoint.manifest import CORRUPT_NAME, MANIFEST_NAME, Manifest, parse_step_dir
from checkpoint.storage import Storage

log = logging.getLogger(__name__)

ProblemKind = Literal["missing", "size", "digest", "manifest", "unsafe", "unreadable"]
#: Problem kinds that prove the step's bytes are not what was committed (``unsafe``: a
#: ``.metadata`` that asks the unpickler for anything but DCP metadata).
CORRUPTION_KINDS = frozenset({"missing", "size", "digest", "manifest", "unsafe"})


@dataclass(slots=True)
class Problem:
    """One thing wrong with one file of a step directory."""

    file: str
    """Name relative to the step directory (``manifest.json`` for manifest problems)."""
    kind: ProblemKind
    detail: str

    def __str__(self) -> str:
        return f"{self.file}: {self.kind}: {self.detail}"


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


def _check_file(storage: Storage, rel: str, algorithm: str, chunk_bytes: int) -> tuple[int, str]:
    """Stream ``rel`` through a hasher, retrying the whole read on transient errors."""

    def read() -> tuple[int, str]:
        hasher = new_hasher(algorithm)
        size_bytes = 0
        for chunk in storage.iter_chunks(rel, chunk_bytes):
            hasher.update(chunk)
            size_bytes += len(chunk)
        return size_bytes, hasher.hexdigest()

    return storage.retry(read, f"verify {rel}")


def _verify(storage: Storage, dirname: str, manifest: Manifest, names: Iterable[str] | None,
            chunk_bytes: int) -> _Tally:
    tally = _Tally()
    for name in sorted(manifest.files) if names is None else list(names):
        entry = manifest.files.get(name)
        if entry is None:
            tally.problems.append(Problem(name, "manifest", "not listed in the manifest"))
            continue
        try:
            size_bytes, digest = _check_file(storage, f"{dirname}/{name}", manifest.digest_algorithm, chunk_bytes)
        except FileNotFoundError:
            tally.problems.append(Problem(name, "missing", f"listed in the manifest ({entry.size_bytes} bytes) "
                                                           "but not in storage"))
            continue
        except (FatalStorageError, IsADirectoryError, PermissionError) as e:
            tally.problems.append(Problem(name, "unreadable", str(e)))
            continue
        tally.files += 1
        tally.size_bytes += size_bytes
        if size_bytes != entry.size_bytes:
            tally.problems.append(Problem(name, "size", f"expected {entry.size_bytes} bytes, found {size_bytes}"))
        elif digest != entry.digest:
            tally.problems.append(Problem(name, "digest", f"{manifest.digest_algorithm} expected {entry.digest}, "
                                                          f"computed {digest}"))
    return tally


def verify_files(storage: Storage, dirname: str, manifest: Manifest, names: Iterable[str] | None = None,
                 *, chunk_bytes: int = 8 << 20) -> list[Problem]:
    """Problems with the files of ``dirname`` (all in the manifest, or just ``names``)."""
    return _verify(storage, dirname, manifest, names, chunk_bytes).problems


def split_files(manifest: Manifest, rank: int, world_size: int) -> list[str]:
    """The files ``rank`` of ``world_size`` verifies: every file goes to exactly one rank.

    Deterministic greedy balancing by size: files largest first (ties by name), each to the rank
    with the fewest bytes so far (ties to the lowest rank). Returned sorted by name.
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"split_files: need 0 <= rank < world_size, got rank={rank} world_size={world_size}")
    loads = [0] * world_size
    mine: list[str] = []
    for name, entry in sorted(manifest.files.items(), key=lambda kv: (-kv[1].size_bytes, kv[0])):
        # +1 per file so zero-byte files spread out too
        target = min(range(world_size), key=lambda r: (loads[r], r))
        loads[target] += entry.size_bytes + 1
        if target == rank:
            mine.append(name)
    return sorted(mine)


def verify_step(storage: Storage, dirname: str, hmac_key: bytes | None = None, *,
                chunk_bytes: int = 8 << 20) -> VerifyReport:
    """Verify the manifest of ``dirname`` and then every file it lists."""
    step = parse_step_dir(dirname)
    if step is None:
        raise ValueError(f"{dirname!r} is not a step directory name")
    try:
        manifest = read_manifest(storage, dirname, hmac_key)
    except FileNotFoundError:
        return VerifyReport(step, False, [Problem(MANIFEST_NAME, "missing", "step is not committed")], dirname)
    except ManifestError as e:
        return VerifyReport(step, False, [Problem(MANIFEST_NAME, "manifest", str(e))], dirname)
    tally = _verify(storage, dirname, manifest, None, chunk_bytes)
    if not tally.problems:
        tally.problems.extend(check_metadata_safe(storage, dirname))
    return VerifyReport(step, not tally.problems, tally.problems, dirname, manifest, tally.files, tally.size_bytes)


def check_metadata_safe(storage: Storage, dirname: str) -> list[Problem]:
    """Parse ``.metadata`` with the allow-list unpickler (never plain pickle): even a file whose
    digest matches an attacker-edited manifest cannot run code here."""
    from checkpoint.dcp_io import METADATA_NAME, load_metadata  # torch: only when it is needed
    from checkpoint.errors import UnsafePickleError

    try:
        load_metadata(storage.read_bytes(f"{dirname}/{METADATA_NAME}"))
    except FileNotFoundError:
        return [Problem(METADATA_NAME, "missing", "no .metadata")]
    except UnsafePickleError as e:
        return [Problem(METADATA_NAME, "unsafe", str(e))]
    except Exception as e:  # noqa: BLE001 - any unparsable metadata is corrupt
        return [Problem(METADATA_NAME, "unsafe", f"not loadable DCP metadata: {type(e).__name__}: {e}")]
    return []


def mark_corrupt(storage: Storage, dirname: str, problems: list[Problem], reason: str,
                 *, now_s: float | None = None) -> None:
    """Write ``<dirname>/corrupt.json`` = ``{"time", "reason", "problems"}``. Deletes nothing.

    Readers then treat the step as corrupt (see :mod:`checkpoint.catalog`) and fall back.
    """
    record = {
        "time": time.time() if now_s is None else now_s,
        "reason": reason,
        "problems": [asdict(p) for p in problems],
    }
    storage.write_bytes(f"{dirname}/{CORRUPT_NAME}", json.dumps(record, indent=2, sort_keys=True).encode())
    log.warning("checkpoint %s marked corrupt: %s (%s)", dirname, reason, "; ".join(map(str, problems)) or "-")
