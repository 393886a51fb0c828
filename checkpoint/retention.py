"""Retention: which step directories to delete, decided by a pure function, then applied.

:func:`plan_gc` rules, per state (``in_flight`` steps are always kept, whatever their state):

- **committed**: keep the newest committed step (always, even with ``keep_last=0``), the newest
  ``keep_last``, and every step with ``step % keep_every == 0`` (``keep_every=0``: off); delete
  the rest.
- **uncommitted** (no manifest): a save in flight or one that died. Deleted only once its newest
  file is older than ``grace_s``; kept while its age is unknown.
- **corrupt** (bad manifest or a ``corrupt.json`` marker): kept as evidence while it could still
  matter: until a newer committed step exists AND its newest file (the marker counts, so the
  grace restarts when it is marked) is older than ``grace_s``. Then deleted, like any step the
  run has moved past.

:func:`apply_gc` removes each directory's ``manifest.json`` first, so a deletion that dies (or
is stopped) half way leaves an uncommitted directory (removed by a later GC), never a committed
one with holes.

What must stay true: a retention whose writer's round is no longer current removes nothing, and
no directory is removed unless it is still what it was planned as. A retention can be paused
anywhere (SIGSTOP, a frozen host, a long GC) between its plan and its deletes, and resume after a
newer round re-saved and committed a step it planned as torn; so :func:`collect_garbage` plans
under a :class:`GcGuard` (the writer's round, the fence, the key and job), and :func:`apply_gc`
checks the round and judges each directory again, with commit records read then, immediately
before it changes it (its unfinished uploads included): a directory whose state or manifest
digest is no longer the planned one is left alone. Records of steps no longer stored are dropped
the same way: the round checked, the records read again, and only a record still the one seen
dropped. What is left is the time between the last etcd answer and the storage request (and the
removal's own duration): storage has no conditional delete that etcd's round could guard.
"""

from __future__ import annotations

import datetime as _dt
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from ftrain.checkpoint.catalog import State, StepInfo, inspect_step, list_steps
from ftrain.checkpoint.config import DEFAULTS
from ftrain.checkpoint.errors import StaleRoundError
from ftrain.checkpoint.manifest import MANIFEST_NAME, parse_step_dir
from ftrain.checkpoint.publish import Fence
from ftrain.checkpoint.storage import Storage
from ftrain.contract import events as ev

log = logging.getLogger(__name__)


@dataclass
class Retention:
    """Retention settings (defaults: the ``[checkpoint]`` section's, :mod:`ftrain.checkpoint.config`)."""

    keep_last: int = DEFAULTS.keep_last
    keep_every: int = DEFAULTS.keep_every
    grace_s: float = DEFAULTS.gc_grace_s


class GcStop:
    """How a save stops a retention that runs beside training without waiting on a storage
    call that may hang (a paused S3 would otherwise stall the loop at the next save): the save
    asks it to stop, which it does before its next directory, and waits only while the
    directory being deleted is the one that save is about to write (a torn step written again)."""

    def __init__(self) -> None:
        self.requested = threading.Event()
        self._changed = threading.Condition()
        self._deleting: str | None = None

    def stop(self, writing: str | None = None) -> None:
        """Ask the retention to stop; with ``writing``, also wait until it is not deleting that
        directory."""
        with self._changed:
            self.requested.set()
            while writing is not None and self._deleting == writing:
                self._changed.wait()

    def begin(self, dirname: str) -> bool:
        """The retention is about to delete ``dirname``: False once it was asked to stop."""
        with self._changed:
            if self.requested.is_set():
                return False
            self._deleting = dirname
            return True

    def end(self) -> None:
        with self._changed:
            self._deleting = None
            self._changed.notify_all()


@dataclass(frozen=True, slots=True)
class Judged:
    """What the planner saw of one directory: enough to tell whether it changed since."""

    state: State
    digest: str
    """The manifest's digest (:attr:`ftrain.checkpoint.catalog.StepInfo.digest`; "" without one)."""
    marked: bool

    @classmethod
    def of(cls, info: StepInfo) -> Judged:
        return cls(info.state, info.digest, info.marked)


