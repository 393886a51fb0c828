"""ftrain.agents.leader.decide: when the leader forms a round, with whom, and when the job is over
(the pipeline layouts' rounds and the stragglers: test_leader_layouts_and_stragglers.py).

Each test keeps a job's etcd contents in a :class:`~tests.leader_support.FakeJob`, reads it back
like an agent does and applies a ``FormRound`` the way the leader's compare-and-swap does. Time is
a plain number passed to ``decide``: nothing waits.
"""

from __future__ import annotations

import dataclasses
from dataclasses import replace

import pytest

from ftrain.agents.leader import Finish, FormRound, LeaderMemory, Policy, Wait, decide
from ftrain.agents.records import (
    BAD_RECORD,
    FAILED,
    FATAL,
    HANG,
    NODE_LEFT,
    NODE_LOST,
    ROUND_REPAIR,
    SCALE_UP,
    START,
    START_TIMEOUT,
    STOPPED,
    SUCCEEDED,
    WORKER_EXIT,
    YIELDED,
    FinalStatus,
    NodeStatus,
    Report,
    RoundRecord,
)
from tests.leader_support import POLICY, T0, FakeJob, form, memory_at, running_job


# -- Policy -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("recent_failures", "backoff_s"), [(0, 0.0), (1, 0.0), (2, 4.0), (3, 8.0), (4, 16.0), (5, 30.0), (50, 30.0)]
)
def test_backoff_is_free_once_then_doubles_up_to_the_cap(recent_failures: int, backoff_s: float) -> None:
    assert POLICY.backoff_s(recent_failures) == backoff_s


def test_decide_returns_the_next_memory_and_changes_none_of_its_arguments() -> None:
    job = FakeJob()
    job.join("a")
    memory = memory_at(T0)
    state = job.state()
    decision, after = decide(state, POLICY, memory, T0 + 1)
    assert memory == memory_at(T0) and after != memory  # the join was seen, in the returned memory only
    assert after.live == frozenset(state.live_members()) and after.live_changed_at == T0 + 1
    assert decide(state, POLICY, memory, T0 + 1) == (decision, after)  # same inputs, same answer


# -- the first round ---------------------------------------------------------------------------
def test_first_round_waits_for_min_nodes() -> None:
    job = FakeJob()
    job.join("a")
    memory = memory_at(T0)
    decision, memory = decide(job.state(), POLICY, memory, T0 + 1000)
    assert decision == Wait(
        "cannot form a round: 1 of at least 2 nodes live (--nnodes 2:3); waiting for more nodes to join",
        need=START,
        kind="blocked",
    )


def test_first_round_waits_until_membership_is_quiet_for_settle_s() -> None:
    job = FakeJob()
    memory = memory_at(T0)
    job.join("a")
    job.join("b")
    decision, memory = decide(job.state(), POLICY, memory, T0)
    assert isinstance(decision, Wait)
    job.join("c")  # a join restarts the settle window
    decision, memory = decide(job.state(), POLICY, memory, T0 + 3)
    assert isinstance(decision, Wait)
    decision, memory = decide(job.state(), POLICY, memory, T0 + 3 + POLICY.settle_s - 0.1)
    assert isinstance(decision, Wait)
    record, memory = form(job, memory, T0 + 3 + POLICY.settle_s)
    assert [m.node_id for m in record.members] == ["a", "b", "c"]


def test_first_round_members_in_join_order_capped_at_max_nodes() -> None:
    job = FakeJob()
    joined = [job.join(node_id) for node_id in ("zed", "alpha", "mid", "beta")]  # not alphabetical
    memory = memory_at(T0)
    _, memory = decide(job.state(), POLICY, memory, T0)
    record, memory = form(job, memory, T0 + POLICY.settle_s)
    assert record == RoundRecord(
        round=1,
        members=joined[:3],
        nproc_per_node=2,
        reason=START,
        created_at=T0 + POLICY.settle_s,
        failure_times=[],
        restarts_by_cause={},
    )
    assert record.world_size == 6
    assert record.node_rank(joined[0]) == 0  # the oldest agent hosts the rendezvous


def test_healthy_round_waits() -> None:
    job, memory, _ = running_job("a", "b")
    decision, memory = decide(job.state(), POLICY, memory, T0 + 1000)
    assert decision == Wait("round healthy")


