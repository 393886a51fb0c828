"""The leader tests' fake etcd: a job's keys as etcd holds them (:class:`FakeJob`), and the
steps every test takes (a leader's memory, forming a round, a running job, status records).

Each test keeps a job's etcd contents in a :class:`FakeJob` (revisions, create revisions and
leases as etcd assigns them), reads it back with ``JobState.parse`` like an agent does, and
applies a ``FormRound`` the way the leader's compare-and-swap does. Time is a plain number
passed to ``decide``: nothing waits.
"""

from __future__ import annotations

import uuid

from ftrain.agents.etcd import KeyValue
from ftrain.agents.job_keys import JobKeys
from ftrain.agents.leader import FormRound, LeaderMemory, Policy, decide
from ftrain.agents.records import JobState, Member, NodeRecord, NodeStatus, Report, RoundRecord

T0 = 10_000.0
POLICY = Policy.of(
    min_nodes=2,
    max_nodes=3,
    nproc_per_node=2,
    settle_s=5.0,
    start_timeout_s=60.0,
    max_restarts=3,
    restart_window_s=600.0,
    backoff_initial_s=4.0,
    backoff_max_s=30.0,
    scale_up="checkpoint",
    recovery="restart",  # joiners count at once; the live rule has its own test
)


class FakeJob:
    """One job's keys as etcd would hold them."""

    def __init__(self) -> None:
        self.keys = JobKeys("job")
        self.kvs: dict[str, KeyValue] = {}
        self.revision = 0
        self._leases = 100

    def put(self, key: str, value: str, lease: int = 0) -> None:
        self.revision += 1
        prev = self.kvs.get(key)
        self.kvs[key] = KeyValue(
            key,
            value.encode(),
            prev.create_revision if prev else self.revision,
            self.revision,
            prev.version + 1 if prev else 1,
            lease,
        )

    def delete(self, key: str) -> None:
        self.revision += 1
        del self.kvs[key]

    def state(self) -> JobState:
        return JobState.parse(self.keys, list(self.kvs.values()), self.revision)

    # -- what agents write ---------------------------------------------------------------
    def join(self, node_id: str, *, at: float = T0) -> Member:
        """A new agent process registers ``node_id`` on a fresh lease (at time ``at``)."""
        self._leases += 1
        uid = uuid.uuid4().hex[:8]
        record = NodeRecord(node_id, uid, f"host-{node_id}", 4000 + self._leases, 2, at)
        self.put(self.keys.node(node_id), record.to_json(), lease=self._leases)
        return Member(node_id, uid)

    def lose(self, node_id: str) -> None:
        """The agent's lease expired (or was revoked): its leased keys are gone."""
        self.delete(self.keys.node(node_id))
        self.kvs.pop(self.keys.status(node_id), None)

    def apply(self, record: RoundRecord) -> None:
        self.put(self.keys.round, str(record.round))
        self.put(self.keys.round_record(record.round), record.to_json())

    def start(self, g: int, *node_ids: str) -> None:
        for node_id in node_ids:
            self.put(self.keys.started(g, node_id), self.uid(node_id))

    def report(
        self, g: int, node_id: str, outcome: str, reason: str = "", *, time: float, workers_ready: int = -1
    ) -> None:
        report = Report(
            outcome, reason, f"{outcome} on {node_id}", self.uid(node_id), time, workers_ready=workers_ready
        )
        self.put(self.keys.report(g, node_id), report.to_json())

    def checkpoint(self, node_id: str, committed_step: int, *, at: float = T0 + 1) -> None:
        """The agent's status record, written at ``at``, shows ``committed_step``."""
        status = NodeStatus(state="running", committed_step=committed_step, updated_at=at)
        self.put(self.keys.status(node_id), status.to_json(), lease=self.kvs[self.keys.node(node_id)].lease)

    def uid(self, node_id: str) -> str:
        return self.state().nodes[node_id].agent_uid


def memory_at(now: float) -> LeaderMemory:
    """What an agent gives itself when it becomes the leader at ``now``."""
    return LeaderMemory(leader_since=now)


def form(job: FakeJob, memory: LeaderMemory, now: float, policy: Policy = POLICY) -> tuple[RoundRecord, LeaderMemory]:
    decision, memory = decide(job.state(), policy, memory, now)
    assert isinstance(decision, FormRound), decision
    job.apply(decision.record)
    return decision.record, memory


def running_job(*node_ids: str, policy: Policy = POLICY) -> tuple[FakeJob, LeaderMemory, RoundRecord]:
    """Round 1 formed at T0 with ``node_ids`` (joined in that order), all workers started; the
    leader has led since long before."""
    job = FakeJob()
    for node_id in node_ids:
        job.join(node_id)
    memory = memory_at(T0 - 100)
    _, memory = decide(job.state(), policy, memory, T0 - 100)  # membership observed, then quiet
    record, memory = form(job, memory, T0, policy)
    job.start(record.round, *node_ids)
    return job, memory, record


def busy(job: FakeJob, g: int, at: float, **busy_s: float) -> None:
    """Each node's status: its busiest rank's busy time per step, as its agent publishes it."""
    for node_id, busy in busy_s.items():
        status = NodeStatus(round=g, state="running", busy_s=busy, busy_rank=ord(node_id[0]) - 97, updated_at=at)
        job.put(job.keys.status(node_id), status.to_json(), lease=job.kvs[job.keys.node(node_id)].lease)
