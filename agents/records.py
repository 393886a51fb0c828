"""What a job keeps in etcd, and how one read of it becomes a :class:`JobState`.

The keys and who follows which: :mod:`ftrain.agents.job_keys`. Each record is decoded once per
change (:func:`decode`) and a state assembled from decoded records (:meth:`JobState.assemble`)
equals a fresh :meth:`JobState.parse` of the same keys.

Reading is forgiving per record and strict per field (what must stay true):

- A record that cannot be read (not JSON within :mod:`ftrain.contract.bounded_json`'s bounds,
  not an object, a missing field, a field of the wrong type or out of range, a key whose round
  segment is not a number, a master that is not ``host:port``) is **skipped** and listed in
  :attr:`JobState.problems`; whatever a record holds (a 400-digit number in a float field, a
  list nested 100,000 deep, invalid UTF-8), :func:`decode` and :meth:`JobState.parse` never
  raise. Fields a newer version added are ignored, so old agents read new records.
- Counts are bounded where they are read: a round of at most :data:`MAX_NPROC_PER_NODE` workers a
  node and :data:`~ftrain.contract.control.MAX_WORLD_SIZE` ranks (an agent starts that many
  processes, and builds tables of that many ranks).
- Skipping never makes anyone act on a wrong round: an unreadable ``round`` key sets
  :attr:`JobState.round_unreadable` (followers hold, the leader forms a new round above every
  round number found in any key), and an unreadable record of the current round leaves
  :attr:`JobState.current` empty (followers hold, the leader forms the next round).
- An unreadable ``nodes/<id>`` is not a live member. An unreadable report of a member counts as
  a failure of that member (never as a success). A ``leader`` without a lease (agents always put
  it on theirs) or unreadable does not lead.
- Ids are one path segment: :func:`validate_id` (job ids, node ids).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from ftrain.agents.etcd import KeyValue
from ftrain.agents.job_keys import JobKeys, validate_id
from ftrain.agents.record_checks import checker, from_dict
from ftrain.contract.bounded_json import VALUE_ERRORS, loads, printable, short
from ftrain.contract.control import MAX_WORLD_SIZE
from ftrain.contract.heartbeat import MAX_LOCAL_RANK
from ftrain.contract.worker_env import MAX_ROUND

# Round formation reasons. FAILURE_CAUSES count against the restart budget.
START, WORKER_EXIT, HANG, START_TIMEOUT, NODE_LOST, NODE_LEFT, SCALE_UP = (
    "start",
    "worker_exit",
    "hang",
    "start_timeout",
    "node_lost",
    "node_left",
    "scale_up",
)
#: a member's workers were persistently slower than the others' and agent.on_straggler = evict
STRAGGLER = "straggler"
#: a record of the current round could not be used (a malformed master address...)
BAD_RECORD = "bad_record"
#: the round key or the current round's record was unreadable: the leader formed a new round
ROUND_REPAIR = "round_repair"
#: live recovery: a rank left its round on an error of the round's communication (a collective
#: failed, the round's store could not be hosted) and no member was lost, failed or drained
#: for :func:`ftrain.agents.supervision.left_round_grace_s`: the round moves on without it
RANK_LEFT = "rank_left"
FAILURE_CAUSES = frozenset({WORKER_EXIT, HANG, START_TIMEOUT, BAD_RECORD, RANK_LEFT})
#: a round formed for one of these lost a member of the round before it: that round's survivors
#: leave it at once (live recovery) instead of finishing their step first
INTERRUPTING_CAUSES = FAILURE_CAUSES | {NODE_LOST, ROUND_REPAIR}
#: Report reason: the workers stopped on an error a restart cannot fix (e.g. too many failed
#: checkpoint commits in a row); the leader ends the job at once with the report's detail.
FATAL = "fatal"

# Report outcomes. stopped: this node drains (its workers stopped early because it asked them to):
# it leaves. yielded: its workers stopped early because a peer's drain stopped the whole round
# (ranks stop together): it stays for the next round.
SUCCEEDED, FAILED, STOPPED, YIELDED = "succeeded", "failed", "stopped", "yielded"
#: a node status's ``state`` while its agent drains (its workers finish the step, save, exit)
DRAINING = "stopping"


#: the largest record read (etcd's own limit on a request is 1.5 MiB by default)
MAX_RECORD_BYTES = 4 << 20
#: the most workers a round may give a node (a local rank past this cannot send a heartbeat)
MAX_NPROC_PER_NODE = MAX_LOCAL_RANK + 1


def _dumps(obj: Any) -> str:
    return json.dumps(asdict(obj), separators=(",", ":"), sort_keys=True)


def parse_master(value: str) -> tuple[str, int]:
    """``host:port`` of a round's rendezvous, or ValueError saying what is wrong with it."""
    host, sep, port = value.rpartition(":")
    if (
        not sep
        or not host
        or not _is_decimal(port, 5)
        or not 1 <= int(port) <= 65535
        or len(host) > 255
        or any(c.isspace() or not c.isprintable() for c in host)
    ):
        raise ValueError(f"malformed master address {value[:80]!r}: expected host:port with a port in 1-65535")
    return host, int(port)


