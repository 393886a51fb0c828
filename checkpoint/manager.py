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
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.state_dict_saver import (
    AsyncCheckpointerType,
    AsyncSaveResponse,
)

from ftrain.checkpoint.catalog import StepInfo, inspect_step, list_steps
from ftrain.checkpoint.config import DEFAULTS, ON_NO_LOADABLE_STEP
from ftrain.checkpoint.dcp_read import METADATA_NAME, VerifiedReader, load_metadata, needed_ranges
from ftrain.checkpoint.dcp_write import DigestingWriter
from ftrain.checkpoint.errors import (
    CheckpointError,
    ChecksumMismatchError,
    FatalStorageError,
    ManifestError,
    StaleRoundError,
    TransientStorageError,
    UnsafePickleError,
)
from ftrain.checkpoint.fetch import SparseFile, fetch_files, pieces_for, verification_share
from ftrain.checkpoint.local_cache import LocalCache, StepCache
from ftrain.checkpoint.manifest import (
    MANIFEST_NAME,
    Manifest,
    hmac_key_from_env,
    job_problem,
    step_dir_name,
)
from ftrain.checkpoint.publish import Fence, StepPublisher
from ftrain.checkpoint.retention import GcStop, Retention, collect_garbage
from ftrain.checkpoint.safe_pickle import SafeLoadPlanner
from ftrain.checkpoint.save_process import SaveProcess
from ftrain.checkpoint.staging import new_stager
from ftrain.checkpoint.storage import Storage, StorageOptions
from ftrain.checkpoint.verify import (
    CORRUPTION_KINDS,
    Problem,
    check_pickled_items,
    mark_corrupt,
)
from ftrain.contract import events as ev

log = logging.getLogger(__name__)

EventSink = Callable[[ev.Record], Any]


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
#: Errors of storage, not of the bytes: they never mark a step corrupt.
_STORAGE_TYPES = (TransientStorageError, FatalStorageError, OSError)
#: DCP re-raises a failed metadata read as a bare AssertionError carrying only the message.
_CORRUPTION_TEXT = (
    "ChecksumMismatchError",
    "UnsafePickleError",
    "UnsafeMetadataError",
    "DCP metadata",
    "does not match the manifest",
    "changed since it was verified",
)


def _exceptions(err: BaseException) -> list[BaseException]:
    """``err``, each rank's error inside a DCP CheckpointException, and their causes."""
    roots: list[object] = [err]  # what a CheckpointException wraps may be anything
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict):
        for wrapped in failures.values():
            roots.append(wrapped[0] if isinstance(wrapped, tuple) else getattr(wrapped, "exc", wrapped))
    found: list[BaseException] = []
    for root in roots:
        exc: object = root
        while isinstance(exc, BaseException) and exc not in found and len(found) < 64:
            found.append(exc)
            exc = exc.__cause__ or exc.__context__
    return found


def _is_corruption(err: BaseException) -> bool:
    """Did a load fail because the bytes were not what the manifest promised?

    A typed corruption error anywhere (any rank, any cause) says yes; otherwise a storage error
    anywhere says no (an I/O failure proves nothing about the bytes); only an untyped error
    (DCP's bare AssertionError) is judged by its text.
    """
    excs = _exceptions(err)
    if any(isinstance(e, _CORRUPTION_TYPES) for e in excs):
        return True
    if any(isinstance(e, _STORAGE_TYPES) for e in excs):
        return False
    text = describe_error(err) + repr(err)
    return any(marker in text for marker in _CORRUPTION_TEXT)


@dataclass(slots=True)
class Refusal:
    """One step a load could not use, and why (manifest, HMAC, job, digests, marker...)."""

    step: int
    reason: str

    def __str__(self) -> str:
        return f"step {self.step}: {self.reason}"


class NoLoadableStepError(CheckpointError):
    """Steps with manifests exist under the root but none can be loaded (or a pinned
    ``load_step`` cannot): starting from step 0 over them would lose the run silently."""

    #: Restarting cannot help (the same steps would be refused again): a supervisor that reads
    #: this attribute (ftrain's node agent does) ends the job with the message instead.
    fatal = True

    def __init__(self, url: str, refusals: list[Refusal], *, load_step: int = -1):
        self.url = url
        self.refusals = list(refusals)
        self.load_step = load_step
        listing = "\n".join(f"  - {r}"[:1200] for r in self.refusals) or "  (none)"
        if load_step >= 0:
            message = (
                f"checkpoint.load_step={load_step} cannot be loaded from {url}:\n{listing}\n"
                f"Pick a committed step (ftrain ckpt ls {url}) or set checkpoint.load_step=-1."
            )
        else:
            message = (
                f"no checkpoint step under {url} can be loaded, but {len(self.refusals)} step(s) with "
                f"manifests exist; refusing to start from step 0 over them:\n{listing}\n"
                "Fix the cause (the HMAC key in checkpoint.hmac_key_env, the job id FTRAIN_JOB / "
                "agent.job, checkpoint.uri, or the storage), or set checkpoint.on_no_loadable_step=fresh "
                "to start from step 0 (the new run replaces those step directories as it saves)."
            )
        super().__init__(message)


