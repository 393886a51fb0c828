"""The commit protocol's storage side for one step: before any rank writes, the step
directory is made safe to write (fence checked, a committed step refused, a torn or foreign
one cleared); after every file is stored, the manifest is written, and then the fence records
the commit — atomically with its round check, where it keeps records (an agent's job:
:mod:`ftrain.agent_link.fence`); that record is then the commit point, else the manifest is.

Runs wherever DCP's coordinator runs (the training thread, a background thread, a background
process), so :class:`StepPublisher` is picklable. Used by :class:`ftrain.checkpoint.manager.CheckpointManager`.

What must stay true: a writer whose round is no longer current changes nothing, and a committed
step is never removed nor its manifest replaced. A writer can be paused anywhere (SIGSTOP, a
frozen host, a long GC) and resume after a newer round formed and committed the same step, so
every change is fenced *immediately before* it is made, not once at the start: the fence is
checked, and the step judged again with the fence's records read then, right before the
directory is cleared (or its unfinished uploads aborted) and right before the manifest is
written; the commit record itself is one etcd transaction with the round check. What is left is
the time between that last etcd answer and the storage request (and the removal's own
duration): storage has no conditional delete or PUT that etcd's round could guard, so only
distinct paths per save attempt would close it (docs/security.md: the delete fence).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from ftrain.checkpoint.catalog import StepInfo, inspect_step, read_manifest
from ftrain.checkpoint.errors import CheckpointError, ManifestError
from ftrain.checkpoint.manifest import MANIFEST_NAME, FileEntry, Manifest, hmac_key_from_env, manifest_digest
from ftrain.checkpoint.storage import Storage, StorageOptions

log = logging.getLogger(__name__)


class Fence(Protocol):
    """The round fence of a job's commits (:class:`ftrain.agent_link.fence.EtcdRoundFence`)."""

    def check(self, round_: int) -> None:
        """StaleRoundError when ``round_`` is no longer the job's current round."""

    def record(self, round_: int, step: int, manifest_digest: str) -> None:
        """Record ``step`` as committed with this manifest digest, atomically with the check of
        ``check`` (StaleRoundError, nothing recorded, when the round moved on)."""

    def recorded(self) -> dict[int, str] | None:
        """Every recorded commit, ``{step: manifest digest}``; None if this fence keeps no
        records (the manifests are then the commit point)."""

    def forget(self, round_: int, expected: Mapping[int, str]) -> list[int]:
        """Drop the records of steps retention deleted, each only while ``round_`` is current
        and its record is still the one naming the digest in ``expected`` (atomically); the
        steps dropped (StaleRoundError when the round moved on)."""


def _other_job(storage: Storage, dirname: str, job: str) -> str | None:
    """The job named by ``dirname``'s manifest (read without a key) when it is another job's;
    None when there is no readable manifest or it is this job's."""
    try:
        manifest = read_manifest(storage, dirname)
    except (FileNotFoundError, ManifestError):
        return None
    return manifest.job if manifest.job and manifest.job != job else None


