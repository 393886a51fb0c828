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
(:meth:`ftrain.memory_tier.MemoryTier.restore`), which checks every byte against the manifest
before any of it is used: nothing read from this directory is trusted (its manifests are parsed
as any manifest, signed ones checked with the job's key, and a file is only ever read by a name
the manifest lists).

Each worker deletes the snapshots it wrote (or found in its own ``local<n>`` directory) once
they are superseded, and everything it wrote when the job ends normally. A job that ends for good
any other way leaves its directory behind: ``rm -rf <memory_dir>/ftrain-tier-<job>``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import socket
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from checkpoint.errors import ManifestError
from checkpoint.manifest import Manifest

log = logging.getLogger(__name__)

#: the manifest's bytes inside a snapshot directory (a name no DCP file has)
MANIFEST_FILE = "snapshot-manifest.json"
#: the most bytes of a manifest read back (a listing of every file's digest and blocks)
MAX_MANIFEST_BYTES = 64 << 20
_SAFE = re.compile(r"[^A-Za-z0-9._-]")


@dataclass(slots=True)
class Snapshot:
    """One step of this rank's memory tier: the manifest (parsed, and its bytes), and the files
    this rank holds of it (``.metadata``, its own shards, its buddy's): bytes in its memory, or
    :class:`DirFiles` read from the node's tier directory. Held files are checked against the
    manifest before they are used."""

    step: int
    manifest: Manifest
    manifest_bytes: bytes
    files: Mapping[str, bytes]

    @property
    def key(self) -> str:
        """The manifest's identity: ranks agree on a snapshot only if they hold the same one."""
        return snapshot_key(self.manifest_bytes)

    def holdings(self) -> dict[str, Any]:
        return {"step": self.step, "key": self.key, "files": sorted(self.files), "all": sorted(self.manifest.files)}


def snapshot_key(manifest_bytes: bytes) -> str:
    return hashlib.sha256(manifest_bytes).hexdigest()[:32]


class DirFiles(Mapping[str, bytes]):
    """Files of a snapshot in tier directories: the names known up front, the bytes read when
    asked for (a tmpfs read: a memory copy)."""

    def __init__(self, paths: Mapping[str, Path]):
        self._paths = dict(paths)

    def __getitem__(self, name: str) -> bytes:
        return self._paths[name].read_bytes()

    def __iter__(self) -> Iterator[str]:
        return iter(self._paths)

    def __len__(self) -> int:
        return len(self._paths)

    def merged(self, other: DirFiles) -> DirFiles:
        return DirFiles({**other._paths, **self._paths})


def _safe(part: str, fallback: str) -> str:
    return _SAFE.sub("_", part)[:100] or fallback


def _listed(manifest: Manifest, name: str) -> bool:
    """A name a snapshot directory may hold: a file of the manifest, and a plain file name."""
    return name in manifest.files and name not in ("", ".", "..", MANIFEST_FILE) and "/" not in name


class TierStore:
    """One worker's view of its node's tier directory (see the module doc)."""

    def __init__(self, memory_dir: str, job: str, node: str, local_rank: int):
        self.node_dir = (
            Path(memory_dir) / f"ftrain-tier-{_safe(job, 'nojob')}" / _safe(node or socket.gethostname(), "node")
        )
        self.own_dir = self.node_dir / f"local{local_rank}"
        self._written: dict[str, Path] = {}  #: key -> a step directory of this worker's to delete when superseded

    def persist(self, snap: Snapshot) -> Snapshot:
        """Write ``snap``'s files (bytes in memory) to this worker's directory; the same snapshot
        with its files now read from there. Raises OSError (the tmpfs is full, say): the caller
        keeps the bytes in memory instead."""
        final = self.own_dir / f"step-{snap.step:09d}-{snap.key}"
        if snap.key in self._written:
            return snap
        tmp = self.own_dir / f".tmp-{final.name}-{os.getpid()}"
        try:
            tmp.mkdir(parents=True, exist_ok=False)
            for name, data in snap.files.items():
                if not _listed(snap.manifest, name):
                    raise ManifestError(f"memory tier: {name!r} is not a file of the manifest of step {snap.step}")
                (tmp / name).write_bytes(data)
            (tmp / MANIFEST_FILE).write_bytes(snap.manifest_bytes)
            os.replace(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self._written[snap.key] = final
        return Snapshot(snap.step, snap.manifest, snap.manifest_bytes, DirFiles({n: final / n for n in snap.files}))

    def keep(self, snapshots: list[Snapshot]) -> None:
        """Delete this worker's step directories of snapshots not in ``snapshots``."""
        kept = {s.key for s in snapshots}
        for key in [k for k in self._written if k not in kept]:
            shutil.rmtree(self._written.pop(key), ignore_errors=True)

    def discover(self, hmac_key: bytes | None, job: str) -> list[Snapshot]:
        """The snapshots this node's directory holds (every worker's of the node), oldest first,
        the files of one manifest found in several directories merged into one snapshot. A
        directory that cannot be a snapshot of this job (no manifest, one that does not parse or
        verify, another job's) is skipped with a warning; unfinished ones of this worker are
        removed. Sizes and digests are not checked here: the restore checks every byte it uses."""
        for tmp in self.own_dir.glob(".tmp-*") if self.own_dir.is_dir() else []:
            shutil.rmtree(tmp, ignore_errors=True)  # a worker of this local rank died writing it
        found: dict[str, Snapshot] = {}
        for step_dir in sorted(self.node_dir.glob("local*/step-*")):
            snap = self._read(step_dir, hmac_key, job)
            if snap is None:
                continue
            if step_dir.parent == self.own_dir:
                self._written[snap.key] = step_dir  # superseded by this worker's own snapshots later
            held = found.get(snap.key)
            if held is not None and isinstance(held.files, DirFiles) and isinstance(snap.files, DirFiles):
                snap = Snapshot(snap.step, snap.manifest, snap.manifest_bytes, held.files.merged(snap.files))
            found[snap.key] = snap
        return sorted(found.values(), key=lambda s: s.step)

    def _read(self, step_dir: Path, hmac_key: bytes | None, job: str) -> Snapshot | None:
        try:
            with open(step_dir / MANIFEST_FILE, "rb") as fh:
                manifest_bytes = fh.read(MAX_MANIFEST_BYTES + 1)
            if len(manifest_bytes) > MAX_MANIFEST_BYTES:
                raise ManifestError(f"larger than {MAX_MANIFEST_BYTES} bytes")
            manifest = Manifest.from_json(manifest_bytes, hmac_key)
            if manifest.job != job:
                raise ManifestError(f"a snapshot of job {manifest.job!r}, not {job!r}")
            names = [p.name for p in step_dir.iterdir() if p.name != MANIFEST_FILE]
        except (OSError, ManifestError, ValueError) as e:
            log.warning("memory tier: %s is not a usable snapshot (ignored): %s", step_dir, e)
            return None
        files = {n: step_dir / n for n in names if _listed(manifest, n)}
        return Snapshot(manifest.step, manifest, manifest_bytes, DirFiles(files))

    def discard(self) -> None:
        """The job ended: delete everything this worker wrote, and the directories left empty."""
        for path in self._written.values():
            shutil.rmtree(path, ignore_errors=True)
        self._written.clear()
        for path in (self.own_dir, self.node_dir, self.node_dir.parent):
            try:
                path.rmdir()
            except OSError:
                break  # not empty (another worker's, or another node's), or gone


__all__ = ["DirFiles", "MANIFEST_FILE", "Snapshot", "TierStore", "snapshot_key"]