@dataclass(frozen=True, slots=True)
class Member:
    node_id: str
    agent_uid: str  #: one per agent process: a restarted agent is a different member

    def key(self) -> tuple[str, str]:
        return self.node_id, self.agent_uid


@dataclass(slots=True)
class NodeRecord:
    node_id: str
    agent_uid: str
    host: str
    pid: int
    nproc_per_node: int
    registered_at: float
    create_revision: int = 0  #: filled in from etcd: join order

    def member(self) -> Member:
        return Member(self.node_id, self.agent_uid)

    def to_json(self) -> str:
        d = asdict(self)
        d.pop("create_revision")
        return json.dumps(d, separators=(",", ":"), sort_keys=True)


@dataclass(slots=True)
class RoundRecord:
    round: int
    members: list[Member]  #: in node-rank order: members[0] hosts the rendezvous
    nproc_per_node: int
    reason: str
    created_at: float
    failure_times: list[float] = field(default_factory=list)  #: recent failures, for the restart budget
    restarts_by_cause: dict[str, int] = field(default_factory=dict)  #: every round after the first, by reason
    #: recent failures' "reason|step|error" (empty: not comparable), for the deterministic-failure rule
    failure_signatures: list[str] = field(default_factory=list)
    #: node id -> wall time until which it is kept out (evicted as a straggler); carried to later rounds
    excluded: dict[str, float] = field(default_factory=dict)

    @property
    def world_size(self) -> int:
        return len(self.members) * self.nproc_per_node

    def node_rank(self, member: Member) -> int | None:
        try:
            return self.members.index(member)
        except ValueError:
            return None

    def to_json(self) -> str:
        return _dumps(self)

    @classmethod
    def from_json(cls, raw: bytes | str) -> RoundRecord:
        record = from_dict(cls, _json(raw, "RoundRecord"))
        if (
            not 1 <= record.round <= MAX_ROUND
            or not 1 <= record.nproc_per_node <= MAX_NPROC_PER_NODE
            or not record.members
            or record.world_size > MAX_WORLD_SIZE
        ):
            raise ValueError(
                f"RoundRecord: round {record.round}, nproc_per_node {record.nproc_per_node} and "
                f"{len(record.members)} members: need round 1..{MAX_ROUND}, nproc 1..{MAX_NPROC_PER_NODE}, "
                f"a member and a world size of at most {MAX_WORLD_SIZE}"
            )
        return record


@dataclass(slots=True)
class Report:
    outcome: str  #: succeeded | failed | stopped | yielded
    reason: str = ""  #: for failures: worker_exit | hang | start_timeout | bad_record | rank_left | fatal
    detail: str = ""
    agent_uid: str = ""
    time: float = 0.0
    step: int = -1  #: the newest step the workers reported before the round ended here (-1: none)
    error: str = ""  #: the workers' own error message, or a stand-in ("torchrun exit code 1")
    #: live recovery: warm processes this node could serve the next round with, counted after the
    #: failure (its survivors and warm spares); -1: not known (restart mode, older agents)
    workers_ready: int = -1

    def to_json(self) -> str:
        return _dumps(self)


