"""The memory tier: each rank's checkpoint shards kept in host memory — its own, and a copy of a
buddy's on another node — so that a round that lost ranks of a sharded strategy (fsdp, zero2, tp,
hsdp: no rank holds everything) heals from peers' memory instead of object storage.

**Snapshot** (:meth:`MemoryTier.maybe_snapshot`, every ``checkpoint.memory_interval`` steps, at
a step boundary). The training thread stages this rank's state (model and optimizer shards,
RNG; DCP's stager) into host memory — the only part it waits for. A background thread writes
the staged state in DCP's format into this process's memory (the checkpoint writer on a private
``memory://`` root: every file digested, a manifest as for a checkpoint, signed when the job has
a key), then exchanges over the tier's own gloo group: rank 0 gives every rank the manifest and
``.metadata``; each rank sends its shard files to its buddy — ``local_world_size`` ranks ahead,
on the next node (any other rank on a single node) — and checks the digests of what it gets. A
rank keeps its newest snapshot and the one before it (a round that ends during an exchange can
leave ranks one snapshot apart); the older one is dropped once every rank finished the newer.
Nothing here is unpickled: bytes travel as uint8 tensors, names as JSON.

**Restore** (:meth:`MemoryTier.restore`, collective, when a round starts without a full replica).
The ranks gather which snapshots and files each holds; :func:`choose` picks the newest step whose
every file some live rank holds, if it is at least as new as the newest committed checkpoint.
Each rank plans the files its DCP load needs (any world size and strategy: DCP reshards),
receives those it lacks from their holders, checks every digest against the manifest, and only
then DCP copies tensors out of the verified bytes (``.metadata`` through the allow-list
unpickler, as for storage). Anything missing, damaged or disagreeing gives every rank ``None``
(and a ``memory_refused`` event): the caller loads from storage. Object storage stays the durable
tier: a rank lost together with its buddy, or every worker, takes the memory copies with it.

**Across restarts** (``checkpoint.memory_dir``, a tmpfs such as ``/dev/shm``; restart recovery,
``ftrain train``): every complete snapshot is kept in that node-local directory rather than in
the process (:mod:`ftrain.tier_store`), so it outlives the worker. A restarted worker offers what
its node's directory holds to its first restore, which checks it exactly as above, before
anything is loaded from storage (:meth:`ftrain.train.Trainer.run`). Live workers keep their
snapshots in their processes (they survive a round change there).
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import fsspec
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from checkpoint.dcp_read import METADATA_NAME, VerifiedReader, needed_files
from checkpoint.dcp_write import DigestingWriter
from checkpoint.digest import new_hasher
from checkpoint.errors import CheckpointError, ManifestError
from checkpoint.manager import new_stager
from checkpoint.manifest import FileEntry, Manifest, hmac_key_from_env
from checkpoint.safe_pickle import SafeLoadPlanner
from checkpoint.storage import StorageOptions
from contract import events as ev
from contract.worker_env import WorkerEnv
from ftrain.checkpointing import apply_loaded, current_round, load_target, manifest_fields, training_state
from ftrain.config import Config, worker_job_id
from ftrain.faults import maybe_damage_memory_copy
from ftrain.tier_store import Snapshot, TierStore

log = logging.getLogger(__name__)

#: with ``checkpoint.memory_interval = -1``: the share of training time a snapshot may block
AUTO_BLOCKED_SHARE = 0.02
#: snapshots a rank keeps (the newest, and the one before while the newest may be incomplete)
KEPT = 2


@dataclass(frozen=True, slots=True)
class Choice:
    """What :func:`choose` decided: the snapshot, who sends its manifest, who sends each file."""

    step: int
    key: str
    manifest_from: int
    sources: dict[str, int]


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


class MemoryTier:
    """One worker's memory tier, across the rounds it serves: a live worker's (:mod:`ftrain.live`
    owns it), or, with ``checkpoint.memory_dir``, a restarted one's (:func:`ftrain.train.train`)."""

    def __init__(self, cfg: Config, memory_dir: str = ""):
        """``memory_dir``: keep complete snapshots there, and offer what the node kept there to the
        first restore (``checkpoint.memory_dir``, for restarted workers); empty: in this process."""
        self.cfg = cfg
        self.memory_dir = memory_dir
        self.setting = cfg.checkpoint.memory_interval
        self.interval = max(1, self.setting)
        self.algorithm = cfg.checkpoint.digest
        self.hmac_key = hmac_key_from_env(cfg.checkpoint.hmac_key_env)
        self.job = worker_job_id(cfg)
        self.snapshots: list[Snapshot] = []  #: oldest first, at most KEPT
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._group: Any = None
        self._stager: Any = None
        self._root = f"memory://ftrain-tier-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._store: TierStore | None = None  #: checkpoint.memory_dir: snapshots kept there
        self.rank = self.world = self.local_world = 0
        self._next_step = self.interval  #: the step of the next snapshot (the same on every rank)
        self._staged = threading.Event()  #: the snapshot in the background has copied the state
        self._staged.set()

    @property
    def enabled(self) -> bool:
        return self.setting != 0

    # -- rounds -------------------------------------------------------------------------
    def join_round(self, rank: int, world: int, local_world: int, device_type: str) -> None:
        """Collective (every rank, while building its trainer): the round's own gloo group."""
        self.rank, self.world, self.local_world = rank, world, local_world
        if self.memory_dir and self._store is None:
            node, local_rank = WorkerEnv.from_env().node, int(os.environ.get("LOCAL_RANK", "0"))
            self._store = TierStore(self.memory_dir, self.job, node, local_rank)
            if not self.snapshots:  # a new process: offer what the node kept to this round's restore
                self.snapshots = self._store.discover(self.hmac_key, self.job)[-KEPT:]
                if self.snapshots:
                    log.info(
                        "memory tier: %s holds snapshot(s) of step(s) %s",
                        self._store.node_dir,
                        [s.step for s in self.snapshots],
                    )
        # its own gloo group (its collectives run beside training's), bounded like training's
        timeout = timedelta(seconds=self.cfg.parallel.timeout_s)
        self._group = dist.new_group(backend="gloo", timeout=timeout) if world > 1 else None
        self._next_step = 0  # a new round: a snapshot at its first step boundary
        if self._stager is None:  # the snapshot thread copies: a synchronous stager, there
            self._stager = new_stager(device_type, asynchronous=False)

    def leave_round(self) -> None:
        """After the round's process groups were aborted (a blocked exchange fails then)."""
        thread = self._thread
        if thread is not None:
            thread.join()
        self._thread = None
        self._group = None

    def wait(self) -> None:
        """Until the snapshot in the background (if any) is complete (or failed)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def close(self, *, job_done: bool = False) -> None:
        """``job_done``: the job ended normally; the snapshots this worker kept in
        ``checkpoint.memory_dir`` are deleted (otherwise they stay for a restarted worker)."""
        self.leave_round()
        if self._stager is not None:
            self._stager.close()
            self._stager = None
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
    def maybe_snapshot(self, step: int, trainer: Any, *, checkpointed: bool = False) -> None:
        """At a step boundary: if a snapshot is due, stage this rank's state and hand it to the
        background. Every rank takes the same snapshots (their exchange is collective): a
        snapshot's step is fixed when the one before starts, from the interval of the one before
        that (whose figures the ranks agreed on as it ended: a rank still exchanging it is
        waited for before the next starts, so every rank starts with the same interval). A
        step that was just ``checkpointed`` always gets one too: the tier is then never older than
        storage, which a restore would prefer."""
        if not self.enabled or self._group is None or (step < self._next_step and not checkpointed):
            return
        if self._thread is not None:
            self._thread.join()  # ends by agreeing on the interval
            self._thread = None
        began = time.monotonic()
        state = training_state(trainer.par, trainer.rank)  # views of the live tensors: the thread copies them
        fields = manifest_fields(self.cfg, trainer.par, trainer.cursor, current_round())
        blocked_s = time.monotonic() - began
        self._next_step = step + self.interval  # the interval the ranks agreed on last
        self._staged = threading.Event()
        self._thread = threading.Thread(
            target=self._snapshot,
            args=(step, state, fields, began, blocked_s, trainer.events, trainer.last_step_time_s),
            name=f"memory-tier-{step}",
            daemon=True,
        )
        self._thread.start()

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
        step: int,
        state: dict[str, Any],
        fields: dict[str, Any],
        began: float,
        blocked_s: float,
        events: Any,
        step_time_s: float,
    ) -> None:
        group = self._group
        try:
            staged = self._stager.stage(state)  # into the stager's buffers, reused from the last
        except Exception as e:  # noqa: BLE001 - no snapshot this time; training goes on
            log.warning("memory-tier snapshot of step %d could not copy the state: %s", step, e)
            return
        finally:
            del state
            self._staged.set()
        url = f"{self._root}/step-{step:09d}"
        publisher = _Publisher(
            {**fields, "step": step, "digest_algorithm": self.algorithm, "job": self.job}, self.hmac_key
        )
        try:
            writer = DigestingWriter(url, options=StorageOptions(), algorithm=self.algorithm, publisher=publisher)
            dcp.save(staged, storage_writer=writer, process_group=group)
            own = _take_files(url)
            manifest_bytes = _broadcast_bytes(publisher.manifest_bytes, 0, group)
            manifest = Manifest.from_json(manifest_bytes, self.hmac_key)
            metadata = own.pop(METADATA_NAME, None)
            metadata = _broadcast_bytes(metadata, 0, group)
            theirs = _verified(self._swap_with_buddy(own, manifest, group), manifest)
            files = maybe_damage_memory_copy(self.rank, {METADATA_NAME: metadata, **own, **theirs}, sorted(theirs))
            snap = self._kept(Snapshot(step, manifest, manifest_bytes, files))
            with self._lock:
                self.snapshots = [*self.snapshots, snap][-KEPT:]
            seconds = time.monotonic() - began
            # every rank holds this one now (the one before can go); and the figures the next
            # interval is chosen from, the slowest rank's, so that every rank chooses the same
            agreed = _max_over(group, [blocked_s, seconds, step_time_s])
            with self._lock:
                self.snapshots = [s for s in self.snapshots if s.step >= step]
                if self._store is not None:
                    self._store.keep(self.snapshots)
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - the previous one stays; training goes on
            log.warning("memory-tier snapshot of step %d failed (the previous one stays): %s", step, e)
            return
        size = sum(len(v) for v in own.values())
        self._adapt(*agreed)  # read when the next snapshot starts, after this thread was joined
        events.emit(
            ev.MemorySnapshot(
                step=step,
                blocked_s=round(blocked_s, 6),
                seconds=round(seconds, 4),
                size_bytes=size,
                buddy=self._keeper_of() if self.world > 1 else -1,
                interval=self.interval,
            )
        )

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

    def _adapt(self, blocked_s: float, seconds: float, step_time_s: float) -> None:
        """``memory_interval = -1``: as often as blocking stays within AUTO_BLOCKED_SHARE of the
        training time, and no more often than a snapshot completes."""
        if self.setting != -1 or step_time_s <= 0:
            return
        self.interval = max(
            1, math.ceil(blocked_s / (AUTO_BLOCKED_SHARE * step_time_s)), math.ceil(seconds / step_time_s)
        )

    def _swap_with_buddy(self, own: dict[str, bytes], manifest: Manifest, group: Any) -> dict[str, bytes]:
        """Send this rank's shard files to its buddy, receive its keeper's (collective)."""
        if self.world < 2:
            return {}
        names = _all_gather_json(sorted(own), group)
        theirs_names = names[self._keeper_of()]
        out_buf = _concat([own[n] for n in sorted(own)])
        sizes = [_size_of(manifest, n) for n in theirs_names]
        in_buf = torch.empty(sum(sizes), dtype=torch.uint8)
        ops = []
        if out_buf.numel():
            ops.append(dist.P2POp(dist.isend, out_buf, self.buddy(), group))
        if in_buf.numel():
            ops.append(dist.P2POp(dist.irecv, in_buf, self._keeper_of(), group))
        for work in dist.batch_isend_irecv(ops) if ops else []:
            work.wait()
        return _split(in_buf, theirs_names, sizes)

    # -- restore ------------------------------------------------------------------------
    def restore(self, trainer: Any, committed_step: int) -> int | None:
        """Collective: put the newest complete snapshot (not older than ``committed_step``) into
        ``trainer``; its step, or None (every rank alike) when the tier cannot give it."""
        if not self.enabled or self._group is None:
            return None
        group = self._group
        with self._lock:
            mine = list(self.snapshots)
        holdings = _all_gather_json([s.holdings() for s in mine], group)
        choice = choose(holdings, committed_step)
        if choice is None:
            newest = max((s["step"] for held in holdings for s in held), default=-1)
            if newest >= 0:
                why = "older than the newest committed checkpoint" if newest < committed_step else "incomplete"
                self._refuse(trainer, newest, f"the newest snapshot (step {newest}) is {why}")
            return None
        snap = next((s for s in mine if s.key == choice.key), None)
        manifest_bytes = _broadcast_bytes(snap.manifest_bytes if snap else None, choice.manifest_from, group)
        metadata = _broadcast_bytes(snap.files[METADATA_NAME] if snap else None, choice.manifest_from, group)
        problem = ""
        try:
            manifest = Manifest.from_json(manifest_bytes, self.hmac_key)
            if manifest.step != choice.step or manifest.job != self.job:
                raise ManifestError(f"manifest of step {manifest.step}, job {manifest.job!r}")
        except ManifestError as e:
            problem, manifest = f"manifest: {e}", None
        target = load_target(trainer.par, trainer.rank, manifest) if manifest is not None else {}
        needed = needed_files(target, metadata, manifest.files, trainer.rank == 0) if manifest is not None else []
        files, problem = self._gather_files(snap, choice, holdings, needed, manifest, metadata, problem, group)
        problems = _all_gather_json(problem, group)
        bad = [f"rank {r}: {p}" for r, p in enumerate(problems) if p]
        if bad or manifest is None:
            self._refuse(trainer, choice.step, "; ".join(bad)[:1000])
            return None
        reader = VerifiedReader(
            f"{self._root}/restore",
            options=StorageOptions(),
            files=manifest.files,
            algorithm=manifest.digest_algorithm,
            prefetched=files,
        )
        dcp.load(target, storage_reader=reader, planner=SafeLoadPlanner())
        apply_loaded(trainer.par, trainer.cursor, trainer.rank, manifest, target)
        return manifest.step

    def _gather_files(
        self,
        snap: Snapshot | None,
        choice: Choice,
        holdings: list[list[dict[str, Any]]],
        needed: list[str],
        manifest: Manifest | None,
        metadata: bytes,
        problem: str,
        group: Any,
    ) -> tuple[dict[str, bytes], str]:
        """Collective: every rank receives the files its load needs and does not hold, from the
        lowest rank that holds each; returns the files (checked against the manifest) and this
        rank's problem ("" if none)."""
        wants = _all_gather_json(needed, group)
        held = snap.files if snap is not None else {}
        holds = [next((set(s["files"]) for s in h if s["key"] == choice.key), set()) for h in holdings]
        ops, incoming = [], {}
        for dst, names in enumerate(wants):
            for name in names:
                src = choice.sources.get(name, -1)
                if name in holds[dst] or src < 0:
                    continue
                if src == self.rank:
                    ops.append(dist.P2POp(dist.isend, _as_tensor(held[name]), dst, group))
                elif dst == self.rank and manifest is not None:
                    incoming[name] = torch.empty(_size_of(manifest, name), dtype=torch.uint8)
                    ops.append(dist.P2POp(dist.irecv, incoming[name], src, group))
        for work in dist.batch_isend_irecv(ops) if ops else []:
            work.wait()
        files = {METADATA_NAME: metadata}
        for name in needed:
            data = incoming[name].numpy().tobytes() if name in incoming else held.get(name)
            if data is None:
                problem = problem or f"no live rank holds {name}"
                continue
            files[name] = data
        if manifest is not None and not problem:
            for name, data in files.items():
                entry = manifest.files.get(name)
                if entry is None or not _matches(data, entry, manifest.digest_algorithm):
                    problem = f"{name} does not match the manifest of step {manifest.step}"
                    break
        return files, problem

    def _refuse(self, trainer: Any, step: int, why: str) -> None:
        log.warning("memory tier: no state for this round (loading from storage): %s", why)
        trainer.events.emit(ev.MemoryRefused(step=step, why=why[:1000]))