# -- failures -----------------------------------------------------------------------------------
@pytest.mark.parametrize("reason", [WORKER_EXIT, HANG])
def test_failure_reported_by_every_member_restarts_at_once(reason: str) -> None:
    job, _, first = running_job("a", "b")
    failed_at = T0 + 30
    job.report(1, "a", FAILED, reason, time=failed_at - 0.5)  # the first failure: its reason is the round's
    job.report(1, "b", FAILED, WORKER_EXIT, time=failed_at)
    # Even a leader elected this very instant (no quiet time at all) does not wait to settle:
    # the live agents are exactly the members, and every one of them has reported.
    record, _ = form(job, memory_at(failed_at), failed_at)
    assert record.round == 2
    assert record.reason == reason
    assert record.members == first.members
    assert record.failure_times == [failed_at]
    assert record.restarts_by_cause == {reason: 1}


def test_the_round_takes_the_reason_of_the_first_failure_whatever_the_node_ids() -> None:
    """A hung rank's agent reports the hang before it kills; the peers that fail once it is gone
    report after it. Seen in CI: node a's victim report won over node b's hang by node id."""
    job, memory, _ = running_job("a", "b")
    job.report(1, "b", FAILED, HANG, time=T0 + 30)
    job.report(1, "a", FAILED, WORKER_EXIT, time=T0 + 30.4)
    record, _ = form(job, memory, T0 + 31)
    assert record.reason == HANG


def test_failure_reported_while_membership_changes_waits_to_settle() -> None:
    job, memory, _ = running_job("a", "b")
    job.join("c")
    job.report(1, "a", FAILED, WORKER_EXIT, time=T0 + 30)
    job.report(1, "b", FAILED, WORKER_EXIT, time=T0 + 30)
    decision, memory = decide(job.state(), POLICY, memory, T0 + 30)
    assert isinstance(decision, Wait)
    record, memory = form(job, memory, T0 + 30 + POLICY.settle_s)
    assert [m.node_id for m in record.members] == ["a", "b", "c"]
    assert record.reason == WORKER_EXIT


def test_report_of_an_earlier_agent_process_is_not_a_failure_of_the_member() -> None:
    job, memory, _ = running_job("a", "b")
    # A report with b's node id but another agent's uid (a previous process of node b).
    stale = Report(FAILED, WORKER_EXIT, "old agent", agent_uid="previous-agent", time=T0 + 5)
    job.put(job.keys.report(1, "b"), stale.to_json())
    decision, memory = decide(job.state(), POLICY, memory, T0 + 30)
    assert decision == Wait("round healthy")


def test_second_failure_in_window_waits_backoff_initial_s() -> None:
    job, memory, _ = running_job("a", "b")
    for node_id in ("a", "b"):
        job.report(1, node_id, FAILED, WORKER_EXIT, time=T0 + 10)
    record, memory = form(job, memory, T0 + 10)
    assert record.round == 2  # the first failure: no backoff
    job.start(2, "a", "b")

    failed_at = T0 + 20
    for node_id in ("a", "b"):
        job.report(2, node_id, FAILED, WORKER_EXIT, time=failed_at)
    decision, memory = decide(job.state(), POLICY, memory, failed_at + POLICY.backoff_initial_s - 0.1)
    assert isinstance(decision, Wait) and decision.why.startswith("backoff"), decision
    record, memory = form(job, memory, failed_at + POLICY.backoff_initial_s)
    assert record.round == 3
    assert record.failure_times == [T0 + 10, failed_at]
    job.start(3, "a", "b")

    failed_at = T0 + 40  # the third failure waits twice as long
    for node_id in ("a", "b"):
        job.report(3, node_id, FAILED, HANG, time=failed_at)
    decision, memory = decide(job.state(), POLICY, memory, failed_at + 2 * POLICY.backoff_initial_s - 0.1)
    assert isinstance(decision, Wait)
    record, memory = form(job, memory, failed_at + 2 * POLICY.backoff_initial_s)
    assert record.round == 4


def test_restart_budget_exhausted_finishes_failed() -> None:
    policy = Policy.of(
        min_nodes=1,
        max_nodes=2,
        nproc_per_node=1,
        max_restarts=2,
        restart_window_s=600.0,
        backoff_initial_s=0.0,
        recovery="restart",
    )
    job, memory, _ = running_job("a", policy=policy)
    for g, failed_at in ((1, T0 + 10), (2, T0 + 20)):
        job.report(g, "a", FAILED, WORKER_EXIT, time=failed_at)
        record, memory = form(job, memory, failed_at, policy)
        assert record.round == g + 1
        job.start(g + 1, "a")

    job.report(3, "a", FAILED, HANG, time=T0 + 30)
    decision, memory = decide(job.state(), policy, memory, T0 + 30)
    assert isinstance(decision, Finish), decision
    final = decision.final
    assert (final.status, final.round, final.time) == (FAILED, 3, T0 + 30)
    assert "restart budget exhausted" in final.reason
    assert "max_restarts=2" in final.reason
    assert "3 failures" in final.reason
    assert HANG in final.reason


