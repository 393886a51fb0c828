"""The load half of :class:`~ftrain.checkpoint.manager.CheckpointManager`: the newest committed step
(or a pinned one) verified before any tensor of it is used, then loaded; a bad step marked
corrupt and the one before tried; every rank given the same verdict. What must stay true is in
:mod:`ftrain.checkpoint.manager`'s docstring.

A mixin: the annotations of :class:`CheckpointLoading` are the manager's state and the two
methods of its save side a load uses (it stops retention while it reads, and reads through the
node's local cache).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata

from ftrain.checkpoint.catalog import StepInfo, inspect_step, list_steps
from ftrain.checkpoint.dcp_read import METADATA_NAME, VerifiedReader, load_metadata, needed_ranges
from ftrain.checkpoint.errors import (
    CheckpointError,
    ChecksumMismatchError,
    FatalStorageError,
    ManifestError,
    TransientStorageError,
    UnsafePickleError,
)
from ftrain.checkpoint.fetch import SparseFile, fetch_files, pieces_for, verification_share
from ftrain.checkpoint.local_cache import LocalCache, StepCache
from ftrain.checkpoint.manifest import (
    MANIFEST_NAME,
    Manifest,
    hmac_key_from_env,
    step_dir_name,
)
from ftrain.checkpoint.publish import Fence
from ftrain.checkpoint.safe_pickle import SafeLoadPlanner
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


#: the manifest's ``layout`` key that names the kind of loop that wrote a step; absent: ``ftrain train``
WRITER_KEY = "writer"
#: the writer a step without :data:`WRITER_KEY` was written by
TRAIN_WRITER = "train"
_WRITER_NAMES = {TRAIN_WRITER: "ftrain train", "session": "a Session"}
_WRITER_ROOT = {TRAIN_WRITER: "checkpoint.uri", "session": "Session(checkpoint_uri=...)"}


def writer_of(manifest: Manifest) -> str:
    """Which kind of loop wrote ``manifest``'s step (:data:`WRITER_KEY`; ``train`` when absent)."""
    value = manifest.layout.get(WRITER_KEY, TRAIN_WRITER)
    return value if isinstance(value, str) else repr(value)[:40]


class ForeignStepError(CheckpointError):
    """An intact step written by another kind of loop (a Session's step under ``ftrain train``, or
    the reverse): their trainer states differ, so it cannot be loaded, and it is not corrupt
    either (nothing is marked). Two kinds of writer share one root: a configuration error."""

    #: restarting cannot help: the same step would be refused again (see :class:`NoLoadableStepError`)
    fatal = True

    def __init__(self, url: str, step: int, found: str, expected: str):
        self.step, self.found, self.expected = step, found, expected
        by = f"{_WRITER_NAMES.get(found, repr(found))} ({WRITER_KEY}={found})"
        if found == TRAIN_WRITER:
            by = f"ftrain train (its layout names no {WRITER_KEY})"
        super().__init__(
            f"step {step} under {url} was written by {by}, not by {_WRITER_NAMES.get(expected, expected)}: give "
            f"this job its own checkpoint root ({_WRITER_ROOT.get(expected, 'another root')}); nothing was marked, "
            "the step is intact"
        )


class SideFile(Protocol):
    """A file of a step, listed in its manifest, that the caller reads before the step's state
    dict is built (a Session's ``user_state.json``): rank 0 fetches it whole and checks its size
    and digest before a byte of it is parsed, then every rank gets the same verified bytes."""

    #: a larger file is refused unread (the step is corrupt: its writer never writes one)
    max_bytes: int

    def name(self, manifest: Manifest) -> str | None:
        """The file of ``manifest``'s step to read (None: this step has none; called on every rank)."""

    def read(self, manifest: Manifest, data: bytes) -> None:
        """Take the verified bytes; ManifestError (or ValueError/TypeError/KeyError) when they
        are not what the writer writes: the step is corrupt (marked, fall back)."""


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


