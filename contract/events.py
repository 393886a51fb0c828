"""Lifecycle events: the catalogue (:class:`Event`, one typed record per event) and the log.

Workers, the checkpoint service, agents and chaos write them; ``bench/``, the demo and the chaos
invariants read them. Each event is one JSON line: the envelope (``time``, ``event``, ``rank``,
``round``, ``pid``) and the record's fields. Every writer appends to the same file with one
``write`` of one line, which appends atomically on local filesystems.

What must stay true: an event name appears once, here; a writer emits a record of this module
(never a bare name), so every field an event can carry is declared on its record. Readers compare
``e["event"]`` with :class:`Event` members (a ``str`` enum) or turn lines into records with
:func:`parse`. A log is read as untrusted input (any process of the job, or anyone who can write
the file, may have written a line): :func:`read_jsonl` keeps only lines that are JSON objects
within :mod:`ftrain.contract.bounded_json`'s bounds and skips the rest (a torn line, invalid
UTF-8, a 400-digit number, nesting 100,000 deep), and :func:`parse` never raises; what a record's
fields hold is still only what the line said (check a value's type before use).

**Size.** Over 600 lines: the catalogue of every event a job writes, one record per event: the
vocabulary is read (and reviewed) in one place.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, ClassVar

from ftrain.contract.bounded_json import VALUE_ERRORS, JsonInputError, loads
from ftrain.contract.local_files import open_append

log = logging.getLogger(__name__)


class Event(StrEnum):
    # a training worker (one per rank)
    WORKER_STARTED = "worker_started"  #: a worker process joined its round's process group
    RESUME_STARTED = "resume_started"
    RESUMED = "resumed"
    WEIGHTS_LOADED = "weights_loaded"  #: model.init_from's files were loaded as the initial weights (their sha256)
    MODEL_BUILT = "model_built"  #: the model is built and made parallel: what the start-up cost in memory
    #: committed steps exist but none loads (on_no_loadable_step=fail), or the step to load would change the LR
    #: schedule (on_schedule_change=fail)
    RESUME_FAILED = "resume_failed"
    GRACEFUL_STOP = "graceful_stop"
    NONFINITE = "nonfinite"
    ROLLED_BACK = "rolled_back"
    REPLICA_MISMATCH = "replica_mismatch"
    CKPT_UNSIGNED = "ckpt_unsigned"
    CKPT_FAILURES_EXCEEDED = "ckpt_failures_exceeded"
    LIVE_ROUND_LEFT = "live_round_left"  #: a live worker left its round (a peer failed, or a newer round)
    LIVE_RESTORED = "live_restored"  #: a live worker joined a round and has its state (from where, how fast)
    LIVE_PEER_REFUSED = "live_peer_refused"  #: a peer's state was refused (header, step, digest): storage instead
    MEMORY_SNAPSHOT = "memory_snapshot"  #: a rank's shards (and its buddy's) are in the memory tier
    MEMORY_REFUSED = "memory_refused"  #: the memory tier could not give a round its state: storage instead
    MEMORY_RESTORED = "memory_restored"  #: restarted workers resumed from the memory tier kept in checkpoint.memory_dir
    MEMORY_SKIPPED = "memory_skipped"  #: something in checkpoint.memory_dir not used (another run, unsafe, unreadable)
    FLIGHT_RECORDED = "flight_recorded"  #: a failing worker's own flight record (its last collectives)
    # the checkpoint service (in the workers)
    CKPT_STAGED = "ckpt_staged"
    CKPT_SKIPPED = "ckpt_skipped"
    CKPT_COMMITTED = "ckpt_committed"
    CKPT_FAILED = "ckpt_failed"
    CKPT_LOADED = "ckpt_loaded"
    CKPT_CORRUPT = "ckpt_corrupt"
    CKPT_FRESH_START = "ckpt_fresh_start"
    CKPT_GC = "ckpt_gc"
    # a node agent (rank -1)
    AGENT_REGISTERED = "agent_registered"
    NODE_HOST = "node_host"  #: where a node's agent runs (its address, host name): reports name the host
    AGENT_METRICS = "agent_metrics"
    AGENT_EXIT = "agent_exit"
    LEASE_LOST = "lease_lost"
    ETCD_UNREACHABLE = "etcd_unreachable"
    ETCD_REACHABLE = "etcd_reachable"
    BAD_RECORD = "bad_record"
    RECORD_REPAIRED = "record_repaired"
    LEADER_ELECTED = "leader_elected"
    ROUND_FORMED = "round_formed"
    ROUND_HELD = "round_held"
    #: the leader needs a new round and does not form it yet (too few nodes, a layout they cannot run, backoff...)
    ROUND_PENDING = "round_pending"
    #: an agent's device time so far by cause (ftrain.contract.accounting): status and report add these up
    DEVICE_TIME = "device_time"
    #: this node's worker processes exit before they are ready, time after time (live recovery)
    WORKERS_FAILING = "workers_failing"
    JOB_FINAL = "job_final"
    WORKERS_STARTED = "workers_started"  #: an agent launched its node's workers (torchrun) for a round
    WORKERS_STOPPED = "workers_stopped"
    WORKERS_REASSIGNED = "workers_reassigned"  #: an agent moved its live workers to a new round
    WORKERS_EXITED = "workers_exited"
    CHECKPOINT_FAILING = "checkpoint_failing"
    HANG = "hang"
    DUMPED = "dumped"  #: flight records and stacks dumped on request (``ftrain status --dump``), not a hang
    DRAIN = "drain"
    #: an agent found its node's ranks corrupt (silent data corruption) agent.drain_after_corruptions times: it drains
    NODE_SUSPECT = "node_suspect"
    STRAGGLER_DETECTED = "straggler_detected"  #: the leader found a member persistently slower than the others
    # chaos (the fault injector)
    CHAOS_FAULT = "chaos_fault"
    CHAOS_FAULT_STEP = "chaos_fault_step"
    CHAOS_FAULT_DONE = "chaos_fault_done"
    CHAOS_NODE_BACK = "chaos_node_back"


RECORDS: dict[Event, type[Record]] = {}


def _record(cls: type[Record]) -> type[Record]:
    """Register ``cls`` as the one record of its event."""
    assert cls.EVENT not in RECORDS, cls.EVENT
    RECORDS[cls.EVENT] = cls
    return cls


@dataclass(frozen=True, slots=True)
class Record:
    EVENT: ClassVar[Event]

    def fields(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


# -- a training worker ---------------------------------------------------------------------------
@_record
@dataclass(frozen=True, slots=True)
class WorkerStarted(Record):
    EVENT = Event.WORKER_STARTED
    world_size: int
    strategy: str
    node: str
    local_rank: int


@_record
@dataclass(frozen=True, slots=True)
class ResumeStarted(Record):
    EVENT = Event.RESUME_STARTED


@_record
@dataclass(frozen=True, slots=True)
class Resumed(Record):
    EVENT = Event.RESUMED
    step: int
    from_world_size: int
    world_size: int
    round: int
    schedule: dict[str, Any] = field(default_factory=dict)  #: the LR schedule in force from here (optim.Schedule)
    #: same | kept | rescaled (train.on_schedule_change, after a change) | unrecorded (an older checkpoint's)
    schedule_outcome: str = ""
    schedule_changes: list[str] = field(default_factory=list)  #: "key old -> new", saved to configured


@_record
@dataclass(frozen=True, slots=True)
class WeightsLoaded(Record):
    EVENT = Event.WEIGHTS_LOADED
    path: str
    files: dict[str, str]  #: each file's name in ``path`` -> its sha256
    #: bytes each rank read from the files, where each read only its part (ftrain.models.init_shards);
    #: empty where rank 0 read them whole and sent the weights
    read_bytes_by_rank: list[int] = field(default_factory=list)


@_record
@dataclass(frozen=True, slots=True)
class ModelBuilt(Record):
    EVENT = Event.MODEL_BUILT
    model_fp32_bytes: int  #: the whole model's parameters in fp32
    deferred: bool  #: built on the meta device, each rank materializing its part (ftrain.models.deferred_init)
    host_before_bytes: int  #: the process's resident memory before the build
    host_peak_bytes: int  #: its peak resident memory once the model is parallel (the start-up phase included)
    device_peak_bytes: int  #: peak allocated GPU memory then (0 on the CPU)


@_record
@dataclass(frozen=True, slots=True)
class LiveRoundLeft(Record):
    EVENT = Event.LIVE_ROUND_LEFT
    step: int  #: the last complete step, which this rank keeps
    why: str


@_record
@dataclass(frozen=True, slots=True)
class LiveRestored(Record):
    EVENT = Event.LIVE_RESTORED
    source: str  #: live_peer | memory | memory_tier | storage | fresh
    step: int  #: the step training goes on from
    from_rank: int  #: live_peer: the rank that sent it (-1 otherwise)
    world_size: int
    held_step: int  #: what this rank held before (-1: nothing, a new worker)
    seconds: float  #: assignment read to state restored (the sum of the three phases below)
    join_s: float  #: the round's process group: store and connections to every peer
    build_s: float  #: the trainer at the round's layout: model, strategy wrap, optimizer, checkpointing
    state_s: float  #: agreement on the step, and the state from a peer or storage


@_record
@dataclass(frozen=True, slots=True)
class LivePeerRefused(Record):
    EVENT = Event.LIVE_PEER_REFUSED
    from_rank: int  #: the rank that sent (or was to send) the state
    step: int  #: the step the survey announced
    problem: str  #: what this rank, or another, refused


@_record
@dataclass(frozen=True, slots=True)
class MemorySnapshot(Record):
    EVENT = Event.MEMORY_SNAPSHOT
    step: int
    blocked_s: float  #: the training thread's share: staging the state into host memory
    seconds: float  #: staging to a complete exchange with the buddy (in the background after staging)
    size_bytes: int  #: this rank's own shard files
    buddy: int  #: the rank whose shards this rank keeps a copy of (-1: none)
    interval: int  #: steps between snapshots, as chosen (checkpoint.memory_interval, or measured)


@_record
@dataclass(frozen=True, slots=True)
class MemoryRestored(Record):
    """A started job (``ftrain train``: its workers restarted) resumed from the memory tier kept
    in ``checkpoint.memory_dir``, not from storage (live workers say ``live_restored``)."""

    EVENT = Event.MEMORY_RESTORED
    step: int
    committed_step: int  #: the newest committed checkpoint then (-1: none)
    world_size: int
    seconds: float  #: deciding, receiving the missing files from peers, checking and loading


@_record
@dataclass(frozen=True, slots=True)
class MemoryRefused(Record):
    EVENT = Event.MEMORY_REFUSED
    step: int  #: the snapshot that could not be used (-1: none was complete)
    why: str


@_record
@dataclass(frozen=True, slots=True)
class MemorySkipped(Record):
    """Something in ``checkpoint.memory_dir`` this worker did not use: a snapshot of another run
    (other run id, config or checkpoint root), one that cannot be read, or a tier directory that
    is not safe (the on-disk tier is then off)."""

    EVENT = Event.MEMORY_SKIPPED
    path: str
    why: str


@_record
@dataclass(frozen=True, slots=True)
class ResumeFailed(Record):
    EVENT = Event.RESUME_FAILED
    refused: list[str]
    load_step: int


@_record
@dataclass(frozen=True, slots=True)
class GracefulStop(Record):
    EVENT = Event.GRACEFUL_STOP
    step: int


@_record
@dataclass(frozen=True, slots=True)
class Nonfinite(Record):
    EVENT = Event.NONFINITE
    step: int
    loss: str
    grad_norm: str
    policy: str


@_record
@dataclass(frozen=True, slots=True)
class RolledBack(Record):
    EVENT = Event.ROLLED_BACK
    step: int
    reason: str


@_record
@dataclass(frozen=True, slots=True)
class ReplicaMismatch(Record):
    EVENT = Event.REPLICA_MISMATCH
    step: int
    ranks: list[int]  #: the ranks whose copies differ from their replicas' majority (the whole group: no majority)
    policy: str
    nodes: list[str] = field(default_factory=list)  #: each rank's node ("" outside an agent)
    decided: bool = True  #: a majority of replicas agreed (False: the culprit is unknown)


@_record
@dataclass(frozen=True, slots=True)
class CkptUnsigned(Record):
    EVENT = Event.CKPT_UNSIGNED
    uri: str


@_record
@dataclass(frozen=True, slots=True)
class CkptFailuresExceeded(Record):
    EVENT = Event.CKPT_FAILURES_EXCEEDED
    failures: int
    limit: int
    error: str


# -- the checkpoint service ----------------------------------------------------------------------
@_record
@dataclass(frozen=True, slots=True)
class CkptStaged(Record):
    EVENT = Event.CKPT_STAGED
    step: int
    staging_s: float


@_record
@dataclass(frozen=True, slots=True)
class CkptSkipped(Record):
    EVENT = Event.CKPT_SKIPPED
    step: int
    in_flight: int  #: the step still uploading


@_record
@dataclass(frozen=True, slots=True)
class CkptCommitted(Record):
    EVENT = Event.CKPT_COMMITTED
    step: int
    duration_s: float


@_record
@dataclass(frozen=True, slots=True)
class CkptFailed(Record):
    EVENT = Event.CKPT_FAILED
    step: int
    error: str
    stale_round: bool  #: the commit fence refused it: this worker's round is over


@_record
@dataclass(frozen=True, slots=True)
class CkptLoaded(Record):
    EVENT = Event.CKPT_LOADED
    step: int
    world_size: int  #: the world size it was saved at
    ckpt_round: int  #: the round that committed it
    created_time: float  #: with ``step``, names the commit that was read
    job: str
    refused_newer: list[str]  #: newer steps that were refused, and why
    bytes_read: int = 0  #: what this rank read for the load (and its share of the verification)
    bytes_from_cache: int = 0  #: of it, from this node's local cache (checkpoint.local_cache_dir)


@_record
@dataclass(frozen=True, slots=True)
class CkptCorrupt(Record):
    EVENT = Event.CKPT_CORRUPT
    step: int
    problems: list[str]


@_record
@dataclass(frozen=True, slots=True)
class CkptFreshStart(Record):
    EVENT = Event.CKPT_FRESH_START
    refused: list[str]


@_record
@dataclass(frozen=True, slots=True)
class CkptGc(Record):
    EVENT = Event.CKPT_GC
    deleted: list[str]


# -- a node agent --------------------------------------------------------------------------------
@_record
@dataclass(frozen=True, slots=True)
class AgentRegistered(Record):
    EVENT = Event.AGENT_REGISTERED
    node: str
    agent: str  #: this agent process's uid
    first: bool


@_record
@dataclass(frozen=True, slots=True)
class NodeHost(Record):
    EVENT = Event.NODE_HOST
    node: str
    host: str  #: the address the other nodes reach it at (``ftrain agent --host``)
    hostname: str  #: the machine's host name


@_record
@dataclass(frozen=True, slots=True)
class AgentMetrics(Record):
    EVENT = Event.AGENT_METRICS
    node: str
    port: int


@_record
@dataclass(frozen=True, slots=True)
class AgentExit(Record):
    EVENT = Event.AGENT_EXIT
    node: str
    exit_code: int | None  #: None: it stopped before deciding one


@_record
@dataclass(frozen=True, slots=True)
class LeaseLost(Record):
    EVENT = Event.LEASE_LOST
    node: str
    reason: str | None


@_record
@dataclass(frozen=True, slots=True)
class EtcdUnreachable(Record):
    EVENT = Event.ETCD_UNREACHABLE
    node: str
    error: str


@_record
@dataclass(frozen=True, slots=True)
class EtcdReachable(Record):
    EVENT = Event.ETCD_REACHABLE
    node: str
    down_s: float


@_record
@dataclass(frozen=True, slots=True)
class BadRecord(Record):
    EVENT = Event.BAD_RECORD
    node: str
    key: str
    mod_revision: int
    error: str


@_record
@dataclass(frozen=True, slots=True)
class RecordRepaired(Record):
    EVENT = Event.RECORD_REPAIRED
    node: str
    key: str


@_record
@dataclass(frozen=True, slots=True)
class LeaderElected(Record):
    EVENT = Event.LEADER_ELECTED
    node: str


@_record
@dataclass(frozen=True, slots=True)
class RoundFormed(Record):
    EVENT = Event.ROUND_FORMED
    node: str
    new_round: int
    reason: str
    members: list[str]
    world_size: int


@_record
@dataclass(frozen=True, slots=True)
class RoundHeld(Record):
    EVENT = Event.ROUND_HELD
    node: str
    why: str


@_record
@dataclass(frozen=True, slots=True)
class RoundPending(Record):
    EVENT = Event.ROUND_PENDING
    node: str  #: the leader
    need: str  #: why a new round is needed: its reason (and detail)
    why: str  #: why it is not formed now
    blocked: bool  #: it cannot form until the nodes change (not a wait that ends by itself)


@_record
@dataclass(frozen=True, slots=True)
class DeviceTime(Record):
    EVENT = Event.DEVICE_TIME
    node: str
    devices: int  #: this node's workers
    wall_s: float  #: since its first launch
    seconds: dict[str, float]  #: device-seconds by cause (ftrain.contract.accounting.CAUSES)


@_record
@dataclass(frozen=True, slots=True)
class WorkersFailing(Record):
    EVENT = Event.WORKERS_FAILING
    node: str
    exits: int  #: processes in a row that exited before they were ready
    exit_code: int  #: the last one's
    error: str  #: the last one's error, as it said it (or the last error line of its log)


@_record
@dataclass(frozen=True, slots=True)
class JobFinal(Record):
    EVENT = Event.JOB_FINAL
    node: str
    status: str
    reason: str


@_record
@dataclass(frozen=True, slots=True)
class WorkersStarted(Record):
    EVENT = Event.WORKERS_STARTED
    node: str
    worker_round: int
    node_rank: int
    nnodes: int
    pid: int  #: torchrun's
    log: str


@_record
@dataclass(frozen=True, slots=True)
class WorkersReassigned(Record):
    EVENT = Event.WORKERS_REASSIGNED
    node: str
    worker_round: int
    node_rank: int
    nnodes: int
    kept: list[int]  #: PIDs that served the previous round and serve this one
    started: list[int]  #: PIDs new to the round (spares taken, or processes started now)


@_record
@dataclass(frozen=True, slots=True)
class WorkersStopped(Record):
    EVENT = Event.WORKERS_STOPPED
    node: str
    worker_round: int
    why: str


@_record
@dataclass(frozen=True, slots=True)
class WorkersExited(Record):
    EVENT = Event.WORKERS_EXITED
    node: str
    worker_round: int
    exit_code: int
    outcome: str


@_record
@dataclass(frozen=True, slots=True)
class CheckpointFailing(Record):
    EVENT = Event.CHECKPOINT_FAILING
    node: str
    worker_round: int
    failures: int
    error: str


@_record
@dataclass(frozen=True, slots=True)
class Hang(Record):
    EVENT = Event.HANG
    node: str
    worker_round: int
    why: str
    local_ranks: list[int]
    stacks: dict[str, str]  #: pid -> Python stacks of its threads
    #: global rank -> its flight record (ftrain.contract.flight.FlightRecord, newest collectives of each group)
    flight: dict[str, Any] = field(default_factory=dict)
    missing: dict[str, str] = field(default_factory=dict)  #: global rank -> why it gave no flight record
    frozen: list[int] = field(default_factory=list)  #: global ranks stopped or silent (no "alive" datagram)
    verdict: str = ""  #: who is at fault, in one line (ftrain.agents.flight_verdict), from this node's records


@_record
@dataclass(frozen=True, slots=True)
class Dumped(Hang):
    """What a ``hang`` event holds, taken on request (``ftrain status --dump``) while the job runs."""

    EVENT = Event.DUMPED


@_record
@dataclass(frozen=True, slots=True)
class FlightRecorded(Record):
    """A worker's own flight record, written as it fails (its agent can no longer ask it)."""

    EVENT = Event.FLIGHT_RECORDED
    record: dict[str, Any]  #: ftrain.contract.flight.FlightRecord
    why: str