def test_failures_older_than_the_window_do_not_count() -> None:
    policy = Policy.of(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=1,
        max_restarts=1,
        restart_window_s=100.0,
        backoff_initial_s=50.0,
        backoff_max_s=50.0,
        recovery="restart",
    )
    job, memory, _ = running_job("a", policy=policy)
    for g in range(1, 5):
        failed_at = T0 + 101 * g
        job.report(g, "a", FAILED, WORKER_EXIT, time=failed_at)
        record, memory = form(job, memory, failed_at, policy)  # each failure is alone in its window: no backoff
        assert record.failure_times == [failed_at]
        job.start(record.round, "a")


# -- lost and replaced agents -------------------------------------------------------------------
def test_lost_member_gives_a_node_lost_round_without_it() -> None:
    job, memory, first = running_job("a", "b", "c")
    lost_at = T0 + 50
    job.lose("b")
    record, memory = form(job, memory, lost_at)  # at once: nobody new to wait for
    assert record.reason == NODE_LOST
    assert record.members == [first.members[0], first.members[2]]
    assert record.failure_times == []  # a lost node is not a failure of the job
    assert record.restarts_by_cause == {NODE_LOST: 1}


def test_lost_members_below_min_nodes_wait() -> None:
    job, memory, _ = running_job("a", "b")
    job.lose("b")
    decision, memory = decide(job.state(), POLICY, memory, T0 + 1000)
    assert decision == Wait(
        "cannot form a round: 1 of at least 2 nodes live (--nnodes 2:3); waiting for more nodes to join",
        need=f"{NODE_LOST} (agent gone: b)",
        kind="blocked",
    )


def test_replaced_agent_is_a_lost_member_and_rejoins_last() -> None:
    job, memory, first = running_job("a", "b", "c")
    job.lose("a")
    new_a = job.join("a")  # the agent of node a restarted: same node id, new process
    _, memory = decide(job.state(), POLICY, memory, T0 + 50)
    record, memory = form(job, memory, T0 + 50 + POLICY.settle_s)
    assert record.reason == NODE_LOST
    assert record.members == [first.members[1], first.members[2], new_a]  # b now hosts the rendezvous


def test_new_leader_forms_a_node_lost_round_at_once() -> None:
    # The old leader's node is lost, its memory with it: the new leader acts on etcd's records
    # alone, which say that a member is gone and nobody joins, so there is no last call to wait for.
    job, _, first = running_job("a", "b", "c")
    job.lose("a")
    elected_at = T0 + 50
    memory = LeaderMemory(
        leader_since=elected_at, live=frozenset(job.state().live_members()), live_changed_at=elected_at
    )
    record, memory = form(job, memory, elected_at)
    assert record.reason == NODE_LOST
    assert record.members == first.members[1:]


def test_new_leader_waits_settle_s_when_a_lost_node_was_replaced() -> None:
    # A member is gone and a node not in the round is live: a joiner, so the last call applies.
    job, _, _ = running_job("a", "b", "c")
    job.lose("a")
    job.join("d")
    elected_at = T0 + 50
    memory = LeaderMemory(
        leader_since=elected_at, live=frozenset(job.state().live_members()), live_changed_at=elected_at
    )
    decision, memory = decide(job.state(), POLICY, memory, elected_at + POLICY.settle_s - 0.1)
    assert isinstance(decision, Wait) and decision.why.startswith("settling"), decision
    record, memory = form(job, memory, elected_at + POLICY.settle_s)
    assert record.reason == NODE_LOST


def test_drained_member_that_left_gives_a_node_left_round() -> None:
    # membership just changed, but only by the drained node's going: nobody to give a last call to
    policy = Policy.of(min_nodes=1, max_nodes=3, nproc_per_node=2, max_restarts=0, recovery="restart")
    job, memory, first = running_job("a", "b", policy=policy)
    job.report(1, "a", STOPPED, time=T0 + 30)
    job.lose("a")
    record, memory = form(job, memory, T0 + 30, policy)  # no restart budget: a drain is no failure
    assert record.reason == NODE_LEFT
    assert record.members == [first.members[1]]
    assert record.restarts_by_cause == {NODE_LEFT: 1}