class _Publisher:
    """The coordinator's end of a snapshot's DCP save: the manifest, in memory (picklable)."""

    def __init__(self, fields: dict[str, Any], hmac_key: bytes | None = None):
        self.fields = fields
        self.hmac_key = hmac_key
        self.manifest_bytes: bytes | None = None

    def prepare(self) -> None:
        return None

    def commit(self, files: dict[str, FileEntry]) -> None:
        self.manifest_bytes = Manifest(files=files, created_time=time.time(), **self.fields).to_json(self.hmac_key)


# -- bytes over the tier's group (no pickle) -----------------------------------------------------
def _as_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def _concat(parts: list[bytes]) -> torch.Tensor:
    return _as_tensor(b"".join(parts))


def _split(buf: torch.Tensor, names: list[str], sizes: list[int]) -> dict[str, bytes]:
    out, offset, raw = {}, 0, buf.numpy().tobytes()
    for name, size in zip(names, sizes, strict=True):
        out[name] = raw[offset : offset + size]
        offset += size
    return out


def _size_of(manifest: Manifest, name: str) -> int:
    entry = manifest.files.get(name)
    if entry is None:
        raise CheckpointError(f"memory tier: {name} is not in the manifest of step {manifest.step}")
    return entry.size_bytes


def _broadcast_bytes(data: bytes | None, src: int, group: Any) -> bytes:
    if group is None:
        return data or b""
    size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
    dist.broadcast(size, src, group=group)
    buf = _as_tensor(data) if dist.get_rank() == src and data else torch.empty(int(size.item()), dtype=torch.uint8)
    if buf.numel():
        dist.broadcast(buf, src, group=group)
    return data if dist.get_rank() == src and data is not None else buf.numpy().tobytes()