class CheckpointLoading:
    """Loading, for :class:`~ftrain.checkpoint.manager.CheckpointManager`."""

    url: str
    options: StorageOptions
    job: str
    hmac_key_env: str
    fence: Fence | None
    round: int | None
    on_no_loadable_step: str
    on_event: EventSink
    device_type: str
    storage: Storage
    cache: LocalCache | None
    rank: int
    load_reads: tuple[int, int]
    _step_cache: Callable[[str], StepCache | None]
    _stop_gc: Callable[..., None]

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
        writer: str | None = None,
        side: SideFile | None = None,
    ) -> Manifest | None:
        """Load the newest verified committed step (or ``load_step``) into the state dict that
        ``build_state_dict(manifest)`` returns; None if there is nothing to load (or, with
        ``on_no_loadable_step="fresh"``, nothing loadable). See the module doc for the rules.

        ``validate(manifest)`` checks what the caller needs of the manifest (its trainer state)
        before any file is read; a :class:`ManifestError` (or ValueError/TypeError/KeyError) from
        it makes the step corrupt (marked, fall back). ``build_state_dict`` must not judge the
        manifest: what it raises propagates. ``writer``: the kind of loop loading
        (:func:`writer_of`); a step of another kind raises :class:`ForeignStepError` on every rank
        before any file of it is read, and is not marked (it is intact). ``side``: a file of the
        step read, verified, before ``build_state_dict`` is called (:class:`SideFile`).
        """
        self._stop_gc()  # it must not delete a step that this load falls back to
        candidates, refusals = self._agree_or_raise(lambda: self._survey(load_step))
        for info in candidates:
            if writer is not None and info.manifest is not None and writer_of(info.manifest) != writer:
                raise ForeignStepError(self.url, info.step, writer_of(info.manifest), writer)
            manifest, refusal = self._try_load(info, build_state_dict, validate, side)
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
        side: SideFile | None = None,
    ) -> tuple[Manifest | None, Refusal | None]:
        """Verify then read one step: (manifest, None) when loaded, (None, refusal) when the step
        is corrupt (marked). A storage error raises CheckpointError on every rank, marks nothing."""
        manifest = info.manifest
        if manifest is None:  # _survey hands over committed steps only, and their manifests parsed
            raise CheckpointError(f"{info.dirname} has no parsed manifest; only a committed step can be loaded")
        side_name = side.name(manifest) if side is not None else None
        if side is not None and side_name is not None:
            refusal = self._read_side(info, manifest, side, side_name)
            if refusal is not None:
                return None, refusal
        state_dict = build_state_dict(manifest)
        problems, fetched, metadata = self._fetch_everywhere(
            info, manifest, validate, state_dict, skip={side_name} if side_name else set()
        )
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

    def _read_side(self, info: StepInfo, manifest: Manifest, side: SideFile, name: str) -> Refusal | None:
        """Collective: ``side``'s file of ``info`` fetched whole by rank 0 (its size and digest
        checked before a byte is parsed), judged by ``side.read`` there, then the same bytes read
        on every other rank. A refusal (the step marked corrupt) for a bad file; CheckpointError
        on every rank for a storage error (nothing marked)."""
        problems: list[Problem] = []
        data = b""
        if self.rank == 0:
            entry = manifest.files.get(name)
            if entry is None:
                problems.append(Problem(name, "manifest", "named by the manifest's trainer state but not listed"))
            elif entry.size_bytes > side.max_bytes:
                problems.append(
                    Problem(
                        name, "manifest", f"{entry.size_bytes} bytes, more than the {side.max_bytes} a reader accepts"
                    )
                )
            else:
                try:
                    got = fetch_files(
                        self.storage,
                        info.dirname,
                        manifest,
                        {name: None},
                        keep={name},
                        cache=self._step_cache(info.dirname),
                    )
                    problems += got.problems
                    data = got.data[name].whole() if name in got.data and not got.problems else b""
                except _STORAGE_TYPES as e:
                    problems.append(
                        Problem(name, "unreadable", f"storage error, not corruption: {type(e).__name__}: {e}"[:500])
                    )
            if not problems:
                try:
                    side.read(manifest, data)
                except (ManifestError, ValueError, TypeError, KeyError, RecursionError) as e:
                    problems.append(Problem(name, "manifest", f"not usable by this loop: {e}"[:1000]))
        problems, data = self._agree((problems, b"" if problems else data))
        if any(p.kind in CORRUPTION_KINDS for p in problems):
            self._reject(info, problems)
            return Refusal(info.step, "; ".join(str(p) for p in problems[:5]))
        if problems:
            raise CheckpointError(
                f"{info.dirname}/{name} cannot be read (a storage problem, not corruption; nothing was marked): "
                + "; ".join(map(str, problems[:5]))
            )
        if self.rank != 0:
            side.read(manifest, data)  # the bytes rank 0 verified and judged
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
        skip: set[str] | None = None,
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
            **verification_share(
                manifest, everyone, self.rank, world, merge=needed, skip={METADATA_NAME, *(skip or ())}
            ),
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