def test_drained_member_still_registered_is_not_in_the_next_round() -> None:
    # A draining agent writes its STOPPED report, then revokes its lease as it exits: the
    # leader, woken by the report, sees the report while the node key is still there.
    policy = Policy.of(min_nodes=1, max_nodes=3, nproc_per_node=2, recovery="restart")
    job, memory, first = running_job("a", "b", policy=policy)
    job.report(1, "a", STOPPED, time=T0 + 30)
    record, memory = form(job, memory, T0 + 30, policy)
    assert record.reason == NODE_LEFT
    assert record.members == [first.members[1]]


def test_every_node_drained_and_back_under_new_agents_forms_the_next_round() -> None:
    # scancel drained every node; the resubmitted (or requeued) job's agents register the same
    # node ids anew while the drained round's STOPPED reports are still the newest: they are back
    policy = Policy.of(min_nodes=1, max_nodes=2, nproc_per_node=2, recovery="live")
    job, memory, first = running_job("a", "b", policy=policy)
    for node in ("a", "b"):
        job.report(1, node, STOPPED, time=T0 + 30)
        job.lose(node)
    back = [job.join("a", at=T0 + 40), job.join("b", at=T0 + 40)]
    decision, memory = decide(job.state(), policy, memory, T0 + 60)
    assert isinstance(decision, Wait) and decision.kind == "settling"  # membership changed: a last call
    record, memory = form(job, memory, T0 + 60 + policy.settle_s, policy)
    assert record.reason == NODE_LEFT
    assert sorted(record.members, key=lambda m: m.node_id) == back
    assert not set(record.members) & set(first.members)


def test_a_yielded_member_stays_while_the_drained_one_leaves() -> None:
    # a drain stops every rank of the round: the drained node reports stopped, the others yielded
    policy = Policy.of(min_nodes=1, max_nodes=3, nproc_per_node=2, recovery="restart")
    job, memory, first = running_job("a", "b", policy=policy)
    job.report(1, "b", YIELDED, time=T0 + 30)
    decision, memory = decide(job.state(), policy, memory, T0 + 30)
    assert isinstance(decision, Wait)  # the drained node's report is still to come
    job.report(1, "a", STOPPED, time=T0 + 31)
    record, memory = form(job, memory, T0 + 31, policy)
    assert record.reason == NODE_LEFT
    assert record.members == [first.members[1]]


def test_a_new_leader_forms_the_round_without_the_drained_leader_at_once() -> None:
    # the drained node led: the node elected after it needs no last call either, unless a node joins
    policy = Policy.of(min_nodes=1, max_nodes=3, nproc_per_node=2, recovery="live")
    job, _, first = running_job("a", "b", "c", policy=policy)
    job.report(1, "a", STOPPED, time=T0 + 30)
    job.report(1, "b", YIELDED, time=T0 + 30)
    job.report(1, "c", YIELDED, time=T0 + 30)
    job.lose("a")
    elected_at = T0 + 31
    memory = LeaderMemory(
        leader_since=elected_at, live=frozenset(job.state().live_members()), live_changed_at=elected_at
    )
    record, memory = form(job, memory, elected_at, policy)
    assert record.reason == NODE_LEFT and record.members == first.members[1:]
    job.join("d")  # a node joins just as another drains: it gets its last call
    job.report(2, "b", STOPPED, time=T0 + 40)
    job.lose("b")
    decision, memory = decide(job.state(), policy, memory, T0 + 40)
    assert isinstance(decision, Wait) and decision.why.startswith("settling"), decision


def test_a_stop_no_drain_asked_for_restarts_the_round_with_everyone() -> None:
    # every node yielded (a worker got SIGTERM from outside, not through its agent): nobody leaves
    policy = Policy.of(min_nodes=1, max_nodes=3, nproc_per_node=2, recovery="restart")
    job, memory, first = running_job("a", "b", policy=policy)
    job.report(1, "a", YIELDED, time=T0 + 30)
    job.report(1, "b", YIELDED, time=T0 + 30)
    record, memory = form(job, memory, T0 + 30, policy)
    assert record.reason == NODE_LEFT and record.members == first.members


# -- start timeout -----------------------------------------------------------------------------
def test_member_that_never_starts_its_workers_times_out() -> None:
    job = FakeJob()
    job.join("a")
    job.join("b")
    memory = memory_at(T0 - 100)
    _, memory = decide(job.state(), POLICY, memory, T0 - 100)
    first, memory = form(job, memory, T0)
    job.start(1, "a")
    decision, memory = decide(job.state(), POLICY, memory, T0 + POLICY.start_timeout_s)
    assert decision == Wait("round healthy")
    timed_out_at = T0 + POLICY.start_timeout_s + 1
    record, memory = form(job, memory, timed_out_at)
    assert record.reason == START_TIMEOUT
    assert record.members == first.members
    assert record.failure_times == [T0 + POLICY.start_timeout_s]  # when the round ran out of time
    assert record.restarts_by_cause == {START_TIMEOUT: 1}


