"""The manifest: the commit point of one checkpoint step.

``<root>/step-000001200/manifest.json`` is written last, by the coordinator, after every DCP file
is durable. It records who wrote the step (fencing round, world size, layout, config) and, for
every other file in the directory, its size and digest. A step directory without a manifest that
parses (and passes its HMAC when a key is set) does not exist for readers.

The JSON is canonical (sorted keys, fixed separators, ASCII) so the HMAC can be recomputed from the
parsed object. Format 2 (written now) signs ``HMAC-SHA256(key, b"ftrain-manifest-v2\\n" +
canonical JSON of every field except "hmac")``. Every field is covered, so a signature binds:

- the **job** (``job``): a signed step copied from another job's root is refused by a reader of
  this job (:func:`ftrain.checkpoint.catalog.read_manifest` compares it with the reader's job); and the
  **run** (``run_id``, only in memory-tier snapshots, absent when empty);
- the **step** (``step``, which must equal the directory's step) and the **writer** (``round``,
  ``world_size``, ``layout``, ``config_hash``, ``created_time``): a manifest cannot be moved to
  another step directory or passed off as another round's commit;
- the **bytes** (``files``: name, size and digest of every file, ``.metadata`` included, and
  ``digest_algorithm``) and the trainer state;
- the **format**: the domain prefix names the version, so a MAC made for another format or
  another protocol that shares the key never verifies here.

Format-1 manifests (no ``job`` field, an HMAC over the bare canonical JSON) are still read
**without** an HMAC key (they carry no job to check, like any unsigned legacy step). **With** a
key they are refused: their signature does not bind the job, so a signed step of another job
could pass as this job's. Re-save under format 2 (or read without the key) to use them.

Manifests come from storage, so parsing is bounded before any JSON is built: at most
:data:`MAX_MANIFEST_BYTES` bytes, nesting at most :data:`MAX_JSON_DEPTH`, numbers of at most
:data:`MAX_NUMBER_CHARS` characters, no NaN/Infinity, no duplicate keys. A manifest that does
not fit the schema raises :class:`ManifestError` (the step is corrupt), never anything else.
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

from ftrain.checkpoint.digest import ALGORITHMS
from ftrain.checkpoint.errors import ManifestError
from ftrain.contract import bounded_json

FORMAT_VERSION = 2
#: Formats a reader accepts (format 1 only without an HMAC key; see the module doc).
READABLE_FORMATS = (1, 2)
#: Domain separation of the format-2 HMAC: it signs this prefix + the canonical JSON.
HMAC_DOMAIN = b"ftrain-manifest-v2\n"
#: A manifest larger than this is refused unparsed (a real one is KiBs: one entry per file).
MAX_MANIFEST_BYTES = 16 << 20
#: Deepest JSON nesting accepted (config and layout sections are a few levels deep).
MAX_JSON_DEPTH = bounded_json.MAX_DEPTH
#: Longest number literal accepted: int64 has 19 digits; floats print in <= 24 characters.
MAX_NUMBER_CHARS = bounded_json.MAX_NUMBER_CHARS
#: Largest file size (and block size) a manifest may list: a reader sizes buffers and reads by it,
#: and a 40-digit size overflows every int64 on the way.
MAX_FILE_BYTES = 1 << 62
#: Longest job id accepted.
MAX_JOB_CHARS = 256
#: The DCP metadata file: every committed step lists it (it is what a reader opens first).
METADATA_FILE = ".metadata"
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
        return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode(
            "ascii"
        )
    except (TypeError, ValueError) as e:
        raise ManifestError(f"manifest is not JSON-serialisable: {e}") from e


def manifest_digest(data: bytes) -> str:
    """What a commit record holds of a manifest (see :func:`ftrain.checkpoint.catalog.inspect_step`):
    the SHA-256 of its stored bytes, hex."""
    return hashlib.sha256(data).hexdigest()


def _hmac_hex(key: bytes, payload: bytes) -> str:
    return hmac.new(key, payload, hashlib.sha256).hexdigest()


def manifest_hmac(key: bytes, obj: dict[str, Any]) -> str:
    """The format-2 HMAC of manifest object ``obj`` (every field but ``hmac``): domain-separated."""
    return _hmac_hex(key, HMAC_DOMAIN + canonical_json({k: v for k, v in obj.items() if k != "hmac"}))


def job_problem(job: Any) -> str | None:
    """Why ``job`` cannot be a job id recorded in a manifest, or None if it can ("" = no job id)."""
    if not isinstance(job, str):
        return f"must be a string, got {type(job).__name__}"
    if len(job) > MAX_JOB_CHARS:
        return f"is longer than {MAX_JOB_CHARS} characters"
    if not job.isprintable() or job != job.strip():
        return f"{job!r} has control characters or surrounding blanks"
    return None


def parse_json_bounded(data: bytes, what: str = "manifest") -> Any:
    """``json.loads(data)`` within the bounds of the module doc (the bounded reader of every
    untrusted JSON, :func:`ftrain.contract.bounded_json.loads`); ManifestError for anything else."""
    try:
        return bounded_json.loads(
            data, max_bytes=MAX_MANIFEST_BYTES, what=what, max_depth=MAX_JSON_DEPTH, max_number_chars=MAX_NUMBER_CHARS
        )
    except bounded_json.JsonInputError as e:
        raise ManifestError(str(e)) from e


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
    return value.encode("utf-8", "surrogateescape")  # undecodable bytes of the environment stay as they were


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
    block_bytes: int = 0
    """The file is also digested in blocks of this many bytes (0: not; manifests written before
    block digests), so that a reader can verify just the blocks it reads."""
    blocks_file: str = ""
    """The file of the same step that lists those block digests, in order (the last block may be
    shorter): a JSON list of hex strings, itself listed in the manifest (without blocks)."""

    def block_span(self, index: int) -> tuple[int, int]:
        """Byte range ``[start, end)`` of block ``index``."""
        start = index * self.block_bytes
        return start, min(self.size_bytes, start + self.block_bytes)


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
    """One of :data:`ftrain.checkpoint.digest.ALGORITHMS`."""
    files: dict[str, FileEntry]
    """Every file of the step directory (``.metadata`` included, this manifest excluded),
    by name relative to the directory."""
    created_time: float
    """Unix time the manifest was written."""
    job: str = ""
    """Job id of the writer (``FTRAIN_JOB`` / ``agent.job``); "" when it had none (never with an
    HMAC key: the worker refuses to start). Always "" in a format-1 manifest."""
    format: int = FORMAT_VERSION
    """Manifest format version."""
    run_id: str = ""
    """The run that wrote it: memory-tier snapshots carry it (:mod:`ftrain.recovery.tier_binding`), so that a
    snapshot left by another run of the same job is never resumed; "" in checkpoints (they are
    resumed across runs on purpose) and then left out of the JSON."""

    def __post_init__(self) -> None:
        problem = self._problem()
        if problem is not None:
            raise ManifestError(problem)

    def _problem(self) -> str | None:
        if self.format not in READABLE_FORMATS:
            return f"unknown manifest format version {self.format!r} (this reader knows {READABLE_FORMATS})"
        why = job_problem(self.job)
        if why is not None:
            return f"manifest field 'job' {why}"
        why = job_problem(self.run_id)
        if why is not None:
            return f"manifest field 'run_id' {why}"
        if self.format == 1 and self.job:
            return "a format-1 manifest has no 'job' field"
        if self.step < 0:
            return f"manifest field 'step' must be >= 0, got {self.step}"
        if self.round < 0:
            return f"manifest field 'round' must be >= 0, got {self.round}"
        if self.world_size < 1:
            return f"manifest field 'world_size' must be >= 1, got {self.world_size}"
        if self.digest_algorithm not in ALGORITHMS:
            return (
                f"manifest field 'digest_algorithm' is {self.digest_algorithm!r}, "
                f"expected one of {', '.join(ALGORITHMS)}"
            )
        if not math.isfinite(self.created_time):
            return f"manifest field 'created_time' must be finite, got {self.created_time}"
        hex_len = _DIGEST_HEX_LEN[self.digest_algorithm]
        for name, entry in self.files.items():
            why = _check_file_name(name)
            if why is not None:
                return f"bad file entry {name!r}: name {why}"
            if not isinstance(entry, FileEntry):
                return f"bad file entry {name!r}: not a FileEntry"
            size = entry.size_bytes
            if isinstance(size, bool) or not isinstance(size, int) or not 0 <= size <= MAX_FILE_BYTES:
                return f"bad file entry {name!r}: size_bytes must be an int in 0..2**62, got {size!r}"
            if not isinstance(entry.digest, str) or len(entry.digest) != hex_len or not _HEX.fullmatch(entry.digest):
                return (
                    f"bad file entry {name!r}: digest must be {hex_len} lower-case hex digits "
                    f"for {self.digest_algorithm}, got {entry.digest!r}"
                )
            why = _blocks_problem(entry, self.files)
            if why is not None:
                return f"bad file entry {name!r}: {why}"
        return None

    @property
    def total_size_bytes(self) -> int:
        return sum(e.size_bytes for e in self.files.values())

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict of every field (no HMAC); a file without block digests is
        written as before they existed."""
        obj = asdict(self)
        if not obj["run_id"]:
            del obj["run_id"]
        for entry in obj["files"].values():
            if not entry["block_bytes"]:
                del entry["block_bytes"], entry["blocks_file"]
        return obj

    def to_json(self, hmac_key: bytes | None = None) -> bytes:
        """Canonical format-2 JSON bytes; with ``hmac_key``, plus ``"hmac"`` (:func:`manifest_hmac`).

        Only the current format is written: a format-1 manifest read from storage is never re-signed.
        """
        if self.format != FORMAT_VERSION:
            raise ManifestError(f"only format {FORMAT_VERSION} manifests are written, not format {self.format}")
        obj = self.to_dict()
        if hmac_key is not None:
            obj["hmac"] = manifest_hmac(hmac_key, obj)
        return canonical_json(obj)

    @classmethod
    def from_json(cls, data: bytes, hmac_key: bytes | None = None) -> Manifest:
        """Parse and check ``data``; any defect raises :class:`ManifestError` naming it.

        With ``hmac_key`` the manifest must be format 2 and carry a matching ``"hmac"``. Without a
        key an ``"hmac"`` field is accepted unchecked. The job is returned, not judged: comparing
        it with the reader's job is :func:`ftrain.checkpoint.catalog.read_manifest`'s work.
        """
        obj = parse_json_bounded(data)
        if not isinstance(obj, dict):
            raise ManifestError(f"manifest must be a JSON object, got {type(obj).__name__}")
        fmt = obj.get("format")
        if isinstance(fmt, bool) or not isinstance(fmt, int):
            raise ManifestError(f"manifest field 'format' is missing or not an int: {fmt!r}")
        if fmt not in READABLE_FORMATS:
            raise ManifestError(f"unknown manifest format version {fmt} (this reader knows {READABLE_FORMATS})")
        given = obj.pop("hmac", None)
        if hmac_key is not None:
            _check_hmac(obj, given, hmac_key, fmt)
        return cls._from_obj(obj, fmt)

    @classmethod
    def _from_obj(cls, obj: dict[str, Any], fmt: int) -> Manifest:
        def get(name: str, types: type | tuple[type, ...], what: str) -> Any:
            if name not in obj:
                raise ManifestError(f"manifest field {name!r} is missing")
            value = obj[name]
            if isinstance(value, bool) or not isinstance(value, types):
                raise ManifestError(f"manifest field {name!r} must be {what}, got {type(value).__name__}")
            return value

        if fmt == 1 and "job" in obj:
            raise ManifestError("a format-1 manifest has no 'job' field; this one is forged or damaged")
        job = get("job", str, "a string") if fmt >= 2 else ""
        return cls(
            step=get("step", int, "an int"),
            round=get("round", int, "an int"),
            world_size=get("world_size", int, "an int"),
            layout=get("layout", dict, "an object"),
            config_hash=get("config_hash", str, "a string"),
            config=get("config", dict, "an object"),
            trainer=get("trainer", dict, "an object"),
            digest_algorithm=get("digest_algorithm", str, "a string"),
            files=_files_from(get("files", dict, "an object")),
            created_time=float(get("created_time", (int, float), "a number")),
            job=job,
            format=fmt,
            run_id=get("run_id", str, "a string") if "run_id" in obj else "",
        )


