"""The checkpoint service a training job talks to: save (sync or async), load with
verification and fallback, retention.

Save: ``<root>/step-NNNNNNNNN/`` gets DCP shards and ``.metadata`` (digested while written),
then the coordinator writes ``manifest.json`` — the commit point — unless the fence says the
writer's round is stale. At most one save is in flight; the next one waits or is skipped
(``when_busy``). A failed background save is reported by :meth:`poll` on the next step.

Load: the newest committed step (or a pinned one) is verified before any tensor of it is used —
manifest (and HMAC); then each rank fetches the files its own DCP load plan needs, once each, by
concurrent ranged GETs (:mod:`ftrain.checkpoint.fetch`), and checks their digests; the files no rank
needs are verified by a pass split across ranks; one verdict for all — and only then DCP copies
tensors out of the verified bytes in memory (``.metadata`` is checked against the manifest and
unpickled with an allow-list). One read per byte. A bad step gets a ``corrupt.json`` marker
(nothing is deleted) and the previous committed step is tried.

What must stay true on load:

- Only a verified bad byte marks a step corrupt: a digest or size mismatch, a missing file, an
  unsafe or unparsable ``.metadata`` whose digest matched, a manifest that fails its HMAC, its
  job or the caller's ``validate``; and only the manifest that failed: the marker is written
  only while this writer's round is current and the step is still committed with the manifest
  the verdict was reached on (:meth:`CheckpointManager._mark_corrupt`). A storage error
  (transient after retries, fatal, any ``OSError``) fails the load attempt with
  :class:`CheckpointError` and writes no marker; every rank gets the same verdict (problems are
  gathered), so no rank waits alone in a collective.
- A step written by another kind of loop (a Session's step under ``ftrain train``, or the
  reverse: :data:`~ftrain.checkpoint.loading.WRITER_KEY` in its layout) is intact: the load
  raises :class:`~ftrain.checkpoint.loading.ForeignStepError` naming it, on every rank, before
  any file of it is read, and marks nothing.
- A job never starts from step 0 over steps it could not load: when step directories with
  manifests exist and none loads, ``on_no_loadable_step="fail"`` (the default) raises
  :class:`NoLoadableStepError` naming every step and why it was refused; ``"fresh"`` emits
  ``ckpt_fresh_start``, logs it loudly and returns None. A pinned ``load_step`` that cannot be
  loaded always raises. A root with no manifests at all starts fresh silently.
- After a fresh start the old directories never block saves: :meth:`StepPublisher.prepare`
  clears a step directory whose manifest is not committed under the current key and job.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import (
    AsyncCheckpointerType,
    AsyncSaveResponse,
)

from ftrain.checkpoint.config import DEFAULTS, ON_NO_LOADABLE_STEP
from ftrain.checkpoint.dcp_write import DigestingWriter
from ftrain.checkpoint.errors import (
    CheckpointError,
    StaleRoundError,
)
from ftrain.checkpoint.loading import CheckpointLoading, EventSink, describe_error
from ftrain.checkpoint.local_cache import LocalCache, StepCache
from ftrain.checkpoint.manifest import (
    job_problem,
    step_dir_name,
)
from ftrain.checkpoint.publish import Fence, StepPublisher
from ftrain.checkpoint.retention import GcStop, Retention, collect_garbage
from ftrain.checkpoint.save_process import SaveProcess
from ftrain.checkpoint.staging import new_stager
from ftrain.checkpoint.storage import Storage, StorageOptions
from ftrain.contract import events as ev

log = logging.getLogger(__name__)


def _no_event(record: ev.Record) -> None:
    return None


@dataclass
class SaveStatus:
    """What :meth:`CheckpointManager.poll` reports into each step's metrics."""

    last_committed_step: int = -1
    last_save_duration_s: float = 0.0
    saves_failed: int = 0
    saves_skipped: int = 0
    in_flight_step: int = -1
    last_error: str = ""
    consecutive_failures: int = 0
    """Failed saves since the last commit (skipped saves do not count); 0 after a commit."""


@dataclass
class _InFlight:
    step: int
    started: float
    future: Future


