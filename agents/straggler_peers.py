"""Which members of a round are slow against their peers: busy time per step (not blocked on
communication) over ``factor`` times the median of the other members that run the same
pipeline stages. Pure; :func:`ftrain.agents.leader.watch_stragglers` calls it on every leader
tick and turns slowness that lasts into stragglers.

It is O(N log N) at N members — the busy times sorted once per group of stages, the exact
median of the others taken only for the few members above a group's floor, each by binary
search — instead of a median of N-1 peers for each member (O(N²): seconds at 4,096 nodes).

What must stay true: the answer is the plain definition's. A member is judged when its status
is of the current round, ``running``, with a busy time > 0; its peers are the other judged
members with the same first and last pipeline stage; it is slow when the median of its peers'
busy times (:func:`statistics.median`; 0.0 without peers) is > 0 and its own busy time is over
``factor`` times that median (``tests/unit/test_decide_scale.py`` holds the helpers to it).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from ftrain.agents.records import JobState, NodeStatus, RoundRecord

#: the first and last pipeline stage a node's ranks run (:meth:`ftrain.agents.leader.Policy.stage_spans`)
Stages = tuple[int, int]


@dataclass(frozen=True, slots=True)
class Slow:
    """A member busier per step than ``factor`` times its peers' median."""

    node: str
    status: NodeStatus  #: its status (busy time per step, busiest rank)
    others_s: float  #: the median busy time per step of its peers


def slow_members(state: JobState, cur: RoundRecord, spans: list[Stages], factor: float) -> list[Slow]:
    """The slow members of round ``cur`` in node-id order; ``spans``: each node rank's stages."""
    busy = _judged(state, cur, spans)
    peers_busy_s = _busy_by_stages(busy)
    slow = []
    for node in sorted(_maybe_slow(busy, peers_busy_s, factor)):
        status, stages = busy[node]
        others_s = median_of_others(peers_busy_s[stages], status.busy_s)
        if others_s > 0 and status.busy_s > factor * others_s:
            slow.append(Slow(node, status, others_s))
    return slow


def median_of_others(sorted_values: list[float], value: float) -> float:
    """The median of ``sorted_values`` with one occurrence of ``value`` (which it holds) left
    out, as :func:`statistics.median` gives it; 0.0 when no other value is left. O(log n)."""
    count = len(sorted_values) - 1
    if count <= 0:
        return 0.0
    skip = bisect.bisect_left(sorted_values, value)

    def at(j: int) -> float:
        return sorted_values[j if j < skip else j + 1]

    mid = count // 2
    return at(mid) if count % 2 else (at(mid - 1) + at(mid)) / 2


def _judged(state: JobState, cur: RoundRecord, spans: list[Stages]) -> dict[str, tuple[NodeStatus, Stages]]:
    """The members whose status says they run this round and reports a busy time per step,
    with the stages each runs."""
    busy = {}
    for m, stages in zip(cur.members, spans, strict=True):
        status = state.status.get(m.node_id)
        if status is not None and status.round == cur.round and status.state == "running" and status.busy_s > 0:
            busy[m.node_id] = status, stages
    return busy


def _busy_by_stages(busy: dict[str, tuple[NodeStatus, Stages]]) -> dict[Stages, list[float]]:
    """The judged members' busy times per step, sorted, by the stages they run: a member's
    peers are the others of its group."""
    groups: dict[Stages, list[float]] = {}
    for status, stages in busy.values():
        groups.setdefault(stages, []).append(status.busy_s)
    for values in groups.values():
        values.sort()
    return groups


def _maybe_slow(
    busy: dict[str, tuple[NodeStatus, Stages]], peers_busy_s: dict[Stages, list[float]], factor: float
) -> list[str]:
    """The members that may be slow: busier than ``factor`` times the lowest median of others
    any member of their group can have (the group's without its largest value: leaving out a
    larger value never raises the median). Every slow member is among them, and in a healthy
    round hardly anyone else."""
    floor_s = {stages: factor * median_of_others(values, values[-1]) for stages, values in peers_busy_s.items()}
    return [node for node, (status, stages) in busy.items() if status.busy_s > floor_s[stages]]
