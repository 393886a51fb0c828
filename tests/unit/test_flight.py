"""Flight records (ftrain.contract.flight) and the verdicts drawn from them (ftrain.agents.flight_verdict):
decoding refuses what a worker directory could hold besides a record, and each verdict names
the rank the records point at — including where they cannot tell."""

from __future__ import annotations

import json

import pytest

from ftrain.agents.flight_verdict import CULPRIT, DESYNC, NONE, SLOWEST, STUCK, Stall, analyze, from_events, from_stalls
from ftrain.contract import events as ev
from ftrain.contract.flight import MAX_ENTRIES, Collective, FlightRecord

T0 = 1_000.0


def _c(seq: int, op: str = "gloo:all_reduce", *, size: int = 1000, done: bool = True, at: float = 0.0) -> Collective:
    return Collective(seq, "0", op, [[size]], ["Float"], done=done, enqueued_s=T0 + at if at else T0 + seq)


def _record(rank: int, entries: list[Collective], *, world: int = 3, taken_at: float = T0 + 100) -> FlightRecord:
    return FlightRecord(rank, 100 + rank, taken_at, entries, {"0": list(range(world))})


def test_a_record_round_trips_and_keeps_the_newest_entries_of_each_group():
    record = _record(0, [_c(s) for s in range(1, 50)] + [Collective(1, "1", "gloo:broadcast", [[4]], ["Byte"])])
    back = FlightRecord.decode(record.encode())
    assert back == record
    tail = back.tail(3)
    assert [(e.group, e.seq) for e in tail.entries] == [("0", 47), ("0", 48), ("0", 49), ("1", 1)]


@pytest.mark.parametrize(
    "damage, named",
    [
        (lambda d: d.update(rank="0"), "rank"),
        (lambda d: d.update(pid=True), "pid"),
        (lambda d: d.update(taken_at=float("nan")), "taken_at"),
        (lambda d: d["entries"][0].update(seq=-1), "entries[0].seq"),
        (lambda d: d["entries"][0].update(state="lost"), "entries[0].state"),
        (lambda d: d["entries"][0].update(sizes=[[1, -2]]), "entries[0].sizes"),
        (lambda d: d["entries"][0].update(op="x" * 300), "entries[0].op"),
        (lambda d: d["entries"][0].update(done="yes"), "entries[0].done"),
        (lambda d: d.update(groups={"0": ["a"]}), "groups"),
        (lambda d: d.update(entries=[d["entries"][0]] * (MAX_ENTRIES + 1)), "entries"),
        (lambda d: d.update(entries={}), "entries"),
    ],
)
def test_a_record_with_one_wrong_field_is_refused_whole_naming_it(damage, named):
    data = _record(0, [_c(1)]).to_dict()
    damage(data)
    with pytest.raises(ValueError, match=named.replace("[", r"\[").replace("]", r"\]")):
        FlightRecord.decode(json.dumps(data))


def test_not_an_object_and_an_oversized_record_are_refused():
    with pytest.raises(ValueError):
        FlightRecord.decode(b"[1, 2]")
    with pytest.raises(ValueError, match="bytes"):
        FlightRecord.decode(b" " * (9 << 20))


def test_the_rank_that_never_entered_the_collective_the_others_wait_in_is_the_culprit():
    done = [_c(s) for s in range(1, 10)]
    records = {
        0: _record(0, [*done, _c(10, done=False)]),
        1: _record(1, done),  # alive, its last collective done: it is elsewhere
        2: _record(2, [*done, _c(10, done=False, at=12.0)]),
    }
    v = analyze(records)
    assert (v.kind, v.ranks, v.seq, v.waiting) == (CULPRIT, [1], 10, [0, 2])
    assert v.line.startswith("rank 1 never entered collective #10 gloo:all_reduce [1000] Float on group 0")
    assert "ranks 0,2 wait for 90.0 s" in v.line  # from the oldest waiter's entry to when the records were taken


def test_a_frozen_rank_without_a_record_is_named_by_its_silence():
    waiting = [_c(s) for s in range(1, 5)] + [_c(5, done=False)]
    v = analyze({0: _record(0, waiting), 2: _record(2, waiting)}, frozen=[1], missing=[1])
    assert (v.kind, v.ranks, v.waiting, v.seq) == (CULPRIT, [1], [0, 2], 5)
    assert "rank 1 is frozen" in v.line and "#5" in v.line
    # a member no node recorded, not known to be frozen, is still the only one not seen in it
    v = analyze({0: _record(0, waiting), 2: _record(2, waiting)})
    assert (v.kind, v.ranks) == (CULPRIT, [1]) and "not seen in" in v.line and "no record of theirs" in v.line