#: RankStall.why: inside one collective for long | the process stopped talking | no step beat past its limit
WAITING, FROZEN, NO_PROGRESS = "waiting", "frozen", "no_progress"


@dataclass(slots=True)
class RankStall:
    """A rank of a node that is not making progress, as its agent last saw it (``NodeStatus.stalled``;
    the other agents read it to tell whether anyone in the round still moves, ``ftrain status``
    shows it). Read from etcd, so it is bounded where it is used (:mod:`ftrain.agents.supervision`)."""

    rank: int  #: global rank
    why: str  #: waiting | frozen | no_progress
    since: float  #: wall clock: when it entered the collective it waits in, went silent, or last stepped
    seq: int = -1  #: waiting: the collective's sequence number in its group
    group: str = ""  #: its process group
    what: str = ""  #: op, shapes, dtypes (may be empty)


@dataclass(slots=True)
class NodeStatus:
    round: int = 0
    state: str = "starting"  #: starting | waiting | running | stopping (DRAINING) | done
    step: int = -1
    step_time_s: float = 0.0
    heartbeat_age_s: float | None = None
    committed_step: int = -1
    restarts: int = 0
    host: str = ""
    pid: int = 0
    updated_at: float = 0.0
    ckpt_failures: int = 0  #: checkpoint commits failed in a row (0 after a commit)
    ckpt_failures_total: int = 0  #: failed commits this agent's workers reported, all rounds
    ckpt_error: str = ""  #: the last failed commit's error
    recovery: str = ""  #: this agent's recovery mode: live | restart
    workers_kept: int = 0  #: worker processes of this round that served the previous one (live)
    workers_new: int = 0  #: worker processes new to this round (started, or spares taken)
    workers_ready: int = 0  #: live recovery: warm worker processes on this node, serving or spare
    hang_verdict: str = ""  #: the newest hang's verdict from the flight records (round: who is at fault)
    productive_s: float = 0.0  #: step time of first-time steps on this node since its first launch
    lost_s: float = 0.0  #: wall time since the first launch that was not productive
    device_hours: dict[str, float] = field(default_factory=dict)  #: by cause (ftrain.agents.metrics.device_seconds)
    devices: int = 0  #: this node's workers (devices)
    device_hour_price: float = 0.0  #: accounting.device_hour_price (0: not priced)
    busy_s: float = 0.0  #: mean busy time per step (not blocked on communication) of this node's busiest rank lately
    busy_rank: int = -1  #: that rank
    stragglers: list[str] = field(default_factory=list)  #: the leader's: one line per straggler it sees
    dump_nonce: str = ""  #: the newest ``ftrain status --dump`` request this agent answered
    dump_verdict: str = ""  #: what its workers' flight records said then
    #: this node's ranks that are not making progress (none while the round runs well)
    stalled: list[RankStall] = field(default_factory=list)
    hang_dumped_round: int = -1  #: the newest round whose hang this agent's workers' flight records were dumped for
    #: the leader's: why a new round is needed and why it is not formed yet (empty: none is needed)
    round_pending: str = ""
    #: the leader's: node id -> why that live node is outside the current round (bounded, oldest first)
    waiting: dict[str, str] = field(default_factory=dict)
    #: this node's workers cannot start: their processes exit before they are ready, with this error
    workers_error: str = ""

    def to_json(self) -> str:
        return _dumps(self)


@dataclass(slots=True)
class DumpRequest:
    nonce: str  #: hex, at most 32 characters
    time: float  #: when it was asked (wall clock): agents that start later ignore an old one

    def to_json(self) -> str:
        return _dumps(self)


