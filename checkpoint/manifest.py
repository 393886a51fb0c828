"""The manifest: the commit point of one checkpoint step.

``<root>/step-000001200/manifest.json`` is written last, by the coordinator, after every DCP file
is durable. It records who wrote the step (fencing round, world size, layout, config) and, for
every other file in the directory, its size and digest. A step directory without a manifest that
parses (and passes its HMAC when a key is set) does not exist for readers.

The JSON is canonical (sorted keys, fixed separators, ASCII) so the HMAC, an HMAC-SHA256 over the
canonical JSON of every field except ``hmac`` itself, can be recomputed from the parsed object.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import os
import posixpath
import re
from dataclasses import asdict, dataclass
from typing import Any

from checkpoint.digest import ALGORITHMS
from checkpoint.errors import ManifestError

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
CORRUPT_NAME = "corrupt.json"
#: Names a manifest may never list: they are not checkpoint data.
RESERVED_NAMES = frozenset({MANIFEST_NAME, CORRUPT_NAME})

_STEP_DIR = re.compile(r"step-(\d{9,})")
_HEX = re.compile(r"[0-9a-f]+")
_DIGEST_HEX_LEN = {"xxh3_128": 32, "crc32c": 8}


def step_dir_name(step: int) -> str:
    """``step-000001200`` for step 1200 (9 digits, more only past 999,999,999)."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"checkpoint step must be a non-negative int, got {step!r}")
    return f"step-{step:09d}"


def parse_step_dir(name: str) -> int | None:
    """The step of a canonical step directory name (a trailing ``/`` is ignored), else None.

    Only the exact spelling :func:`step_dir_name` produces is accepted, so two directories can
    never claim the same step.
    """
    name = name.rstrip("/")
    m = _STEP_DIR.fullmatch(name)
    if m is None:
        return None
    step = int(m.group(1))
    return step if step_dir_name(step) == name else None


def canonical_json(obj: Any) -> bytes:
    """The one byte encoding of ``obj`` that manifests and their HMACs use."""
    try:
        return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                          allow_nan=False).encode("ascii")
    except (TypeError, ValueError) as e:
        raise ManifestError(f"manifest is not JSON-serialisable: {e}") from e


def _hmac_hex(key: bytes, payload: bytes) -> str:
    return hmac.new(key, payload, hashlib.sha256).hexdigest()


def hmac_key_from_env(var_name: str) -> bytes | None:
    """The HMAC key held in environment variable ``var_name``; None when no name is given.

    A name that is given but not set (or set empty) is an error: silently skipping the HMAC
    check would defeat it.
    """
    if not var_name:
        return None
    value = os.environ.get(var_name)
    if not value:
        raise ManifestError(f"manifest HMAC key variable {var_name} is not set (or empty)")
    return value.encode("utf-8")


def _check_file_name(name: str) -> str | None:
    """Why ``name`` may not be listed in a manifest, or None if it may."""
    if not isinstance(name, str) or not name:
        return "empty or not a string"
    if name.startswith("/") or "\\" in name:
        return "not a relative '/'-separated path"
    parts = name.split("/")
    if any(p in ("", ".", "..") for p in parts):
        return "has an empty, '.' or '..' component"
    if posixpath.normpath(name) in RESERVED_NAMES:
        return "is a reserved name"
    return None


@dataclass(slots=True)
class FileEntry:
    """One file of a step directory as its writer saw it leave."""

    size_bytes: int
    """Exact length in bytes."""
    digest: str
    """Lower-case hex digest under the manifest's ``digest_algorithm``."""


