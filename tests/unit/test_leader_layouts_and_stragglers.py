"""ftrain.agents.leader: the node counts a pipeline layout can use, and stragglers (compared within
the stages a node runs). The fake etcd is tests/leader_support.py's."""

from __future__ import annotations

from dataclasses import replace

from ftrain.agents.agent_status import STATUS_INTERVAL_S
from ftrain.agents.config import agent_flags, settings_of_flags
from ftrain.agents.heartbeat import BusyWindow
from ftrain.agents.leader import SLOWDOWN_MARGIN, STRAGGLER_LAG_S, Policy, Wait, decide, slowdown_flagged
from ftrain.agents.records import SCALE_UP
from tests.leader_support import POLICY, T0, busy, form, running_job


def test_rounds_take_as_many_nodes_as_make_a_world_size_the_layout_can_use() -> None:
    """A pipeline of 4 stages on nodes of 2 workers needs an even node count: of three live
    nodes the newest waits, a lost one leaves one survivor waiting, and a third node that would
    not make a usable size joins nobody's round."""
    policy = Policy.of(
        min_nodes=1, max_nodes=4, nproc_per_node=2, scale_up="immediate", recovery="restart", pipeline_degrees=(4,)
    )
    assert [policy.usable_nodes(n) for n in range(6)] == [0, 0, 2, 2, 4, 4]
    job, memory, first = running_job("a", "b", "c", policy=policy)
    assert first.members == [m for m in first.members if m.node_id in ("a", "b")] and len(first.members) == 2
    job.lose("b")
    _, memory = decide(job.state(), policy, memory, T0 + 50)  # c was waiting: a and c make 4 ranks
    record, memory = form(job, memory, T0 + 50 + policy.settle_s, policy)
    assert [m.node_id for m in record.members] == ["a", "c"]
    job.start(record.round, "a", "c")
    job.lose("c")
    decision, memory = decide(job.state(), policy, memory, T0 + 100)
    assert isinstance(decision, Wait) and "multiple of 4 ranks" in decision.why
    job.join("d")  # a and d make 4 ranks
    job.join("e")  # a fifth node would not: it waits
    _, memory = decide(job.state(), policy, memory, T0 + 101)
    record, memory = form(job, memory, T0 + 101 + policy.settle_s, policy)
    assert [m.node_id for m in record.members] == ["a", "d"]
    job.start(record.round, "a", "d")
    assert decide(job.state(), policy, memory, T0 + 500)[0] == Wait("round healthy")  # e alone cannot grow it


def test_a_member_slow_without_a_break_for_straggler_after_s_is_a_straggler_and_warn_keeps_it() -> None:
    policy = replace(POLICY, on_straggler="warn", straggler_factor=1.5, straggler_after_s=3.0)  # not the default
    job, memory, record = running_job("a", "b", "c", policy=policy)
    busy(job, 1, T0 + 1, a=0.030, b=0.031, c=0.050)  # 1.63x the others' median
    decision, memory = decide(job.state(), policy, memory, T0 + 1)
    assert decision == Wait("round healthy") and memory.slow_since == (("c", T0 + 1),) and memory.stragglers == ()
    decision, memory = decide(job.state(), policy, memory, T0 + 4)
    [slow] = memory.stragglers
    assert (slow.node, slow.rank, slow.busy_s, slow.others_s) == ("c", 2, 0.050, 0.0305)
    assert "c (rank 2): busy 0.050 s per step vs 0.030 s on the other nodes (1.64x) for 3.0 s" in slow.describe(T0 + 4)
    assert decision == Wait("round healthy"), "warn: no new round"
    busy(job, 1, T0 + 5, a=0.030, b=0.031, c=0.040)  # 1.31x: a break ends the episode
    _, memory = decide(job.state(), policy, memory, T0 + 5)
    assert memory.slow_since == () and memory.stragglers == ()


def test_with_fallback_degrees_a_round_takes_the_nodes_some_degree_can_use_and_runs_the_first_that_fits() -> None:
    policy = Policy.of(min_nodes=1, max_nodes=4, nproc_per_node=1, recovery="restart", pipeline_degrees=(4, 2))
    assert [policy.usable_nodes(n) for n in range(1, 6)] == [0, 2, 2, 4, 4]
    assert [policy.pipeline_at(n) for n in (4, 2, 3)] == [4, 2, None]
    assert [policy.stages_of(k, 2) for k in range(2)] == [{0}, {1}]  # at 2 nodes: the 2-stage layout
    assert policy.layout_needs() == "a multiple of 4 or 2 ranks"