def _all_gather_json(obj: Any, group: Any) -> list[Any]:
    if group is None:
        return [obj]
    blob = json.dumps(obj).encode()
    world = dist.get_world_size(group)
    size = torch.tensor([len(blob)], dtype=torch.int64)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    longest = max(int(s.item()) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: len(blob)] = torch.frombuffer(bytearray(blob), dtype=torch.uint8) if blob else padded[:0]
    out = [torch.zeros(longest, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(out, padded, group=group)
    return [json.loads(t[: int(n.item())].numpy().tobytes()) for t, n in zip(out, sizes, strict=True)]


def _max_over(group: Any, values: list[float]) -> list[float]:
    """Collective: the element-wise maximum of ``values`` over the group's ranks."""
    if group is None:
        return values
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


def _take_files(url: str) -> dict[str, bytes]:
    """The files this process wrote under ``url`` (memory://), removed from the memory filesystem."""
    fs, path = fsspec.core.url_to_fs(url)
    names = [p.rsplit("/", 1)[-1] for p in fs.ls(path, detail=False)] if fs.exists(path) else []
    files = {name: fs.cat_file(f"{path}/{name}") for name in names}
    fs.rm(path, recursive=True)
    return files


def _matches(data: bytes, entry: FileEntry, algorithm: str) -> bool:
    hasher = new_hasher(algorithm)
    hasher.update(data)
    return len(data) == entry.size_bytes and hasher.hexdigest() == entry.digest


def _verified(files: dict[str, bytes], manifest: Manifest) -> dict[str, bytes]:
    good = {}
    for name, data in files.items():
        entry = manifest.files.get(name)
        if entry is not None and _matches(data, entry, manifest.digest_algorithm):
            good[name] = data
        else:
            log.error(
                "memory tier: %s from the buddy does not match the manifest of step %d: dropped", name, manifest.step
            )
    return good


__all__ = ["MemoryTier", "Snapshot", "Choice", "choose"]
