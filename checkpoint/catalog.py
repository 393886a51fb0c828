"""What checkpoint steps exist under a root, and in which state.

The listing plus each step's manifest are the truth (never the advisory ``latest`` pointer):

- ``committed``: ``manifest.json`` parses (and passes its HMAC when a key is set), names the same
  step as its directory, and no ``corrupt.json`` marker sits beside it;
- ``corrupt``: a manifest exists but fails, or a ``corrupt.json`` marker is present;
- ``uncommitted``: no manifest (a save in flight, or one that died); readers ignore it.

Storage errors (transient after retries, or fatal) propagate: an unreachable bucket is not
evidence that a checkpoint is corrupt.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

from checkpoint.errors import ManifestError
from checkpoint.manifest import CORRUPT_NAME, MANIFEST_NAME, Manifest, parse_step_dir
from checkpoint.storage import Storage

State = Literal["committed", "uncommitted", "corrupt"]


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


def read_manifest(storage: Storage, dirname: str, hmac_key: bytes | None = None) -> Manifest:
    """The manifest of ``dirname``, checked: parse, HMAC, and its step equals the directory's.

    Raises :class:`ManifestError` for a bad manifest, ``FileNotFoundError`` if there is none.
    """
    data = storage.read_bytes(f"{dirname}/{MANIFEST_NAME}")
    manifest = Manifest.from_json(data, hmac_key)
    step = parse_step_dir(dirname)
    if step is not None and manifest.step != step:
        raise ManifestError(f"manifest of {dirname} says step {manifest.step}")
    return manifest


def _marker_reason(storage: Storage, dirname: str) -> str:
    try:
        marker = json.loads(storage.read_bytes(f"{dirname}/{CORRUPT_NAME}"))
        reason = marker.get("reason") if isinstance(marker, dict) else None
    except (ValueError, FileNotFoundError):
        reason = None
    return f"marked corrupt: {reason}" if reason else "marked corrupt"


def inspect_step(storage: Storage, dirname: str, hmac_key: bytes | None = None) -> StepInfo:
    """The state of one step directory (see the module doc)."""
    step = parse_step_dir(dirname)
    if step is None:
        raise ValueError(f"{dirname!r} is not a step directory name")
    names = set(storage.listdir(dirname))
    marked = CORRUPT_NAME in names
    manifest: Manifest | None = None
    error: str | None = None
    if MANIFEST_NAME in names:
        try:
            manifest = read_manifest(storage, dirname, hmac_key)
        except ManifestError as e:
            error = str(e)
        except FileNotFoundError:  # removed since the listing (GC removes the manifest first)
            names.discard(MANIFEST_NAME)
    if marked:
        reason = _marker_reason(storage, dirname)
        return StepInfo(step, dirname, "corrupt", manifest, f"{reason}; {error}" if error else reason, marked=True)
    if error is not None:
        return StepInfo(step, dirname, "corrupt", None, error)
    if manifest is None:
        return StepInfo(step, dirname, "uncommitted", None, None)
    return StepInfo(step, dirname, "committed", manifest, None)


def list_steps(storage: Storage, hmac_key: bytes | None = None) -> list[StepInfo]:
    """Every step directory directly under the root, ascending by step; other names ignored."""
    dirnames = [name for name in storage.listdir("") if parse_step_dir(name) is not None]
    infos = [inspect_step(storage, name, hmac_key) for name in dirnames]
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