def test_every_member_inside_the_collective_is_frozen_inside_or_stuck():
    inside = [_c(1), _c(2, done=False)]
    records = {r: _record(r, inside) for r in range(3)}
    v = analyze(records, frozen=[2])
    assert (v.kind, v.ranks, v.waiting) == (CULPRIT, [2], [0, 1]) and "frozen inside collective #2" in v.line
    v = analyze(records)
    assert v.kind == STUCK and v.ranks == [] and "itself is stuck" in v.line


def test_a_desync_is_named_at_the_first_sequence_number_where_ranks_disagree():
    same = [_c(s) for s in range(1, 8)]
    odd = Collective(8, "0", "gloo:all_reduce", [[2]], ["Float"], done=False, enqueued_s=T0 + 8)
    records = {
        0: _record(0, [*same, _c(8, "gloo:all_gather", size=4, done=False)]),
        1: _record(1, [*same, odd]),
        2: _record(2, [*same, _c(8, "gloo:all_gather", size=4, done=False)]),
    }
    v = analyze(records)
    assert (v.kind, v.ranks, v.seq) == (DESYNC, [1], 8)
    assert "ranks 0,2 ran gloo:all_gather [4] Float; rank 1 ran gloo:all_reduce [2] Float" in v.line
    # two ranks, two stories: no majority, both are named
    v = analyze({0: records[0], 1: records[1]})
    assert v.kind == DESYNC and v.ranks == [0, 1] and "no majority" in v.line


def test_rooted_ops_differ_in_inputs_without_a_desync():
    root = Collective(1, "0", "gloo:scatter", [[3, 20]], ["Byte"], enqueued_s=T0)
    leaf = Collective(1, "0", "gloo:scatter", [], [], enqueued_s=T0)
    assert analyze({0: _record(0, [root], world=2), 1: _record(1, [leaf], world=2)}).kind != DESYNC


def test_with_nothing_in_flight_the_rank_that_arrives_last_is_the_slowest():
    records = {r: _record(r, [_c(s, at=s + (0.3 if r == 2 else 0.01 * r)) for s in range(1, 30)]) for r in range(3)}
    v = analyze(records)
    assert v.kind == SLOWEST and v.ranks == [2] and "last to arrive at 20 of the 20 newest" in v.line, v.line
    assert "by 0.300 s on average" in v.line  # after the first to arrive


def test_no_usable_record_says_why():
    off = FlightRecord(0, 5, T0, [], available=False)
    assert analyze({0: off}).kind == NONE and "flight_recorder_entries" in analyze({0: off}).line
    assert analyze({0: off}, frozen=[0]).ranks == [0]


def test_the_event_log_merges_every_nodes_records_of_a_round_and_skips_bad_ones():
    waiting = [_c(1), _c(2, done=False)]
    a = ev.EventLog(rank=-1).emit(
        ev.Hang(
            node="a",
            worker_round=4,
            why="no heartbeat",
            local_ranks=[0],
            stacks={},
            flight={"0": _record(0, waiting).to_dict()},
            missing={"1": "stopped"},
            frozen=[1],
        )
    )
    b = ev.EventLog(rank=-1).emit(
        ev.Hang(
            node="b",
            worker_round=4,
            why="round formed after a hang elsewhere",
            local_ranks=[],
            stacks={},
            flight={"2": _record(2, waiting).to_dict(), "3": {"rank": "x"}},
        )
    )
    failed = ev.EventLog(rank=5, round_=7).emit(ev.FlightRecorded(record=_record(5, [_c(1)]).to_dict(), why="boom"))
    [four, seven] = from_events([a, b, failed, {"event": "hang", "worker_round": 4}])
    assert four.round == 4 and sorted(four.records) == [0, 2] and four.frozen == {1} and four.nodes == ["a", "b"]
    assert len(four.problems) == 1 and "rank 3" in four.problems[0]
    v = four.verdict()
    assert (v.kind, v.ranks, v.waiting) == (CULPRIT, [1], [0, 2])
    assert seven.round == 7 and list(seven.records) == [5]


def test_ranks_that_wait_in_different_collectives_each_for_the_other_are_a_desync():
    """The issue's stall: rank 1's background thread in the tier group's all_gather (its main
    thread waiting for that thread), rank 0 in the training group's all_reduce."""
    groups = {"0": [0, 1], "2": [0, 1]}
    train = [_c(s) for s in range(1, 6)]
    tier = [Collective(s, "2", "gloo:all_gather", [[8]], ["Byte"], done=True, enqueued_s=T0 + s) for s in (1, 2)]
    stuck_tier = Collective(3, "2", "gloo:all_gather", [[8]], ["Byte"], done=False, enqueued_s=T0 + 6.5)
    records = {
        0: FlightRecord(0, 100, T0 + 100, [*train, *tier, _c(6, done=False)], groups),
        1: FlightRecord(1, 101, T0 + 100, [*train, *tier, stuck_tier], groups),
    }
    v = analyze(records, where={0: "node a, host h1", 1: "node b, host h2"})
    assert (v.kind, v.ranks, v.seq, v.group, v.waiting) == (DESYNC, [1], 6, "0", [0]), v
    assert "the ranks wait in different collectives" in v.line
    assert "rank 0 (node a, host h1) in #6 gloo:all_reduce [1000] Float on group 0 for 94.0 s" in v.line
    assert "rank 1 (node b, host h2) in #3 gloo:all_gather [8] Byte on group 2" in v.line
    # when the other one waits for a frozen rank instead, it is not a desync: the frozen one is at fault
    assert analyze(records, frozen=[1]).kind == CULPRIT
    # nor when the absent rank waits in nothing (it is elsewhere: the culprit)
    records[1] = FlightRecord(1, 101, T0 + 100, [*train, *tier], groups)
    v = analyze(records, where={1: "node b, host h2"})
    assert v.kind == CULPRIT and v.line.startswith("rank 1 (node b, host h2) never entered collective #6"), v.line


