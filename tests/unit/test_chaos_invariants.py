"""The chaos invariant on loads judges each load against the commit it actually read."""

from __future__ import annotations

from chaos.invariants import loads_were_committed


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