def test_started_members_never_time_out() -> None:
    job, memory, _ = running_job("a", "b")
    decision, memory = decide(job.state(), POLICY, memory, T0 + 100 * POLICY.start_timeout_s)
    assert decision == Wait("round healthy")


def test_start_timeout_after_an_earlier_failure_forms_a_round_after_its_backoff() -> None:
    job, memory, _ = running_job("a", "b")
    for node_id in ("a", "b"):
        job.report(1, node_id, FAILED, WORKER_EXIT, time=T0 + 10)
    second, memory = form(job, memory, T0 + 10)
    job.start(2, "a")  # b never starts
    timed_out_at = second.created_at + POLICY.start_timeout_s + 1
    # Well past any backoff, and the earlier failure is still inside the restart window.
    decision, memory = decide(job.state(), POLICY, memory, timed_out_at + POLICY.backoff_max_s + 1)
    assert isinstance(decision, FormRound), decision
    assert decision.record.reason == START_TIMEOUT


# -- scale up ----------------------------------------------------------------------------------
def test_scale_up_at_checkpoint_waits_for_the_committed_step_to_advance() -> None:
    job, memory, first = running_job("a", "b")
    job.checkpoint("a", 100)
    job.checkpoint("b", 100)
    c = job.join("c")
    decision, memory = decide(job.state(), POLICY, memory, T0 + 10)
    assert decision == Wait("round healthy")  # baseline: step 100
    decision, memory = decide(job.state(), POLICY, memory, T0 + 1000)
    assert decision == Wait("round healthy")  # no new checkpoint yet
    job.checkpoint("b", 200)
    record, memory = form(job, memory, T0 + 1001)
    assert record.reason == SCALE_UP
    assert record.members == [*first.members, c]
    assert record.failure_times == []
    assert record.restarts_by_cause == {SCALE_UP: 1}
    job.start(2, "a", "b", "c")
    decision, memory = decide(job.state(), POLICY, memory, T0 + 1002)
    assert decision == Wait("round healthy")


def test_under_live_recovery_a_joiner_enters_only_once_its_workers_are_warm() -> None:
    policy = dataclasses.replace(POLICY, recovery="live")
    job, memory, first = running_job("a", "b", policy=policy)
    c = job.join("c")
    job.checkpoint("a", 100, at=T0 + 2)
    job.checkpoint("b", 100, at=T0 + 2)
    cold = NodeStatus(state="waiting", workers_ready=1, updated_at=T0 + 2)  # 1 of nproc_per_node=2 warm
    job.put(job.keys.status("c"), cold.to_json(), lease=job.kvs[job.keys.node("c")].lease)
    decision, memory = decide(job.state(), policy, memory, T0 + 3)
    job.checkpoint("a", 200, at=T0 + 4)
    decision, memory = decide(job.state(), policy, memory, T0 + 5)
    assert decision == Wait("round healthy"), decision  # a new checkpoint, but c is still cold
    warm = NodeStatus(state="waiting", workers_ready=2, updated_at=T0 + 6)
    job.put(job.keys.status("c"), warm.to_json(), lease=job.kvs[job.keys.node("c")].lease)
    decision, memory = decide(job.state(), policy, memory, T0 + 7)  # warm now: the baseline is step 200
    job.checkpoint("b", 300, at=T0 + 8)
    record, memory = form(job, memory, T0 + 9, policy)
    assert record.reason == SCALE_UP and record.members == [*first.members, c]


@pytest.mark.parametrize(
    ("recovery", "min_nodes", "workers_ready", "left_out"),
    [
        ("live", 1, 1, True),  # no warm replacement: a goes on alone, b rejoins when warm
        ("live", 1, 2, False),  # a warm spare replaces the worker: nobody waits, b stays
        ("live", 1, -1, False),  # not known (an older agent): keep b
        ("live", 2, 1, False),  # a fixed node count: the round waits for b's cold start
        ("restart", 1, 1, False),  # restart mode restarts everyone anyway
    ],
)
@pytest.mark.parametrize("reason", [WORKER_EXIT, HANG])
def test_under_live_recovery_a_node_without_a_warm_replacement_is_left_out_while_enough_remain(
    reason: str, recovery: str, min_nodes: int, workers_ready: int, left_out: bool
) -> None:
    policy = dataclasses.replace(POLICY, recovery=recovery, min_nodes=min_nodes)
    job, memory, first = running_job("a", "b", policy=policy)
    job.report(1, "b", FAILED, reason, time=T0 + 30, workers_ready=workers_ready)
    record, memory = form(job, memory, T0 + 30.2, policy)
    assert record.reason == reason
    assert record.members == (first.members[:1] if left_out else first.members)


