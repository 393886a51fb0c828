"""The memory tier's snapshots kept in a node-local directory in host memory, so that they
outlive the worker processes that took them.

With ``checkpoint.memory_dir`` set (a tmpfs: ``/dev/shm``), each worker writes every complete
snapshot it holds (``.metadata``, its own shard files, its buddy's copies, and the manifest's
bytes) to ``<memory_dir>/ftrain-tier-<job>/<node>/local<local rank>/step-<step>-<key>/`` and
keeps only the names in its process: the bytes live once, in the tmpfs. A directory is written
under a temporary name and renamed when complete, so a worker killed while writing leaves
nothing that looks like a snapshot. A worker that starts on the node with no snapshot of its own
(one the agent restarted after a failure, a spare) finds what its node holds
(:meth:`TierStore.discover`) and offers it to the round's restore
(:meth:`ftrain.recovery.memory_tier.MemoryTier.restore`), which checks every byte against the manifest
before any of it is used.

Nothing read from this directory is trusted (what must stay true):

- the directories are this user's own: ``ftrain-tier-<job>`` and everything below it are created
  ``0700`` (:func:`ftrain.contract.local_files.private_dir`), and one that exists but is a link, owned
  by another user or writable by group or others makes :meth:`TierStore.open` raise
  :class:`~ftrain.contract.local_files.UnsafeLocalDirError` (the caller runs without the on-disk
  tier); files are created ``0600`` without following links
  (:func:`ftrain.contract.local_files.create_new`), so other local users can neither plant a snapshot
  nor read weights;
- a snapshot is offered only if its manifest parses (signed ones verified with the job's key),
  names this job and is bound to this run (:func:`ftrain.recovery.tier_binding.binding_problem`: run id,
  config hash, checkpoint root); anything else is skipped and reported (:class:`Skipped`);
- a file is only ever read by a name its manifest lists, only if it is a regular file (never a
  link, FIFO, device or directory), never more than the size the manifest lists plus one byte,
  and it is returned only if its size and digest match (:meth:`DirFiles.read`); any other outcome
  is an ``OSError`` naming the file, which the restore turns into a refusal, never a crash.

Each worker deletes the snapshots it wrote (or found in its own ``local<n>`` directory) once
they are superseded, and everything it wrote when the job ends normally; a directory is renamed
out of ``step-*`` before it is deleted, so a worker killed while deleting leaves no half of a
snapshot for a restart to find (and report). A job that ends for good
any other way leaves its directory behind: ``rm -rf <memory_dir>/ftrain-tier-<job>``; a later run
of the job skips (and names) what it finds there of another run, and leaves it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import socket
import stat
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ftrain.checkpoint.digest import new_hasher
from ftrain.checkpoint.errors import ManifestError
from ftrain.checkpoint.manifest import MAX_MANIFEST_BYTES, Manifest
from ftrain.contract.local_files import create_new, private_dir, read_regular
from ftrain.recovery.tier_binding import Binding, binding_problem

log = logging.getLogger(__name__)

#: the manifest's bytes inside a snapshot directory (a name no DCP file has)
MANIFEST_FILE = "snapshot-manifest.json"
#: the setting whose directory this is (named in every complaint about it)
SETTING = "checkpoint.memory_dir"
_SAFE = re.compile(r"[^A-Za-z0-9._-]")
_WRITING = ".tmp-"  #: a step directory being written (renamed to ``step-*`` when complete)
_DELETING = ".del-"  #: a step directory being deleted


@dataclass(slots=True)
class Snapshot:
    """One step of this rank's memory tier: the manifest (parsed, and its bytes), and the files
    this rank holds of it (``.metadata``, its own shards, its buddy's): bytes in its memory, or
    :class:`DirFiles` read from the node's tier directory. Held files are checked against the
    manifest before they are used."""

    step: int
    manifest: Manifest
    manifest_bytes: bytes
    files: Mapping[str, bytes | bytearray]

    @property
    def key(self) -> str:
        """The manifest's identity: ranks agree on a snapshot only if they hold the same one."""
        return snapshot_key(self.manifest_bytes)

    def holdings(self) -> dict[str, Any]:
        return {"step": self.step, "key": self.key, "files": sorted(self.files), "all": sorted(self.manifest.files)}


@dataclass(frozen=True, slots=True)
class Skipped:
    """Something :meth:`TierStore.discover` did not offer, and why (reported by the caller)."""

    path: str
    why: str


def snapshot_key(manifest_bytes: bytes) -> str:
    return hashlib.sha256(manifest_bytes).hexdigest()[:32]


class DirFiles(Mapping[str, bytes]):
    """Files of a snapshot in tier directories: for each name the paths that hold it (the node's
    workers may each hold a copy), the bytes read when asked for (a tmpfs read: a memory copy),
    bounded and checked against ``manifest`` (:meth:`read`)."""

    def __init__(self, paths: Mapping[str, list[Path]], manifest: Manifest):
        self._paths = {name: list(candidates) for name, candidates in paths.items()}
        self._manifest = manifest

    def read(self, name: str) -> bytes:
        """The bytes of ``name`` from the first of its paths that is a regular file of the size
        and digest the manifest lists (at most that size + 1 bytes read of any); OSError naming
        every path and what was wrong with it otherwise (a link, a FIFO, a directory, gone,
        too long or short, another digest)."""
        entry = self._manifest.files.get(name)
        if entry is None or name not in self._paths:
            raise OSError(f"{name} is not a file of this snapshot")
        problems = []
        for path in self._paths[name]:
            try:
                data = read_regular(path, entry.size_bytes)
            except OSError as e:
                problems.append(f"{path}: {e.strerror or e}")
                continue
            hasher = new_hasher(self._manifest.digest_algorithm)
            hasher.update(data)
            if len(data) != entry.size_bytes:
                problems.append(
                    f"{path}: {'more than' if len(data) > entry.size_bytes else len(data)} bytes, "
                    f"the manifest lists {entry.size_bytes}"
                )
            elif hasher.hexdigest() != entry.digest:
                problems.append(f"{path}: does not match its digest in the manifest")
            else:
                return data
        raise OSError("; ".join(problems))

    def where(self, name: str) -> str:
        return " or ".join(str(p) for p in self._paths.get(name, [])) or name

    def __getitem__(self, name: str) -> bytes:
        if name not in self._paths:
            raise KeyError(name)
        return self.read(name)

    def __contains__(self, name: object) -> bool:
        return name in self._paths

    def __iter__(self) -> Iterator[str]:
        return iter(self._paths)

    def __len__(self) -> int:
        return len(self._paths)

    def merged(self, other: DirFiles) -> DirFiles:
        """Both sets of paths: this one's first."""
        paths = {name: list(candidates) for name, candidates in self._paths.items()}
        for name, candidates in other._paths.items():
            held = paths.setdefault(name, [])
            held.extend(p for p in candidates if p not in held)
        return DirFiles(paths, self._manifest)


def _safe(part: str, fallback: str) -> str:
    return _SAFE.sub("_", part)[:100] or fallback


def _listed(manifest: Manifest, name: str) -> bool:
    """A name a snapshot directory may hold: a file of the manifest, and a plain file name."""
    return name in manifest.files and name not in ("", ".", "..", MANIFEST_FILE) and "/" not in name


def _real_dirs(parent: Path, prefix: str) -> list[Path]:
    """The directories directly in ``parent`` whose names start with ``prefix``: real ones only
    (a link is never followed), sorted; none when ``parent`` cannot be listed."""
    try:
        with os.scandir(parent) as it:
            return sorted(Path(e.path) for e in it if e.name.startswith(prefix) and e.is_dir(follow_symlinks=False))
    except OSError:
        return []


def _remove(step_dir: Path) -> None:
    """Delete a step directory so that no kill can leave a part of it under its own name: renamed
    out of ``step-*`` first (one atomic call), then removed. A worker killed in between leaves a
    ``.del-`` directory, which its restart removes; a restart never finds a snapshot that lost its
    manifest or some of its files half-way through a delete."""
    doomed = step_dir.with_name(f"{_DELETING}{step_dir.name}")
    try:
        os.rename(step_dir, doomed)
    except OSError:
        doomed = step_dir  # gone already, or cannot be renamed: remove what is there
    shutil.rmtree(doomed, ignore_errors=True)


def _write(path: Path, data: bytes | bytearray) -> None:
    fd = create_new(path)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


class TierStore:
    """One worker's view of its node's tier directory (see the module doc)."""

    def __init__(self, memory_dir: str, job: str, node: str, local_rank: int):
        self.tier_dir = Path(memory_dir) / f"ftrain-tier-{_safe(job, 'nojob')}"
        self.node_dir = self.tier_dir / _safe(node or socket.gethostname(), "node")
        self.own_dir = self.node_dir / f"local{local_rank}"
        self._written: dict[str, Path] = {}  #: key -> a step directory of this worker's to delete when superseded

    def open(self) -> None:
        """Create (``0700``) or check the tier directory, this node's and this worker's:
        UnsafeLocalDirError when one is not this user's alone, OSError when one cannot be made."""
        for path in (self.tier_dir, self.node_dir, self.own_dir):
            private_dir(path, SETTING)

    def persist(self, snap: Snapshot) -> Snapshot:
        """Write ``snap``'s files (bytes in memory) to this worker's directory; the same snapshot
        with its files now read from there. Raises OSError (the tmpfs is full, say): the caller
        keeps the bytes in memory instead."""
        final = self.own_dir / f"step-{snap.step:09d}-{snap.key}"
        if snap.key in self._written:
            return snap
        tmp = self.own_dir / f"{_WRITING}{final.name}-{os.getpid()}"
        try:
            os.mkdir(tmp, 0o700)
            for name, data in snap.files.items():
                if not _listed(snap.manifest, name):
                    raise ManifestError(f"memory tier: {name!r} is not a file of the manifest of step {snap.step}")
                _write(tmp / name, data)
            _write(tmp / MANIFEST_FILE, snap.manifest_bytes)
            os.rename(tmp, final)  # fails (kept in memory) if anything is there already
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self._written[snap.key] = final
        files = DirFiles({n: [final / n] for n in snap.files}, snap.manifest)
        return Snapshot(snap.step, snap.manifest, snap.manifest_bytes, files)

    def keep(self, snapshots: list[Snapshot]) -> None:
        """Delete this worker's step directories of snapshots not in ``snapshots``."""
        kept = {s.key for s in snapshots}
        for key in [k for k in self._written if k not in kept]:
            _remove(self._written.pop(key))

    def discover(self, hmac_key: bytes | None, job: str, binding: Binding) -> tuple[list[Snapshot], list[Skipped]]:
        """The snapshots this node's directory holds (every worker's of the node) that are this
        run's, oldest first, the files of one manifest found in several directories merged into
        one snapshot; and what was skipped, and why: a directory that cannot be a snapshot of this
        job (no manifest, one that does not parse or verify, another job's), a snapshot of another
        run (:func:`ftrain.recovery.tier_binding.binding_problem`), a file that is not a regular file of the
        size the manifest lists. Unfinished directories of this worker are removed. Digests are
        checked when a file is read (:meth:`DirFiles.read`)."""
        for prefix in (_WRITING, _DELETING):  # a worker of this local rank died writing or deleting it
            for tmp in _real_dirs(self.own_dir, prefix):
                shutil.rmtree(tmp, ignore_errors=True)
        found: dict[str, Snapshot] = {}
        skipped: list[Skipped] = []
        for local_dir in _real_dirs(self.node_dir, "local"):
            for step_dir in _real_dirs(local_dir, "step-"):
                snap = self._read(step_dir, hmac_key, job, binding, skipped)
                if snap is None:
                    continue
                if step_dir.parent == self.own_dir:
                    self._written[snap.key] = step_dir  # superseded by this worker's own snapshots later
                held = found.get(snap.key)
                if held is not None and isinstance(held.files, DirFiles) and isinstance(snap.files, DirFiles):
                    snap = Snapshot(snap.step, snap.manifest, snap.manifest_bytes, held.files.merged(snap.files))
                found[snap.key] = snap
        for s in skipped:
            log.warning("memory tier: %s not used: %s", s.path, s.why)
        return sorted(found.values(), key=lambda s: s.step), skipped

    def _read(
        self, step_dir: Path, hmac_key: bytes | None, job: str, binding: Binding, skipped: list[Skipped]
    ) -> Snapshot | None:
        try:
            manifest_bytes = read_regular(step_dir / MANIFEST_FILE, MAX_MANIFEST_BYTES)
            manifest = Manifest.from_json(manifest_bytes, hmac_key)
            if manifest.job != job:
                raise ManifestError(f"a snapshot of job {manifest.job!r}, not {job!r}")
            with os.scandir(step_dir) as it:
                entries = {e.name: e.stat(follow_symlinks=False) for e in it if e.name != MANIFEST_FILE}
        except (OSError, ManifestError, ValueError) as e:
            skipped.append(Skipped(str(step_dir), f"not a usable snapshot: {e}"))
            return None
        other_run = binding_problem(manifest, binding)
        if other_run:
            skipped.append(
                Skipped(str(step_dir), f"a snapshot of {other_run}: not resumed (rm -rf {step_dir} to free it)")
            )
            return None
        files: dict[str, list[Path]] = {}
        for name, st in sorted(entries.items()):
            if not _listed(manifest, name):
                continue
            problem = _file_problem(st, manifest.files[name].size_bytes)
            if problem:
                skipped.append(Skipped(str(step_dir / name), f"not used: {problem}"))
                continue
            files[name] = [step_dir / name]
        return Snapshot(manifest.step, manifest, manifest_bytes, DirFiles(files, manifest))

    def discard(self) -> None:
        """The job ended: delete everything this worker wrote, and the directories left empty."""
        for path in self._written.values():
            _remove(path)
        self._written.clear()
        for path in (self.own_dir, self.node_dir, self.tier_dir):
            try:
                path.rmdir()
            except OSError:
                break  # not empty (another worker's, or another node's), or gone


def _file_problem(st: os.stat_result, size_bytes: int) -> str:
    """Why a directory entry cannot be the file the manifest lists ("" if it can)."""
    if stat.S_ISLNK(st.st_mode):
        return "a symbolic link, not a regular file"
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    if st.st_size != size_bytes:
        return f"{st.st_size} bytes, the manifest lists {size_bytes}"
    return ""


__all__ = ["DirFiles", "MANIFEST_FILE", "SETTING", "Skipped", "Snapshot", "TierStore", "snapshot_key"]
