"""One accounting of device time in every tool (issue 38 item 17): for one job, ``ftrain status``
(the agents' statuses in etcd) and ``ftrain report`` (the agents' ``device_time`` events) give
the same numbers under the same names, and a loop that sends only its step number (an
``ftrain.Session`` script) has productive time.

Before: the agents called the time they could not account ``restarts`` and only counted it from
a torchrun launch (under live recovery: nothing, 0 device-hours), the report had its own split
from metrics lines a Session script never writes (0 productive), and status and report
disagreed (0.0000 against 41.9%). The agents are driven on tests/unit/test_agent_unit.py's
in-memory store and fake clock.
"""

from __future__ import annotations

import pytest

from ftrain.agents.records import SUCCEEDED
from ftrain.agents.status import format_status, status_of
from ftrain.contract.accounting import CAUSES, DeviceTime, describe, summary
from ftrain.contract.events import read_jsonl
from ftrain.observability.run_report import build
from tests.unit.test_agent_unit import JOB, Job, start_round_1


def _train(job: Job, steps: range, *nodes: str) -> None:
    """Each node's loop does one step per tick (0.2 s of the fake clock)."""
    for step in steps:
        for node in nodes:
            job.nodes[node].workers.beat(step, step_time_s=0.0)  # a Session loop's: no step time, no phases
        job.tick()


def test_status_and_report_give_the_same_device_time_by_the_same_names_for_a_session_loop(job: Job) -> None:
    start_round_1(job, "a", "b", nnodes="2:2")
    _train(job, range(1, 31), "a", "b")
    job.nodes["b"].workers.fail("ValueError: bad batch", step=30)  # round 2 resumes from step 20
    job.run_until(lambda: job.running(2, "a", "b"), "round 2")
    _train(job, range(21, 51), "a", "b")
    for node in ("a", "b"):
        job.nodes[node].workers.finish(step=50)
    job.run_until(lambda: all(n.agent.exit_code is not None for n in job.nodes.values()), "the job's end")
    state = job.state()
    assert state.final is not None and state.final.status == SUCCEEDED

    shown = status_of(state, JOB, now=job.clock.time())["accounting"]
    reported = build([], read_jsonl(job.tmp_path / "events.jsonl"))["accounting"]
    assert reported["source"] == "agents" and shown["devices"] == reported["devices"] == 2
    assert [c["cause"] for c in shown["causes"]] == [c["cause"] for c in reported["causes"]] == list(CAUSES)
    for mine, theirs in zip(shown["causes"], reported["causes"], strict=True):
        assert mine["device_hours"] == pytest.approx(theirs["device_hours"], abs=2e-6), mine["cause"]
    assert shown["goodput"] == pytest.approx(reported["goodput"], abs=1e-3)
    hours = {c["cause"]: c["device_hours"] for c in shown["causes"]}
    # measured from the beats: 1 tick per step, one device per node, steps 2..30 and 31..50 are new
    # (each round's first is its warm-up), 22..30 done again
    assert hours["productive"] == pytest.approx((29 + 20) * 0.2 * 2 / 3600, abs=2e-6)
    assert hours["recomputation"] == pytest.approx(9 * 0.2 * 2 / 3600, abs=2e-6)
    assert hours["startup"] > 0 and hours["recovery"] > 0 and "restarts" not in hours
    assert describe(shown) in format_status(status_of(state, JOB, now=job.clock.time()))


def test_device_time_adds_up_to_the_wall_time_and_a_node_outside_the_round_is_idle() -> None:
    account = DeviceTime(devices=2)
    account.start(100.0)
    account.step(1, None, 105.0)  # the first step: start-up ends
    account.step(4, 1.0, 108.0)  # three new steps of 1 s
    account.outside(10.0)  # left out of a round for 10 s
    account.step(2, None, 120.0)  # a new round from step 2
    account.step(4, 1.0, 122.0)  # 3 and 4 again
    account.step(5, 1.0, 123.0)
    account.staged(0.5)
    seconds = account.seconds(130.0)
    assert seconds["startup"] == 10.0 and seconds["idle"] == 20.0
    assert seconds["productive"] == 4 * 2.0 - 0.5 and seconds["recomputation"] == 2 * 2.0
    assert sum(seconds.values()) == pytest.approx(30.0 * 2)
    s = summary({**seconds, "restarts": 1.0, "nonsense": 5.0}, devices=2, wall_s=30.0, device_hour_price=2.0)
    by = {c["cause"]: c for c in s["causes"]}
    assert by["recovery"]["device_hours"] == pytest.approx((seconds["recovery"] + 1.0) / 3600, abs=1e-6)
    assert by["idle"]["cost"] == pytest.approx(20.0 / 3600 * 2.0, abs=1e-4) and "nonsense" not in by