@pytest.mark.parametrize(
    ("recovery", "min_nodes", "c_ready", "c_in"),
    [
        ("live", 1, 1, False),  # c came back and is warming: a and b go on, c joins once warm
        ("live", 1, 2, True),  # warm: it joins with the round that is formed anyway
        ("live", 2, 1, False),  # a and b are min_nodes: enough without c
        ("restart", 1, 1, True),  # restart mode starts everyone cold anyway
    ],
)
def test_under_live_recovery_a_failure_round_does_not_wait_for_a_joiner_still_warming(
    recovery: str, min_nodes: int, c_ready: int, c_in: bool
) -> None:
    """Seen in the soak: a node whose agent came back after a node loss was put into the round
    formed for the next worker failure with its processes still importing torch, and the round
    waited 18-21 s for them to join the rendezvous."""
    policy = dataclasses.replace(POLICY, recovery=recovery, min_nodes=min_nodes)
    job, memory, first = running_job("a", "b", policy=policy)
    c = job.join("c", at=T0 + 20)
    status = NodeStatus(state="waiting", workers_ready=c_ready, updated_at=T0 + 21)
    job.put(job.keys.status("c"), status.to_json(), lease=job.kvs[job.keys.node("c")].lease)
    _, memory = decide(job.state(), policy, memory, T0 + 22)  # the leader sees c join
    job.report(1, "b", FAILED, WORKER_EXIT, time=T0 + 30, workers_ready=2)  # b has a warm spare
    record, memory = form(job, memory, T0 + 40, policy)
    assert record.reason == WORKER_EXIT
    assert record.members == ([*first.members, c] if c_in else first.members)


def test_scale_up_baseline_comes_from_a_status_written_after_the_join() -> None:
    """A commit made before the node joined, still unseen in a stale status record, is not the
    checkpoint the node waits for."""
    job, memory, first = running_job("a", "b")
    job.checkpoint("a", 100, at=T0 + 5)
    job.checkpoint("b", 100, at=T0 + 5)
    c = job.join("c", at=T0 + 50)  # step 200 was committed at T0 + 49; the status records still say 100
    decision, memory = decide(job.state(), POLICY, memory, T0 + 50.5)
    assert decision == Wait("round healthy")
    job.checkpoint("a", 200, at=T0 + 51)
    job.checkpoint("b", 200, at=T0 + 51)
    decision, memory = decide(job.state(), POLICY, memory, T0 + 51.5)
    assert decision == Wait("round healthy")  # baseline: 200, not 100
    job.checkpoint("b", 300, at=T0 + 60)
    record, memory = form(job, memory, T0 + 61)
    assert record.reason == SCALE_UP and record.members == [*first.members, c]


def test_scale_up_immediate_forms_once_membership_settles() -> None:
    policy = Policy.of(
        min_nodes=2, max_nodes=3, nproc_per_node=2, settle_s=5.0, scale_up="immediate", recovery="restart"
    )
    job, memory, first = running_job("a", "b", policy=policy)
    joined_at = T0 + 10
    c = job.join("c")
    decision, memory = decide(job.state(), policy, memory, joined_at)
    assert isinstance(decision, Wait)
    record, memory = form(job, memory, joined_at + policy.settle_s, policy)  # no checkpoint needed
    assert record.reason == SCALE_UP
    assert record.members == [*first.members, c]


def test_no_scale_up_beyond_max_nodes() -> None:
    policy = Policy.of(min_nodes=2, max_nodes=2, nproc_per_node=2, scale_up="immediate", recovery="restart")
    job, memory, _ = running_job("a", "b", policy=policy)
    job.join("c")
    decision, memory = decide(job.state(), policy, memory, T0 + 1000)
    assert decision == Wait("round healthy")


# -- the end -----------------------------------------------------------------------------------
def test_every_member_succeeded_finishes_the_job() -> None:
    job, memory, _ = running_job("a", "b")
    job.report(1, "a", SUCCEEDED, time=T0 + 100)
    decision, memory = decide(job.state(), POLICY, memory, T0 + 101)
    assert decision == Wait("round healthy")  # b still training
    job.report(1, "b", SUCCEEDED, time=T0 + 102)
    decision, memory = decide(job.state(), POLICY, memory, T0 + 103)
    assert isinstance(decision, Finish), decision
    assert (decision.final.status, decision.final.round, decision.final.time) == (SUCCEEDED, 1, T0 + 103)