@_record
@dataclass(frozen=True, slots=True)
class StragglerDetected(Record):
    EVENT = Event.STRAGGLER_DETECTED
    node: str  #: the straggler
    worker_round: int
    busy_rank: int  #: its busiest rank (not ``rank``: the envelope's)
    busy_s: float  #: that rank's busy time per step (not blocked on communication), lately
    others_s: float  #: the other members' median
    slow_for_s: float
    policy: str  #: warn | evict


@_record
@dataclass(frozen=True, slots=True)
class Drain(Record):
    EVENT = Event.DRAIN
    node: str
    worker_round: int


@_record
@dataclass(frozen=True, slots=True)
class NodeSuspect(Record):
    EVENT = Event.NODE_SUSPECT
    node: str
    corruptions: int  #: times the consistency check found this node's ranks corrupt
    limit: int  #: agent.drain_after_corruptions


# -- chaos ---------------------------------------------------------------------------------------
@_record
@dataclass(frozen=True, slots=True)
class ChaosFault(Record):
    """An injected fault: its kind and what the injector recorded (node, pid, step, ...), flat."""

    EVENT = Event.CHAOS_FAULT
    kind: str
    detail: dict[str, Any] = field(default_factory=dict)

    def fields(self) -> dict[str, Any]:
        return {**self.detail, "kind": self.kind}