def test_the_merged_verdict_names_the_node_and_host_of_each_rank_at_fault():
    waiting = [_c(1), _c(2, done=False)]
    events = [
        ev.EventLog(rank=-1).emit(ev.NodeHost(node="a", host="10.0.0.1", hostname="host-a")),
        ev.EventLog(rank=-1).emit(ev.NodeHost(node="b", host="10.0.0.2", hostname="10.0.0.2")),
        ev.EventLog(rank=1, round_=4).emit(ev.WorkerStarted(world_size=2, strategy="ddp", node="b", local_rank=0)),
        ev.EventLog(rank=-1).emit(
            ev.Hang(
                node="a",
                worker_round=4,
                why="a hang reported by b",
                local_ranks=[],
                stacks={},
                flight={"0": _record(0, waiting, world=2).to_dict()},
            )
        ),
        ev.EventLog(rank=-1).emit(
            ev.Hang(
                node="b",
                worker_round=4,
                why="no heartbeat",
                local_ranks=[0],
                stacks={},
                missing={"1": "stopped"},
                frozen=[1],
            )
        ),
    ]
    [four] = from_events(events)
    assert four.where() == {0: "node a, host 10.0.0.1", 1: "node b, host 10.0.0.2"}
    v = four.verdict()
    assert (v.kind, v.ranks, v.waiting, v.seq) == (CULPRIT, [1], [0], 2)
    assert v.line.startswith("rank 1 (node b, host 10.0.0.2) is frozen"), v.line
    assert "collective #2 gloo:all_reduce [1000] Float on group 0, in which rank 0 waits" in v.line


def test_the_statuses_stalled_ranks_give_the_round_wide_view():
    where = {0: "node a", 1: "node b"}
    now = T0 + 10
    same = [
        Stall(0, "waiting", T0, 12, "0", "gloo:all_gather [2] Double"),
        Stall(1, "waiting", T0, 12, "0", "gloo:all_reduce [1] Float"),
    ]
    v = from_stalls(same, now=now, where=where)
    assert (v.kind, v.seq, v.group) == (DESYNC, 12, "0") and "desync at collective #12 on group 0" in v.line
    assert "rank 1 (node b) waits in gloo:all_reduce [1] Float" in v.line
    apart = [
        Stall(0, "waiting", T0, 12, "0", "gloo:all_reduce [1] Float"),
        Stall(1, "waiting", T0 + 1, 3, "2", "gloo:all_gather"),
    ]
    v = from_stalls(apart, now=now, where=where)
    assert v.kind == DESYNC and "wait in different collectives" in v.line and "for 10.0 s" in v.line
    frozen = [Stall(0, "waiting", T0, 12, "0", "gloo:all_reduce [1] Float"), Stall(1, "frozen", T0)]
    v = from_stalls(frozen, now=now, where=where)
    assert (v.kind, v.ranks, v.waiting) == (CULPRIT, [1], [0])
    assert (
        v.line
        == "rank 1 (node b) is frozen; waiting: rank 0 (node a) in #12 gloo:all_reduce [1] Float on group 0 for 10.0 s"
    )
    together = [Stall(r, "waiting", T0, 12, "0", "gloo:all_reduce [1] Float") for r in (0, 1)]
    assert from_stalls(together, now=now).kind == STUCK
    assert from_stalls([], now=now).kind == NONE


def test_a_scripts_workers_get_the_recorder_unless_an_environment_sets_a_size():
    from ftrain.contract.flight import DEFAULT_ENTRIES, script_recorder_env

    assert script_recorder_env({"PATH": "/bin"}, {}) == {"TORCH_FR_BUFFER_SIZE": str(DEFAULT_ENTRIES)}
    assert script_recorder_env({}, {"TORCH_FR_BUFFER_SIZE": "0"}) == {}  # the user's 0: off
    assert script_recorder_env({"TORCH_NCCL_TRACE_BUFFER_SIZE": "50"}, {}) == {}