@dataclass(slots=True)
class FinalStatus:
    status: str  #: succeeded | failed
    reason: str
    round: int
    time: float
    committed_step: int = -1  #: newest committed checkpoint the members reported

    def to_json(self) -> str:
        return _dumps(self)


def _json(raw: bytes | str, what: str) -> Any:
    """A record's JSON, bounded (:func:`ftrain.contract.bounded_json.loads`): JsonInputError otherwise."""
    return loads(raw, max_bytes=MAX_RECORD_BYTES, what=what)


def _load(cls: type, raw: bytes) -> Any:
    return from_dict(cls, _json(raw, cls.__name__))


@dataclass(frozen=True, slots=True)
class Problem:
    """A record :meth:`JobState.parse` skipped: report it once per (key, mod_revision)."""

    key: str
    mod_revision: int
    error: str

    def __str__(self) -> str:
        return printable(f"unreadable job record {self.key} (revision {self.mod_revision}): {self.error}")


def _is_decimal(text: str, max_digits: int) -> bool:
    """``text`` is 1 to ``max_digits`` ASCII digits (``str.isdigit`` also takes ``"²"``, which
    ``int`` refuses, and other scripts' digits)."""
    return 0 < len(text) <= max_digits and text.isascii() and text.isdigit()


def _round_number(text: str) -> int:
    if not _is_decimal(text, 18):
        raise ValueError(f"round segment {short(text)} is not a round number")
    return int(text)