@dataclass
class StepPublisher:
    """The coordinator's storage work for one step (picklable, so it runs wherever DCP's
    coordinator runs: the training thread, a background thread or a background process).

    ``prepare`` checks the fence (a zombie of an old round must not even clear or write files
    the current round may be uploading), then refuses a step that is committed under the
    current key and job, and clears any other directory of the same step (torn, marked corrupt,
    or with a manifest that this key/job does not accept: e.g. the old steps after a fresh start)
    before any rank writes, after checking the fence and the step's state once more (see the
    module doc); ``commit`` checks the fence again, makes sure no other writer committed the
    step meanwhile and writes the manifest, then records the commit in the fence.
    ``fields["job"]`` is the writer's job id. Retention is the manager's, after the commit.
    """

    url: str
    options: StorageOptions
    dirname: str
    fields: dict[str, Any]
    hmac_key_env: str = ""
    fence: Fence | None = None
    #: called with the step after the commit's fence check, before the manifest is written (a
    #: fault hook: :func:`ftrain.faults.maybe_pause_after_fence`); picklable, or None
    after_fence: Callable[[int], None] | None = None
    #: called with the step after ``prepare`` inspected the step directory, before its fenced
    #: removal (a fault hook: :func:`ftrain.faults.maybe_pause_before_clear`); picklable, or None
    before_clear: Callable[[int], None] | None = None

    def prepare(self) -> None:
        storage = Storage(self.url, self.options)
        if not storage.listdir(self.dirname):
            self._before_clear()
            if self.fence is not None:
                self.fence.check(self.fields["round"])  # a zombie never aborts the current round's uploads
            storage.clear_multipart_uploads(self.dirname)  # what a save killed in its first upload left
            return
        if self.fence is not None:
            self.fence.check(self.fields["round"])  # a zombie is told so, before anything else
        info = self._inspect(storage)
        if info.state == "committed":
            raise CheckpointError(f"{self.dirname} is already committed; a step is never overwritten")
        other = _other_job(storage, self.dirname, self.fields["job"])
        if other is not None:
            raise CheckpointError(
                f"{self.dirname} holds a step of job {other!r}, not of this job "
                f"({self.fields['job']!r}): two jobs share {self.url}; give each job its own "
                "checkpoint.uri (nothing was deleted)"
            )
        self._before_clear()
        self._fenced_removal(storage)
        if info.state == "corrupt":
            log.warning(
                "clearing %s before saving it again: not a committed step under the current HMAC key and job %r (%s)",
                self.dirname,
                self.fields["job"],
                info.error,
            )
        else:
            log.warning("clearing %s (a torn earlier save) before saving it again", self.dirname)
        storage.remove(self.dirname, recursive=True)
        storage.clear_multipart_uploads(self.dirname)
        storage.retry(lambda: storage.fs.makedirs(storage.path(self.dirname), exist_ok=True), "mkdir")

    def _inspect(self, storage: Storage) -> StepInfo:
        recorded = self.fence.recorded() if self.fence is not None else None
        return inspect_step(
            storage, self.dirname, hmac_key_from_env(self.hmac_key_env), job=self.fields["job"], recorded=recorded
        )

    def _before_clear(self) -> None:
        if self.before_clear is not None:
            self.before_clear(self.fields["step"])

    def _fenced_removal(self, storage: Storage) -> None:
        """Immediately before this writer removes anything of the step: its round must still be
        current (StaleRoundError otherwise: a writer paused since it looked, whose round moved on,
        removes nothing) and the step must not have become committed meanwhile."""
        if self.fence is None:
            return  # no rounds: no writer of another round
        self.fence.check(self.fields["round"])
        self._refuse_if_committed(storage, "removed")

    def _refuse_if_committed(self, storage: Storage, what: str) -> None:
        """CheckpointError when the step is committed now (judged with the fence's records read
        now): a committed step is never removed nor its manifest replaced."""
        if self._inspect(storage).state == "committed":
            raise CheckpointError(
                f"{self.dirname} was committed by another writer since this save began; a committed step is "
                f"never {what} (nothing was changed)"
            )

    def commit(self, files: dict[str, FileEntry]) -> None:
        round_ = self.fields["round"]
        if self.fence is not None:
            self.fence.check(round_)  # a fenced-out worker stops here, most of the time
        if self.after_fence is not None:
            self.after_fence(self.fields["step"])
        manifest = Manifest(files=files, created_time=time.time(), **self.fields)
        storage = Storage(self.url, self.options)
        if self.fence is not None:  # a writer paused since its check must not replace a newer commit
            self._refuse_if_committed(storage, "overwritten")
        data = manifest.to_json(hmac_key_from_env(self.hmac_key_env))
        storage.write_bytes(f"{self.dirname}/{MANIFEST_NAME}", data)
        if self.fence is not None:
            # the commit point where the fence keeps records: one etcd transaction with the round
            # check, so a worker paused since the check above cannot commit for an old round
            self.fence.record(round_, manifest.step, manifest_digest(data))
        storage.write_bytes("latest", str(manifest.step).encode())


__all__ = ["Fence", "StepPublisher"]
