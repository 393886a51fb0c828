"""A SIGTERM that lands as a round that lists the agent forms, before it started workers in it:
the leader that just formed a scale-up round (it kills its workers of the round replaced: their
drain save could not commit for it), or the node that joins. The agent exits 75 and reports
``stopped`` for the new round, so that the next leader tells its departure as ``node_left``, not
``node_lost`` (a race first seen in tests/integration/test_drain_states.py).

Deterministic: the agents of tests/unit/test_agent_unit.py (fake workers, a fake clock), on a real
etcd and on the in-memory store the unit tests use, ticked by the test, which drains an agent
between the pass in which the round formed and its next tick. On etcd an agent's view follows
the job by watch: the test waits on conditions with a deadline, ticking every agent meanwhile."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ftrain.agents.etcd import EtcdClient
from ftrain.agents.jobstore import EtcdJobStore
from ftrain.agents.records import NODE_LEFT, SCALE_UP, STOPPED
from ftrain.contract import exits
from ftrain.testbed.wait import wait_for
from tests.unit.test_agent_unit import Job

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(params=["memory", "etcd"])
def job(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Job]:
    if request.param == "memory":
        j = Job(tmp_path)
    else:
        endpoint = request.getfixturevalue("etcd").endpoint
        j = Job(tmp_path, lambda: EtcdJobStore(EtcdClient([endpoint], timeout_s=1.0, retry_timeout_s=5.0)))
    try:
        yield j
    finally:
        j.close()


class _Training:
    """The workers of the job: every pass, each that runs beats at :attr:`step` with
    :attr:`committed_step` committed (a worker's heartbeat does, even while it drains); silent
    for ``hang_timeout_s`` of the fake clock, they would be judged hung."""

    def __init__(self, job: Job):
        self.job = job
        self.step, self.committed_step = 0, -1

    def beat(self) -> None:
        for node in self.job.nodes.values():
            for workers in node.started if node.alive else ():
                if workers.rc is None:
                    workers.beat(self.step, committed_step=self.committed_step)

    def until(self, condition: Callable[[], object], what: str, timeout_s: float = 30.0) -> None:
        """Pass after pass (the workers beat, every live agent ticks, the fake clock moves one
        tick) until ``condition()``."""

        def passed() -> object:
            if condition():
                return True
            self.beat()
            self.job.tick()
            return condition()

        wait_for(passed, timeout_s, what, poll_s=0.01)


@pytest.mark.parametrize("drained", ["a", "c"])
def test_an_agent_drained_as_a_round_that_lists_it_forms_reports_stopped_for_it(job: Job, drained: str) -> None:
    """``a``: the leader, drained right after it formed the round (its workers of the round before
    are killed); ``c``: the node that joins, drained before it started any worker."""
    training = _Training(job)
    for node_id in ("a", "b"):
        job.join(node_id, nnodes="1:3")
    training.until(lambda: job.running(1, "a", "b"), "round 1 running on a and b")
    assert job.state().leader == "a"
    training.step, training.committed_step = 12, 10
    training.beat()
    job.join("c", nnodes="1:3")
    training.until(
        lambda: (s := job.state().status.get("a")) and s.updated_at >= job.state().nodes["c"].registered_at,
        "a's status written after c joined",
    )
    training.step, training.committed_step = 21, 20  # a checkpoint after c joined: the leader scales up at it
    # a ticks first in every pass: once round 2 is there, a formed it and has not ticked since (b
    # and c have, but nobody started workers in it: a, its node rank 0, has not named its master)
    training.until(lambda: job.state().round == 2, "round 2 formed")
    record = job.state().current
    assert record is not None and record.reason == SCALE_UP
    assert [m.node_id for m in record.members] == ["a", "b", "c"]
    node = job.nodes[drained]
    before = list(node.started)
    # what the agent knows (its view follows etcd by watch): the round that lists it
    wait_for(lambda: node.agent.view.snapshot().round == 2, 30, f"{drained}'s view of round 2", poll_s=0.01)

    node.agent.drain("signal 15")  # the SIGTERM, before the agent acts on the round
    training.until(lambda: node.agent.exit_code is not None, f"{drained} drained")
    assert node.agent.exit_code == exits.DRAINED
    assert node.started == before and all(w.killed for w in before)  # none started in round 2
    node.close()  # the process exits: its lease is revoked

    report = job.state().reports.get(2, {}).get(drained)
    assert report is not None and report.outcome == STOPPED, job.state().reports
    assert report.agent_uid == node.agent.uid
    training.until(lambda: job.state().round == 3, f"round 3 formed without {drained}")
    record = job.state().current
    assert record is not None and record.reason == NODE_LEFT, record  # node_lost before the fix
    assert [m.node_id for m in record.members] == sorted({"a", "b", "c"} - {drained})
    assert record.failure_times == []  # a drain is no failure