def _parse_quietly(data: bytes) -> Metadata | None:
    """``.metadata`` parsed with the allow-list unpickler, or None (rank 0's check says why)."""
    try:
        return load_metadata(data)
    except Exception:  # noqa: BLE001 - judged by check_pickled_items, not here
        return None


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
class CheckpointManager:
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

    # -- loading -------------------------------------------------------------------------
    def _hmac_key(self) -> bytes | None:
        return hmac_key_from_env(self.hmac_key_env)

    def _recorded(self) -> dict[int, str] | None:
        """The fence's commit records (None: it keeps none, the manifests are the commit point)."""
        return self.fence.recorded() if self.fence is not None else None

    def committed_steps(self) -> list[StepInfo]:
        steps = list_steps(self.storage, self._hmac_key(), job=self.job, recorded=self._recorded())
        return [s for s in steps if s.state == "committed"]

    def newest_committed_step(self) -> int:
        """Collective: the newest committed step under ``url`` as rank 0 lists it (-1: none), on
        every rank (a listing error raises on every rank)."""
        return self._agree_or_raise(lambda: max((s.step for s in self.committed_steps()), default=-1))

    def load(
        self,
        build_state_dict: Callable[[Manifest], dict[str, Any]],
        *,
        load_step: int = -1,
        validate: Callable[[Manifest], None] | None = None,
    ) -> Manifest | None:
        """Load the newest verified committed step (or ``load_step``) into the state dict that
        ``build_state_dict(manifest)`` returns; None if there is nothing to load (or, with
        ``on_no_loadable_step="fresh"``, nothing loadable). See the module doc for the rules.

        ``validate(manifest)`` checks what the caller needs of the manifest (its trainer state)
        before any file is read; a :class:`ManifestError` (or ValueError/TypeError/KeyError) from
        it makes the step corrupt (marked, fall back). ``build_state_dict`` must not judge the
        manifest: what it raises propagates.
        """
        self._stop_gc()  # it must not delete a step that this load falls back to
        candidates, refusals = self._agree_or_raise(lambda: self._survey(load_step))
        for info in candidates:
            manifest, refusal = self._try_load(info, build_state_dict, validate)
            if manifest is not None:
                self._loaded(info, manifest, refusals)
                return manifest
            refusals.append(refusal)
        self._nothing_loaded(refusals, load_step)  # raises, or the job starts fresh
        return None

    def _survey(self, load_step: int) -> tuple[list[StepInfo], list[Refusal]]:
        """Rank 0's view: committed candidates newest first, and the steps already refused."""
        steps = self._steps_with_manifests()
        if load_step >= 0:
            steps = [s for s in steps if s.step == load_step]
            if not steps:
                return [], [Refusal(load_step, f"no directory {step_dir_name(load_step)} with a manifest")]
        candidates = sorted((s for s in steps if s.state == "committed"), key=lambda s: s.step, reverse=True)
        refusals = [Refusal(s.step, s.error or "corrupt") for s in steps if s.state == "corrupt"]
        return candidates, sorted(refusals, key=lambda r: -r.step)

    def _steps_with_manifests(self) -> list[StepInfo]:
        """Every step directory that has a manifest (committed or corrupt), ascending by step."""
        steps = list_steps(self.storage, self._hmac_key(), job=self.job, recorded=self._recorded())
        return [s for s in steps if s.state != "uncommitted"]

    def _try_load(
        self,
        info: StepInfo,
        build_state_dict: Callable[[Manifest], dict[str, Any]],
        validate: Callable[[Manifest], None] | None,
    ) -> tuple[Manifest | None, Refusal | None]:
        """Verify then read one step: (manifest, None) when loaded, (None, refusal) when the step
        is corrupt (marked). A storage error raises CheckpointError on every rank, marks nothing."""
        manifest = info.manifest
        if manifest is None:  # _survey hands over committed steps only, and their manifests parsed
            raise CheckpointError(f"{info.dirname} has no parsed manifest; only a committed step can be loaded")
        state_dict = build_state_dict(manifest)
        problems, fetched, metadata = self._fetch_everywhere(info, manifest, validate, state_dict)
        if any(p.kind in CORRUPTION_KINDS for p in problems):
            self._reject(info, problems)
            return None, Refusal(info.step, "; ".join(str(p) for p in problems[:5]))
        if problems:  # unreadable / storage errors: not proof of corruption, so no marker
            raise CheckpointError(
                f"{info.dirname} cannot be read (a storage problem, not corruption; nothing was "
                "marked): " + "; ".join(map(str, problems[:5]))
            )
        reader = VerifiedReader(
            self.storage.child_url(info.dirname),
            options=self.options,
            files=manifest.files,
            algorithm=manifest.digest_algorithm,
            prefetched=fetched,
            metadata=metadata,
        )
        try:
            dcp.load(state_dict, storage_reader=reader, planner=SafeLoadPlanner())
        except BaseException as e:  # noqa: BLE001 - CheckpointException wraps per-rank errors
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            if not _is_corruption(e):
                raise CheckpointError(
                    f"reading {info.dirname} failed, not proof of corruption (nothing was "
                    f"marked): {describe_error(e)[:1000]}"
                ) from e
            problems = [Problem(METADATA_NAME, "digest", describe_error(e)[:300])]
            self._reject(info, problems)
            return None, Refusal(info.step, str(problems[0]))
        return manifest, None

    def _loaded(self, info: StepInfo, manifest: Manifest, refusals: list[Refusal]) -> None:
        if self.cache is not None:
            self.cache.keep_only(info.dirname)
        newer = [str(r) for r in refusals if r.step > info.step]
        if newer:
            log.warning(
                "loaded step %d although newer steps exist that were refused: %s", info.step, "; ".join(newer)[:2000]
            )
        self.on_event(
            ev.CkptLoaded(
                step=info.step,
                world_size=manifest.world_size,
                ckpt_round=manifest.round,
                created_time=manifest.created_time,
                job=manifest.job,
                refused_newer=newer,
                bytes_read=self.load_reads[0],
                bytes_from_cache=self.load_reads[1],
            )
        )
        log.info("loaded checkpoint step %d (saved at world size %d)", info.step, manifest.world_size)

    def _nothing_loaded(self, refusals: list[Refusal], load_step: int) -> None:
        if load_step >= 0:
            raise NoLoadableStepError(self.url, refusals, load_step=load_step)
        if not refusals:
            return None  # nothing but uncommitted directories (or nothing at all): a fresh job
        if self.on_no_loadable_step != "fresh":
            raise NoLoadableStepError(self.url, refusals)
        lines = "; ".join(str(r) for r in refusals)
        log.error(
            "STARTING FROM STEP 0 (checkpoint.on_no_loadable_step=fresh): no step under %s can be loaded: %s",
            self.url,
            lines[:4000],
        )
        self.on_event(ev.CkptFreshStart(refused=[str(r)[:1000] for r in refusals]))
        return None

    def _agree(self, value: Any) -> Any:
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _agree_or_raise(self, compute: Callable[[], Any]) -> Any:
        """Rank 0's ``compute()``, on every rank; if it raised, every rank raises (none is left
        waiting in the broadcast)."""
        value, error = None, None
        if self.rank == 0:
            try:
                value = compute()
            except Exception as e:  # noqa: BLE001 - re-raised below, on every rank
                error = e
        if error is not None and not (dist.is_initialized() and dist.get_world_size() > 1):
            raise error
        value, message = self._agree((value, None if error is None else f"{type(error).__name__}: {error}"))
        if error is not None:
            raise error
        if message is not None:
            raise CheckpointError(f"rank 0 could not list the checkpoints under {self.url}: {message}")
        return value

    def _fetch_everywhere(
        self,
        info: StepInfo,
        manifest: Manifest,
        validate: Callable[[Manifest], None] | None,
        state_dict: dict[str, Any],
    ) -> tuple[list[Problem], dict[str, SparseFile], Metadata | None]:
        """Fetch and verify ``info`` (whose parsed manifest is ``manifest``) before any byte of it
        is loaded: every rank reads the blocks its own DCP load plan needs, once each (concurrent
        ranged GETs), keeps them verified for DCP, and verifies its share of the blocks no rank
        needs. Returns every rank's problems, gathered (the same list on every rank), and this
        rank's verified files. Only rank 0 judges the manifest (``validate``) and what
        ``.metadata`` would unpickle (:func:`check_pickled_items`)."""
        world = dist.get_world_size() if dist.is_initialized() else 1
        mine = self._validation_problems(manifest, validate) if self.rank == 0 else []
        data: dict[str, SparseFile] = {}
        needed: dict[str, list[tuple[int, int]]] = {}
        parsed: Metadata | None = None
        cache = self._step_cache(info.dirname)
        self.load_reads = (0, 0)
        try:
            meta = fetch_files(
                self.storage, info.dirname, manifest, {METADATA_NAME: None}, keep={METADATA_NAME}, cache=cache
            )
            self.load_reads = (meta.bytes_read, meta.bytes_cached)
            if self.rank == 0:
                mine += meta.problems
            data.update(meta.data)
            if METADATA_NAME in meta.data:
                parsed = _parse_quietly(meta.data[METADATA_NAME].whole())
                needed = needed_ranges(state_dict, parsed, manifest.files, self.rank == 0) if parsed else {}
        except _STORAGE_TYPES as e:
            mine.append(Problem(METADATA_NAME, "unreadable", f"storage error, not corruption: {type(e).__name__}: {e}"))
        mine_pieces = {n: pieces_for(manifest.files[n], r) for n, r in needed.items() if n in manifest.files}
        if world > 1:
            everyone: list[dict[str, list[int]]] = [{} for _ in range(world)]
            dist.all_gather_object(everyone, mine_pieces)
        else:
            everyone = [mine_pieces]
        wanted = {
            **needed,
            **verification_share(manifest, everyone, self.rank, world, merge=needed, skip={METADATA_NAME}),
        }
        try:
            got = fetch_files(self.storage, info.dirname, manifest, wanted, keep=needed, cache=cache)
            mine += got.problems
            data.update(got.data)
            self.load_reads = (self.load_reads[0] + got.bytes_read, self.load_reads[1] + got.bytes_cached)
            log.info(
                "step %d: fetched %.1f MB for this rank's load (and its share of the verification) in %.2fs%s",
                info.step,
                got.bytes_read / 1e6,
                got.seconds,
                f", {got.bytes_cached / 1e6:.1f} MB of it from the local cache" if cache is not None else "",
            )
            if self.rank == 0 and not any(p.file == METADATA_NAME for p in mine):
                mine += check_pickled_items(self.storage, info.dirname, manifest, metadata=parsed)
        except _STORAGE_TYPES as e:
            mine.append(
                Problem(
                    next(iter(wanted), MANIFEST_NAME),
                    "unreadable",
                    f"storage error, not corruption: {type(e).__name__}: {e}"[:500],
                )
            )
        if world == 1:
            return mine, data, parsed
        gathered: list[list[Problem]] = [[] for _ in range(world)]
        dist.all_gather_object(gathered, mine)
        return [p for problems in gathered for p in problems], data, parsed

    @staticmethod
    def _validation_problems(manifest: Manifest, validate: Callable[[Manifest], None] | None) -> list[Problem]:
        if validate is None:
            return []
        try:
            validate(manifest)
        except (ManifestError, ValueError, TypeError, KeyError) as e:
            return [Problem(MANIFEST_NAME, "manifest", f"not usable by this trainer: {e}"[:1000])]
        return []

    def _reject(self, info: StepInfo, problems: list[Problem]) -> None:
        text = "; ".join(str(p) for p in problems[:5])
        log.error("checkpoint step %d is corrupt, falling back: %s", info.step, text)
        self.on_event(ev.CkptCorrupt(step=info.step, problems=[str(p) for p in problems]))
        if self.rank == 0:
            try:
                self._mark_corrupt(info, problems)
            except (CheckpointError, OSError) as e:  # the step is refused either way; the marker is evidence
                log.warning("could not mark %s corrupt (it is refused for this load anyway): %s", info.dirname, e)
        if dist.is_initialized():
            dist.barrier()

    def _mark_corrupt(self, info: StepInfo, problems: list[Problem]) -> None:
        """Mark ``info`` corrupt, fenced like every other change: immediately before the marker
        is written this writer's round must still be current (StaleRoundError otherwise) and the
        step, judged again with the commit records read now, must still be committed with the
        manifest the verdict was reached on (``info.digest``). A loader paused since it looked
        (whose verdict may come from reading a step that a newer round cleared and saved again)
        never marks the newer round's step; only the manifest that failed is ever marked."""
        if self.fence is not None:
            if self.round is None:
                log.warning("%s not marked corrupt: no round known to fence the marker", info.dirname)
                return
            self.fence.check(self.round)
        now = inspect_step(self.storage, info.dirname, self._hmac_key(), job=self.job, recorded=self._recorded())
        if now.marked and now.digest == info.digest:
            log.info("%s is already marked corrupt", info.dirname)
            return
        if now.state != "committed" or now.digest != info.digest:
            log.warning(
                "%s not marked corrupt: it changed since it was verified (now %s, manifest %s, verified %s)",
                info.dirname,
                now.state,
                now.digest[:16] or "-",
                info.digest[:16] or "-",
            )
            return
        mark_corrupt(self.storage, info.dirname, problems, reason="verification before load failed")

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
