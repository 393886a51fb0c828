"""The node agent's mixins (:mod:`ftrain.agents.agent_membership`, :mod:`ftrain.agents.agent_hangs`,
:mod:`ftrain.agents.agent_status`) hold to the two rules their pattern relies on:

- every name a mixin declares (the agent state and the other parts' methods it uses) is there
  on a newly built :class:`Agent`: a declaration is only a type for mypy, so a declared
  attribute that ``Agent.__init__`` no longer sets would fail only when that code runs;
- no method or attribute is defined by more than one of the classes: which definition wins
  never depends on the order of the bases.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from ftrain.agents.agent import Agent
from ftrain.agents.agent_options import AgentOptions
from ftrain.agents.heartbeat import Beat, RankTotals
from ftrain.agents.metrics import AgentMetrics
from ftrain.agents.workers import Launch, Workers
from ftrain.contract.events import EventLog
from tests.memory_jobstore import FakeClock, MemoryJobStore

MIXINS = [c for c in Agent.__mro__ if c not in (Agent, object)]


class _NoHeartbeats:
    path = "hb.sock"

    def reset(self, round_: int) -> None: ...

    def carry(self, beats: Mapping[int, Beat], now: float) -> None: ...

    def beats(self) -> dict[int, Beat]:
        return {}

    def take_totals(self) -> dict[int, RankTotals]:
        return {}

    def close(self) -> None: ...


def _no_launch(launch: Launch, env: dict[str, str], log_path: str) -> Workers:
    raise AssertionError("nothing is launched here")


def _agent(tmp_path: Path) -> Agent:
    clock = FakeClock()
    opts = AgentOptions.of(etcd=["http://etcd.invalid:2379"], job="job", node_id="a", worker_args=["cfg.toml"])
    return Agent(
        opts,
        store=MemoryJobStore(clock),
        clock=clock,
        heartbeats=_NoHeartbeats(),
        metrics=AgentMetrics("job", "a", clock=clock.monotonic),
        events=EventLog(str(tmp_path / "events.jsonl"), rank=-1),
        launcher=_no_launch,
        run_dir=str(tmp_path),
    )


def test_the_agent_has_three_mixins():
    assert {c.__name__ for c in MIXINS} == {"AgentMembership", "AgentHangs", "AgentStatus"}


def test_every_name_a_mixin_declares_is_set_on_a_new_agent(tmp_path):
    agent = _agent(tmp_path)
    try:
        missing = {
            f"{mixin.__name__}.{name}" for mixin in MIXINS for name in mixin.__annotations__ if not hasattr(agent, name)
        }
        assert not missing, f"declared by a mixin but not set by Agent.__init__ (nor defined): {sorted(missing)}"
    finally:
        agent.close()


def test_no_name_is_defined_by_two_of_the_agents_classes():
    owners: dict[str, list[str]] = {}
    for cls in (Agent, *MIXINS):
        for name in vars(cls):
            if not (name.startswith("__") and name.endswith("__")):
                owners.setdefault(name, []).append(cls.__name__)
    twice = {name: classes for name, classes in owners.items() if len(classes) > 1}
    assert not twice, f"defined in more than one class (the order of the bases would decide): {twice}"