@dataclass(slots=True)
class JobState:
    """One consistent read of a job (every key at one etcd revision)."""

    revision: int
    nodes: dict[str, NodeRecord] = field(default_factory=dict)
    leader: str | None = None  #: None also when the key is unreadable or has no lease
    leader_lease: int = 0
    leader_mod_revision: int = 0  #: 0: no leader key (an unusable one is replaced with a CAS on this)
    round: int = 0
    round_mod_revision: int = 0  #: 0: no round key yet
    #: the round key is unreadable: ``round`` is then the highest round number in any key
    round_unreadable: bool = False
    rounds: dict[int, RoundRecord] = field(default_factory=dict)
    masters: dict[int, str] = field(default_factory=dict)
    bad_masters: dict[int, str] = field(default_factory=dict)  #: round -> why its master is unusable
    hangs: dict[int, str] = field(default_factory=dict)  #: round -> the first member that reported a hang in it
    stragglers: dict[int, list[str]] = field(default_factory=dict)  #: round -> the leader's stragglers in it
    started: dict[int, set[str]] = field(default_factory=dict)
    reports: dict[int, dict[str, Report]] = field(default_factory=dict)
    status: dict[str, NodeStatus] = field(default_factory=dict)
    final: FinalStatus | None = None
    dump: DumpRequest | None = None  #: the newest ``ftrain status --dump`` request
    #: the newest step with a commit record (``commits/<step>``, written at the commit point; -1: none)
    newest_commit: int = -1
    final_mod_revision: int = 0  #: of an unreadable ``final`` (0: none): the leader replaces it
    problems: list[Problem] = field(default_factory=list)  #: records skipped, in key order

    @property
    def current(self) -> RoundRecord | None:
        """The current round's record; None when there is none yet, or when the round key or
        this record is unreadable (nobody may act on a round it cannot read)."""
        return None if self.round_unreadable else self.rounds.get(self.round)

    @property
    def round_known(self) -> bool:
        """False while the round key, or the record of the round it names, is unreadable:
        followers then hold (keep their workers, start nothing) until the leader forms a new
        round."""
        return not self.round_unreadable and (self.round == 0 or self.round in self.rounds)

    def newest_record(self) -> RoundRecord | None:
        """The readable round record with the highest number (the restart budget's memory when
        the current one is unreadable)."""
        return self.rounds[max(self.rounds)] if self.rounds else None

    def live_members(self) -> list[Member]:
        """Registered agents in join order (oldest first)."""
        return [n.member() for n in sorted(self.nodes.values(), key=lambda n: n.create_revision)]

    def member_reports(self, g: int) -> dict[str, Report]:
        """Reports of round g from the agents that are its members (a report by an earlier
        agent process with the same node id does not count)."""
        record = self.rounds.get(g)
        if record is None:
            return {}
        uids = {m.node_id: m.agent_uid for m in record.members}
        return {
            n: r
            for n, r in self.reports.get(g, {}).items()
            if uids.get(n) == r.agent_uid or (n in uids and r.agent_uid == _UNREADABLE_UID)
        }

    @classmethod
    def parse(cls, keys: JobKeys, kvs: list[KeyValue], revision: int) -> JobState:
        """Never raises on what is in etcd: unreadable records are skipped into ``problems``
        (see the module docstring for what skipping means for each key)."""
        return cls.assemble([decode(keys, kv) for kv in kvs], revision)

    @classmethod
    def assemble(cls, records: Iterable[Decoded], revision: int) -> JobState:
        """The state of records already decoded (in key order): what a fresh :meth:`parse` of
        their keys gives, without decoding any of them again (:mod:`ftrain.agents.job_view`)."""
        state = cls(revision=revision)
        highest_round = 0
        round_mod_revision = 0
        for record in records:
            parts = record.parts
            if parts[0] in ("rounds", "tally") and len(parts) >= 2 and _is_decimal(parts[1], 18):
                highest_round = max(highest_round, int(parts[1]))
            if record.rel == "round":
                round_mod_revision = record.kv.mod_revision
            if record.error:
                state.problems.append(Problem(record.kv.key, record.kv.mod_revision, record.error))
                state._skipped(record)
            else:
                state._place(record)
        if state.round_unreadable:
            state.round = max(highest_round, state.round)
            state.round_mod_revision = round_mod_revision
        return state

    def _place(self, record: Decoded) -> None:
        kv, parts, value = record.kv, record.parts, record.value
        kind = record.kind
        if kind == "node":
            self.nodes[parts[1]] = value
        elif kind == "leader":
            self.leader_mod_revision = kv.mod_revision
            self.leader, self.leader_lease = value, kv.lease
        elif kind == "round":
            self.round_mod_revision = kv.mod_revision
            self.round = value
        elif kind == "round_record":
            self.rounds[value.round] = value
        elif kind == "master":
            self.masters[int(parts[1])] = value
        elif kind == "hang":
            self.hangs[int(parts[1])] = value
        elif kind == "stragglers":
            self.stragglers[int(parts[1])] = value
        elif kind == "started":
            self.started.setdefault(int(parts[1]), set()).add(parts[3])
        elif kind == "report":
            self.reports.setdefault(int(parts[1]), {})[parts[3]] = value
        elif kind == "status":
            self.status[parts[1]] = value
        elif kind == "commit":
            self.newest_commit = max(self.newest_commit, value)
        elif kind == "dump":
            self.dump = value
        elif kind == "final":
            self.final = value

    def _skipped(self, record: Decoded) -> None:
        """What an unreadable record means (the safe reading of each key)."""
        kv, parts, kind = record.kv, record.parts, record.kind
        if kind == "round":
            self.round_unreadable = True
        elif kind == "leader":
            self.leader_mod_revision = kv.mod_revision
        elif kind == "final":
            self.final_mod_revision = kv.mod_revision
        elif kind == "master" and _is_decimal(parts[1], 18):
            self.bad_masters[int(parts[1])] = f"{kv.key}: {record.error}"
        elif kind == "report" and _is_decimal(parts[1], 18):
            self.reports.setdefault(int(parts[1]), {})[parts[3]] = Report(
                FAILED, WORKER_EXIT, f"unreadable report {kv.key}: {record.error}"[:300], _UNREADABLE_UID, 0.0
            )


@dataclass(frozen=True, slots=True)
class Decoded:
    """One job record as read, decoded once per change of its key: what it holds (``value``),
    or why it cannot be used (``error``, non-empty)."""

    kv: KeyValue
    rel: str  #: the key below the job's prefix
    parts: tuple[str, ...]  #: ``rel`` split at ``/``
    #: node | leader | round | round_record | master | hang | stragglers | started | report | status |
    #: commit | dump | final | "" (not one of ours: ignored)
    kind: str
    value: Any = None
    error: str = ""