@dataclass(frozen=True)
class GcGuard:
    """What a retention checks immediately before each change it makes (see the module doc): the
    writer's ``round`` is still current (with a ``fence``), and the directory is still what it was
    planned as, judged with ``hmac_key``, ``job`` and the commit records read then.
    ``before_gc(step)`` runs first (a fault hook: :func:`ftrain.faults.maybe_pause_before_gc`)."""

    hmac_key: bytes | None
    job: str | None
    fence: Fence | None = None
    round: int | None = None
    before_gc: Callable[[int], None] | None = None

    def __post_init__(self) -> None:
        if self.fence is not None and self.round is None:
            raise ValueError("GcGuard: a fenced retention needs the writer's round")

    def paused_here(self, step: int | None) -> None:
        if self.before_gc is not None and step is not None:
            self.before_gc(step)

    def check_round(self) -> None:
        """StaleRoundError when the writer's round is no longer current."""
        if self.fence is not None and self.round is not None:
            self.fence.check(self.round)

    def now(self, storage: Storage, dirname: str) -> Judged:
        """``dirname`` as it is now, after the round check."""
        self.check_round()
        recorded = self.fence.recorded() if self.fence is not None else None
        return Judged.of(inspect_step(storage, dirname, self.hmac_key, job=self.job, recorded=recorded))


@dataclass(slots=True)
class GcPlan:
    """What :func:`apply_gc` will do: directory names, ascending by step, and why."""

    delete: list[str] = field(default_factory=list)
    keep: list[str] = field(default_factory=list)
    reasons: dict[str, str] = field(default_factory=dict)
    """A reason for every directory in ``delete`` and ``keep``."""
    judged: dict[str, Judged] = field(default_factory=dict)
    """What every directory in ``delete`` was when planned."""
    guard: GcGuard | None = None
    """Set by :func:`collect_garbage`: :func:`apply_gc` then deletes a directory only while the
    guard finds it unchanged (and the writer's round current). None (``ftrain ckpt gc``, an
    operator's command with no round): deleted as planned."""


def plan_gc(
    steps: list[StepInfo],
    *,
    keep_last: int,
    keep_every: int,
    in_flight: set[int],
    now_s: float,
    modified_s: dict[str, float],
    grace_s: float,
) -> GcPlan:
    """Decide what to delete (pure: no I/O, ``now_s`` injected). Rules in the module doc."""
    if keep_last < 0:
        raise ValueError(f"plan_gc: keep_last must be >= 0, got {keep_last}")
    if keep_every < 0:
        raise ValueError(f"plan_gc: keep_every must be >= 0, got {keep_every}")
    if grace_s < 0:
        raise ValueError(f"plan_gc: grace_s must be >= 0, got {grace_s}")

    committed = sorted((s.step for s in steps if s.state == "committed"), reverse=True)
    newest = committed[0] if committed else None
    newest_k = set(committed[:keep_last])

    def age(info: StepInfo) -> float | None:
        t = modified_s.get(info.dirname)
        return None if t is None else now_s - t

    def decide(info: StepInfo) -> tuple[bool, str]:
        if info.step in in_flight:
            return False, "in flight"
        if info.state == "committed":
            if info.step == newest:
                return False, "newest committed"
            if info.step in newest_k:
                return False, f"among the newest {keep_last} committed"
            if keep_every and info.step % keep_every == 0:
                return False, f"step is a multiple of keep_every={keep_every}"
            return True, "older committed step outside the keep rules"
        a = age(info)
        if info.state == "uncommitted":
            if a is None:
                return False, "uncommitted, age unknown"
            if a <= grace_s:
                return False, f"uncommitted, {a:.0f}s old <= grace {grace_s:.0f}s (may still be writing)"
            return True, f"uncommitted and {a:.0f}s old > grace {grace_s:.0f}s"
        # corrupt
        if newest is None or info.step >= newest:
            return False, "corrupt, kept as evidence: no newer committed step"
        if a is None:
            return False, "corrupt, kept as evidence: age unknown"
        if a <= grace_s:
            return False, f"corrupt, kept as evidence: {a:.0f}s old <= grace {grace_s:.0f}s"
        return True, f"corrupt, older than newest committed step {newest} and {a:.0f}s old > grace {grace_s:.0f}s"

    plan = GcPlan()
    for info in sorted(steps, key=lambda s: s.step):
        delete, reason = decide(info)
        (plan.delete if delete else plan.keep).append(info.dirname)
        plan.reasons[info.dirname] = reason
        if delete:
            plan.judged[info.dirname] = Judged.of(info)
    return plan


