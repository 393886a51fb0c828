"""bench/lib/session_marks.py: the phases of a user loop's live recovery, read from the agents'
events and the loop's probe lines (no processes: the lines are written here)."""

from __future__ import annotations

from typing import Any

from bench.lib.restart_marks import Marks
from bench.lib.session_marks import first_session_step_after, session_marks, steady_step_s

FAULT = 100.0


def _probe(t: float, kind: str, rank: int, round_: int, world_size: int = 2, **fields: Any) -> dict[str, Any]:
    return {
        "time": t,
        "probe": kind,
        "pid": 10 + rank,
        "rank": rank,
        "world_size": world_size,
        "round": round_,
        **fields,
    }


def _agent(t: float, event: str, **fields: Any) -> dict[str, Any]:
    return {"time": t, "event": event, "rank": -1, **fields}


def _before_the_fault() -> list[dict[str, Any]]:
    lines = [_probe(90.0 + r, "restored", r, 1, step=0, source="fresh") for r in (0, 1)]
    return lines + [_probe(95.0 + s / 100, "step", 0, 1, step=s, step_time_s=0.02) for s in range(1, 51)]


def test_a_worker_kill_gives_every_phase_from_the_agents_events_and_the_loops_marks():
    events = [
        _agent(99.0, "round_formed", reason="start"),
        _agent(100.1, "workers_exited"),
        _agent(100.2, "round_formed", reason="worker_exit"),
        _agent(100.25, "workers_reassigned", worker_round=2),
        _agent(100.3, "workers_reassigned", worker_round=2),
    ]
    probes = [
        *_before_the_fault(),
        _probe(100.4, "load_started", 0, 2),
        _probe(100.5, "load_started", 1, 2),
        _probe(100.6, "restored", 1, 2, step=50, source="live_peer"),
        _probe(100.7, "restored", 0, 2, step=50, source="live_peer"),
        _probe(100.75, "step", 1, 2, step=51),  # rank 1's line: not the mark
        _probe(100.8, "step", 0, 2, step=51),
    ]
    marks = Marks(**session_marks(FAULT, events, probes))
    assert marks.phases() == {
        "detect": 0.1,
        "rendezvous": 0.2,
        "launcher": None,
        "worker_start": 0.2,
        "ckpt_load": 0.2,
        "first_step": 0.1,
    }
    assert marks.total_s == 0.8 and marks.world_size == 2 and marks.resumed_step == 50
    assert marks.detected_by == "workers_exited" and marks.load_start_by == "session.load (live_peer)"
    assert steady_step_s(probes, FAULT) == 0.02


def test_no_marks_until_rank_0_completes_a_step_past_the_restored_one():
    probes = [*_before_the_fault(), _probe(102.0, "restored", 0, 2, world_size=1, step=50, source="memory")]
    assert session_marks(FAULT, [], probes) is None
    probes.append(_probe(102.1, "step", 0, 2, world_size=1, step=50))  # not past the restored step
    assert first_session_step_after(FAULT, probes) is None
    probes.append(_probe(102.2, "step", 0, 2, world_size=1, step=51))
    restored, line = first_session_step_after(FAULT, probes)
    assert (restored["round"], line["step"]) == (2, 51)
    marks = session_marks(FAULT, [_agent(102.0 - 0.1, "round_formed", reason="node_lost")], probes)
    assert marks["world_size"] == 1 and marks["detected_by"] == "round_formed (node_lost)"
    assert marks["launched"] is None and marks["started"] is None  # no event, no load_started: folded into the next
