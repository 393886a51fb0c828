"""The hang rule for collectives (ftrain.agents.supervision), on a fake clock: a rank inside one
collective for over the hang timeout, with no step beat meanwhile, is hung in any phase —
unless somebody in its round still makes progress (a sibling, or another member by its status);
and what the agent does about it (the judge), and the in-flight fields of the "alive" datagram."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest

from ftrain.agents.heartbeat import Beat, _after_alive, parse_beat
from ftrain.agents.records import FROZEN, NO_PROGRESS, WAITING, NodeStatus, RankStall
from ftrain.agents.status import stalled_line
from ftrain.agents.supervision import (
    FROZEN_AFTER_S,
    STATUS_FRESH_S,
    collective_hangs,
    judge,
    member_moving,
    stalls,
)
from ftrain.contract.heartbeat import MAX_IN_FLIGHT_CHARS, Message

H = 5.0  #: hang_timeout_s
START = 60.0  #: start_timeout_s
NOW = 1_000.0  #: the agent's monotonic clock
WALL = 50_000.0  #: its wall clock


def beat(
    local_rank: int,
    *,
    phase: str = "training",
    stepped_ago: float = 0.5,
    alive_ago: float = 0.5,
    in_flight_ago: float | None = None,
    seq: int = 7,
    recording: bool = True,
) -> Beat:
    """A rank as its agent sees it at NOW: its last step beat, its last "alive", its oldest
    collective in flight (entered ``in_flight_ago`` seconds ago; None: none)."""
    return Beat(
        local_rank=local_rank,
        rank=10 + local_rank,
        pid=100 + local_rank,
        step=3,
        step_time_s=0.1,
        committed_step=-1,
        received_at=NOW - stepped_ago,
        phase=phase,
        alive_at=NOW - alive_ago,
        recording=recording,
        in_flight_since=NOW - in_flight_ago if in_flight_ago is not None else 0.0,
        in_flight_seq=seq if in_flight_ago is not None else -1,
        in_flight_group="0" if in_flight_ago is not None else "",
        in_flight="gloo:all_reduce [1] Float" if in_flight_ago is not None else "",
    )


def call(beats: dict[int, Beat], *, others_moving: bool = False, live: bool = True, nproc: int | None = None):
    return judge(
        beats,
        nproc_per_node=len(beats) if nproc is None else nproc,
        started_at=NOW - 100,
        now=NOW,
        hang_timeout_s=H,
        start_timeout_s=START,
        others_moving=others_moving,
        live=live,
    )


def hangs(beats: dict[int, Beat], *, others_moving: bool = False) -> list[int]:
    return collective_hangs(
        beats, nproc_per_node=len(beats), hung=[], now=NOW, hang_timeout_s=H, others_moving=others_moving
    )


@pytest.mark.parametrize("phase", ["training", "starting", "loading", "saving", "recovering"])
def test_a_rank_inside_one_collective_past_the_timeout_is_hung_in_any_phase_though_it_says_alive(phase):
    stuck = beat(0, phase=phase, stepped_ago=H + 0.2, in_flight_ago=H + 0.1)
    assert hangs({0: stuck}) == [0]
    decided = call({0: stuck})
    assert decided is not None and decided.ranks == [0] and decided.kill == []  # live: the round watchdog frees it
    assert "inside one collective" in decided.why
    restart = call({0: stuck}, live=False)
    assert restart is not None and restart.kill == [0]  # restart recovery ends the node's workers
    # just under the timeout, or with recording off: not by this rule (a non-training phase has
    # the start timeout by its step beats, which the old rule still applies)
    assert hangs({0: beat(0, phase=phase, stepped_ago=H + 0.2, in_flight_ago=H - 0.1)}) == []
    unknown = beat(0, phase=phase, stepped_ago=H + 0.2, in_flight_ago=H + 0.1, recording=False)
    assert hangs({0: unknown}) == []


def test_progress_is_not_a_hang_however_long_the_wait():
    # a collective in flight long, but the training thread stepped since (a background save's gather)
    assert hangs({0: beat(0, stepped_ago=0.3, in_flight_ago=40)}) == []
    # the oldest collective is young (many collectives completing: a long first step, a big exchange)
    assert hangs({0: beat(0, stepped_ago=30, in_flight_ago=0.2)}) == []
    # a rank waits in a collective for a sibling that computes, loads or starts (no collective in flight)
    waiter = beat(0, phase="starting", stepped_ago=30, in_flight_ago=30)
    assert hangs({0: waiter, 1: beat(1, phase="starting", stepped_ago=30)}) == []
    assert call({0: waiter, 1: beat(1, phase="starting", stepped_ago=30)}) is None
    # ... or for another member whose status shows a rank making progress
    assert hangs({0: waiter}, others_moving=True) == []
    assert call({0: waiter}, others_moving=True) is None
    # a sibling not yet heard from in this round is starting: it is waited for
    assert (
        collective_hangs({0: waiter}, nproc_per_node=2, hung=[], now=NOW, hang_timeout_s=H, others_moving=False) == []
    )


def test_when_every_rank_waits_each_is_hung_and_none_is_killed_under_live_recovery():
    # the stall: one rank's background thread in the tier group's all_gather while its
    # main thread waits for it; its sibling in the training group's all_reduce
    a = beat(0, stepped_ago=H + 1, in_flight_ago=H + 0.5, seq=12)
    b = beat(1, stepped_ago=H + 1, in_flight_ago=0.6 * H, seq=3)  # entered later: over half the timeout
    assert hangs({0: a, 1: b}) == [0]
    decided = call({0: a, 1: b})
    assert decided is not None and decided.ranks == [0, 1] and decided.kill == []  # both reported, neither ended
    # a frozen sibling (silent) counts as not moving; it is the one ended
    frozen = beat(1, stepped_ago=H + 1, alive_ago=H + 1)
    decided = call({0: a, 1: frozen})
    assert decided is not None and decided.kill == [1] and decided.ranks == [0, 1]


def test_stuck_outside_any_collective_is_ended_and_without_recording_the_old_deadlock_rule_stays():
    outside = beat(0, stepped_ago=H + 1)  # alive, in no collective, past the training limit
    decided = call({0: outside})
    assert decided is not None and decided.kill == [0] and "in no collective" in decided.why
    # a waiter for a member that still moves is left alone (that member's limit decides)
    assert call({0: beat(0, stepped_ago=H + 1, in_flight_ago=H + 1)}, others_moving=True) is None
    # recording off: with nobody frozen, twice the timeout, then every hung rank
    blind = {0: beat(0, stepped_ago=H + 1, recording=False)}
    assert call(blind) is None
    blind = {0: beat(0, stepped_ago=2 * H + 1, recording=False)}
    decided = call(blind)
    assert decided is not None and decided.kill == [0]


def test_what_a_node_publishes_and_how_another_reads_it():
    beats = {
        0: beat(0, stepped_ago=3, in_flight_ago=2.6, seq=12),  # over half the timeout: waiting
        1: beat(1, alive_ago=FROZEN_AFTER_S + 0.1),  # silent: frozen
        2: beat(2, stepped_ago=H + 1),  # past its limit (hung), in no collective
        3: beat(3, stepped_ago=0.1, in_flight_ago=0.1),  # moving
    }
    out = stalls(beats, [2], now=NOW, now_wall=WALL, hang_timeout_s=H)
    assert [(s.rank, s.why) for s in out] == [(10, WAITING), (11, FROZEN), (12, NO_PROGRESS)]
    assert out[0].seq == 12 and out[0].group == "0" and out[0].since == pytest.approx(WALL - 2.6)
    assert out[0].what == "gloo:all_reduce [1] Float"

    def status(*stalled: int, round_: int = 4, age_s: float = 0.5, state: str = "running") -> NodeStatus:
        return NodeStatus(
            round=round_,
            state=state,
            updated_at=WALL - age_s,
            stalled=[RankStall(r, WAITING, WALL - 3, 12, "0") for r in stalled],
        )

    def moving(s: NodeStatus | None) -> bool:
        return member_moving(s, round_=4, nproc_per_node=2, now_wall=WALL)

    assert not moving(status(2, 3))  # both of its ranks stalled
    assert moving(status(2))  # one still moves
    assert moving(status(2, 2))  # the same rank twice is one rank
    assert moving(None) and moving(status(2, 3, round_=3)) and moving(status(2, 3, state="waiting"))
    assert moving(status(2, 3, age_s=STATUS_FRESH_S + 1))  # stale: says nothing about now


def alive(seq: int = -1, age_s: float = 0.0, **extra) -> bytes:
    fields = {"kind": "alive", "round": 2, "rank": 0, "local_rank": 0, "pid": 4242, "recording": True}
    if seq >= 0:
        fields.update(in_flight_seq=seq, in_flight_group="0", in_flight="gloo:all_reduce [1] Float", in_flight_s=age_s)
    return json.dumps({**fields, **extra}).encode()


def test_the_alive_datagram_carries_the_collective_in_flight_bounded_and_checked():
    msg = Message(kind="alive", round=2, rank=0, local_rank=0, pid=4242, recording=True, in_flight_seq=9)
    long = Message.decode(
        json.dumps({**json.loads(msg.encode()), "in_flight": "x" * 5000, "in_flight_group": "g" * 900}).encode()
    )
    assert len(long.in_flight) == MAX_IN_FLIGHT_CHARS and len(long.in_flight_group) == MAX_IN_FLIGHT_CHARS
    assert Message.decode(alive(7, 2.5)).in_flight_s == 2.5
    for bad, named in [
        ({"in_flight_seq": 1.5}, "in_flight_seq"),
        ({"in_flight_seq": -2}, "in_flight_seq"),
        ({"in_flight_s": float("inf")}, "in_flight_s"),
        ({"in_flight_s": 1e12}, "in_flight_s"),
        ({"in_flight_s": -1}, "in_flight_s"),
        ({"recording": "yes"}, "recording"),
        ({"in_flight": 3}, "in_flight"),
        ({"recording": False}, "recording"),  # an in-flight collective from a worker that records none
        ({"in_flight_seq": -1}, "need a collective"),  # an age or a name without a collective
    ]:
        with pytest.raises(ValueError, match=named):
            Message.decode(alive(7, 2.5, **bad))
    # an older worker's datagram (no such fields) says nothing is known
    old = Message.decode(json.dumps({"kind": "alive", "round": 2, "local_rank": 0, "pid": 4242}).encode())
    assert not old.recording and old.in_flight_seq == -1


def test_the_agent_keeps_the_earliest_sighting_of_one_collective():
    _, _, first = parse_beat(alive(7, 1.0), 100.0)
    assert first.in_flight_since == 99.0
    _, _, later = parse_beat(alive(7, 1.5), 101.0)  # a delayed datagram: its age is too short
    kept = _after_alive(first, later)
    assert kept.in_flight_since == 99.0 and kept.alive_at == 101.0
    _, _, other = parse_beat(alive(8, 0.1), 102.0)  # the next collective: its own sighting
    assert _after_alive(kept, other).in_flight_since == pytest.approx(101.9)
    _, _, none = parse_beat(alive(), 103.0)
    assert _after_alive(kept, none).in_flight_seq == -1 and _after_alive(kept, none).in_flight_since == 0.0


def test_ftrain_status_judges_every_nodes_stalled_ranks_together():
    def node(name: str, *stalled: RankStall, live: bool = True, worker_round: int = 3) -> dict:
        return {
            "node": name,
            "live": live,
            "host": f"10.0.0.{ord(name) - 96}",
            "worker_round": worker_round,
            "stalled": [dataclasses.asdict(x) for x in stalled],
        }

    now = time.time()
    gather = RankStall(0, WAITING, now - 7, 12, "0", "gloo:all_gather [2] Double")
    reduce = RankStall(1, WAITING, now - 7, 12, "0", "gloo:all_reduce [1] Float")
    s = {"round": 3, "nodes": [node("a", gather), node("b", reduce)]}
    line = stalled_line(s)
    assert line.startswith("STALLED in round 3: desync at collective #12 on group 0"), line
    assert "rank 1 (node b, host 10.0.0.2) waits in gloo:all_reduce [1] Float" in line
    s = {"round": 3, "nodes": [node("a", gather), node("b", RankStall(1, FROZEN, now - 6))]}
    assert stalled_line(s).startswith("STALLED in round 3: rank 1 (node b, host 10.0.0.2) is frozen; waiting: rank 0")
    # a node of another round, a lost one, or an entry that is not one are not judged
    s = {"round": 3, "nodes": [node("a", gather, worker_round=2), node("b", reduce, live=False)]}
    assert stalled_line(s) == ""
    s = {"round": 3, "nodes": [{**node("a"), "stalled": [{"rank": 0}]}]}
    assert stalled_line(s) == ""
    assert stalled_line({"round": 3, "nodes": [node("a")]}) == ""
