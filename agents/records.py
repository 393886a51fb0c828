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
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from agents.etcd import KeyValue

ROOT = "/ftrain/jobs"

# Round formation reasons. FAILURE_CAUSES count against the restart budget.
START, WORKER_EXIT, HANG, START_TIMEOUT, NODE_LOST, NODE_LEFT, SCALE_UP = (
    "start", "worker_exit", "hang", "start_timeout", "node_lost", "node_left", "scale_up")
FAILURE_CAUSES = frozenset({WORKER_EXIT, HANG, START_TIMEOUT})

# Report outcomes.
SUCCEEDED, FAILED, STOPPED = "succeeded", "failed", "stopped"


class JobKeys:
    def __init__(self, job: str):
        if not job or "/" in job:
            raise ValueError(f"bad job id {job!r}: must be non-empty and contain no '/'")
        self.job = job
        self.prefix = f"{ROOT}/{job}/"

    def node(self, node_id: str) -> str:
        return f"{self.prefix}nodes/{node_id}"

    @property
    def leader(self) -> str:
        return f"{self.prefix}leader"

    @property
    def round(self) -> str:
        return f"{self.prefix}round"

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


def _dumps(obj: Any) -> str:
    return json.dumps(asdict(obj), separators=(",", ":"), sort_keys=True)


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
        d = json.loads(raw)
        d["members"] = [Member(**m) for m in d["members"]]
        return cls(**d)


@dataclass(slots=True)
class Report:
    outcome: str  #: succeeded | failed | stopped
    reason: str = ""  #: for failures: worker_exit | hang | start_timeout
    detail: str = ""
    agent_uid: str = ""
    time: float = 0.0

    def to_json(self) -> str:
        return _dumps(self)


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
    return cls(**json.loads(raw))


@dataclass(slots=True)
class JobState:
    """One consistent read of a job (every key at one etcd revision)."""
    revision: int
    nodes: dict[str, NodeRecord] = field(default_factory=dict)
    leader: str | None = None
    leader_lease: int = 0
    round: int = 0
    round_mod_revision: int = 0  #: 0: no round key yet
    rounds: dict[int, RoundRecord] = field(default_factory=dict)
    masters: dict[int, str] = field(default_factory=dict)
    started: dict[int, set[str]] = field(default_factory=dict)
    reports: dict[int, dict[str, Report]] = field(default_factory=dict)
    status: dict[str, NodeStatus] = field(default_factory=dict)
    final: FinalStatus | None = None

    @property
    def current(self) -> RoundRecord | None:
        return self.rounds.get(self.round)

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
        return {n: r for n, r in self.reports.get(g, {}).items() if uids.get(n) == r.agent_uid}

    @classmethod
    def parse(cls, keys: JobKeys, kvs: list[KeyValue], revision: int) -> JobState:
        state = cls(revision=revision)
        for kv in kvs:
            rel = kv.key[len(keys.prefix):]
            parts = rel.split("/")
            try:
                if parts[0] == "nodes" and len(parts) == 2:
                    node = _load(NodeRecord, kv.value)
                    node.create_revision = kv.create_revision
                    state.nodes[parts[1]] = node
                elif rel == "leader":
                    state.leader, state.leader_lease = kv.value.decode(), kv.lease
                elif rel == "round":
                    state.round, state.round_mod_revision = int(kv.value), kv.mod_revision
                elif parts[0] == "rounds" and len(parts) == 2:
                    state.rounds[int(parts[1])] = RoundRecord.from_json(kv.value)
                elif parts[0] == "rounds" and len(parts) == 3 and parts[2] == "master":
                    state.masters[int(parts[1])] = kv.value.decode()
                elif parts[0] == "rounds" and len(parts) == 4 and parts[2] == "started":
                    state.started.setdefault(int(parts[1]), set()).add(parts[3])
                elif parts[0] == "rounds" and len(parts) == 4 and parts[2] == "reports":
                    state.reports.setdefault(int(parts[1]), {})[parts[3]] = _load(Report, kv.value)
                elif parts[0] == "status" and len(parts) == 2:
                    state.status[parts[1]] = _load(NodeStatus, kv.value)
                elif rel == "final":
                    state.final = _load(FinalStatus, kv.value)
            except (ValueError, TypeError, KeyError) as e:
                raise ValueError(f"unreadable job record {kv.key}: {e}") from None
        return state
