"""The control plane's CPU cost at N nodes, without processes: a synthetic job in etcd's shape,
and how long reading it (``JobState.parse``), deciding on it (``leader.decide``) and showing it
(``ftrain status``) take.

:func:`synthetic_job` builds the keys a running job of N nodes holds, as the agents write them
(``NodeRecord``/``NodeStatus``/``RoundRecord``/``Report`` through their own ``to_json``, key names
through :class:`~ftrain.agents.job_keys.JobKeys`, so a change of the key layout or of a record is
picked up here): every node's ``nodes/<id>`` (on its lease, in join order) and ``status/<id>``
(running, a few stalled ranks, device hours, busy times with jitter), the leader, the current
round with all N members, its master and every member's ``started`` key, the previous round's
record (or more: ``past_rounds``) with a few reports, and a few commit records. :func:`measure_micro` times the three
steps on it; ``bench/control_plane.py`` imports it (``from bench.lib.control_plane_micro import
measure_micro`` with the repository on ``sys.path``).

What must stay true:

- The state is *steady*: :func:`ftrain.agents.leader.decide` on it waits ("round healthy"); after
  :meth:`SyntheticJob.lose` it forms the next round without the lost node (``node_lost``).
  :func:`measure_micro` checks both, so a timing never describes a different decision.
- Deterministic for a given N and seed (a fixed ``random.Random``; times relative to ``NOW``).
- Times are medians of the wall time of repeated calls in this process (``time.perf_counter``:
  on a shared machine, other load inflates them); the etcd read of ``ftrain status`` is not
  included (``bench/control_plane.py`` measures that against a real etcd; :func:`write_to_etcd`
  puts a synthetic job there).
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ftrain.agents.etcd import EtcdClient, KeyValue, Op
from ftrain.agents.job_keys import JobKeys
from ftrain.agents.leader import FormRound, LeaderMemory, Policy, Wait, decide
from ftrain.agents.records import (
    FAILED,
    NODE_LOST,
    STOPPED,
    WORKER_EXIT,
    JobState,
    Member,
    NodeRecord,
    NodeStatus,
    RankStall,
    Report,
    RoundRecord,
)
from ftrain.agents.status import format_status, status_from_kvs, status_of

NOW = 1_700_000_000.0  #: wall clock of the synthetic job's "now" (seconds since the epoch)
NPROC_PER_NODE = 8
ROUND = 7  #: the current round (rounds 1..6 came before; by default only the previous one is kept here)
STALLED_NODES = 3  #: nodes whose status lists stalled ranks
REPORTS_IN_PREVIOUS_ROUND = 4
COMMITTED_STEPS = (1000, 1500, 2000)


def node_id(index: int) -> str:
    return f"node-{index:05d}"


def policy_for(num_nodes: int) -> Policy:
    """The leader's settings for a job of ``num_nodes``: the ``[agent]`` defaults (live recovery,
    stragglers warned about), half the nodes at least, 8 ranks per node in tensor-parallel groups
    of 8 and a pipeline of 4 stages (or 2, or none, for sizes 4 does not tile)."""
    return Policy.of(
        min_nodes=max(1, num_nodes // 2),
        max_nodes=num_nodes,
        nproc_per_node=NPROC_PER_NODE,
        pipeline_degrees=(4, 2, 1),
        fixed_tp_size=NPROC_PER_NODE,
    )


@dataclass
class SyntheticJob:
    """A job's keys as etcd holds them (revisions as etcd assigns them), and its leader."""

    keys: JobKeys
    num_nodes: int
    kvs: dict[str, KeyValue] = field(default_factory=dict)
    revision: int = 0
    members: list[Member] = field(default_factory=list)

    def put(self, key: str, value: str, *, lease: int = 0) -> None:
        self.revision += 1
        prev = self.kvs.get(key)
        created = prev.create_revision if prev else self.revision
        self.kvs[key] = KeyValue(key, value.encode(), created, self.revision, prev.version + 1 if prev else 1, lease)

    def delete(self, key: str) -> None:
        self.revision += 1
        self.kvs.pop(key, None)

    def listing(self) -> list[KeyValue]:
        """The keys in etcd's order (by key), as one prefix range returns them."""
        return sorted(self.kvs.values(), key=lambda kv: kv.key)

    def state(self) -> JobState:
        return JobState.parse(self.keys, self.listing(), self.revision)

    def lose(self, index: int) -> None:
        """Node ``index``'s lease expired: its leased keys (record and status) are gone."""
        self.delete(self.keys.node(node_id(index)))
        self.delete(self.keys.status(node_id(index)))


