"""bench/lib/session_marks.py with bench/lib/live_marks.py: the phases of a user loop's live
recovery, read from the job's events (the agents', and the ``live_restored`` the session logs)
and the loop's step marks (no processes: the lines are written here)."""

from __future__ import annotations

from typing import Any

from bench.lib.live_marks import first_live_step_after, live_marks
from bench.lib.restart_marks import Marks
from bench.lib.session_marks import steady_step_s, step_lines

FAULT = 100.0


def _step(t: float, rank: int, step: int, world_size: int = 2, **fields: Any) -> dict[str, Any]:
    return {
        "time": t,
        "probe": "step",
        "pid": 10 + rank,
        "rank": rank,
        "world_size": world_size,
        "step": step,
        **fields,
    }


def _event(t: float, event: str, rank: int = -1, **fields: Any) -> dict[str, Any]:
    return {"time": t, "event": event, "rank": rank, **fields}


def _restored(t: float, rank: int, round_: int, step: int, source: str, state_s: float, **fields: Any) -> dict:
    return _event(t, "live_restored", rank, round=round_, step=step, source=source, state_s=state_s, **fields)


def _before_the_fault() -> list[dict[str, Any]]:
    return [_step(95.0 + s / 100, 0, s, step_time_s=0.02) for s in range(1, 51)]


def test_a_worker_kill_gives_every_phase_from_the_events_and_the_loops_step_marks():
    events = [
        _event(99.0, "round_formed", reason="start"),
        _restored(90.0, 0, 1, 0, "fresh", 0.01, world_size=2),
        _event(100.1, "workers_exited"),
        _event(100.2, "round_formed", reason="worker_exit"),
        _event(100.25, "workers_reassigned", worker_round=2),
        _event(100.3, "workers_reassigned", worker_round=2),
        _restored(100.6, 1, 2, 50, "live_peer", 0.1, world_size=2),  # entered session.load at 100.5
        _restored(100.7, 0, 2, 50, "live_peer", 0.3, world_size=2),  # at 100.4
    ]
    probes = [*_before_the_fault(), _step(100.75, 1, 51), _step(100.8, 0, 51)]  # rank 1's line: not the mark
    marks = Marks(**live_marks(FAULT, events, step_lines(probes)))
    assert marks.phases() == {
        "detect": 0.1,
        "rendezvous": 0.2,
        "launcher": None,
        "worker_start": 0.2,
        "ckpt_load": 0.2,
        "first_step": 0.1,
    }
    assert marks.total_s == 0.8 and marks.world_size == 2 and marks.resumed_step == 50
    assert marks.detected_by == "workers_exited" and marks.load_start_by == "live_restored (live_peer)"
    assert steady_step_s(probes, FAULT) == 0.02


def test_no_marks_until_rank_0_completes_a_step_past_the_restored_one():
    events = [_restored(102.0, 0, 2, 50, "memory", 0.05, world_size=1)]
    probes = _before_the_fault()
    assert live_marks(FAULT, events, step_lines(probes)) is None
    probes.append(_step(102.1, 0, 50, world_size=1))  # not past the restored step
    assert first_live_step_after(FAULT, events, step_lines(probes)) is None
    probes.append(_step(102.2, 0, 51, world_size=1))
    restored, line = first_live_step_after(FAULT, events, step_lines(probes))
    assert (restored["round"], line["step"]) == (2, 51)
    marks = live_marks(FAULT, [_event(101.9, "round_formed", reason="node_lost"), *events], step_lines(probes))
    assert marks["world_size"] == 1 and marks["detected_by"] == "round_formed (node_lost)"
    assert marks["launched"] is None  # no workers_reassigned: folded into the next phase
