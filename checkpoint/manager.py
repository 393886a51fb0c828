"""The checkpoint service a training job talks to: save (sync or async), load with
verification and fallback, retention.

Save: ``<root>/step-NNNNNNNNN/`` gets DCP shards and ``.metadata`` (digested while written),
then the coordinator writes ``manifest.json`` — the commit point — unless the fence says the
writer's round is stale. At most one save is in flight; the next one waits or is skipped
(``when_busy``). A failed background save is reported by :meth:`poll` on the next step.

Load: the newest committed step (or a pinned one) is verified — manifest (and HMAC), then every
file's digest, the work split across ranks and one verdict for all — and only then read by DCP,
whose ``.metadata`` is checked against the manifest and unpickled with an allow-list. A bad step
gets a ``corrupt.json`` marker (nothing is deleted) and the previous committed step is tried.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from checkpoint.catalog import StepInfo, list_steps
from checkpoint.dcp_io import METADATA_NAME, DigestingWriter, VerifiedReader
from checkpoint.errors import (
    ChecksumMismatchError,
    CheckpointError,
    StaleRoundError,
    UnsafePickleError,
)
from checkpoint.manifest import CORRUPT_NAME, MANIFEST_NAME, FileEntry, Manifest, hmac_key_from_env, step_dir_name
from checkpoint.retention import apply_gc, modified_times, plan_gc
from checkpoint.storage import Storage, StorageOptions
from checkpoint.verify import CORRUPTION_KINDS, Problem, check_metadata_safe, mark_corrupt, split_files, verify_files

log = logging.getLogger(__name__)

EventSink = Callable[..., None]


class Fence(Protocol):
    """Raises StaleRoundError when ``round_`` is no longer the job's current round."""

    def check(self, round_: int) -> None: ...