def _lease(index: int) -> int:
    return 0x7000_0000 + index


def _node_status(index: int, rng: random.Random, *, step: int, leader: bool, stalled: bool) -> NodeStatus:
    productive_h = 40.0 + rng.random()
    return NodeStatus(
        round=ROUND,
        state="running",
        step=step,
        step_time_s=round(1.2 + 0.05 * rng.random(), 3),
        heartbeat_age_s=round(0.4 * rng.random(), 3),
        committed_step=COMMITTED_STEPS[-1],
        restarts=ROUND - 1,
        host=f"10.{index // 65536}.{index // 256 % 256}.{index % 256}",
        pid=10_000 + index,
        updated_at=NOW - rng.random(),
        recovery="live",
        workers_kept=NPROC_PER_NODE,
        workers_ready=NPROC_PER_NODE,
        productive_s=round(productive_h * 3600 / NPROC_PER_NODE, 3),
        lost_s=round(1800 * rng.random(), 3),
        device_hours={
            "productive": round(productive_h, 6),
            "restart": round(0.5 * rng.random(), 6),
            "recomputation": round(0.2 * rng.random(), 6),
            "checkpoint": round(0.1 * rng.random(), 6),
        },
        devices=NPROC_PER_NODE,
        device_hour_price=2.5,
        busy_s=round(0.9 + 0.1 * rng.random(), 6),  # within straggler_factor of each other: nobody is slow
        busy_rank=index * NPROC_PER_NODE + rng.randrange(NPROC_PER_NODE),
        stragglers=["node-00042 (rank 337): busy 1.300 s per step vs 0.950 s (1.37x) for 2.0 s"] if leader else [],
        stalled=[
            RankStall(index * NPROC_PER_NODE + r, "waiting", NOW - 30.0, 4711, "dp", "allreduce fp32[1048576]")
            for r in range(NPROC_PER_NODE)
        ]
        if stalled
        else [],
    )


def _report(member: Member, outcome: str, *, at: float) -> str:
    reason = WORKER_EXIT if outcome == FAILED else ""
    error = "RuntimeError: CUDA error: an illegal memory access was encountered" if outcome == FAILED else ""
    return Report(outcome, reason, f"{outcome} on {member.node_id}", member.agent_uid, at, 1999, error, 8).to_json()


def synthetic_job(num_nodes: int, *, seed: int = 0, job: str = "bench", past_rounds: int = 1) -> SyntheticJob:
    """A running job of ``num_nodes`` nodes in round :data:`ROUND`, steady (see the module doc),
    with the records of ``past_rounds`` earlier rounds (1 to ``ROUND - 1``; the agents keep up to
    ``ftrain.agents.agent.ROUNDS_KEPT``, each listing every member)."""
    rng = random.Random(seed)
    sj = SyntheticJob(JobKeys(job), num_nodes)
    keys = sj.keys
    for i in range(num_nodes):  # join order: node 0 first
        uid = f"{rng.getrandbits(64):016x}"
        record = NodeRecord(node_id(i), uid, f"10.0.{i // 256}.{i % 256}", 4000 + i, NPROC_PER_NODE, NOW - 86_400 + i)
        sj.put(keys.node(node_id(i)), record.to_json(), lease=_lease(i))
        sj.members.append(record.member())
    sj.put(keys.leader, node_id(0), lease=_lease(0))
    for g in range(ROUND - past_rounds, ROUND):
        past = RoundRecord(g, list(sj.members), NPROC_PER_NODE, WORKER_EXIT, NOW - 3_600 * (ROUND + 1 - g))
        sj.put(keys.round_record(g), past.to_json())
    for k, member in enumerate(sj.members[:REPORTS_IN_PREVIOUS_ROUND]):
        sj.put(keys.report(ROUND - 1, member.node_id), _report(member, FAILED if k == 0 else STOPPED, at=NOW - 3_600))
    current = RoundRecord(
        ROUND,
        list(sj.members),
        NPROC_PER_NODE,
        WORKER_EXIT,
        NOW - 3_590,
        failure_times=[NOW - 3_600],
        restarts_by_cause={WORKER_EXIT: ROUND - 2, NODE_LOST: 1},
        failure_signatures=["worker_exit|1999|RuntimeError: CUDA error: an illegal memory access was encountered"],
    )
    sj.put(keys.round, str(ROUND))
    sj.put(keys.round_record(ROUND), current.to_json())
    sj.put(keys.master(ROUND), f"{sj.members[0].node_id}:29500")
    for member in sj.members:
        sj.put(keys.started(ROUND, member.node_id), member.agent_uid)
    stalled = set(rng.sample(range(num_nodes), min(STALLED_NODES, num_nodes)))
    for i in range(num_nodes):
        status = _node_status(i, rng, step=2345, leader=i == 0, stalled=i in stalled)
        sj.put(keys.status(node_id(i)), status.to_json(), lease=_lease(i))
    for step in COMMITTED_STEPS:
        sj.put(f"{keys.commits}{step:012d}", f'{{"digest":"{step:064x}","round":{ROUND}}}')
    return sj


