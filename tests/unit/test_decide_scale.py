"""ftrain.agents.leader at thousands of nodes: the decisions on a 4,096-node job (steady, a node
lost, every member failed, one straggler) and the helpers that keep ``decide`` O(N log N) —
the median of a member's peers, and every node's pipeline stages in one pass — held to the
plain definitions they replace. The synthetic job is the control-plane bench's
(:mod:`bench.lib.control_plane_micro`); how long each step takes is that bench's to say."""

from __future__ import annotations

import random
import statistics
from dataclasses import replace

import pytest

from bench.lib.control_plane_micro import NOW, ROUND, measure_micro, node_id, policy_for, steady_memory, synthetic_job
from ftrain.agents.leader import FormRound, Policy, Wait, decide
from ftrain.agents.records import FAILED, NODE_LOST, WORKER_EXIT, Report
from ftrain.agents.straggler_peers import median_of_others

NODES = 4096


@pytest.fixture(scope="module")
def big_job():
    sj = synthetic_job(NODES)
    state = sj.state()
    return sj, state, policy_for(NODES), steady_memory(state, policy_for(NODES))


def test_median_of_the_others_is_statistics_median_of_the_list_without_the_value() -> None:
    rng = random.Random(7)
    for _ in range(500):
        values = sorted(rng.choice([0.5, 1.0, 1.0, 2.0, rng.random()]) for _ in range(rng.randint(1, 9)))
        for value in values:
            others = list(values)
            others.remove(value)
            assert median_of_others(values, value) == (statistics.median(others) if others else 0.0)


@pytest.mark.parametrize(
    "nproc,degrees,tp", [(1, (1,), 1), (8, (4, 2, 1), 8), (2, (3, 1), 1), (4, (4,), 2), (3, (2,), 1)]
)
def test_stages_of_every_node_rank_in_one_pass_are_the_stages_of_its_ranks(nproc, degrees, tp) -> None:
    policy = Policy.of(min_nodes=1, max_nodes=64, nproc_per_node=nproc, pipeline_degrees=degrees, fixed_tp_size=tp)
    for nodes in range(1, 40):
        per_stage = max(1, nodes * nproc // (policy.pipeline_at(nodes) or 1))
        naive = [frozenset(r // per_stage for r in range(k * nproc, (k + 1) * nproc)) for k in range(nodes)]
        assert [frozenset(range(first, last + 1)) for first, last in policy.stage_spans(nodes)] == naive
        assert [policy.stages_of(k, nodes) for k in range(nodes)] == naive


def test_a_steady_job_of_4096_nodes_waits_and_a_lost_node_forms_the_next_round_without_it(big_job) -> None:
    sj, state, policy, memory = big_job
    assert decide(state, policy, memory, NOW)[0] == Wait("round healthy")
    lost = node_id(1234)
    kvs = [kv for kv in sj.listing() if kv.key not in (sj.keys.node(lost), sj.keys.status(lost))]
    decision, _ = decide(type(state).parse(sj.keys, kvs, sj.revision + 2), policy, memory, NOW)
    assert isinstance(decision, FormRound) and decision.record.reason == NODE_LOST
    survivors = [m for m in sj.members if m.node_id != lost]
    assert decision.record.members == survivors[: policy.usable_nodes(len(survivors))]
    assert decision.record.round == ROUND + 1


def test_every_member_of_4096_failing_forms_one_round_with_every_failure_counted_once(big_job) -> None:
    sj, state, policy, memory = big_job
    crash = Report(FAILED, WORKER_EXIT, "NCCL watchdog", "", NOW - 1.0, 2345, "RuntimeError: NCCL timeout", 8)
    reports = {
        m.node_id: replace(crash, agent_uid=m.agent_uid, time=NOW - 1.0 - k * 1e-3) for k, m in enumerate(sj.members)
    }
    failed = replace(state, reports={**state.reports, ROUND: reports})
    decision, _ = decide(failed, policy, memory, NOW)
    assert isinstance(decision, FormRound) and decision.record.reason == WORKER_EXIT
    assert decision.record.failure_times[-1] == NOW - 1.0  # the latest of the failing reports
    assert decision.record.members == sj.members


def test_one_straggler_among_4096_is_found_against_the_median_of_its_stage_peers(big_job) -> None:
    sj, state, policy, memory = big_job
    policy = replace(policy, straggler_after_s=0.0)
    slow = node_id(2049)
    statuses = dict(state.status)
    statuses[slow] = replace(statuses[slow], busy_s=5.0)
    state = replace(state, status=statuses)
    _, after = decide(state, policy, memory, NOW)
    [straggler] = after.stragglers
    stages = policy.stages_of(2049, NODES)
    peers = [
        statuses[m.node_id].busy_s
        for k, m in enumerate(sj.members)
        if m.node_id != slow and policy.stages_of(k, NODES) == stages
    ]
    assert (straggler.node, straggler.busy_s, straggler.others_s) == (slow, 5.0, statistics.median(peers))
    assert after.slow_since == ((slow, NOW),)


def test_the_micro_bench_runs_and_times_each_step_of_a_small_job() -> None:
    """The bench's smoke mode: it checks its own decisions (steady: wait; a node lost: a round)."""
    [(size, row)] = measure_micro([16], repeats=1).items()
    assert size == 16 and row["num_keys"] > 3 * 16
    for name in ("parse_ms", "decide_ms", "decide_node_lost_ms", "status_ms", "status_render_ms"):
        assert row[name] > 0, name