def apply_gc(storage: Storage, plan: GcPlan, clear_multipart: bool = True, stop: GcStop | None = None) -> list[str]:
    """Delete every directory in ``plan.delete``: manifest first, then the rest, recursively;
    returns the directories deleted. With ``clear_multipart`` also abort unfinished multipart
    uploads under each deleted directory. A stopped ``stop`` ends it before the next directory
    (the rest waits for a later GC). With ``plan.guard``, immediately before each directory is
    touched the writer's round is checked (StaleRoundError: nothing more is removed) and the
    directory judged again: one that is no longer what it was planned as is left alone."""
    deleted: list[str] = []
    guard = plan.guard
    for dirname in plan.delete:
        if guard is not None:
            guard.paused_here(parse_step_dir(dirname))
        if stop is not None and not stop.begin(dirname):
            log.info("gc: stopped before %s (%d of %d deleted)", dirname, len(deleted), len(plan.delete))
            break
        try:
            if guard is not None:
                try:
                    now = guard.now(storage, dirname)
                except StaleRoundError:
                    log.warning(
                        "gc: round %s is no longer current: this retention belongs to an old round and removes "
                        "nothing more (%d of %d deleted; %s left alone)",
                        guard.round,
                        len(deleted),
                        len(plan.delete),
                        dirname,
                    )
                    raise
                planned = plan.judged.get(dirname)
                if now != planned:
                    log.warning(
                        "gc: %s left alone: it changed since it was planned for deletion (planned %s, now %s)",
                        dirname,
                        planned,
                        now,
                    )
                    continue
            if clear_multipart:
                aborted = storage.clear_multipart_uploads(dirname)
                if aborted:
                    log.info("gc: aborted %d multipart uploads under %s", aborted, dirname)
            storage.remove(f"{dirname}/{MANIFEST_NAME}")
            storage.remove(dirname, recursive=True)
        finally:
            if stop is not None:
                stop.end()
        log.info("gc: deleted %s (%s)", dirname, plan.reasons.get(dirname, ""))
        deleted.append(dirname)
    return deleted


def _entry_time(info: dict[str, Any]) -> float | None:
    """Modification time of one fsspec info dict (local ``mtime``, S3 ``LastModified``,
    memory ``created``) as Unix seconds."""
    for key in ("mtime", "LastModified", "last_modified", "modified", "created"):
        value = info.get(key)
        if value is None:
            continue
        if isinstance(value, bool):
            continue
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:
                value = _dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
            except ValueError:
                continue
        if isinstance(value, _dt.datetime):
            if value.tzinfo is None:
                value = value.replace(tzinfo=_dt.UTC)
            return value.timestamp()
    return None


def gc_survey(storage: Storage, steps: list[StepInfo]) -> tuple[list[StepInfo], dict[str, float]]:
    """What :func:`plan_gc` needs beyond the listed ``steps``: the step directories that hold
    nothing but unfinished multipart uploads (a save killed in its first upload leaves one; no
    listing shows it) added as uncommitted steps, dated by their newest upload's start, and the
    age of every step that is not committed."""
    listed = {s.dirname for s in steps}
    hidden: dict[str, float] = {}
    found: list[StepInfo] = []
    for key, started_s in storage.pending_uploads().items():
        dirname = key.partition("/")[0]
        step = parse_step_dir(dirname)
        if step is None or dirname in listed:
            continue
        if dirname not in hidden:
            found.append(StepInfo(step, dirname, "uncommitted", None, None))
        hidden[dirname] = max(hidden.get(dirname, started_s), started_s)
    ages = modified_times(storage, [s.dirname for s in steps if s.state != "committed"])
    return sorted(steps + found, key=lambda s: s.step), {**ages, **hidden}


