"""What checkpoint steps exist under a root, and in which state.

The listing plus each step's manifest are the truth (never the advisory ``latest`` pointer):

- ``committed``: ``manifest.json`` parses (and passes its HMAC when a key is set), names the same
  step as its directory, belongs to the reader's job (when the reader names one), and no
  ``corrupt.json`` marker sits beside it;
- ``corrupt``: a manifest exists but fails any of that, or a ``corrupt.json`` marker is present;
- ``uncommitted``: no manifest (a save in flight, or one that died); readers ignore it.

Where commits are recorded in etcd (an agent's job: :mod:`ftrain.agent_link.fence`), the reader passes the
records (``recorded``: step -> SHA-256 of the manifest's bytes): the record is then the commit
point, and a step whose stored manifest is not the recorded one is ``uncommitted`` too (a save
that was fenced out after it stored its manifest, or one still committing). Without records
(plain ``ftrain train``, ``ftrain ckpt``) the manifest is the commit point.

A job's readers pass ``job``: a manifest of another job (a step copied between roots, or a root
shared by mistake) is then not committed for them, and the error names both jobs. ``job=None``
(inspection tools that know no job) accepts any job. Format-1 manifests record no job; they are
accepted without an HMAC key whatever the reader's job (see :mod:`ftrain.checkpoint.manifest`).

Everything read here is bounded: a manifest past :data:`~ftrain.checkpoint.manifest.MAX_MANIFEST_BYTES`
is corrupt without being read whole, and a marker's reason is read from at most
:data:`MAX_MARKER_BYTES` bytes.

Storage errors (transient after retries, or fatal) propagate: an unreachable bucket is not
evidence that a checkpoint is corrupt.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from ftrain.checkpoint.errors import ManifestError
from ftrain.checkpoint.manifest import (
    CORRUPT_NAME,
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    Manifest,
    manifest_digest,
    parse_json_bounded,
    parse_step_dir,
)
from ftrain.checkpoint.storage import Storage

State = Literal["committed", "uncommitted", "corrupt"]

#: A ``corrupt.json`` marker is read up to this size (its reason is only shown to people).
MAX_MARKER_BYTES = 1 << 20


@dataclass(slots=True)
class StepInfo:
    """One step directory as the catalog found it."""

    step: int
    dirname: str
    """Directory name relative to the root, e.g. ``step-000001200``."""
    state: State
    manifest: Manifest | None
    """The parsed manifest when it parsed (also for a step marked corrupt), else None."""
    error: str | None
    """Why the step is corrupt (manifest error or the marker's reason); None otherwise."""
    marked: bool = False
    """True when a ``corrupt.json`` marker is present (an earlier verification failed)."""
    digest: str = ""
    """:func:`~ftrain.checkpoint.manifest.manifest_digest` of the manifest's bytes when they were read
    (also when they did not parse; "" when there is no manifest, or one too large to read): which
    manifest this judgement was made on. Whoever acts on it later (a corrupt marker, retention)
    judges the step again and acts only if the digest is still this one."""


def read_bounded(storage: Storage, rel: str, max_bytes: int) -> bytes:
    """``rel``'s bytes, or ManifestError once more than ``max_bytes`` arrive (the rest unread).

    The whole read is retried on transient errors; FileNotFoundError and storage errors propagate.
    """

    def read() -> bytes:
        parts: list[bytes] = []
        size_bytes = 0
        for chunk in storage.iter_chunks(rel, chunk_bytes=min(max_bytes + 1, 1 << 20)):
            parts.append(chunk)
            size_bytes += len(chunk)
            if size_bytes > max_bytes:
                raise ManifestError(f"{rel} is larger than {max_bytes} bytes; refused unread")
        return b"".join(parts)

    return storage.retry(read, f"read {rel}")


def read_manifest(storage: Storage, dirname: str, hmac_key: bytes | None = None, *, job: str | None = None) -> Manifest:
    """The manifest of ``dirname``, checked: bounded parse, HMAC, its step equals the directory's,
    and (unless ``job`` is None) it belongs to job ``job``.

    Raises :class:`ManifestError` for a bad manifest, ``FileNotFoundError`` if there is none.
    """
    data = read_bounded(storage, f"{dirname}/{MANIFEST_NAME}", MAX_MANIFEST_BYTES)
    return _check_manifest(data, dirname, hmac_key, job=job)


def _check_manifest(data: bytes, dirname: str, hmac_key: bytes | None, *, job: str | None) -> Manifest:
    """The manifest ``data`` of ``dirname``, checked (see :func:`read_manifest`)."""
    manifest = Manifest.from_json(data, hmac_key)
    step = parse_step_dir(dirname)
    if step is not None and manifest.step != step:
        raise ManifestError(f"manifest of {dirname} says step {manifest.step}")
    if job is not None and manifest.format >= 2 and manifest.job != job:
        raise ManifestError(
            f"manifest of {dirname} belongs to job {manifest.job!r}, not to this job {job!r}: "
            "copied from another job's root, or two jobs share checkpoint.uri"
        )
    return manifest


def _marker_reason(storage: Storage, dirname: str) -> str:
    try:
        marker = parse_json_bounded(read_bounded(storage, f"{dirname}/{CORRUPT_NAME}", MAX_MARKER_BYTES), CORRUPT_NAME)
        reason = marker.get("reason") if isinstance(marker, dict) else None
    except (ManifestError, FileNotFoundError):
        reason = None
    return f"marked corrupt: {str(reason)[:500]}" if reason else "marked corrupt"


def inspect_step(
    storage: Storage,
    dirname: str,
    hmac_key: bytes | None = None,
    *,
    job: str | None = None,
    recorded: Mapping[int, str] | None = None,
) -> StepInfo:
    """The state of one step directory (see the module doc; ``recorded``: the commit records)."""
    step = parse_step_dir(dirname)
    if step is None:
        raise ValueError(f"{dirname!r} is not a step directory name")
    names = set(storage.listdir(dirname))
    marked = CORRUPT_NAME in names
    manifest: Manifest | None = None
    error: str | None = None
    digest = ""
    if MANIFEST_NAME in names:
        try:
            data = read_bounded(storage, f"{dirname}/{MANIFEST_NAME}", MAX_MANIFEST_BYTES)
            digest = manifest_digest(data)
            manifest = _check_manifest(data, dirname, hmac_key, job=job)
        except ManifestError as e:
            error = str(e)
        except FileNotFoundError:  # removed since the listing (GC removes the manifest first)
            names.discard(MANIFEST_NAME)
    if marked:
        reason = _marker_reason(storage, dirname)
        why = f"{reason}; {error}" if error else reason
        return StepInfo(step, dirname, "corrupt", manifest, why, marked=True, digest=digest)
    if error is not None:
        return StepInfo(step, dirname, "corrupt", None, error, digest=digest)
    if manifest is None:
        return StepInfo(step, dirname, "uncommitted", None, None)
    if recorded is not None and recorded.get(step) != digest:  # fenced out after its PUT, or committing
        return StepInfo(step, dirname, "uncommitted", None, None, digest=digest)
    return StepInfo(step, dirname, "committed", manifest, None, digest=digest)


def list_steps(
    storage: Storage,
    hmac_key: bytes | None = None,
    *,
    job: str | None = None,
    recorded: Mapping[int, str] | None = None,
) -> list[StepInfo]:
    """Every step directory directly under the root, ascending by step; other names ignored.
    ``job``, ``recorded``: see the module doc."""
    dirnames = [name for name in storage.listdir("") if parse_step_dir(name) is not None]
    infos = [inspect_step(storage, name, hmac_key, job=job, recorded=recorded) for name in dirnames]
    return sorted(infos, key=lambda info: info.step)


def newest_committed(steps: list[StepInfo]) -> StepInfo | None:
    """The committed step with the highest number, or None."""
    committed = [s for s in steps if s.state == "committed"]
    return max(committed, key=lambda s: s.step) if committed else None


def committed_before(steps: list[StepInfo], step: int) -> list[StepInfo]:
    """Committed steps strictly older than ``step``, newest first: the fallback order."""
    return sorted((s for s in steps if s.state == "committed" and s.step < step), key=lambda s: -s.step)


def fallback_order(steps: list[StepInfo]) -> list[StepInfo]:
    """Every committed step, newest first: try each in turn until one verifies."""
    return sorted((s for s in steps if s.state == "committed"), key=lambda s: -s.step)