MAX_STRAGGLERS = 1024  #: node ids read from one ``rounds/<g>/stragglers`` (bounded: it comes from etcd)


def _kind(rel: str, parts: tuple[str, ...]) -> str:
    top, n = parts[0], len(parts)
    if top == "nodes" and n == 2:
        return "node"
    if top == "status" and n == 2:
        return "status"
    if top == "rounds" and n == 2:
        return "round_record"
    if top == "rounds" and n == 3 and parts[2] in ("master", "hang", "stragglers"):
        return parts[2]
    if top == "tally" and n == 4 and parts[2] == "started":
        return "started"
    if top == "tally" and n == 4 and parts[2] == "reports":
        return "report"
    if top == "commits" and n == 2 and _is_decimal(parts[1], 18):
        return "commit"
    if rel in ("leader", "round", "dump", "final"):
        return rel
    return ""


def decode(keys: JobKeys, kv: KeyValue) -> Decoded:
    """Decode one of the job's records (``kv`` under ``keys.prefix``); never raises on what is in
    etcd: an unreadable record comes back with its ``error`` (any exception a value raises:
    :data:`ftrain.contract.bounded_json.VALUE_ERRORS`)."""
    rel = kv.key[len(keys.prefix) :]
    parts = tuple(rel.split("/"))
    kind = _kind(rel, parts)
    try:
        if parts[0] in ("rounds", "tally") and len(parts) >= 2:
            _round_number(parts[1])
        return Decoded(kv, rel, parts, kind, _decode_value(kind, kv, parts))
    except VALUE_ERRORS as e:
        return Decoded(kv, rel, parts, kind, error=f"{type(e).__name__}: {e}"[:300])


def _decode_value(kind: str, kv: KeyValue, parts: tuple[str, ...]) -> Any:
    if kind == "node":
        node = _load(NodeRecord, kv.value)
        if node.node_id != parts[1]:
            raise ValueError(f"node_id {node.node_id!r} does not match its key")
        node.create_revision = kv.create_revision
        return node
    if kind == "leader":
        leader = kv.value.decode()
        if not kv.lease:
            raise ValueError(f"leader {leader[:64]!r} holds no lease (agents always put it on theirs)")
        return validate_id(leader, "leader")
    if kind == "round":
        value = _round_number(kv.value.decode().strip())
        if value < 1:
            raise ValueError("round 0 is never formed")
        return value
    if kind == "round_record":
        record = RoundRecord.from_json(kv.value)
        if record.round != int(parts[1]):
            raise ValueError(f"record of round {record.round} under rounds/{parts[1]}")
        return record
    if kind == "master":
        address = kv.value.decode()
        parse_master(address)
        return address
    if kind == "hang":
        return validate_id(kv.value.decode(), "hang reporter")
    if kind == "stragglers":
        nodes = checker(list[str])(_json(kv.value, "stragglers"), "stragglers")
        return [validate_id(n, "straggler") for n in nodes[:MAX_STRAGGLERS]]
    if kind == "report":
        return _load(Report, kv.value)
    if kind == "status":
        return _load(NodeStatus, kv.value)
    if kind == "commit":
        return int(parts[1])
    if kind == "dump":
        request = _load(DumpRequest, kv.value)
        if not re.fullmatch(r"[0-9a-f]{1,32}", request.nonce):
            raise ValueError("a dump request's nonce must be 1 to 32 hex digits")
        return request
    if kind == "final":
        final = _load(FinalStatus, kv.value)
        if final.status not in (SUCCEEDED, FAILED):
            raise ValueError("final status must be succeeded or failed")
        return final
    return None


#: agent_uid of the stand-in for an unreadable report: it counts for whichever agent is the member
_UNREADABLE_UID = "?unreadable"
