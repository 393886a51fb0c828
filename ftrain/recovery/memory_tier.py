"""The memory tier: each rank's checkpoint shards kept in host memory — its own, and a copy of a
buddy's on another node — so that a round that lost ranks of a sharded strategy (fsdp, zero2, tp,
hsdp: no rank holds everything) heals from peers' memory instead of object storage.

**Snapshot** (:meth:`MemoryTier.maybe_snapshot`, at a step boundary, when
:mod:`ftrain.recovery.tier_schedule` says so: every rank of the round at the same steps). The training
thread stages this rank's state (model and optimizer shards, RNG; DCP's stager) into host memory
— the only part it waits for. A background thread writes the staged state in DCP's format into
this process's memory (the checkpoint writer on a private ``memory://`` root: every file
digested, a manifest as for a checkpoint, signed when the job has a key, bound to this run:
:mod:`ftrain.recovery.tier_binding`), then exchanges over the tier's own gloo group: rank 0 gives every
rank the manifest and ``.metadata``; each rank sends its shard files to its buddy —
``local_world_size`` ranks ahead, on the next node (any other rank on a single node) — and checks
the digests of what it gets. A rank keeps its newest snapshot and the one before it (a round that
ends during an exchange can leave ranks one snapshot apart); the older one is dropped once every
rank kept the newer. Nothing here is unpickled: bytes travel as uint8 tensors, names as JSON.

**Restore** (:meth:`MemoryTier.restore`, collective, when a round starts without a full replica).
The ranks gather which snapshots and files each holds; :func:`choose` picks the newest step whose
every file some live rank holds, if it is at least as new as the newest committed checkpoint.
Each rank plans the files its DCP load needs (any world size and strategy: DCP reshards),
receives those it lacks from their holders, checks every digest against the manifest, and only
then DCP copies tensors out of the verified bytes (``.metadata`` through the allow-list
unpickler, as for storage, and only once its digest matched). Anything missing, damaged,
unreadable, of another run or disagreeing gives every rank ``None`` (and a ``memory_refused``
event naming it): the caller loads from storage. Object storage stays the durable tier: a rank
lost together with its buddy, or every worker, takes the memory copies with it.

**Collective agreement** (what must stay true). A rank never leaves a collective sequence of the
tier alone: whatever can fail on one rank (staging, reading a file of ``memory_dir``, a digest, a
manifest it cannot verify, a file it cannot keep) is found before the next exchange and told to
every rank in the all-gather or all-reduce that precedes it, and then every rank gives up
together. Snapshots start at the same steps on every rank (:mod:`ftrain.recovery.tier_schedule`: the
schedule is reset when a round starts, and changes only from figures the ranks agreed on); after a
snapshot that failed on any rank (the ranks tell each other on the training group as the next one
starts), the tier's group is made anew, so one broken exchange does not fail every later one.
The tier's group has half training's timeout: a rank left waiting in an exchange (a peer that
broke off) gives up before that peer, waiting for it in the training group, would.

**Across restarts** (``checkpoint.memory_dir``, a tmpfs such as ``/dev/shm``; restart recovery,
``ftrain train``): every complete snapshot is kept in that node-local directory rather than in
the process (:mod:`ftrain.recovery.tier_store`: a ``0700`` directory of this user's, files ``0600``), so
it outlives the worker. A restarted worker offers what its node's directory holds of *this run*
(:mod:`ftrain.recovery.tier_binding`: run id, config hash, checkpoint root; another run's snapshots are
skipped and named in a ``memory_skipped`` event) to its first restore, which checks it exactly as
above, before anything is loaded from storage (:meth:`ftrain.train.Trainer.run`). An unsafe
directory, or a run id no rank knows, leaves the worker without the on-disk tier (said once, with
the fix); training goes on. Live workers keep their snapshots in their processes (they survive a
round change there).

**Whose state.** The tier snapshots and restores a :class:`TierSubject`: ``ftrain train``'s
:class:`~ftrain.train.Trainer` (model, optimizer, data cursor, RNG, LR schedule) or a user's
loop under :meth:`ftrain.Session.run` (:mod:`ftrain.session_tier`: the module, its optimizers and
the loop's other entries, encoded). The subject says what its state is; everything else here
(when, with whom, verified how) is the same for both.

**Size.** Over 600 lines: snapshot and restore are one collective protocol on one process group
(whatever can fail on one rank is told to every rank before the next exchange); its store,
schedule, wire format and run binding are modules of their own.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from ftrain.checkpoint.dcp_read import METADATA_NAME, VerifiedReader, needed_files
from ftrain.checkpoint.dcp_write import DigestingWriter
from ftrain.checkpoint.errors import CheckpointError, ManifestError
from ftrain.checkpoint.manifest import Manifest, hmac_key_from_env
from ftrain.checkpoint.safe_pickle import SafeLoadPlanner
from ftrain.checkpoint.staging import new_stager
from ftrain.checkpoint.storage import StorageOptions
from ftrain.config import Config, worker_job_id
from ftrain.contract import events as ev
from ftrain.contract.config import ConfigError
from ftrain.contract.worker_env import WorkerEnv
from ftrain.faults import maybe_damage_memory_copy
from ftrain.recovery.tier_binding import (
    NO_RUN_ID_FIX,
    Binding,
    agree_run_id,
    binding_of,
    binding_problem,
    resolve_run_id,
)
from ftrain.recovery.tier_host import Publisher, drop_files, give_back_freed, take_files, too_big_to_receive
from ftrain.recovery.tier_schedule import Figures, base_interval, is_due, next_interval, put_off
from ftrain.recovery.tier_store import DirFiles, Snapshot, TierStore
from ftrain.recovery.tier_wire import (
    WireError,
    all_gather_json,
    any_rank,
    any_ranks,
    as_tensor,
    broadcast_bytes,
    exchange_files,
    matches,
    max_over,
)

log = logging.getLogger(__name__)

#: snapshots a rank keeps (the newest, and the one before while the newest may be incomplete)
KEPT = 2


class TierSubject(Protocol):
    """What the tier snapshots and restores: the state of ``ftrain train``'s trainer
    (:class:`ftrain.train.Trainer`) or of a user's loop (:mod:`ftrain.session_tier`). The tier
    owns the protocol (when, with whom, verified how); the subject says what its state is."""

    device: torch.device  #: where the training group's collectives run
    rank: int
    events: Any  #: where the tier's events go (``emit``)
    last_step_time_s: float  #: the round's last step time (the auto interval's measure)

    def tier_state(self) -> dict[str, Any]:
        """This rank's state in DCP's form, as views of the live tensors (the tier copies them
        in the background until :meth:`MemoryTier.wait_staged`)."""
        ...

    def tier_fields(self) -> dict[str, Any]:
        """The snapshot manifest's fields besides its files, step, job and digest (what a
        checkpoint of this state records: round, world size, layout, config, trainer)."""
        ...

    def tier_target(self, manifest: Manifest) -> dict[str, Any]:
        """The state dict a load of ``manifest``'s snapshot fills at this layout; ManifestError
        or ConfigError when this state cannot take it (every rank then loads from storage)."""
        ...

    def tier_apply(self, manifest: Manifest, target: dict[str, Any]) -> None:
        """Put the loaded ``target`` (DCP filled it from the verified bytes) into the state."""
        ...


@dataclass(frozen=True, slots=True)
class Choice:
    """What :func:`choose` decided: the snapshot, who sends its manifest, who sends each file."""

    step: int
    key: str
    manifest_from: int
    sources: dict[str, int]


@dataclass(frozen=True, slots=True)
class _Outcome:
    """How this rank's last snapshot of the round ended: ``ok`` only when every rank kept it
    (the tier's closing all-reduce said so), with the figures they agreed on."""

    ok: bool
    figures: Figures | None = None


class _Refused(Exception):  # noqa: N818 - every rank gives up the same snapshot or restore
    """Some rank found a problem; every rank learnt it in the same collective."""


def choose(holdings: list[list[dict[str, Any]]], committed_step: int) -> Choice | None:
    """Pure: from every rank's holdings (by rank: a list of ``{step, key, files, all}``: the
    files it holds of a snapshot, and every file its manifest lists), the newest snapshot that
    the live ranks hold completely — each file by some rank, the lowest holder sending — unless
    it is older than ``committed_step`` (storage holds something newer); None if there is none."""
    by_key: dict[str, dict[str, Any]] = {}
    for rank, held in enumerate(holdings):
        for snap in held:
            entry = by_key.setdefault(snap["key"], {"step": snap["step"], "all": set(snap["all"]), "holders": []})
            if entry["step"] != snap["step"] or entry["all"] != set(snap["all"]):
                continue  # the same manifest bytes cannot describe two things: ignore the odd one
            entry["holders"].append((rank, set(snap["files"])))
    for key, entry in sorted(by_key.items(), key=lambda kv: (-kv[1]["step"], kv[0])):
        if entry["step"] < committed_step:
            return None
        sources: dict[str, int] = {}
        for rank, files in entry["holders"]:
            for name in files & entry["all"]:
                sources.setdefault(name, rank)
        if set(sources) == entry["all"]:
            return Choice(entry["step"], key, min(rank for rank, _ in entry["holders"]), sources)
    return None


def _problems(rows: list[Any]) -> list[str]:
    """``rank r: problem`` for every rank's non-empty problem (``rows``: by rank)."""
    return [f"rank {r}: {p}" for r, p in enumerate(rows) if p]


class MemoryTier:
    """One worker's memory tier, across the rounds it serves: a live worker's (:mod:`ftrain.recovery.live`
    owns it), or, with ``checkpoint.memory_dir``, a restarted one's (:func:`ftrain.train.train`)."""

    def __init__(self, cfg: Config, memory_dir: str = ""):
        """``memory_dir``: keep complete snapshots there, and offer what the node kept there of
        this run to the first restore (``checkpoint.memory_dir``, for restarted workers); empty:
        in this process."""
        self.cfg = cfg
        self.memory_dir = memory_dir
        self.setting = cfg.checkpoint.memory_interval
        self.interval = base_interval(self.setting)
        self.algorithm = cfg.checkpoint.digest
        self.hmac_key = hmac_key_from_env(cfg.checkpoint.hmac_key_env)
        self.job = worker_job_id(cfg)
        #: what this process's snapshots are bound to; its run id is learnt with memory_dir only
        #: (live workers' snapshots never leave their process)
        self.binding = binding_of(json.loads(json.dumps(cfg.to_dict(), default=str)), cfg.digest(), "")
        self.snapshots: list[Snapshot] = []  #: oldest first, at most KEPT
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._group: Any = None
        self._device_type = "cpu"  #: where the state lives: how a snapshot stages it
        self._root = f"memory://ftrain-tier-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._store: TierStore | None = None  #: checkpoint.memory_dir: snapshots kept there
        self._store_opened = False  #: the first round settled whether there is one
        self.off_why = ""  #: why this process's tier does nothing (every rank of its round agreed)
        self.rank = self.world = self.local_world = 0
        self._next_step = 0  #: the step of the next snapshot (the same on every rank)
        self._taken_step = -1  #: the step of the newest snapshot begun (the same on every rank)
        self._outcome: _Outcome | None = None  #: the round's last snapshot on this rank (None: none yet)
        self._staged = threading.Event()  #: the snapshot in the background has copied the state
        self._staged.set()

    @property
    def enabled(self) -> bool:
        return self.setting != 0

    @property
    def active(self) -> bool:
        """Taking part in this round (the same on every rank of it)."""
        return self.enabled and self._group is not None and not self.off_why

    # -- rounds -------------------------------------------------------------------------
    def join_round(self, rank: int, world: int, local_world: int, device_type: str, events: Any = None) -> None:
        """Collective (every rank, while building its trainer): the round's own gloo group, a
        fresh schedule (:mod:`ftrain.recovery.tier_schedule`), and in a new process with
        ``checkpoint.memory_dir``, the node's directory (:meth:`_open_store`)."""
        self.rank, self.world, self.local_world = rank, world, local_world
        # alone, a rank has no buddy: only snapshots kept in memory_dir outlive its process
        self._group = self._new_group() if world > 1 or self.memory_dir else None
        self.interval, self._next_step, self._outcome = base_interval(self.setting), 0, None
        if self.memory_dir:
            self._agree_store(events)
        self._device_type = device_type

    def _new_group(self) -> Any:
        """Its own gloo group (its collectives run beside training's), with half training's
        timeout: an exchange a peer left gives up before that peer, waiting for this rank in a
        training collective at the next snapshot, would (see :meth:`maybe_snapshot`)."""
        return dist.new_group(backend="gloo", timeout=timedelta(seconds=self.cfg.parallel.timeout_s / 2))

    def _agree_store(self, events: Any) -> None:
        """Collective, every round (``checkpoint.memory_dir``): in a new process, the node's tier
        directory (created ``0700`` or checked), and the snapshots the node kept of this run; on
        every rank, the run id the round agrees on. A process that served earlier rounds offers
        the store and run id it already has (live recovery: a spare that replaces a lost worker
        joins rounds whose other ranks opened theirs long ago). A directory that is not safe, or
        no run id, leaves this worker without the on-disk tier (and the whole tier off for the
        round when no rank of it has one: snapshots in a process that will not restart would help
        nobody)."""
        first = not self._store_opened
        self._store_opened = True
        node, local_rank = WorkerEnv.from_env().node, int(os.environ.get("LOCAL_RANK", "0"))
        store: TierStore | None = self._store
        if first:
            tier_store = TierStore(self.memory_dir, self.job, node, local_rank)
            run_id, source = resolve_run_id(ask_etcd=dist.get_rank(self._group) == 0)  # the others agree below
            store = tier_store
            try:
                tier_store.open()
            except OSError as e:  # an UnsafeLocalDirError among them
                self._skipped(events, str(tier_store.tier_dir), f"{e}; this worker keeps no snapshots there")
                store = None
        else:
            run_id, source = self.binding.run_id, "agreed in an earlier round"
        rows = all_gather_json({"run": run_id, "store": store is not None}, self._group)
        agreed, why = agree_run_id([row["run"] for row in rows])
        if not agreed and store is not None:
            self._skipped(
                events,
                str(store.tier_dir),
                f"{why} (this worker: {source}): snapshots kept there could not be told from another run's, "
                f"so the on-disk tier is off; {NO_RUN_ID_FIX}",
            )
            store = None
        self._store = store
        if not agreed or not any(row["store"] for row in rows):
            self.off_why = f"no rank can keep snapshots in {self.memory_dir}"
            if local_rank == 0:
                log.warning(
                    "memory tier: off for this run (%s): training goes on, restarts load from storage", self.off_why
                )
            return
        self.off_why = ""
        self.binding = Binding(agreed, self.binding.config_hash, self.binding.root, self.binding.config)
        if store is None or not first:
            return
        if self.hmac_key is None and local_rank == 0:
            log.warning(
                "memory tier: %s is used WITHOUT an HMAC key (checkpoint.hmac_key_env is empty). Its directory is "
                "0700: other users can neither plant a snapshot nor read one. This user's other processes and root "
                "still can plant one that a restarted worker trains on (its digests are checked against a manifest "
                "found beside it). Set checkpoint.hmac_key_env to sign every snapshot and check it on restore.",
                store.tier_dir,
            )
        if not self.snapshots:  # a new process: offer what the node kept of this run to its restore
            found, skipped = store.discover(self.hmac_key, self.job, self.binding)
            for s in skipped:
                if events is not None:
                    events.emit(ev.MemorySkipped(path=s.path[:1000], why=s.why[:1000]))
            self.snapshots = found[-KEPT:]
            if self.snapshots:
                log.info("memory tier: %s holds snapshot(s) of step(s) %s", store.node_dir, [s.step for s in found])

    def _skipped(self, events: Any, path: str, why: str) -> None:
        log.warning("memory tier: %s not used: %s", path, why)
        if events is not None:
            events.emit(ev.MemorySkipped(path=path[:1000], why=why[:1000]))

    def leave_round(self) -> None:
        """After the round's process groups were aborted (a blocked exchange fails then)."""
        thread = self._thread
        if thread is not None:
            thread.join()
        self._thread = None
        self._group = None

    def snapshot_before_leaving(self, step: int, subject: TierSubject) -> None:
        """Every rank leaves the round after step boundary ``step`` (a node drains; the step is
        committed): that step in the tier unless its snapshot was begun already, its exchange
        waited for, so that the ranks that stay hold the leaving ranks' shards of it and heal
        their replacements from memory (a tier older than the commit is refused for storage)."""
        if self._taken_step != step:
            self.maybe_snapshot(step, subject, checkpointed=True, last=True)
        self.wait()

    def wait(self) -> None:
        """Until the snapshot in the background (if any) is complete (or failed)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def close(self, *, job_done: bool = False) -> None:
        """``job_done``: the job ended normally; the snapshots this worker kept in
        ``checkpoint.memory_dir`` are deleted (otherwise they stay for a restarted worker)."""
        self.leave_round()
        if job_done and self._store is not None:
            self._store.discard()

    def buddy(self) -> int:
        """The rank whose memory keeps a copy of this rank's shards: on the next node."""
        step = self.local_world if self.world > self.local_world else 1
        return (self.rank + step) % self.world

    def _keeper_of(self) -> int:
        """The rank whose shards this rank keeps (the one that has this rank as its buddy)."""
        step = self.local_world if self.world > self.local_world else 1
        return (self.rank - step) % self.world

    # -- snapshots ------------------------------------------------------------------------
    def maybe_snapshot(
        self, step: int, subject: TierSubject, *, checkpointed: bool = False, last: bool = False
    ) -> None:
        """At a step boundary: if a snapshot is due (:func:`ftrain.recovery.tier_schedule.is_due`, the
        same answer on every rank), stage this rank's state and hand it to the background. First
        the ranks tell each other on the training group (one all-reduce) whether the one before is
        still exchanging anywhere (then all put this one off to the next step boundary) and whether
        it failed anywhere: the next interval comes from the figures they agreed on, or stays (and
        the tier's group is made anew) after a failure (see :mod:`ftrain.recovery.tier_schedule`).
        ``last``: the run's last step (the same on every rank): no step follows to put a due
        snapshot off to, so each rank first waits for its own exchange before they agree."""
        if not self.active or not is_due(step, self._next_step, checkpointed):
            return
        # The one before may still be exchanging somewhere: then every rank waits for the next
        # step boundary rather than block here (a training thread blocked on a slow exchange
        # makes no step and looks hung); none is taken out of turn.
        if last:
            self.wait()  # no training step is held up: the run ends here
        busy = self._thread is not None and self._thread.is_alive()
        outcome = self._outcome
        busy_anywhere, failed_anywhere = any_ranks([busy, outcome is not None and not outcome.ok], subject.device)
        if busy_anywhere:
            self._next_step = put_off(step, self._next_step)
            return
        if self._thread is not None:
            self._thread.join()  # finished: its figures and outcome are complete
            self._thread = None
        outcome = self._outcome
        figures = outcome.figures if outcome is not None and outcome.ok else None
        if failed_anywhere:
            figures = None
            self._renew_group(subject.device)
            if self._group is None:
                return
        self.interval = next_interval(self.setting, self.interval, figures)
        self._next_step = step + self.interval
        self._taken_step = step
        self._outcome = None
        began = time.monotonic()
        state = subject.tier_state()  # views of the live tensors: the thread copies them
        fields = subject.tier_fields()
        blocked_s = time.monotonic() - began
        self._staged = threading.Event()
        self._thread = threading.Thread(
            target=self._snapshot,
            args=([state], fields, step, began, blocked_s, subject.events, subject.last_step_time_s),
            name=f"memory-tier-{step}",
            daemon=True,
        )
        del state
        self._thread.start()

    def _renew_group(self, device: torch.device) -> None:
        """Collective on the training group (every rank, at the same snapshot): a new group for
        the tier after a failed exchange (gloo's pairs of the old one may be closed), or, when
        that fails on any rank, none for the rest of the round (said once)."""
        old, made = self._group, None
        try:
            made = self._new_group()
        except Exception as e:  # noqa: BLE001 - agreed below
            log.warning("memory tier: a new group for its exchanges could not be made: %s", e)
        if any_rank(made is None, device):
            self._group = None
            log.warning("memory tier: off for the rest of this round (its group could not be made anew)")
        else:
            self._group = made
            log.warning("memory tier: the last snapshot failed on some rank: its group was made anew")
        try:
            dist.destroy_process_group(old)
        except Exception as e:  # noqa: BLE001 - a broken group may not tear down cleanly; it is dropped
            log.debug("memory tier: the old group's teardown: %s", e)

    def wait_staged(self) -> float:
        """Until the snapshot in the background has copied the state (call it before anything
        changes it: the next optimizer update); the seconds waited."""
        if self._staged.is_set():
            return 0.0
        began = time.monotonic()
        self._staged.wait()
        return time.monotonic() - began

    def _snapshot(
        self,
        state_box: list[dict[str, Any]],
        fields: dict[str, Any],
        step: int,
        began: float,
        blocked_s: float,
        events: Any,
        step_time_s: float,
    ) -> None:
        outcome, size = _Outcome(False), 0
        try:
            staged: list[Any] = []  # a box: the save's callee drops the staged copy when it is serialized
            problem = ""
            # a stager of this snapshot's own: its buffers are freed once the save has serialized
            # them (a stager kept across snapshots would hold a third copy of the state between
            # them, beside this rank's files and its buddy's)
            stager = new_stager(self._device_type, asynchronous=False)
            try:
                try:
                    staged.append(stager.stage(state_box.pop()))
                except Exception as e:  # noqa: BLE001 - told to every rank below
                    problem = f"could not copy the state: {e}"
                finally:
                    self._staged.set()
                outcome, size = self._exchange(step, staged, stager, problem, fields, began, blocked_s, step_time_s)
            finally:
                stager.release()
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - the previous one stays; training goes on
            log.warning("memory-tier snapshot of step %d failed (the previous one stays): %s", step, e)
        finally:
            self._outcome = outcome  # read when the next snapshot starts, after this thread was joined
            drop_files(f"{self._root}/step-{step:09d}")  # what a save that failed midway left in memory
        if outcome.ok and outcome.figures is not None:
            events.emit(
                ev.MemorySnapshot(
                    step=step,
                    blocked_s=round(blocked_s, 6),
                    seconds=round(outcome.figures.seconds, 4),
                    size_bytes=size,
                    buddy=self._keeper_of() if self.world > 1 else -1,
                    interval=next_interval(self.setting, self.interval, outcome.figures),
                )
            )

    def _exchange(
        self,
        step: int,
        staged_box: list[Any],
        stager: Any,
        problem: str,
        fields: dict[str, Any],
        began: float,
        blocked_s: float,
        step_time_s: float,
    ) -> tuple[_Outcome, int]:
        """The collective part of a snapshot (see the module doc): every local failure is told
        to every rank before the next exchange; _Refused (the same on every rank) ends it.

        Host memory (``S``: this rank's files of a snapshot; what must stay true): besides the
        previous snapshot (kept until every rank holds this one), at most two copies of ``S``
        at any time: the staged state and the files the save serialized it into, until the save
        returns (then the staged copy and ``stager``'s buffers are freed); the files and the
        buddy's copy, received file by file into its final buffers, after that."""
        group = self._group
        if any_rank(bool(problem), torch.device("cpu"), group):
            raise _Refused(problem or "another rank could not copy its state")
        url = f"{self._root}/step-{step:09d}"
        publisher = Publisher(
            {
                **fields,
                "step": step,
                "digest_algorithm": self.algorithm,
                "job": self.job,
                # what the snapshot is bound to is the tier's (its run, its config), whoever's state it is
                "config_hash": self.binding.config_hash,
                "run_id": self.binding.run_id,
            },
            self.hmac_key,
        )
        writer = DigestingWriter(url, options=StorageOptions(), algorithm=self.algorithm, publisher=publisher)
        staged = staged_box.pop()
        dcp.save(staged, storage_writer=writer, process_group=group)  # DCP raises on every rank if one fails
        del staged
        stager.release()  # the staged copy is in the files now: its buffers go before the buddy's copy comes
        give_back_freed()
        own: dict[str, bytes] = {}
        try:
            own = take_files(url)
        except Exception as e:  # noqa: BLE001 - told to every rank below
            problem = f"its files of the save could not be read back: {e}"
        manifest_bytes = broadcast_bytes(publisher.manifest_bytes, 0, group)
        metadata = broadcast_bytes(own.pop(METADATA_NAME, None), 0, group)
        manifest = None
        try:
            manifest = Manifest.from_json(manifest_bytes, self.hmac_key)
            entry = manifest.files.get(METADATA_NAME)
            if entry is None or not matches(metadata, entry, manifest.digest_algorithm):
                raise ManifestError(f"{METADATA_NAME} from rank 0 does not match the manifest")
            # the buddy cuts its receive buffers from the manifest's sizes: this rank's files
            # must have them, or the two ends of the exchange would not pair up
            odd = [n for n, data in own.items() if n in manifest.files and len(data) != manifest.files[n].size_bytes]
            if odd:
                raise ManifestError(f"rank {self.rank}'s {odd[0]} is not of the size the manifest lists")
        except ManifestError as e:
            problem = problem or f"the manifest of step {step}: {e}"
        rows = all_gather_json({"names": sorted(own), "problem": problem}, group)
        bad = _problems([row["problem"] for row in rows])
        unlisted = [n for row in rows for n in row["names"] if manifest is not None and n not in manifest.files]
        if bad or manifest is None or unlisted:
            raise _Refused("; ".join(bad) or f"files not in the manifest: {unlisted[:5]}")
        theirs = _verified(self._swap_with_buddy(own, rows[self._keeper_of()]["names"], manifest, group), manifest)
        kept_here = ""
        try:
            held: dict[str, bytes | bytearray] = {METADATA_NAME: metadata, **own, **theirs}
            files = maybe_damage_memory_copy(self.rank, cast(dict[str, bytes], held), sorted(theirs))
            del held
            snap = self._kept(Snapshot(step, manifest, manifest_bytes, files))
            with self._lock:
                self.snapshots = [*self.snapshots, snap][-KEPT:]
        except Exception as e:  # noqa: BLE001 - told to every rank below
            kept_here = f"rank {self.rank} could not keep it: {e}"
            log.warning("memory-tier snapshot of step %d: %s", step, kept_here)
        seconds = time.monotonic() - began
        # every rank holds this one now (the one before can go), and the figures the next
        # interval is chosen from, the slowest rank's, so that every rank chooses the same
        agreed = max_over(group, [blocked_s, seconds, step_time_s, 1.0 if kept_here else 0.0])
        if agreed[3]:
            raise _Refused("a rank could not keep it")
        with self._lock:
            self.snapshots = [s for s in self.snapshots if s.step >= step]
            if self._store is not None:
                self._store.keep(self.snapshots)
        return _Outcome(True, Figures(*agreed[:3])), sum(len(v) for v in own.values())

    def _kept(self, snap: Snapshot) -> Snapshot:
        """``snap`` written to ``checkpoint.memory_dir`` (its bytes then live there only), or as
        it is, in this process, without one or when writing fails."""
        if self._store is None:
            return snap
        try:
            return self._store.persist(snap)
        except (OSError, CheckpointError) as e:
            log.warning(
                "memory tier: could not keep step %d in %s (kept in memory): %s", snap.step, self._store.own_dir, e
            )
            return snap

    def _swap_with_buddy(
        self, own: dict[str, bytes], theirs_names: list[str], manifest: Manifest, group: Any
    ) -> dict[str, bytearray]:
        """Send this rank's shard files to its buddy, receive its keeper's (``theirs_names``,
        every one listed in ``manifest``: checked by every rank before, as every rank's own
        files' sizes were) into buffers of the manifest's sizes, which the snapshot then keeps:
        file by file, in bounded messages (:func:`ftrain.recovery.tier_wire.exchange_files`)."""
        if self.world < 2:
            return {}
        theirs = {name: bytearray(manifest.files[name].size_bytes) for name in theirs_names}
        exchange_files([own[n] for n in sorted(own)], self.buddy(), list(theirs.values()), self._keeper_of(), group)
        return theirs

    # -- restore ------------------------------------------------------------------------
    def restore(self, subject: TierSubject, committed_step: int) -> int | None:
        """Collective: put the newest complete snapshot (not older than ``committed_step``) into
        ``subject``'s state; its step, or None (every rank alike) when the tier cannot give it."""
        if not self.active:
            return None
        group = self._group
        with self._lock:
            mine = list(self.snapshots)
        try:
            holdings = all_gather_json([s.holdings() for s in mine], group)
        except WireError as e:  # raised on every rank alike: a rank's listing is past the wire's bounds
            self._refuse(subject, -1, f"the ranks' snapshot listings: {e}")
            return None
        choice = choose(holdings, committed_step)
        if choice is None:
            newest = max((s["step"] for held in holdings for s in held), default=-1)
            if newest >= 0:
                why = "older than the newest committed checkpoint" if newest < committed_step else "incomplete"
                self._refuse(subject, newest, f"the newest snapshot (step {newest}) is {why}")
            return None
        snap = next((s for s in mine if s.key == choice.key), None)
        try:
            manifest, files, target = self._collect(subject, snap, choice, holdings, group)
        except (_Refused, WireError) as e:  # each the same on every rank
            self._refuse(subject, choice.step, str(e))
            return None
        reader = VerifiedReader(
            f"{self._root}/restore",
            options=StorageOptions(),
            files=manifest.files,
            algorithm=manifest.digest_algorithm,
            prefetched=files,
        )
        try:
            dcp.load(target, storage_reader=reader, planner=SafeLoadPlanner())  # DCP raises on every rank if one fails
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - nothing was applied yet
            self._refuse(subject, choice.step, f"the load from the verified bytes failed: {e}")
            return None
        subject.tier_apply(manifest, target)
        return manifest.step

    def _collect(
        self,
        subject: TierSubject,
        snap: Snapshot | None,
        choice: Choice,
        holdings: list[list[dict[str, Any]]],
        group: Any,
    ) -> tuple[Manifest, dict[str, bytes], dict[str, Any]]:
        """Collective: the chosen snapshot's manifest, the files this rank's load needs (its own,
        and those it lacks from their holders) checked against the manifest, and the load's
        target; _Refused on every rank when any rank found a problem. Every file a rank sends or
        uses is read and checked before any of them is sent, and the ranks tell each other what
        went wrong first: none is left alone in the exchange."""
        problem = ""
        metadata_out = None
        if snap is not None and self.rank == choice.manifest_from:
            metadata_out, problem = _read_held(snap, METADATA_NAME, snap.manifest, self.rank)
        manifest_bytes = broadcast_bytes(snap.manifest_bytes if snap else None, choice.manifest_from, group)
        metadata = broadcast_bytes(metadata_out, choice.manifest_from, group)
        manifest, target, needed = None, {}, []
        try:
            manifest = Manifest.from_json(manifest_bytes, self.hmac_key)
            if manifest.step != choice.step or manifest.job != self.job:
                raise ManifestError(f"manifest of step {manifest.step}, job {manifest.job!r}")
            other_run = binding_problem(manifest, self.binding)
            if other_run:
                raise ManifestError(f"a snapshot of {other_run}")
            entry = manifest.files.get(METADATA_NAME)
            if not problem and (entry is None or not matches(metadata, entry, manifest.digest_algorithm)):
                raise ManifestError(f"{METADATA_NAME} from rank {choice.manifest_from} does not match it")
            if not problem:  # .metadata is unpickled (allow-list) to plan the load only once it matched
                target = subject.tier_target(manifest)
                needed = needed_files(target, metadata, manifest.files, subject.rank == 0)
        except (ManifestError, ConfigError) as e:
            problem = problem or f"manifest: {e}"
        wants = all_gather_json({"needed": needed, "problem": problem}, group)
        bad = _problems([w["problem"] for w in wants])
        if bad or manifest is None:
            raise _Refused("; ".join(bad)[:1000])
        plan = _Plan.of(self.rank, [w["needed"] for w in wants], holdings, choice)
        # read (and check) everything this rank sends or uses before anything is sent
        local: dict[str, bytes | bytearray] = {}
        for name in sorted(plan.reads(needed)):
            data, problem = _read_held(snap, name, manifest, self.rank) if snap is not None else (None, "")
            if problem or data is None:
                problem = problem or f"rank {self.rank} holds no {name}"
                break
            local[name] = data
        missing = [n for n in needed if n not in local and n not in plan.receives]
        problem = problem or (f"no live rank holds {missing[0]}" if missing else "")
        problem = problem or too_big_to_receive(sum(manifest.files[n].size_bytes for n in plan.receives), self.rank)
        bad = _problems(all_gather_json(problem, group))
        if bad:
            raise _Refused("; ".join(bad)[:1000])
        incoming = {name: torch.empty(manifest.files[name].size_bytes, dtype=torch.uint8) for name in plan.receives}
        ops = [dist.P2POp(dist.isend, as_tensor(local[name]), dst, group) for name, dst in plan.sends]
        ops += [dist.P2POp(dist.irecv, incoming[name], src, group) for name, src in plan.receives.items()]
        for work in dist.batch_isend_irecv(ops) if ops else []:
            work.wait()
        files = {METADATA_NAME: metadata}
        problem = ""
        for name in needed:
            held = incoming[name].numpy().tobytes() if name in incoming else local[name]
            data = held if isinstance(held, bytes) else bytes(held)  # a buddy's copy is kept in a bytearray
            if not matches(data, manifest.files[name], manifest.digest_algorithm):
                problem = (
                    problem or f"{name} from rank {plan.receives.get(name, self.rank)} does not match the manifest"
                )
            files[name] = data
        bad = _problems(all_gather_json(problem, group))
        if bad:
            raise _Refused("; ".join(bad)[:1000])
        return manifest, files, target

    def _refuse(self, subject: TierSubject, step: int, why: str) -> None:
        log.warning("memory tier: no state for this round (loading from storage): %s", why)
        subject.events.emit(ev.MemoryRefused(step=step, why=why[:1000]))


@dataclass(frozen=True, slots=True)
class _Plan:
    """Who sends which file to whom in a restore (the same on every rank, from what they gathered)."""

    sends: list[tuple[str, int]]  #: (file, to rank) this rank sends
    receives: dict[str, int]  #: file -> the rank this rank receives it from
    held: frozenset[str]  #: the files of the snapshot this rank holds

    @classmethod
    def of(cls, rank: int, wants: list[list[str]], holdings: list[list[dict[str, Any]]], choice: Choice) -> _Plan:
        holds = [next((set(s["files"]) for s in h if s["key"] == choice.key), set()) for h in holdings]
        sends, receives = [], {}
        for dst, names in enumerate(wants):
            for name in names:
                src = choice.sources.get(name, -1)
                if name in holds[dst] or src < 0:
                    continue
                if src == rank:
                    sends.append((name, dst))
                elif dst == rank:
                    receives[name] = src
        return cls(sends, receives, frozenset(holds[rank]))

    def reads(self, needed: list[str]) -> set[str]:
        """The files this rank reads from what it holds: those it sends, and those it uses."""
        return {name for name, _ in self.sends} | (set(needed) & self.held)


def _read_held(snap: Snapshot, name: str, manifest: Manifest, rank: int) -> tuple[bytes | bytearray | None, str]:
    """The bytes of ``name`` that ``snap`` holds, checked against ``manifest``; or None and the
    problem, naming the file (a tier directory's path)."""
    files = snap.files
    where = files.where(name) if isinstance(files, DirFiles) else f"{name} in rank {rank}'s memory"
    try:
        data = files[name]
    except (OSError, KeyError) as e:
        return None, f"{name} cannot be read ({e or where})"[:600]
    entry = manifest.files.get(name)
    if entry is None or not matches(data, entry, manifest.digest_algorithm):
        return None, f"{where} does not match the manifest of step {manifest.step}"[:600]
    return data, ""


def _verified(files: dict[str, bytearray], manifest: Manifest) -> dict[str, bytearray]:
    good = {}
    for name, data in files.items():
        entry = manifest.files.get(name)
        if entry is not None and matches(data, entry, manifest.digest_algorithm):
            good[name] = data
        else:
            log.error(
                "memory tier: %s from the buddy does not match the manifest of step %d: dropped", name, manifest.step
            )
    return good


__all__ = ["Choice", "MemoryTier", "Snapshot", "TierSubject", "choose"]