def modified_times(storage: Storage, dirnames: Iterable[str]) -> dict[str, float]:
    """Newest modification time of any file in each directory (Unix seconds).

    A directory with no dated file falls back to its own time where the backend has one, else
    is left out (:func:`plan_gc` then keeps it: age unknown).
    """
    out: dict[str, float] = {}
    for dirname in dirnames:
        path = storage.path(dirname)

        def find(path: str = path) -> dict[str, dict[str, Any]]:
            storage.fs.invalidate_cache(path)
            try:
                found = storage.fs.find(path, detail=True, withdirs=False)
            except FileNotFoundError:
                return {}
            if not found:
                try:
                    found = {path: storage.fs.info(path)}
                except FileNotFoundError:
                    return {}
            return found

        times = [t for info in storage.retry(find, f"list {dirname}").values() if (t := _entry_time(info)) is not None]
        if times:
            out[dirname] = max(times)
    return out


def collect_garbage(
    storage: Storage,
    retention: Retention,
    *,
    in_flight: set[int],
    hmac_key: bytes | None,
    on_event: Callable[[ev.Record], Any] | None = None,
    job: str | None = None,
    stop: GcStop | None = None,
    fence: Fence | None = None,
    round_: int | None = None,
    before_gc: Callable[[int], None] | None = None,
) -> list[str]:
    """Apply retention: never touches the newest committed step or an in-flight one. With
    ``job``, another job's steps are not committed here (they never count as this job's newest).
    With a ``fence``, every change is fenced by the writer's round ``round_`` (see the module
    doc; without a round, nothing is deleted), and where it records commits, only recorded steps
    are committed (a manifest stored by a fenced-out save is a torn save's), and the records of
    steps no longer stored are dropped. A stopped ``stop`` ends it between two directories.
    ``before_gc``: :class:`GcGuard`. Returns the directories deleted."""
    if fence is not None and round_ is None:
        log.warning("retention skipped: its deletes are fenced by the writer's round, and none is known yet")
        return []
    guard = GcGuard(hmac_key, job, fence, round_, before_gc)
    recorded = fence.recorded() if fence is not None else None
    steps, ages = gc_survey(storage, list_steps(storage, hmac_key, job=job, recorded=recorded))
    plan = plan_gc(
        steps,
        keep_last=retention.keep_last,
        keep_every=retention.keep_every,
        in_flight=in_flight,
        now_s=time.time(),
        modified_s=ages,
        grace_s=retention.grace_s,
    )
    plan.guard = guard
    deleted = apply_gc(storage, plan, stop=stop) if plan.delete else []
    if fence is not None and recorded:
        stored = {s.step for s in steps} - {parse_step_dir(d) for d in deleted}
        gone = sorted(step for step in recorded if step not in stored)
        if gone:
            _forget(guard, fence, gone, recorded)
    if deleted:
        log.info("retention removed %s", ", ".join(deleted))
        if on_event is not None:
            on_event(ev.CkptGc(deleted=deleted))
    return deleted


def _forget(guard: GcGuard, fence: Fence, gone: list[int], recorded: dict[int, str]) -> None:
    """Drop the commit records of ``gone`` (steps no longer stored), fenced like a deletion and
    closer still: each record is dropped in one etcd transaction with the writer's round check,
    and only while it is the one seen (a newer round may have saved the step again and recorded
    it since)."""
    for step in gone:
        guard.paused_here(step)
    if guard.round is None:
        raise ValueError("a fenced retention needs the writer's round")
    forgotten = fence.forget(guard.round, {step: recorded[step] for step in gone})
    kept = [str(step) for step in gone if step not in forgotten]
    if kept:
        log.warning(
            "retention keeps the commit records of steps %s (recorded again since, or etcd did not answer)",
            ", ".join(kept),
        )