def write_to_etcd(client: EtcdClient, sj: SyntheticJob, *, ops_per_txn: int = 64) -> int:
    """Put every key of ``sj`` into a real etcd (without leases: the synthetic lease ids are not
    etcd's), in transactions of ``ops_per_txn`` puts (etcd's default limit is 128); the number of
    transactions."""
    kvs = sj.listing()
    for start in range(0, len(kvs), ops_per_txn):
        client.txn([], [Op.put(kv.key, kv.value) for kv in kvs[start : start + ops_per_txn]])
    return -(-len(kvs) // ops_per_txn)


# -- timing -------------------------------------------------------------------------------------
def median_ms(call: Callable[[], Any], *, repeats: int) -> float:
    """The median wall time of ``repeats`` calls, in milliseconds."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def steady_memory(state: JobState, policy: Policy) -> LeaderMemory:
    """A leader's memory after leading the job for an hour: membership seen and quiet."""
    _, memory = decide(state, policy, LeaderMemory(leader_since=NOW - 3_600), NOW - 60)
    return memory


def _expect(decision: Any, kind: type, what: str) -> None:
    if not isinstance(decision, kind):
        raise AssertionError(f"control_plane_micro: {what}: expected {kind.__name__}, decide said {decision}")


def measure_size(num_nodes: int, *, repeats: int = 5) -> dict[str, float]:
    """``parse_ms``, ``decide_ms`` (steady state), ``decide_node_lost_ms``, ``status_ms`` (parse,
    the status dict and its table: everything ``ftrain status`` does but the etcd read) and
    ``status_render_ms`` (the dict and table alone) for a job of ``num_nodes``."""
    sj = synthetic_job(num_nodes)
    policy = policy_for(num_nodes)
    listing = sj.listing()
    parse_ms = median_ms(lambda: JobState.parse(sj.keys, listing, sj.revision), repeats=repeats)
    state = sj.state()
    memory = steady_memory(state, policy)
    decision, _ = decide(state, policy, memory, NOW)
    _expect(decision, Wait, "steady state")
    decide_ms = median_ms(lambda: decide(state, policy, memory, NOW), repeats=repeats)
    sj.lose(num_nodes // 2)
    lost = sj.state()
    decision, _ = decide(lost, policy, memory, NOW)
    _expect(decision, FormRound, "one node lost")
    decide_lost_ms = median_ms(lambda: decide(lost, policy, memory, NOW), repeats=repeats)
    sj = synthetic_job(num_nodes)
    listing = sj.listing()
    state = sj.state()
    status_ms = median_ms(
        lambda: format_status(status_from_kvs(sj.keys, listing, sj.revision, now=NOW)), repeats=repeats
    )
    render_ms = median_ms(lambda: format_status(status_of(state, sj.keys.job, now=NOW)), repeats=repeats)
    return {
        "num_nodes": num_nodes,
        "num_keys": len(listing),
        "parse_ms": round(parse_ms, 2),
        "decide_ms": round(decide_ms, 2),
        "decide_node_lost_ms": round(decide_lost_ms, 2),
        "status_ms": round(status_ms, 2),
        "status_render_ms": round(render_ms, 2),
    }


def measure_micro(sizes: list[int], *, repeats: int = 5) -> dict[int, dict[str, float]]:
    """:func:`measure_size` for each of ``sizes`` (numbers of nodes), keyed by size."""
    return {n: measure_size(n, repeats=repeats) for n in sizes}


if __name__ == "__main__":  # a quick look: python bench/lib/control_plane_micro.py [N ...]
    import json
    import sys

    print(json.dumps(measure_micro([int(a) for a in sys.argv[1:]] or [256, 1024, 4096]), indent=2))