def describe_error(err: BaseException) -> str:
    """One line per failing rank for DCP's CheckpointException (its str is a traceback dump)."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:
        parts = []
        for rank, wrapped in sorted(failures.items()):
            exc = wrapped[0] if isinstance(wrapped, tuple) else getattr(wrapped, "exc", wrapped)
            parts.append(f"rank {rank}: {type(exc).__name__}: {exc}")
        return "; ".join(parts)
    return f"{type(err).__name__}: {err}"


_CORRUPTION_TYPES = (ChecksumMismatchError, UnsafePickleError)
#: DCP re-raises a failed metadata read as a bare AssertionError carrying only the message.
_CORRUPTION_TEXT = ("ChecksumMismatchError", "UnsafePickleError", "DCP metadata", "does not match the manifest",
                    "changed since it was verified")


def _is_corruption(err: BaseException) -> bool:
    """Did a load fail because the bytes were not what the manifest promised (vs. an I/O error)?"""
    if isinstance(err, _CORRUPTION_TYPES):
        return True
    failures = getattr(err, "failures", None) or {}
    for wrapped in failures.values():
        exc = wrapped[0] if isinstance(wrapped, tuple) else getattr(wrapped, "exc", wrapped)
        if isinstance(exc, _CORRUPTION_TYPES):
            return True
    text = describe_error(err) + repr(err)
    return any(marker in text for marker in _CORRUPTION_TEXT)


def _no_event(name: str, **fields: Any) -> None:
    return None


@dataclass
class Retention:
    keep_last: int = 3
    keep_every: int = 0
    grace_s: float = 3600.0


def collect_garbage(storage: Storage, retention: Retention, *, in_flight: set[int], hmac_key: bytes | None,
                    on_event: EventSink = _no_event) -> list[str]:
    """Apply retention: never touches the newest committed step or an in-flight one."""
    steps = list_steps(storage, hmac_key)
    plan = plan_gc(steps, keep_last=retention.keep_last, keep_every=retention.keep_every, in_flight=in_flight,
                   now_s=time.time(), modified_s=modified_times(storage, [s.dirname for s in steps
                                                                          if s.state != "committed"]),
                   grace_s=retention.grace_s)
    if plan.delete:
        apply_gc(storage, plan)
        log.info("retention removed %s", ", ".join(plan.delete))
        on_event("ckpt_gc", deleted=plan.delete)
    return plan.delete


@dataclass
class StepPublisher:
    """The coordinator's storage work for one step (picklable, so it runs wherever DCP's
    coordinator runs: the training thread, a background thread or a background process).

    ``prepare`` checks the fence (a zombie of an old round must not even clear or write files
    the current round may be uploading), then clears a torn directory of the same step before
    any rank writes; ``commit`` checks the fence again, writes the manifest (the commit point),
    then applies retention.
    """

    url: str
    options: StorageOptions
    dirname: str
    fields: dict[str, Any]
    hmac_key_env: str = ""
    fence: Fence | None = None
    retention: Retention | None = None

    def prepare(self) -> None:
        if self.fence is not None:
            self.fence.check(self.fields["round"])
        storage = Storage(self.url, self.options)
        if not storage.listdir(self.dirname):
            return
        if storage.exists(f"{self.dirname}/{MANIFEST_NAME}") and not storage.exists(f"{self.dirname}/{CORRUPT_NAME}"):
            raise CheckpointError(f"{self.dirname} is already committed; a step is never overwritten")
        log.warning("clearing %s (a torn or corrupt earlier save) before saving it again", self.dirname)
        storage.remove(self.dirname, recursive=True)
        storage.clear_multipart_uploads(self.dirname)
        storage.retry(lambda: storage.fs.makedirs(storage.path(self.dirname), exist_ok=True), "mkdir")

    def commit(self, files: dict[str, FileEntry]) -> None:
        if self.fence is not None:
            self.fence.check(self.fields["round"])
        manifest = Manifest(files=files, created_time=time.time(), **self.fields)
        storage = Storage(self.url, self.options)
        hmac_key = hmac_key_from_env(self.hmac_key_env)
        storage.write_bytes(f"{self.dirname}/{MANIFEST_NAME}", manifest.to_json(hmac_key))
        storage.write_bytes("latest", str(manifest.step).encode())
        if self.retention is not None:
            try:
                collect_garbage(storage, self.retention, in_flight=set(), hmac_key=hmac_key)
            except Exception as e:  # noqa: BLE001 - retention must never fail a committed save
                log.warning("retention after committing %s failed: %s", self.dirname, e)


@dataclass
class SaveStatus:
    """What :meth:`CheckpointManager.poll` reports into each step's metrics."""

    last_committed_step: int = -1
    last_save_duration_s: float = 0.0
    saves_failed: int = 0
    saves_skipped: int = 0
    in_flight_step: int = -1
    last_error: str = ""


@dataclass
class _InFlight:
    step: int
    started: float
    future: Future