def _check_hmac(obj: dict[str, Any], given: Any, hmac_key: bytes, fmt: int) -> None:
    """Raise ManifestError unless ``given`` is the format-2 HMAC of ``obj`` under ``hmac_key``."""
    if fmt == 1:
        raise ManifestError(
            "format-1 manifest refused while an HMAC key is set: its signature does not bind "
            "the job id, so another job's step would pass; re-save it with this version, or "
            "read it without checkpoint.hmac_key_env"
        )
    if given is None:
        raise ManifestError("manifest has no 'hmac' but an HMAC key is set")
    if not isinstance(given, str):
        raise ManifestError("manifest field 'hmac' is not a string")
    expected = manifest_hmac(hmac_key, obj)
    if not hmac.compare_digest(given.encode("ascii", "replace"), expected.encode("ascii")):
        raise ManifestError("manifest HMAC mismatch: edited, or written with another key")


_WITH_BLOCKS = {"size_bytes", "digest", "block_bytes", "blocks_file"}


def _blocks_problem(entry: FileEntry, files: dict[str, FileEntry]) -> str | None:
    """Why ``entry``'s block digests are unusable (None if they are fine or absent)."""
    b = entry.block_bytes
    if isinstance(b, bool) or not isinstance(b, int) or not 0 <= b <= MAX_FILE_BYTES:
        return f"block_bytes must be an int in 0..2**62, got {b!r}"
    if not isinstance(entry.blocks_file, str):
        return "blocks_file must be a string"
    if b == 0:
        return None if not entry.blocks_file else "blocks_file given without block_bytes"
    listed = files.get(entry.blocks_file)
    if listed is None:
        return f"its block digests file {entry.blocks_file!r} is not listed"
    if listed.block_bytes:
        return f"its block digests file {entry.blocks_file!r} has block digests of its own"
    return None


