"""The chaos invariants on loads: each load is judged against the commit it actually read, and no
round goes on from a step older than the newest commit before it."""

from __future__ import annotations

from ftrain.chaos.invariants import (
    cut_off_nodes_rejoined,
    faults_handled,
    loads_were_committed,
    no_commit_from_a_stale_round,
    one_round_at_a_time,
    resumed_from_the_newest_commit,
)


def _ev(event: str, t: float, **fields):
    return {"event": event, "time": t, "rank": fields.pop("rank", 0), "round": fields.pop("round", 0), **fields}


def test_a_step_recommitted_after_chaos_damaged_it_may_be_loaded():
    # seed 3 of the soak: step 2400 committed (round 32), truncated by chaos, refused (round 33),
    # saved and committed again (round 33), and that new commit loaded by round 35
    first, second = 100.0, 130.0
    events = [
        _ev("ckpt_committed", 100.5, step=2400, round=32),
        _ev("chaos_fault", 110.0, kind="ckpt_corrupt", ckpt_step=2400, ckpt_created_time=first),
        _ev("ckpt_corrupt", 120.0, step=2400, round=33),
        _ev("ckpt_committed", 130.5, step=2400, round=33),
        _ev("ckpt_loaded", 150.0, step=2400, round=35, created_time=second),
    ]
    check = loads_were_committed(events, {(2400, first): 100.6, (2400, second): 130.6})
    assert check.ok, check.detail


def test_loading_the_commit_chaos_damaged_fails():
    first = 100.0
    events = [
        _ev("chaos_fault", 110.0, kind="ckpt_corrupt", ckpt_step=2400, ckpt_created_time=first),
        _ev("ckpt_loaded", 150.0, step=2400, round=35, created_time=first),
    ]
    check = loads_were_committed(events, {(2400, first): 100.6})
    assert not check.ok and "after chaos had corrupted" in check.detail


def test_a_load_of_a_commit_nobody_saw_fails():
    events = [_ev("ckpt_loaded", 150.0, step=300, round=4, created_time=140.0)]
    check = loads_were_committed(events, {(300, 90.0): 91.0})
    assert not check.ok and "not committed before the load" in check.detail


def test_a_commit_seen_only_in_the_workers_events_counts():
    events = [
        _ev("ckpt_committed", 140.5, step=300, round=3),
        _ev("ckpt_loaded", 150.0, step=300, round=4, created_time=140.0),
        _ev("ckpt_loaded", 150.1, step=300, round=4, created_time=140.0, rank=1),
    ]
    check = loads_were_committed(events, {})
    assert check.ok and "1 load(s)" in check.detail


def test_a_round_that_went_on_from_before_the_newest_commit_fails():
    # a rank whose restore failed once claimed its fresh trainer as step 0: the next round
    # would have trained from scratch with step 300 on storage
    events = [
        _ev("round_formed", 200.0, new_round=5),
        _ev("live_restored", 200.2, round=5, step=0, source="live_peer"),
        _ev("live_restored", 200.2, round=5, step=0, source="live_peer", rank=1),
    ]
    check = resumed_from_the_newest_commit(events, {(300, 150.0): 150.5})
    assert not check.ok and "round 5 went on from step 0 although step 300 was committed" in check.detail


def test_rounds_from_the_newest_commit_or_a_newer_replica_pass():
    events = [
        _ev("round_formed", 100.0, new_round=1),
        _ev("live_restored", 100.5, round=1, step=0, source="fresh"),
        _ev("round_formed", 200.0, new_round=2),
        _ev("resumed", 200.4, round=2, step=300),  # a storage load inside a live restore
        _ev("live_restored", 200.5, round=2, step=300, source="storage"),
        _ev("round_formed", 300.0, new_round=3),
        _ev("live_restored", 300.1, round=3, step=341, source="live_peer"),  # ahead of the commit
    ]
    check = resumed_from_the_newest_commit(events, {(300, 150.0): 150.5, (400, 305.0): 305.5})
    assert check.ok and "3 round(s)" in check.detail, check.detail


def test_going_back_past_a_damaged_or_refused_commit_passes():
    events = [
        _ev("chaos_fault", 160.0, kind="ckpt_corrupt", ckpt_step=300, ckpt_created_time=150.0),
        _ev("ckpt_corrupt", 170.0, step=250),
        _ev("round_formed", 200.0, new_round=4),
        _ev("resumed", 200.5, round=4, step=200),
    ]
    commits = {(200, 100.0): 100.5, (250, 120.0): 120.5, (300, 150.0): 150.5}
    check = resumed_from_the_newest_commit(events, commits)
    assert check.ok, check.detail


def _step(step: int, t: float, round_: int) -> dict:
    return {"step": step, "time": t, "round": round_}


def test_two_rounds_training_at_once_and_a_stale_commit_are_caught():
    # round 2 formed without the partitioned node, which went on training (and committing) alone
    metrics = [_step(10, 1.0, 1), _step(11, 2.0, 2), _step(11, 2.5, 1), _step(12, 3.0, 2)]
    events = [_ev("ckpt_committed", 1.5, step=10, round=1), _ev("ckpt_committed", 2.6, step=11, round=1)]
    split = one_round_at_a_time(metrics)
    assert not split.ok and "round 1 completed step 11" in split.detail
    stale = no_commit_from_a_stale_round(events, metrics)
    assert not stale.ok and "round 1 committed step 11 after round 2 trained" in stale.detail
    healthy = [m for m in metrics if not (m["round"] == 1 and m["step"] == 11)]
    assert one_round_at_a_time(healthy).ok
    assert no_commit_from_a_stale_round(events[:1], healthy).ok


def test_a_cut_off_node_must_be_back_in_a_later_round_unless_it_never_left():
    cut = _ev("chaos_fault", 10.0, kind="partition", node="b", rank=-2)
    back = _ev("chaos_node_back", 16.0, node="b", rank=-2)
    left = _ev("round_formed", 12.0, new_round=2, members=["a"], rank=-1)
    rejoined = _ev("round_formed", 18.0, new_round=3, members=["a", "b"], rank=-1)
    assert cut_off_nodes_rejoined([cut, left, back, rejoined]).ok
    check = cut_off_nodes_rejoined([cut, left, back])
    assert not check.ok and "not in any round formed after the heal" in check.detail
    assert cut_off_nodes_rejoined([cut, back]).ok  # ridden out with the node in: nothing to rejoin
    assert not cut_off_nodes_rejoined([cut, left]).ok  # never healed


def test_a_lasting_fault_says_at_its_end_whether_it_was_refused():
    started = _ev("chaos_fault", 10.0, kind="pause_between_fence_and_commit", node="a", rank=-2)
    done = _ev("chaos_fault_done", 20.0, kind="pause_between_fence_and_commit", refused=True, rank=-2)
    assert faults_handled([started, done]).ok
    assert not faults_handled([started]).ok