@dataclass(kw_only=True)
class CheckpointManager(CheckpointLoading):
    url: str
    options: StorageOptions = field(default_factory=StorageOptions)
    async_mode: str = DEFAULTS.async_mode  # off | thread | process
    when_busy: str = DEFAULTS.when_busy  # wait | skip
    digest: str = DEFAULTS.digest
    hmac_key_env: str = DEFAULTS.hmac_key_env
    job: str = ""
    """Job id written into every manifest and required of every manifest loaded (see
    :mod:`ftrain.checkpoint.catalog`); must be non-empty when ``hmac_key_env`` is set."""
    fence: Fence | None = None
    """The round fence of commits; where it records commits (an agent's job), its records are
    the commit point for every reader here too (:mod:`ftrain.checkpoint.catalog`)."""
    after_fence: Callable[[int], None] | None = None
    """A fault hook: :attr:`ftrain.checkpoint.publish.StepPublisher.after_fence`."""
    before_clear: Callable[[int], None] | None = None
    """A fault hook: :attr:`ftrain.checkpoint.publish.StepPublisher.before_clear`."""
    before_gc: Callable[[int], None] | None = None
    """A fault hook: :attr:`ftrain.checkpoint.retention.GcGuard.before_gc`."""
    round: int | None = None
    """The writer's round (its fencing token) for what it changes besides a save: retention's
    deletes and a load's corrupt markers, each fenced by it (see :meth:`collect_garbage`,
    :meth:`_mark_corrupt`). Each save's ``fields["round"]`` replaces it (the round of the last
    save). With a fence and no round known, neither is done."""
    keep_last: int = DEFAULTS.keep_last
    keep_every: int = DEFAULTS.keep_every
    gc_grace_s: float = DEFAULTS.gc_grace_s
    on_no_loadable_step: str = DEFAULTS.on_no_loadable_step  # fail | fresh (see the module doc)
    on_event: EventSink = _no_event
    device_type: str = "cpu"
    local_cache_dir: str = DEFAULTS.local_cache_dir
    """Where this node keeps its copy of the newest committed step
    (:mod:`ftrain.checkpoint.local_cache`); empty: off."""

    def __post_init__(self) -> None:
        why = job_problem(self.job)
        if why is not None:
            raise CheckpointError(f"checkpoint job id {why}")
        if self.hmac_key_env and not self.job:
            raise CheckpointError(
                f"signed manifests (HMAC key in {self.hmac_key_env}) are bound to a job id, but none was given"
            )
        if self.on_no_loadable_step not in ON_NO_LOADABLE_STEP:
            raise CheckpointError(
                f"on_no_loadable_step must be one of {ON_NO_LOADABLE_STEP}, got {self.on_no_loadable_step!r}"
            )
        self.storage = Storage(self.url, self.options)
        self.cache = LocalCache.open(self.local_cache_dir, self.url) if self.local_cache_dir else None
        self.status = SaveStatus()
        self._in_flight: _InFlight | None = None
        self._async_group = None
        self._stager = None
        self._staging: Future | None = None  #: the in-flight save's copy of the state, if not done
        self._gc: tuple[threading.Thread, GcStop] | None = None  #: retention running beside training
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self._save_process: SaveProcess | None = None
        self.load_reads = (0, 0)
        """Bytes this rank read in the last load attempt: all of them, and those from the local cache."""
        if self.async_mode != "off" and dist.is_initialized():
            # The async saves' own group (their collectives run beside training's), formed now,
            # while every rank builds its manager, not at the first save: a rendezvous in the
            # middle of a round is one that a peer's death leaves retrying it until the
            # process-group timeout, out of reach of the round watchdog. So is, in process mode,
            # the checkpoint process, started in the background from now.
            group = self._group()
            if self.async_mode == "process":
                self._save_process = SaveProcess(group)

    # -- saving --------------------------------------------------------------------------
    def save(
        self,
        step: int,
        state_dict: dict[str, Any],
        fields: dict[str, Any],
        *,
        sync: bool = False,
        extra_files: dict[str, bytes] | None = None,
    ) -> bool:
        """Save ``state_dict`` as step ``step``; returns False when skipped.

        ``fields`` are the manifest fields besides files (round, world_size, layout, config,
        config_hash, trainer, digest_algorithm). The training thread is blocked only for staging
        in async modes. ``sync=True`` forces a blocking save (final save on a graceful stop).
        ``extra_files``: files of the step besides DCP's (name -> bytes; the coordinator's are
        written, after ``.metadata`` and before the manifest, which lists them with their digests;
        a load reads one back with ``side``, see :meth:`load`).
        """
        if self._in_flight is not None:
            if self.when_busy == "skip" and not sync:
                self.status.saves_skipped += 1
                log.warning("checkpoint of step %d skipped: step %d still uploading", step, self._in_flight.step)
                self.on_event(ev.CkptSkipped(step=step, in_flight=self._in_flight.step))
                return False
            log.info("checkpoint of step %d waits for step %d to finish uploading", step, self._in_flight.step)
            self._wait_upload()
        dirname = step_dir_name(step)
        self._stop_gc(writing=dirname)
        round_ = fields.get("round")
        if isinstance(round_, int) and not isinstance(round_, bool):
            self.round = round_  # the retention after this commit is fenced by it
        publisher = StepPublisher(
            self.url,
            self.options,
            dirname,
            {**fields, "step": step, "digest_algorithm": self.digest, "job": self.job},
            self.hmac_key_env,
            self.fence,
            self.after_fence,
            self.before_clear,
        )
        writer = DigestingWriter(
            self.storage.child_url(dirname),
            options=self.options,
            algorithm=self.digest,
            publisher=publisher,
            cache=self._step_cache(dirname),
            extra_files=extra_files,
        )
        started = time.monotonic()
        if sync or self.async_mode == "off":
            try:
                dcp.save(state_dict, storage_writer=writer)
            except BaseException as e:  # CheckpointException derives from BaseException
                if isinstance(e, (KeyboardInterrupt, SystemExit)):
                    raise
                self._record_failure(step, e)
                return False
            self._record_commit(step, time.monotonic() - started)
            return True
        if self._save_process is not None:
            self._save_process.ready()  # started with the manager: this waits only if it is not up yet
        try:
            response = dcp.async_save(
                state_dict,
                storage_writer=writer,
                process_group=self._group(),
                async_checkpointer_type=AsyncCheckpointerType.PROCESS
                if self.async_mode == "process"
                else AsyncCheckpointerType.THREAD,
                async_stager=self._get_stager(),
            )
            if isinstance(response, AsyncSaveResponse):  # the copy runs on: see wait_staged()
                self._staging = response.staging_completion
        except BaseException as e:  # staging failed: report it like a failed upload; training goes on
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            self._record_failure(step, e)
            return False
        future = response.upload_completion if isinstance(response, AsyncSaveResponse) else response
        self._in_flight = _InFlight(step, started, future)
        self.status.in_flight_step = step
        self.on_event(ev.CkptStaged(step=step, staging_s=time.monotonic() - started))
        return True

    def wait_staged(self) -> None:
        """Until the in-flight save's copy of the state is complete: call it before anything
        changes the state that was saved (the next optimizer update). Training goes on beside
        the copy until then; a copy that failed is reported with the upload (:meth:`poll`)."""
        staging, self._staging = self._staging, None
        if staging is not None:
            try:
                staging.result()
            except BaseException as e:  # noqa: BLE001 - the upload future carries it too
                if isinstance(e, (KeyboardInterrupt, SystemExit)):
                    raise
                log.debug("checkpoint staging failed (reported with its upload): %s", e)

    @property
    def uploading(self) -> bool:
        """A background save has not been seen to finish (the next save would wait for it, or skip)."""
        return self._in_flight is not None

    def _group(self):
        if self._async_group is None and dist.is_initialized():
            self._async_group = dist.new_group(backend="gloo")
        return self._async_group

    def _get_stager(self):
        if self._stager is None:
            self._stager = new_stager(self.device_type, shared=self.async_mode == "process")
        return self._stager

    def poll(self) -> SaveStatus:
        """Check the in-flight save without blocking; surface its result."""
        flight = self._in_flight
        if flight is not None and flight.future.done():
            self._finish_in_flight(flight)
        return self.status

    def wait(self) -> SaveStatus:
        """Block until the in-flight save (if any) is committed or failed, and the retention
        after it has run."""
        self._wait_upload()
        if self._gc is not None:
            self._gc[0].join()
        return self.status

    def _wait_upload(self) -> None:
        flight = self._in_flight
        if flight is not None:
            try:
                flight.future.result()
            except BaseException:  # noqa: BLE001 - reported by _finish_in_flight
                pass
            self._finish_in_flight(flight)

    def _finish_in_flight(self, flight: _InFlight) -> None:
        """Record how ``flight``, the in-flight save, ended (its future is done)."""
        self._in_flight = None
        self.status.in_flight_step = -1
        err = flight.future.exception()
        if err is not None:
            self._record_failure(flight.step, err)
        else:
            self._record_commit(flight.step, time.monotonic() - flight.started)

    def _step_cache(self, dirname: str) -> StepCache | None:
        return self.cache.step(dirname) if self.cache is not None else None

    def _record_commit(self, step: int, duration_s: float) -> None:
        if self.cache is not None:
            self.cache.keep_only(step_dir_name(step))
        self.status.last_committed_step = step
        self.status.last_save_duration_s = duration_s
        self.status.last_error = ""
        self.status.consecutive_failures = 0
        log.info("checkpoint step %d committed in %.2fs", step, duration_s)
        self.on_event(ev.CkptCommitted(step=step, duration_s=duration_s))
        self._collect_garbage_later()

    def _record_failure(self, step: int, err: BaseException) -> None:
        self.status.saves_failed += 1
        self.status.consecutive_failures += 1
        stale = isinstance(err, StaleRoundError) or "StaleRoundError" in describe_error(err)
        self.status.last_error = describe_error(err)[:1000]
        log.error(
            "checkpoint of step %d FAILED (%s); training continues: %s",
            step,
            "stale round" if stale else "error",
            self.status.last_error,
        )
        self.on_event(ev.CkptFailed(step=step, error=self.status.last_error, stale_round=stale))

    # -- retention -----------------------------------------------------------------------
    def collect_garbage(self, stop: GcStop | None = None) -> list[str]:
        """Apply retention now (rank 0; after each commit it also runs in the background),
        fenced by :attr:`round` where there is a fence (:mod:`ftrain.checkpoint.retention`)."""
        if self.rank != 0:
            return []
        in_flight = {self._in_flight.step} if self._in_flight is not None else set()
        return collect_garbage(
            self.storage,
            Retention(self.keep_last, self.keep_every, self.gc_grace_s),
            in_flight=in_flight,
            hmac_key=self._hmac_key(),
            on_event=self.on_event,
            job=self.job,
            stop=stop,
            fence=self.fence,
            round_=self.round,
            before_gc=self.before_gc,
        )

    def _collect_garbage_later(self) -> None:
        """Retention after a commit, beside training (rank 0), so that it never lengthens a save
        (in a soak on a slow S3 it made saves outlast the checkpoint interval, and the loop waited).
        The next save or load stops it before its next directory (:meth:`_stop_gc`); a load waits
        for it to end, a save only while it deletes the directory the save writes (a torn step
        written again): a retention stuck on a storage that hangs never holds up training. The
        next commit runs it again."""
        if self.rank != 0:
            return
        self._stop_gc()
        stop = GcStop()

        def run() -> None:
            try:
                self.collect_garbage(stop)
            except Exception as e:  # noqa: BLE001 - retention must never fail a committed save
                log.warning("retention after a commit failed: %s", e)

        thread = threading.Thread(target=run, name="ckpt-retention", daemon=True)
        self._gc = (thread, stop)
        thread.start()

    def _stop_gc(self, writing: str | None = None) -> None:
        """Stop the retention running beside training; wait for it to end, or with ``writing``
        (a save's directory) only while it deletes that directory."""
        if self._gc is not None:
            thread, stop = self._gc
            stop.stop(writing)
            if writing is None:
                thread.join()
            self._gc = None

    def close(self, *, abandon: bool = False) -> None:
        """Wait for the save in flight and the retention after it, then end the checkpoint
        process and the stager. ``abandon``: the round ended broken and its process groups were
        aborted, so a save still in flight is not waited for (it may be blocked in a collective
        with a peer that is gone until the group's timeout) and counts as failed: it cannot
        commit anyway (its collectives fail, and its fence refuses an old round). Retention is
        told to stop, not waited for."""
        flight = self._in_flight
        if abandon and flight is not None and not flight.future.done():
            self._in_flight = None
            self.status.in_flight_step = -1
            self._record_failure(flight.step, CheckpointError("abandoned in flight: its round ended"))
        if abandon and self._gc is not None:
            self._gc[1].stop(None)
            self._gc = None
        self.wait()
        if self._save_process is not None:
            self._save_process.close()
            self._save_process = None
        if self._stager is not None:
            self._stager.release()