@dataclass(kw_only=True)
class CheckpointManager:
    url: str
    options: StorageOptions = field(default_factory=StorageOptions)
    async_mode: str = "thread"  # off | thread | process
    when_busy: str = "wait"  # wait | skip
    digest: str = "xxh3_128"
    hmac_key_env: str = ""
    fence: Fence | None = None
    keep_last: int = 3
    keep_every: int = 0
    gc_grace_s: float = 3600.0
    on_event: EventSink = _no_event
    device_type: str = "cpu"

    def __post_init__(self) -> None:
        self.storage = Storage(self.url, self.options)
        self.status = SaveStatus()
        self._in_flight: _InFlight | None = None
        self._async_group = None
        self._stager = None
        self.rank = dist.get_rank() if dist.is_initialized() else 0

    # -- saving --------------------------------------------------------------------------
    def save(self, step: int, state_dict: dict[str, Any], fields: dict[str, Any], *, sync: bool = False) -> bool:
        """Save ``state_dict`` as step ``step``; returns False when skipped.

        ``fields`` are the manifest fields besides files (round, world_size, layout, config,
        config_hash, trainer, digest_algorithm). The training thread is blocked only for staging
        in async modes. ``sync=True`` forces a blocking save (final save on a graceful stop).
        """
        if self._in_flight is not None:
            if self.when_busy == "skip" and not sync:
                self.status.saves_skipped += 1
                log.warning("checkpoint of step %d skipped: step %d still uploading", step, self._in_flight.step)
                self.on_event("ckpt_skipped", step=step, in_flight=self._in_flight.step)
                return False
            log.info("checkpoint of step %d waits for step %d to finish uploading", step, self._in_flight.step)
            self.wait()
        dirname = step_dir_name(step)
        publisher = StepPublisher(self.url, self.options, dirname,
                                  {**fields, "step": step, "digest_algorithm": self.digest},
                                  self.hmac_key_env, self.fence,
                                  Retention(self.keep_last, self.keep_every, self.gc_grace_s))
        writer = DigestingWriter(self.storage.child_url(dirname), options=self.options, algorithm=self.digest,
                                 publisher=publisher)
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
        try:
            response = dcp.async_save(
                state_dict, storage_writer=writer, process_group=self._group(),
                async_checkpointer_type=AsyncCheckpointerType.PROCESS if self.async_mode == "process"
                else AsyncCheckpointerType.THREAD,
                async_stager=self._get_stager(),
            )
            if isinstance(response, AsyncSaveResponse):
                response.staging_completion.result()
        except BaseException as e:  # staging failed: report it like a failed upload; training goes on
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            self._record_failure(step, e)
            return False
        future = response.upload_completion if isinstance(response, AsyncSaveResponse) else response
        self._in_flight = _InFlight(step, started, future)
        self.status.in_flight_step = step
        self.on_event("ckpt_staged", step=step, staging_s=time.monotonic() - started)
        return True

    def _group(self):
        if self._async_group is None and dist.is_initialized():
            self._async_group = dist.new_group(backend="gloo")
        return self._async_group

    def _get_stager(self):
        if self._stager is None:
            if self.device_type == "cuda":
                self._stager = DefaultStager()
            else:  # the default pinned/non-blocking copies need an accelerator
                self._stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False,
                                                            use_async_staging=False, use_non_blocking_copy=False))
        return self._stager

    def poll(self) -> SaveStatus:
        """Check the in-flight save without blocking; surface its result."""
        if self._in_flight is not None and self._in_flight.future.done():
            self._finish_in_flight()
        return self.status

    def wait(self) -> SaveStatus:
        """Block until the in-flight save (if any) is committed or failed."""
        if self._in_flight is not None:
            try:
                self._in_flight.future.result()
            except BaseException:  # noqa: BLE001 - reported by _finish_in_flight
                pass
            self._finish_in_flight()
        return self.status

    def _finish_in_flight(self) -> None:
        flight, self._in_flight = self._in_flight, None
        self.status.in_flight_step = -1
        err = flight.future.exception()
        if err is not None:
            self._record_failure(flight.step, err)
        else:
            self._record_commit(flight.step, time.monotonic() - flight.started)

    def _record_commit(self, step: int, duration_s: float) -> None:
        self.status.last_committed_step = step
        self.status.last_save_duration_s = duration_s
        self.status.last_error = ""
        log.info("checkpoint step %d committed in %.2fs", step, duration_s)
        self.on_event("ckpt_committed", step=step, duration_s=duration_s)

    def _record_failure(self, step: int, err: BaseException) -> None:
        self.status.saves_failed += 1
        stale = isinstance(err, StaleRoundError) or "StaleRoundError" in describe_error(err)
        self.status.last_error = describe_error(err)[:1000]
        log.error("checkpoint of step %d FAILED (%s); training continues: %s", step,
                  "stale round" if stale else "error", self.status.last_error)
        self.on_event("ckpt_failed", step=step, error=self.status.last_error, stale_round=stale)

    # -- loading -------------------------------------------------------------------------
    def committed_steps(self) -> list[StepInfo]:
        steps = list_steps(self.storage, hmac_key_from_env(self.hmac_key_env))
        return [s for s in steps if s.state == "committed"]

    def load(self, build_state_dict: Callable[[Manifest], dict[str, Any]], *, load_step: int = -1) -> Manifest | None:
        """Load the newest verified committed step (or ``load_step``) into the state dict that
        ``build_state_dict(manifest)`` returns; None if there is nothing to load."""
        candidates = self._agree(self._candidates(load_step) if self.rank == 0 else None)
        for info in candidates:
            problems = self._verify_everywhere(info)
            if any(p.kind in CORRUPTION_KINDS for p in problems):
                self._reject(info, problems)
                continue
            if problems:  # unreadable (permissions...): not proof of corruption, so no marker
                raise CheckpointError(f"{info.dirname} cannot be read: " + "; ".join(map(str, problems[:5])))
            manifest = info.manifest
            state_dict = build_state_dict(manifest)
            reader = VerifiedReader(self.storage.child_url(info.dirname), options=self.options,
                                    files=manifest.files, algorithm=manifest.digest_algorithm)
            try:
                dcp.load(state_dict, storage_reader=reader)
            except BaseException as e:  # noqa: BLE001 - CheckpointException wraps per-rank errors
                if isinstance(e, (KeyboardInterrupt, SystemExit)) or not _is_corruption(e):
                    raise
                self._reject(info, [Problem(METADATA_NAME, "digest", describe_error(e)[:300])])
                continue
            self.on_event("ckpt_loaded", step=info.step, world_size=manifest.world_size)
            log.info("loaded checkpoint step %d (saved at world size %d)", info.step, manifest.world_size)
            return manifest
        if load_step >= 0:
            raise CheckpointError(f"checkpoint.load_step={load_step} is not a committed, verified step under {self.url}")
        return None

    def _candidates(self, load_step: int) -> list[StepInfo]:
        steps = self.committed_steps()
        if load_step >= 0:
            steps = [s for s in steps if s.step == load_step]
        return sorted(steps, key=lambda s: s.step, reverse=True)

    def _agree(self, value: Any) -> Any:
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _verify_everywhere(self, info: StepInfo) -> list[Problem]:
        world = dist.get_world_size() if dist.is_initialized() else 1
        names = split_files(info.manifest, self.rank, world)
        mine = verify_files(self.storage, info.dirname, info.manifest, names)
        if METADATA_NAME in names and not mine:
            mine = check_metadata_safe(self.storage, info.dirname)
        if world == 1:
            return mine
        gathered: list[list[Problem]] = [[] for _ in range(world)]
        dist.all_gather_object(gathered, mine)
        return [p for problems in gathered for p in problems]

    def _reject(self, info: StepInfo, problems: list[Problem]) -> None:
        text = "; ".join(str(p) for p in problems[:5])
        log.error("checkpoint step %d is corrupt, falling back: %s", info.step, text)
        self.on_event("ckpt_corrupt", step=info.step, problems=[str(p) for p in problems])
        if self.rank == 0:
            mark_corrupt(self.storage, info.dirname, problems, reason="verification before load failed")
        if dist.is_initialized():
            dist.barrier()

    # -- retention -----------------------------------------------------------------------
    def collect_garbage(self) -> list[str]:
        """Apply retention now (rank 0; saves also apply it after each commit)."""
        if self.rank != 0:
            return []
        in_flight = {self._in_flight.step} if self._in_flight is not None else set()
        return collect_garbage(self.storage, Retention(self.keep_last, self.keep_every, self.gc_grace_s),
                               in_flight=in_flight, hmac_key=hmac_key_from_env(self.hmac_key_env),
                               on_event=self.on_event)

    def close(self) -> None:
        self.wait()
        if self._stager is not None:
            self._stager.close()