@dataclass(slots=True)
class Manifest:
    """Everything a reader needs to trust (or refuse) one checkpoint step. See the module doc."""

    step: int
    """Training step the checkpoint was taken after; equals the directory's step."""
    round: int
    """Rendezvous round (fencing token) of the writer; a commit from an old round is refused."""
    world_size: int
    """Ranks that wrote the checkpoint."""
    layout: dict
    """Parallel layout at save time (strategy, mesh shape...), JSON."""
    config_hash: str
    """Hash of the resolved configuration below."""
    config: dict
    """The resolved configuration, JSON."""
    trainer: dict
    """Trainer state outside DCP (data cursor etc.), JSON."""
    digest_algorithm: str
    """One of :data:`checkpoint.digest.ALGORITHMS`."""
    files: dict[str, FileEntry]
    """Every file of the step directory (``.metadata`` included, this manifest excluded),
    by name relative to the directory."""
    created_time: float
    """Unix time the manifest was written."""
    format: int = FORMAT_VERSION
    """Manifest format version."""

    def __post_init__(self) -> None:
        problem = self._problem()
        if problem is not None:
            raise ManifestError(problem)

    def _problem(self) -> str | None:
        if self.format != FORMAT_VERSION:
            return f"unknown manifest format version {self.format!r} (this reader knows {FORMAT_VERSION})"
        if self.step < 0:
            return f"manifest field 'step' must be >= 0, got {self.step}"
        if self.round < 0:
            return f"manifest field 'round' must be >= 0, got {self.round}"
        if self.world_size < 1:
            return f"manifest field 'world_size' must be >= 1, got {self.world_size}"
        if self.digest_algorithm not in ALGORITHMS:
            return (f"manifest field 'digest_algorithm' is {self.digest_algorithm!r}, "
                    f"expected one of {', '.join(ALGORITHMS)}")
        if not math.isfinite(self.created_time):
            return f"manifest field 'created_time' must be finite, got {self.created_time}"
        hex_len = _DIGEST_HEX_LEN[self.digest_algorithm]
        for name, entry in self.files.items():
            why = _check_file_name(name)
            if why is not None:
                return f"bad file entry {name!r}: name {why}"
            if not isinstance(entry, FileEntry):
                return f"bad file entry {name!r}: not a FileEntry"
            if isinstance(entry.size_bytes, bool) or not isinstance(entry.size_bytes, int) or entry.size_bytes < 0:
                return f"bad file entry {name!r}: size_bytes must be a non-negative int, got {entry.size_bytes!r}"
            if not isinstance(entry.digest, str) or len(entry.digest) != hex_len or not _HEX.fullmatch(entry.digest):
                return (f"bad file entry {name!r}: digest must be {hex_len} lower-case hex digits "
                        f"for {self.digest_algorithm}, got {entry.digest!r}")
        return None

    @property
    def total_size_bytes(self) -> int:
        return sum(e.size_bytes for e in self.files.values())

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict of every field (no HMAC)."""
        return asdict(self)

    def to_json(self, hmac_key: bytes | None = None) -> bytes:
        """Canonical JSON bytes; with ``hmac_key``, plus ``"hmac"`` over everything else."""
        obj = self.to_dict()
        if hmac_key is not None:
            obj["hmac"] = _hmac_hex(hmac_key, canonical_json(obj))
        return canonical_json(obj)

    @classmethod
    def from_json(cls, data: bytes, hmac_key: bytes | None = None) -> Manifest:
        """Parse and check ``data``; any defect raises :class:`ManifestError` naming it.

        With ``hmac_key`` the manifest must carry a matching ``"hmac"``. Without a key an
        ``"hmac"`` field is accepted unchecked.
        """
        try:
            obj = json.loads(data)
        except (ValueError, UnicodeDecodeError) as e:
            raise ManifestError(f"manifest is not valid JSON: {e}") from e
        if not isinstance(obj, dict):
            raise ManifestError(f"manifest must be a JSON object, got {type(obj).__name__}")
        fmt = obj.get("format")
        if isinstance(fmt, bool) or not isinstance(fmt, int):
            raise ManifestError(f"manifest field 'format' is missing or not an int: {fmt!r}")
        if fmt != FORMAT_VERSION:
            raise ManifestError(f"unknown manifest format version {fmt} (this reader knows {FORMAT_VERSION})")
        if hmac_key is not None:
            given = obj.pop("hmac", None)
            if given is None:
                raise ManifestError("manifest has no 'hmac' but an HMAC key is set")
            if not isinstance(given, str):
                raise ManifestError("manifest field 'hmac' is not a string")
            expected = _hmac_hex(hmac_key, canonical_json(obj))
            if not hmac.compare_digest(given.encode("ascii", "replace"), expected.encode("ascii")):
                raise ManifestError("manifest HMAC mismatch: edited, or written with another key")
        else:
            obj.pop("hmac", None)

        def get(name: str, types: type | tuple[type, ...], what: str) -> Any:
            if name not in obj:
                raise ManifestError(f"manifest field {name!r} is missing")
            value = obj[name]
            if isinstance(value, bool) or not isinstance(value, types):
                raise ManifestError(f"manifest field {name!r} must be {what}, got {type(value).__name__}")
            return value

        raw_files = get("files", dict, "an object")
        files: dict[str, FileEntry] = {}
        for name, entry in raw_files.items():
            if not isinstance(entry, dict) or set(entry) != {"size_bytes", "digest"}:
                raise ManifestError(f"bad file entry {name!r}: expected an object with exactly "
                                    f"'size_bytes' and 'digest', got {entry!r}")
            files[name] = FileEntry(size_bytes=entry["size_bytes"], digest=entry["digest"])
        return cls(
            step=get("step", int, "an int"),
            round=get("round", int, "an int"),
            world_size=get("world_size", int, "an int"),
            layout=get("layout", dict, "an object"),
            config_hash=get("config_hash", str, "a string"),
            config=get("config", dict, "an object"),
            trainer=get("trainer", dict, "an object"),
            digest_algorithm=get("digest_algorithm", str, "a string"),
            files=files,
            created_time=float(get("created_time", (int, float), "a number")),
            format=fmt,
        )


__all__ = [
    "CORRUPT_NAME", "FORMAT_VERSION", "MANIFEST_NAME", "RESERVED_NAMES", "FileEntry", "Manifest",
    "canonical_json", "hmac_key_from_env", "parse_step_dir", "step_dir_name",
]