def test_finished_job_is_left_alone() -> None:
    job, memory, _ = running_job("a", "b")
    job.put(job.keys.final, FinalStatus(FAILED, "budget", 1, T0 + 5).to_json())
    job.lose("b")
    decision, memory = decide(job.state(), POLICY, memory, T0 + 1000)
    assert decision == Wait("job finished: failed")


def test_restarts_by_cause_accumulate_over_rounds() -> None:
    policy = Policy.of(
        min_nodes=2, max_nodes=3, nproc_per_node=2, max_restarts=10, backoff_initial_s=0.0, recovery="restart"
    )
    job, memory, _ = running_job("a", "b", "c", policy=policy)
    now = T0
    for cause in (WORKER_EXIT, NODE_LOST, HANG, WORKER_EXIT):
        now += 100
        g = job.state().round
        if cause == NODE_LOST:
            job.lose("c")
            _, memory = decide(job.state(), policy, memory, now)
            now += policy.settle_s
        else:
            for node_id in job.state().nodes:
                job.report(g, node_id, FAILED, cause, time=now)
        record, memory = form(job, memory, now, policy)
        job.start(record.round, *(m.node_id for m in record.members))
    assert record.round == 5
    assert record.restarts_by_cause == {WORKER_EXIT: 2, NODE_LOST: 1, HANG: 1}


# -- deterministic and fatal failures ----------------------------------------------------------
LOOSE = Policy.of(
    min_nodes=1,
    max_nodes=2,
    nproc_per_node=1,
    max_restarts=10,
    restart_window_s=600.0,
    backoff_initial_s=0.0,
    deterministic_failures=3,
    recovery="restart",
)


def fail(job: FakeJob, g: int, node_id: str, *, step: int, error: str, when: float, reason: str = WORKER_EXIT) -> None:
    job.put(
        job.keys.report(g, node_id),
        Report(
            FAILED, reason, f"torchrun exited with 1; log round-{g}.log", job.uid(node_id), when, step=step, error=error
        ).to_json(),
    )


def fail_rounds(job: FakeJob, memory: LeaderMemory, failures: list[tuple[int, str]], policy: Policy = LOOSE):
    """Round g fails on node a with failures[g-1] (step, error); returns the decision after the last."""
    for g, (step, error) in enumerate(failures, start=1):
        fail(job, g, "a", step=step, error=error, when=T0 + 10 * g)
        decision, memory = decide(job.state(), policy, memory, T0 + 10 * g)
        if g == len(failures) or not isinstance(decision, FormRound):
            return decision
        job.apply(decision.record)
        job.start(g + 1, "a")


def test_the_same_error_at_the_same_step_three_times_stops_the_job_with_that_error() -> None:
    job, memory, _ = running_job("a", policy=LOOSE)
    decision = fail_rounds(job, memory, [(17, "ValueError: bad batch shape")] * 3)
    assert isinstance(decision, Finish), decision
    final = decision.final
    assert final.status == FAILED and final.round == 3
    assert "deterministic failure" in final.reason and "step 17" in final.reason
    assert "ValueError: bad batch shape" in final.reason and "deterministic_failures=3" in final.reason


@pytest.mark.parametrize(
    "failures",
    [
        [(17, "ValueError: x"), (18, "ValueError: x"), (17, "ValueError: x")],  # not at the same step
        [(17, "ValueError: x"), (17, "OSError: y"), (17, "ValueError: x")],  # not the same error
        [(17, ""), (17, ""), (17, "")],  # killed by a signal: no error of the workers' own, budget only
    ],
)
def test_failures_that_differ_or_say_nothing_restart(failures: list) -> None:
    job, memory, _ = running_job("a", policy=LOOSE)
    decision = fail_rounds(job, memory, failures)
    assert isinstance(decision, FormRound) and decision.record.round == 4, decision


def test_a_peer_killed_at_the_same_step_is_not_a_deterministic_failure() -> None:
    """Node b dies by a signal (no error of its own) three times at step 17; node a's workers fail
    each time with the same "connection closed by peer": a symptom, not evidence."""
    job, memory, _ = running_job("a", "b", policy=LOOSE)
    for g in (1, 2, 3):
        fail(
            job,
            g,
            "a",
            step=17,
            error="RuntimeError: Connection closed by peer [127.0.0.1]:4123" + str(g),
            when=T0 + 10 * g,
        )
        fail(job, g, "b", step=17, error="", when=T0 + 10 * g)
        decision, memory = decide(job.state(), LOOSE, memory, T0 + 10 * g)
        assert isinstance(decision, FormRound), decision
        job.apply(decision.record)
        job.start(g + 1, "a", "b")