def test_under_a_pipeline_members_are_compared_with_those_running_the_same_stages() -> None:
    """pp=2 on four nodes of two workers: a and b run stage 0, c and d stage 1 (the head: more
    work by design). Stage 1 being slower than stage 0 is no straggler; d slower than c is."""
    policy = replace(POLICY, max_nodes=4, on_straggler="warn", straggler_after_s=0.0, pipeline_degrees=(2,))
    job, memory, record = running_job("a", "b", "c", "d", policy=policy)
    assert [policy.stages_of(k, 4) for k in range(4)] == [{0}, {0}, {1}, {1}]
    busy(job, 1, T0 + 1, a=0.030, b=0.031, c=0.060, d=0.061)
    _, memory = decide(job.state(), policy, memory, T0 + 1)
    assert memory.stragglers == ()
    busy(job, 1, T0 + 2, a=0.030, b=0.031, c=0.060, d=0.090)
    _, memory = decide(job.state(), policy, memory, T0 + 2)
    assert [(s.node, s.others_s) for s in memory.stragglers] == [("d", 0.060)]


def test_noise_between_members_and_statuses_of_another_round_are_no_stragglers() -> None:
    policy = replace(POLICY, on_straggler="evict", straggler_after_s=1.0)
    job, memory, record = running_job("a", "b", policy=policy)
    busy(job, 1, T0 + 1, a=0.030, b=0.036)  # 1.2x, under the factor (1.25)
    for now in (T0 + 1, T0 + 5):
        decision, memory = decide(job.state(), policy, memory, now)
    assert memory.stragglers == () and decision == Wait("round healthy")
    busy(job, 0, T0 + 6, a=0.030, b=0.090)  # written for an older round
    decision, memory = decide(job.state(), policy, memory, T0 + 9)
    assert memory.stragglers == () and decision == Wait("round healthy")


def test_evict_forms_a_round_without_the_straggler_and_lets_it_join_again_after_rejoin_s() -> None:
    policy = replace(POLICY, on_straggler="evict", straggler_after_s=2.0, straggler_rejoin_s=30.0, scale_up="immediate")
    job, memory, record = running_job("a", "b", "c", policy=policy)
    busy(job, 1, T0 + 1, a=0.030, b=0.090, c=0.031)
    _, memory = decide(job.state(), policy, memory, T0 + 1)
    evicted, memory = form(job, memory, T0 + 3, policy)
    assert evicted.reason == "straggler" and [m.node_id for m in evicted.members] == ["a", "c"]
    assert evicted.excluded == {"b": T0 + 33} and "failure_times" not in evicted.restarts_by_cause
    assert evicted.failure_times == [], "an eviction is not a failure: it spends no restart budget"
    job.start(2, "a", "c")
    for now in (T0 + 10, T0 + 32.9):  # b is live but kept out
        decision, memory = decide(job.state(), policy, memory, now)
        assert decision == Wait("round healthy"), decision
    back, memory = form(job, memory, T0 + 33.1, policy)
    assert back.reason == SCALE_UP and [m.node_id for m in back.members] == ["a", "b", "c"] and back.excluded == {}


def test_evict_keeps_the_straggler_when_min_nodes_would_not_remain() -> None:
    policy = replace(POLICY, on_straggler="evict", straggler_after_s=1.0)  # min_nodes = 2
    job, memory, record = running_job("a", "b", policy=policy)
    busy(job, 1, T0 + 1, a=0.030, b=0.090)
    _, memory = decide(job.state(), policy, memory, T0 + 1)
    decision, memory = decide(job.state(), policy, memory, T0 + 3)
    assert [s.node for s in memory.stragglers] == ["b"] and decision == Wait("round healthy")


def test_the_slowdown_rule_flags_what_shows_above_the_factor_for_straggler_after_s() -> None:
    """What a stop/continue slowdown of a given length and duty must trigger (the soak's
    worker_slow is held to it): clearly over the factor, for straggler_after_s after it can show."""
    # the lag is the agents' own cadence: two averaged statuses, and the one the leader reads next
    assert STRAGGLER_LAG_S == (BusyWindow()._intervals + 1) * STATUS_INTERVAL_S
    policy = replace(POLICY, on_straggler="warn", straggler_factor=1.25, straggler_after_s=3.0)
    assert slowdown_flagged(2.0, 6.0, policy)  # stopped half the time for 6 s
    assert not slowdown_flagged(2.0, 3.0, policy)  # the soak's old 3 s: over before it can count
    assert not slowdown_flagged(1.25 * SLOWDOWN_MARGIN - 0.01, 60.0, policy)  # too close to the factor
    assert not slowdown_flagged(2.0, 60.0, replace(policy, on_straggler="off"))


def test_agent_flags_read_back_as_settings() -> None:
    flags = agent_flags({"straggler_after_s": 1.5, "on_straggler": "evict", "spares": 2})
    assert settings_of_flags([*flags, "--recovery", "live", "--unknown", "x"]) == {
        "straggler_after_s": 1.5,
        "on_straggler": "evict",
        "spares": 2,
        "recovery": "live",
    }
    assert settings_of_flags(["--straggler-after-s", "1", "--straggler-after-s", "2"]) == {"straggler_after_s": 2.0}
