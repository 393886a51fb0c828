"""The control plane says what it decided, at once, in every tool: a round the leader needs and
cannot form (status, event, log, ``ftrain analyze``), and why a live node waits outside the round.

The pure rules are driven on tests/leader_support.py's fake etcd; the agents on the in-memory
store and fake clock of tests/unit/test_agent_unit.py (nothing sleeps).
"""

from __future__ import annotations

from dataclasses import replace

from ftrain.agents.leader import Policy, Wait, decide, waiting_reasons
from ftrain.agents.records import NODE_LOST, NodeStatus
from ftrain.agents.status import format_status, status_of
from ftrain.contract.events import read_jsonl
from ftrain.observability.decisions import decisions
from tests.leader_support import POLICY, T0, running_job
from tests.unit.test_agent_unit import JOB, Job, start_round_1

PIPELINE = Policy.of(
    min_nodes=1, max_nodes=2, nproc_per_node=1, settle_s=1.0, recovery="restart", pipeline_degrees=(2,)
)


def test_a_node_loss_that_leaves_a_world_the_layout_cannot_run_is_a_blocked_decision_naming_the_fallback() -> None:
    """pp=2 on two nodes of one worker: the survivor alone is world size 1. The leader needs a
    round (node_lost) and says at once, without waiting to settle, that it cannot form one and
    what would fix it; with a fallback degree it forms the round."""
    job, memory, _ = running_job("a", "b", policy=PIPELINE)
    job.lose("a")
    decision, memory = decide(job.state(), PIPELINE, memory, T0 + 10)
    assert isinstance(decision, Wait) and decision.blocked
    assert decision.need == f"{NODE_LOST} (agent gone: a)"
    assert decision.why.startswith("cannot form a round: 1 node(s) x 1 proc = world size 1")
    assert "parallel.pp_size=2" in decision.why and 'parallel.pp_fallback (e.g. "1"' in decision.why

    fallback = replace(PIPELINE, pipeline_degrees=(2, 1))
    record = decide(job.state(), fallback, memory, T0 + 10)[0]
    assert not isinstance(record, Wait), record


def test_waits_that_end_by_themselves_name_the_round_they_wait_to_form() -> None:
    job, memory, record = running_job("a", "b", "c")
    job.report(record.round, "a", "failed", "worker_exit", time=T0 + 5)
    job.join("d")  # membership changes: the round waits to settle
    decision, _ = decide(job.state(), POLICY, memory, T0 + 6)
    assert isinstance(decision, Wait) and decision.why.startswith("settling") and not decision.blocked
    assert decision.need == "worker_exit (a: failed on a)"


def test_the_leader_says_why_each_node_outside_the_round_waits() -> None:
    """A joiner under scale_up=checkpoint waits for the next commit (after the baseline step, once
    known); under live recovery a cold one waits for its workers to warm; one that would not make
    a usable world size says so."""
    job, memory, _ = running_job("a", "b")
    job.checkpoint("a", 100, at=T0 + 1)
    job.checkpoint("b", 100, at=T0 + 1)
    job.join("c", at=T0 + 2)
    reasons = waiting_reasons(job.state(), POLICY, memory, T0 + 3)
    assert reasons == {
        "c": "joins at the next checkpoint commit (agent.scale_up=checkpoint); waiting for the members' status "
        "to show the newest commit"
    }
    job.checkpoint("a", 100, at=T0 + 4)
    job.checkpoint("b", 100, at=T0 + 4)
    _, memory = decide(job.state(), POLICY, memory, T0 + 4)  # the baseline: step 100
    assert waiting_reasons(job.state(), POLICY, memory, T0 + 5)["c"] == (
        "joins at the next checkpoint commit after step 100 (agent.scale_up=checkpoint)"
    )

    live = replace(POLICY, recovery="live")
    job.put(
        job.keys.status("c"),
        NodeStatus(state="waiting", workers_ready=1, updated_at=T0 + 5).to_json(),
        lease=job.kvs[job.keys.node("c")].lease,
    )
    assert waiting_reasons(job.state(), live, memory, T0 + 5)["c"].startswith("its workers are warming (1 of 2 warm)")

    even = replace(POLICY, max_nodes=4, pipeline_degrees=(4,))  # a, b and c are 6 ranks: 4 do not tile them
    assert (
        "would not make a larger world size parallel.pp_size=4 can run"
        in (waiting_reasons(job.state(), even, memory, T0 + 5)["c"])
    )


def test_the_survivor_leader_states_a_round_it_cannot_form_in_its_status_an_event_and_analyze(job: Job) -> None:
    """Item 13 of issue 38: two agents of one worker at pp=2, node a (the leader) lost. Before,
    b became leader, formed nothing and said nothing: ``ftrain status`` kept showing round 1 as
    running and ``ftrain analyze`` found nothing. Now b states it once its lease ran out, and the
    status says which round is to be replaced and what would fix it."""
    start_round_1(job, "a", "b", nnodes="2:2", nproc_per_node=1, pipeline_degrees=(2,))
    job.nodes["a"].die()
    died_at = job.clock.monotonic()

    def pending() -> str:
        status = job.state().status.get("b")
        return status.round_pending if status else ""

    job.run_until(pending, "b's status says why no round is formed", within_s=10)
    assert job.clock.monotonic() - died_at < 2.0 + 2.0, "within a few ticks of the lease running out"
    text = pending()
    assert text.startswith(f"new round needed for {NODE_LOST} (agent gone: a); not formed: cannot form a round: 1 of")
    assert "parallel.pp_size=2 cannot run" in text and "parallel.pp_fallback" in text

    shown = format_status(status_of(job.state(), JOB, now=job.clock.time()))
    assert "is to be replaced; the leader has not formed the next" in shown
    assert f"ROUND PENDING (leader b): {text}" in shown

    for _ in range(20):  # the same decision, tick after tick: one event, not one per tick
        job.tick()
    [event] = job.events("round_pending")
    assert event["node"] == "b" and event["blocked"] is True and event["need"] == f"{NODE_LOST} (agent gone: a)"
    [said] = [d for d in decisions(read_jsonl(job.tmp_path / "events.jsonl")) if d["decision"] == "round_pending"]
    assert said["text"].startswith("leader b: new round needed for node_lost (agent gone: a); not formed: cannot")


def test_a_decision_from_a_hostile_event_prints_as_utf8():
    """An event's text with a lone surrogate (a JSON log may hold "\\udc80") made ``print`` in
    ``ftrain analyze`` raise UnicodeEncodeError; a time past a float's range is no time."""
    events = [{"event": "job_final", "status": "failed", "node": "a\udc80", "reason": "boom \ud800", "time": 10**400}]
    [d] = decisions(events)
    d["text"].encode("utf-8")
    assert d["node"] == "a\\udc80" and d["time"] == 0.0