def test_deterministic_rule_off_with_zero() -> None:
    policy = replace(LOOSE, deterministic_failures=0)
    job, memory, _ = running_job("a", policy=policy)
    decision = fail_rounds(job, memory, [(5, "E: same")] * 4, policy)
    assert isinstance(decision, FormRound), decision


def test_a_node_loss_between_identical_failures_does_not_reset_the_count() -> None:
    job, memory, _ = running_job("a", "b", policy=LOOSE)
    fail(job, 1, "a", step=9, error="E: same", when=T0 + 10)
    record, memory = form(job, memory, T0 + 10, LOOSE)
    job.start(record.round, "a", "b")
    fail(job, 2, "a", step=9, error="E: same", when=T0 + 20)
    record, memory = form(job, memory, T0 + 20, LOOSE)
    job.start(record.round, "a", "b")
    job.lose("b")
    _, memory = decide(job.state(), LOOSE, memory, T0 + 30)  # the leader sees b gone, then membership settles
    record, memory = form(job, memory, T0 + 40, LOOSE)
    assert record.reason == NODE_LOST and record.failure_signatures == ["worker_exit|9|E: same"] * 2
    job.start(record.round, "a")
    fail(job, 4, "a", step=9, error="E: same", when=T0 + 50)
    decision, memory = decide(job.state(), LOOSE, memory, T0 + 50)
    assert isinstance(decision, Finish)


def test_a_fatal_report_ends_the_job_at_once_without_spending_the_budget() -> None:
    job, memory, _ = running_job("a", "b")
    fail(
        job,
        1,
        "b",
        step=60,
        error="CheckpointFailuresError: 3 checkpoint commits in a row failed",
        when=T0 + 5,
        reason=FATAL,
    )
    decision, memory = decide(job.state(), POLICY, memory, T0 + 5)
    assert isinstance(decision, Finish), decision
    assert decision.final.status == FAILED and "fatal error on b at step 60" in decision.final.reason
    assert "CheckpointFailuresError" in decision.final.reason


# -- unreadable records -------------------------------------------------------------------------
def test_an_unreadable_round_key_makes_the_leader_form_a_round_above_every_number_used() -> None:
    job, memory, first = running_job("a", "b")
    job.put(job.keys.round, "garbage")
    job.put(job.keys.started(7, "a"), "uid")  # some key says round 7 was used
    record, memory = form(job, memory, T0 + 10)
    assert record.round == 8 and record.reason == ROUND_REPAIR and record.members == first.members
    state = job.state()
    assert state.round_known and state.current == record


def test_an_unreadable_current_record_makes_the_leader_form_the_next_round_keeping_the_budget() -> None:
    job, memory, _ = running_job("a", "b")
    for g in (1, 2):
        job.report(g, "a", FAILED, WORKER_EXIT, time=T0 + 10 * g)
        record, memory = form(job, memory, T0 + 10 * g + POLICY.backoff_initial_s)
        job.start(record.round, "a", "b")
    job.put(job.keys.round_record(3), '{"round": "three"}')
    record, memory = form(job, memory, T0 + 40)
    assert (record.round, record.reason) == (4, ROUND_REPAIR)
    assert record.failure_times == [T0 + 10]  # round 2's memory: round 3's record is unreadable
    assert record.restarts_by_cause == {WORKER_EXIT: 1, ROUND_REPAIR: 1}


def test_a_malformed_master_fails_the_round_until_every_member_started() -> None:
    job = FakeJob()
    job.join("a"), job.join("b")
    memory = memory_at(T0 - 100)
    _, memory = decide(job.state(), POLICY, memory, T0 - 100)
    _, memory = form(job, memory, T0)
    job.start(1, "a")
    job.put(job.keys.master(1), "nonsense")  # b cannot launch with it
    record, memory = form(job, memory, T0 + 1)
    assert (record.round, record.reason) == (2, BAD_RECORD)
    job.start(2, "a", "b")
    job.put(job.keys.master(2), "also:nonsense")  # everybody started already: nobody needs it any more
    decision, memory = decide(job.state(), POLICY, memory, T0 + 2)
    assert isinstance(decision, Wait)


def test_a_garbage_node_record_is_not_a_live_member() -> None:
    job, memory, _ = running_job("a", "b", "c")
    job.put(job.keys.node("b"), '{"node_id": "b"}')
    _, memory = decide(job.state(), POLICY, memory, T0 + 100)
    record, memory = form(job, memory, T0 + 100 + POLICY.settle_s)
    assert record.reason == NODE_LOST and [m.node_id for m in record.members] == ["a", "c"]
