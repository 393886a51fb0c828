"""What a job keeps in etcd, and how one read of it becomes a :class:`JobState`.

Everything lives under ``/ftrain/jobs/<job>/``::

    nodes/<node_id>            NodeRecord, on the agent's lease (gone when the agent is)
    leader                     node id of the leader, on its lease (election = put-if-absent)
    round                      the current round number as text: the fencing token
    rounds/<g>                 RoundRecord: members in node-rank order, why it was formed
    rounds/<g>/master          "host:port" of round g's rendezvous, written by its node-rank-0 agent
    rounds/<g>/started/<node>  the agent launched its workers for round g
    rounds/<g>/reports/<node>  Report: how round g ended on that node
    status/<node>              NodeStatus, on the agent's lease, refreshed every second or so
    final                      FinalStatus: the job is over (succeeded or failed)

The state is read with one prefix range (a job has a handful of keys) and decided on level by
level, so an agent that missed events, restarted or lost etcd for a while acts on what is true
now rather than on a history it may have half seen.

Reading is forgiving per record and strict per field (what must stay true):

- A record that cannot be read (not JSON, not an object, a missing field, a field of the wrong
  type, a key whose round segment is not a number, a master that is not ``host:port``) is
  **skipped** and listed in :attr:`JobState.problems`; it never makes :meth:`JobState.parse`
  raise. Fields a newer version added are ignored, so old agents read new records.
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
import math
import re
import types
import typing
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from ftrain.agents.etcd import KeyValue

ROOT = "/ftrain/jobs"

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
FAILURE_CAUSES = frozenset({WORKER_EXIT, HANG, START_TIMEOUT, BAD_RECORD})
#: a round formed for one of these lost a member of the round before it: that round's survivors
#: leave it at once (live recovery) instead of finishing their step first
INTERRUPTING_CAUSES = FAILURE_CAUSES | {NODE_LOST, ROUND_REPAIR}
#: Report reason: the workers stopped on an error a restart cannot fix (e.g. too many failed
#: checkpoint commits in a row); the leader ends the job at once with the report's detail.
FATAL = "fatal"

#: Job ids and node ids: one etcd key path segment, printable, bounded.
ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def validate_id(value: str, option: str) -> str:
    """``value`` if it is a valid job or node id, else ValueError naming ``option`` and the fix.

    What must stay true: every id that reaches a key path is one segment matching
    :data:`ID_PATTERN` (no ``/``, no spaces, no control characters, at most 64 characters).
    """
    if not isinstance(value, str) or not ID_PATTERN.fullmatch(value):
        raise ValueError(
            f"{option}: bad id {value!r}: use 1-64 characters from A-Z a-z 0-9 . _ -, starting with a "
            f"letter or digit (e.g. {option} node-1)"
        )
    return value


# Report outcomes.
SUCCEEDED, FAILED, STOPPED = "succeeded", "failed", "stopped"


class JobKeys:
    def __init__(self, job: str):
        self.job = validate_id(job, "--job")
        self.prefix = f"{ROOT}/{job}/"

    def node(self, node_id: str) -> str:
        return f"{self.prefix}nodes/{node_id}"

    @property
    def leader(self) -> str:
        return f"{self.prefix}leader"

    @property
    def round(self) -> str:
        return f"{self.prefix}round"

    @property
    def commits(self) -> str:
        """Prefix of the checkpoint commit records (one per committed step, written by the
        workers' fence: the commit point)."""
        return f"{self.prefix}commits/"

    def round_record(self, g: int) -> str:
        return f"{self.prefix}rounds/{g}"

    def master(self, g: int) -> str:
        return f"{self.prefix}rounds/{g}/master"

    def started(self, g: int, node_id: str) -> str:
        return f"{self.prefix}rounds/{g}/started/{node_id}"

    def report(self, g: int, node_id: str) -> str:
        return f"{self.prefix}rounds/{g}/reports/{node_id}"

    def status(self, node_id: str) -> str:
        return f"{self.prefix}status/{node_id}"

    @property
    def final(self) -> str:
        return f"{self.prefix}final"

    @property
    def dump(self) -> str:
        """``ftrain status --dump``: every agent dumps its workers' flight records and stacks."""
        return f"{self.prefix}dump"


def _dumps(obj: Any) -> str:
    return json.dumps(asdict(obj), separators=(",", ":"), sort_keys=True)


# -- strict field checks ------------------------------------------------------------------------
def _check(value: Any, hint: Any, where: str) -> Any:
    """``value`` if it has type ``hint`` (ints for floats are widened; bools are never numbers),
    else TypeError naming ``where``."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        for option in args:
            try:
                return _check(value, option, where)
            except TypeError:
                continue
        raise TypeError(f"{where}: {value!r} is not {hint}")
    if hint is type(None):
        if value is None:
            return None
    elif hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            return float(value)
    elif hint is str:
        if isinstance(value, str):
            return value
    elif origin is list:
        if isinstance(value, list):
            return [_check(v, args[0], f"{where}[]") for v in value]
    elif origin is dict:
        if isinstance(value, dict):
            return {_check(k, args[0], f"{where} key"): _check(v, args[1], f"{where}[{k!r}]") for k, v in value.items()}
    elif isinstance(hint, type) and hasattr(hint, "__dataclass_fields__"):
        return _from_dict(hint, value)
    raise TypeError(f"{where}: {value!r} is not {getattr(hint, '__name__', hint)}")


def _from_dict(cls: type, d: Any) -> Any:
    """An instance of dataclass ``cls`` from a decoded JSON object: unknown keys ignored, missing
    required fields and wrong types refused (TypeError/ValueError)."""
    if not isinstance(d, dict):
        raise TypeError(f"{cls.__name__}: expected a JSON object, got {type(d).__name__}")
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in fields(cls):
        if f.name in d:
            kwargs[f.name] = _check(d[f.name], hints[f.name], f"{cls.__name__}.{f.name}")
    try:
        return cls(**kwargs)
    except TypeError as e:  # a required field is missing
        raise TypeError(f"{cls.__name__}: {e}") from e


def parse_master(value: str) -> tuple[str, int]:
    """``host:port`` of a round's rendezvous, or ValueError saying what is wrong with it."""
    host, sep, port = value.rpartition(":")
    if (
        not sep
        or not host
        or not port.isdigit()
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
        record = _from_dict(cls, json.loads(raw))
        if record.round < 1 or record.nproc_per_node < 1 or not record.members:
            raise ValueError(
                f"RoundRecord: round {record.round}, nproc_per_node {record.nproc_per_node} and "
                f"{len(record.members)} members: need round >= 1, nproc >= 1 and a member"
            )
        return record


@dataclass(slots=True)
class Report:
    outcome: str  #: succeeded | failed | stopped
    reason: str = ""  #: for failures: worker_exit | hang | start_timeout | bad_record | fatal
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
    state: str = "starting"  #: starting | waiting | running | stopping | done
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


def _load(cls: type, raw: bytes) -> Any:
    return _from_dict(cls, json.loads(raw))


@dataclass(frozen=True, slots=True)
class Problem:
    """A record :meth:`JobState.parse` skipped: report it once per (key, mod_revision)."""

    key: str
    mod_revision: int
    error: str

    def __str__(self) -> str:
        return f"unreadable job record {self.key} (revision {self.mod_revision}): {self.error}"


def _round_number(text: str) -> int:
    if not text.isdigit() or len(text) > 18:
        raise ValueError(f"round segment {text[:40]!r} is not a round number")
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
        state = cls(revision=revision)
        highest_round = 0
        round_kv: KeyValue | None = None
        for kv in kvs:
            rel = kv.key[len(keys.prefix) :]
            parts = rel.split("/")
            try:
                if parts[0] == "rounds" and len(parts) >= 2:
                    highest_round = max(highest_round, _round_number(parts[1]))
                if rel == "round":
                    round_kv = kv
                state._read_one(kv, rel, parts)
            except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as e:
                state.problems.append(Problem(kv.key, kv.mod_revision, f"{type(e).__name__}: {e}"[:300]))
                state._skipped(kv, rel, parts, e)
        if state.round_unreadable:
            state.round = max(highest_round, state.round)
            state.round_mod_revision = round_kv.mod_revision if round_kv else 0
        return state

    def _read_one(self, kv: KeyValue, rel: str, parts: list[str]) -> None:
        if parts[0] == "nodes" and len(parts) == 2:
            node = _load(NodeRecord, kv.value)
            if node.node_id != parts[1]:
                raise ValueError(f"node_id {node.node_id!r} does not match its key")
            node.create_revision = kv.create_revision
            self.nodes[parts[1]] = node
        elif rel == "leader":
            self.leader_mod_revision = kv.mod_revision
            leader = kv.value.decode()
            if not kv.lease:
                raise ValueError(f"leader {leader[:64]!r} holds no lease (agents always put it on theirs)")
            self.leader, self.leader_lease = validate_id(leader, "leader"), kv.lease
        elif rel == "round":
            self.round_mod_revision = kv.mod_revision
            value = _round_number(kv.value.decode().strip())
            if value < 1:
                raise ValueError("round 0 is never formed")
            self.round = value
        elif parts[0] == "rounds" and len(parts) == 2:
            g = _round_number(parts[1])
            record = RoundRecord.from_json(kv.value)
            if record.round != g:
                raise ValueError(f"record of round {record.round} under rounds/{g}")
            self.rounds[g] = record
        elif parts[0] == "rounds" and len(parts) == 3 and parts[2] == "master":
            g = _round_number(parts[1])
            address = kv.value.decode()
            parse_master(address)
            self.masters[g] = address
        elif parts[0] == "rounds" and len(parts) == 4 and parts[2] == "started":
            self.started.setdefault(_round_number(parts[1]), set()).add(parts[3])
        elif parts[0] == "rounds" and len(parts) == 4 and parts[2] == "reports":
            g = _round_number(parts[1])
            self.reports.setdefault(g, {})[parts[3]] = _load(Report, kv.value)
        elif parts[0] == "status" and len(parts) == 2:
            self.status[parts[1]] = _load(NodeStatus, kv.value)
        elif parts[0] == "commits" and len(parts) == 2 and parts[1].isdigit() and len(parts[1]) <= 18:
            self.newest_commit = max(self.newest_commit, int(parts[1]))
        elif rel == "dump":
            request = _load(DumpRequest, kv.value)
            if not isinstance(request.nonce, str) or not re.fullmatch(r"[0-9a-f]{1,32}", request.nonce):
                raise ValueError("a dump request's nonce must be 1 to 32 hex digits")
            self.dump = request
        elif rel == "final":
            self.final_mod_revision = kv.mod_revision
            self.final = _load(FinalStatus, kv.value)
            if self.final.status not in (SUCCEEDED, FAILED):
                self.final = None
                raise ValueError("final status must be succeeded or failed")
            self.final_mod_revision = 0

    def _skipped(self, kv: KeyValue, rel: str, parts: list[str], error: Exception) -> None:
        """What an unreadable record means (the safe reading of each key)."""
        if rel == "round":
            self.round_unreadable = True
        elif parts[0] == "rounds" and len(parts) == 3 and parts[2] == "master" and parts[1].isdigit():
            self.bad_masters[int(parts[1])] = f"{kv.key}: {error}"
        elif parts[0] == "rounds" and len(parts) == 4 and parts[2] == "reports" and parts[1].isdigit():
            self.reports.setdefault(int(parts[1]), {})[parts[3]] = Report(
                FAILED, WORKER_EXIT, f"unreadable report {kv.key}: {error}"[:300], _UNREADABLE_UID, 0.0
            )


#: agent_uid of the stand-in for an unreadable report: it counts for whichever agent is the member
_UNREADABLE_UID = "?unreadable"
