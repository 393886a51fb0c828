"""The leader reports each straggler episode: a node slow again later in the same round is a new
straggler (the soak's seed 3 slowed node n1 twice in round 50, 11.5 s apart: the second went
unreported, as every later one of that round would have)."""

from __future__ import annotations

from types import SimpleNamespace

from ftrain.agents.leader import LeaderMemory, Straggler
from ftrain.contract.events import read_jsonl
from tests.unit.test_agent_mixins import _agent


def test_each_episode_of_a_straggler_is_reported_once(tmp_path):
    agent = _agent(tmp_path)
    state = SimpleNamespace(current=SimpleNamespace(round=50))
    first = Straggler("n1", 0, busy_s=0.13, others_s=0.06, since=100.0)
    second = Straggler("n1", 0, busy_s=0.12, others_s=0.06, since=120.0)
    try:
        for now, stragglers in [
            (103.0, (first,)),
            (104.0, (first,)),  # the same episode goes on: not again
            (110.0, ()),  # it ended
            (123.0, (second,)),  # slow again, same node, same round: a new one
            (124.0, (second,)),
        ]:
            agent._note_stragglers(state, LeaderMemory(leader_since=0.0, stragglers=stragglers), now)
    finally:
        agent.close()
    reported = [e for e in read_jsonl(tmp_path / "events.jsonl") if e["event"] == "straggler_detected"]
    assert [(e["node"], e["worker_round"], e["slow_for_s"]) for e in reported] == [("n1", 50, 3.0), ("n1", 50, 3.0)]