@_record
@dataclass(frozen=True, slots=True)
class ChaosFaultStep(Record):
    EVENT = Event.CHAOS_FAULT_STEP
    kind: str
    node: str
    pid: int
    during: str


@_record
@dataclass(frozen=True, slots=True)
class ChaosFaultDone(Record):
    """A fault that lasts is over: what it found at the end (``injected``, ``refused``, ...), flat;
    it completes the ``chaos_fault`` event of its kind before it."""

    EVENT = Event.CHAOS_FAULT_DONE
    kind: str
    detail: dict[str, Any] = field(default_factory=dict)

    def fields(self) -> dict[str, Any]:
        return {**self.detail, "kind": self.kind}


@_record
@dataclass(frozen=True, slots=True)
class ChaosNodeBack(Record):
    EVENT = Event.CHAOS_NODE_BACK
    node: str


ENVELOPE = ("time", "event", "rank", "round", "pid")


def parse(line: dict[str, Any]) -> Record | None:
    """The record of one read event (None for an unknown event name, fields that do not fit or a
    line that is not an object); never raises."""
    if not isinstance(line, dict) or not isinstance(line.get("event"), str):
        return None
    try:
        cls = RECORDS[Event(line["event"])]
    except VALUE_ERRORS:
        return None
    if cls in (ChaosFault, ChaosFaultDone):  # their detail is written flat beside the kind
        detail = {k: v for k, v in line.items() if k not in (*ENVELOPE, "kind")}
        return cls(kind=str(line.get("kind", "")), detail=detail)
    names = {f.name for f in dataclasses.fields(cls)}
    try:
        return cls(**{k: v for k, v in line.items() if k in names})
    except VALUE_ERRORS:  # a field is missing (written by another version), or refused
        return None


