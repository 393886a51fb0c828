"""What one node's agent reads of the other members of a round during a hang: pure functions of
a :class:`ftrain.agents.records.JobState` (the agent acts on the answers).

- :func:`others_moving`: whether another member still has a rank making progress (then the
  ranks here that wait in a collective are waiting for it, not hung: :mod:`ftrain.agents.supervision`);
- :func:`hang_reported_by`: the member that reported a hang in a round (every other node then
  dumps its workers' flight records while they still wait, whatever the recovery mode);
- :func:`others_dumped`: whether every other live member has done so (the agent that found the
  hang ends its hung workers only then, or after a deadline: ending one first lets the others'
  collectives fail, and a failed collective looks completed in torch's recorder);
- :func:`where` and :func:`stalls_of`: where each rank of a round runs (node, host) and what
  the members' statuses say about their stalled ranks, for the verdicts.

What must stay true: statuses come from etcd and are only claims; a missing, stale or foreign
one says nothing about its ranks (never "stuck"), so an agent that cannot see the others judges
by its own workers alone, and lists read from there are bounded.
"""

from __future__ import annotations

from ftrain.agents.flight_verdict import Stall
from ftrain.agents.records import FAILED, HANG, JobState, RankStall, RoundRecord
from ftrain.agents.supervision import MAX_STALLS, member_moving

MAX_PLACE_CHARS = 120


def _round(state: JobState | None, round_: int) -> RoundRecord | None:
    return state.rounds.get(round_) if state is not None else None


def others_moving(state: JobState | None, round_: int, me: str, *, now_wall: float) -> bool:
    """True unless the record of ``round_`` is at hand and every other member's fresh status
    says all its ranks are stalled (:func:`ftrain.agents.supervision.member_moving`)."""
    record = _round(state, round_)
    if state is None or record is None:
        return True
    return any(
        member_moving(
            state.status.get(m.node_id), round_=round_, nproc_per_node=record.nproc_per_node, now_wall=now_wall
        )
        for m in record.members
        if m.node_id != me
    )


def hang_reported_by(state: JobState, round_: int, me: str) -> str | None:
    """Another member that reported a hang in ``round_`` (None: none did): the first one, named
    in ``rounds/<g>/hang`` (every agent follows it), or one of the reports (the leader reads them)."""
    first = state.hangs.get(round_)
    record = state.rounds.get(round_)
    if first is not None and first != me and record is not None and any(m.node_id == first for m in record.members):
        return first
    for node, report in sorted(state.member_reports(round_).items()):
        if node != me and report.outcome == FAILED and report.reason == HANG:
            return node
    return None


def others_dumped(state: JobState | None, round_: int, me: str) -> bool:
    """Every other live member of ``round_`` says (in its status) that it dumped its workers'
    flight records for a hang of that round (a member that is gone is not waited for)."""
    record = _round(state, round_)
    if state is None or record is None:
        return False
    for m in record.members:
        if m.node_id == me or m.node_id not in state.nodes:
            continue
        status = state.status.get(m.node_id)
        if status is None or status.hang_dumped_round < round_:
            return False
    return True


def where(state: JobState | None, round_: int) -> dict[int, str]:
    """Global rank -> ``node b, host 10.0.0.2`` for every rank of ``round_`` (empty: no record)."""
    record = _round(state, round_)
    if state is None or record is None:
        return {}
    out = {}
    for node_rank, m in enumerate(record.members):
        node = state.nodes.get(m.node_id)
        place = f"node {m.node_id}, host {node.host}" if node is not None else f"node {m.node_id}"
        for local_rank in range(record.nproc_per_node):
            out[node_rank * record.nproc_per_node + local_rank] = place[:MAX_PLACE_CHARS]
    return out


def stalls_of(state: JobState | None, round_: int, me: str) -> list[Stall]:
    """The stalled ranks the other members of ``round_`` publish (their statuses of that round)."""
    record = _round(state, round_)
    if state is None or record is None:
        return []
    out = []
    for m in record.members:
        status = state.status.get(m.node_id)
        if m.node_id == me or status is None or status.round != round_:
            continue
        out += [as_stall(s) for s in status.stalled[: min(MAX_STALLS, record.nproc_per_node)]]
    return out


def as_stall(s: RankStall) -> Stall:
    return Stall(s.rank, s.why[:20], s.since, s.seq, s.group[:200], s.what[:200])