def _files_from(raw_files: dict[str, Any]) -> dict[str, FileEntry]:
    """The file table of a manifest read from storage; it must list ``.metadata``."""
    files: dict[str, FileEntry] = {}
    for name, entry in raw_files.items():
        if not isinstance(entry, dict) or set(entry) not in ({"size_bytes", "digest"}, _WITH_BLOCKS):
            raise ManifestError(
                f"bad file entry {name!r}: expected an object with 'size_bytes' and 'digest' (and optionally "
                f"'block_bytes' and 'blocks_file'), got {entry!r}"[:300]
            )
        files[name] = FileEntry(
            size_bytes=entry["size_bytes"],
            digest=entry["digest"],
            block_bytes=entry.get("block_bytes", 0),
            blocks_file=entry.get("blocks_file", ""),
        )
    if METADATA_FILE not in files:
        raise ManifestError(f"manifest lists no {METADATA_FILE} file: not a DCP checkpoint step")
    return files


__all__ = [
    "CORRUPT_NAME",
    "FORMAT_VERSION",
    "HMAC_DOMAIN",
    "MANIFEST_NAME",
    "MAX_JSON_DEPTH",
    "MAX_MANIFEST_BYTES",
    "METADATA_FILE",
    "READABLE_FORMATS",
    "RESERVED_NAMES",
    "FileEntry",
    "Manifest",
    "canonical_json",
    "hmac_key_from_env",
    "job_problem",
    "manifest_hmac",
    "parse_json_bounded",
    "parse_step_dir",
    "step_dir_name",
]