class EventLog:
    def __init__(self, path: str = "", *, rank: int = 0, round_: int = 0):
        self.path = path
        self.rank = rank
        self.round = round_
        self._lock = threading.Lock()
        self._fd = -1
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self._fd = open_append(path)  # never through a link planted there

    @classmethod
    def or_none(cls, path: str, *, rank: int, round_: int) -> EventLog:
        """The log at ``path``; one that cannot be opened costs the events, not the run: a log
        without a file (said once, here)."""
        try:
            return cls(path, rank=rank, round_=round_)
        except OSError as e:
            log.warning("the job's event log %s cannot be opened (%s): this worker's events are not written", path, e)
            return cls()

    def emit(self, record: Record) -> dict[str, Any]:
        """Append ``record`` with the envelope; the line as written (also without a file)."""
        line = {
            "time": time.time(),
            "event": record.EVENT.value,
            "rank": self.rank,
            "round": self.round,
            "pid": os.getpid(),
            **record.fields(),
        }
        log.debug("event %s", line)
        if self._fd >= 0:
            data = (json.dumps(line, default=str, separators=(",", ":")) + "\n").encode()
            with self._lock:  # a background thread (a save's, the tier's) may emit as the log closes
                if self._fd >= 0:  # closed: the event is dropped, never written to a reused descriptor
                    os.write(self._fd, data)
        return line

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


#: the longest line read (a hang event carries the flight records of a node's ranks)
MAX_LINE_BYTES = 64 << 20


def parse_line(line: bytes | str) -> dict[str, Any] | None:
    """One line of a JSON-lines file as an object; None for anything else (a torn line left by a
    killed writer, invalid UTF-8, JSON past :mod:`ftrain.contract.bounded_json`'s bounds, a value
    that is not an object). Never raises. ``NaN`` and ``Infinity`` are read as floats: Python's
    ``json`` writes them (a metrics line of a step whose loss was NaN), so readers of these files
    check that a number they use is finite."""
    try:
        record = loads(line, max_bytes=MAX_LINE_BYTES, what="line", nonfinite=True)
    except JsonInputError:
        return None
    return record if isinstance(record, dict) else None


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The objects of a JSON-lines file (metrics, events), one per line; every other line is
    skipped (:func:`parse_line`). OSError if the file cannot be read."""
    records = []
    with open(path, "rb") as fh:
        while line := fh.readline(MAX_LINE_BYTES + 1):
            if len(line) > MAX_LINE_BYTES:  # too long to be one of ours: skipped unread
                while line and not line.endswith(b"\n"):
                    line = fh.readline(MAX_LINE_BYTES + 1)
                continue
            record = parse_line(line)
            if record is not None:
                records.append(record)
    return records


read_events = read_jsonl
