"""The phases of one live recovery of a user's loop (``ftrain.Session.run`` under ``ftrain agent
--script --recovery live``: ``bench/recovery.py``'s ``session_live`` rows), read from the agents'
event log and the marks that :mod:`bench.lib.session_loop` writes (its ``--probe-log``).

A user's loop writes no metrics lines (its session logs each round's ``live_restored``, not its
steps), so the loop's own marks, taken where it calls and leaves ``session.load``, stand in for
``ftrain worker``'s (:mod:`bench.lib.live_marks`); the columns of the recovery table are filled as:

- detect: fault -> an agent's first reaction (workers_exited, hang, round_formed);
- rendezvous: -> the last agent assigned the new round to its processes (workers_reassigned);
- launcher: none (no process is started: a warm spare takes the lost rank);
- worker start: -> the last rank of the new round entered ``session.load`` (its process group
  joined, and the loop's ``train`` rebuilt its model, DDP wrapper, optimizer and data);
- ckpt load: -> the last rank's ``session.load`` returned (a live peer, its own memory, or
  storage: ``source``);
- first step: -> rank 0's first step completed past the restored one.
"""

from __future__ import annotations

import statistics
from typing import Any

from bench.lib.live_marks import agents_reaction


def _of(probes: list[dict[str, Any]], kind: str, since: float) -> list[dict[str, Any]]:
    return sorted((p for p in probes if p.get("probe") == kind and p["time"] > since), key=lambda p: p["time"])


def first_session_step_after(
    since: float, probes: list[dict[str, Any]]
) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """(rank 0's ``restored`` mark, its ``step`` mark) of the first step completed after a restore
    that came after ``since``; None if there is none yet."""
    restored = [p for p in _of(probes, "restored", since) if p["rank"] == 0]
    if not restored:
        return None
    for line in _of(probes, "step", restored[0]["time"]):
        if line["rank"] != 0:
            continue
        latest = [p for p in restored if p["time"] < line["time"]][-1]
        if line["step"] > latest["step"]:
            return latest, line
    return None


def session_marks(fault: float, events: list[dict[str, Any]], probes: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The marks of the first recovery after ``fault`` (as ``bench.lib.restart_marks.Marks``
    fields), or None if it has not completed."""
    found = first_session_step_after(fault, probes)
    if found is None:
        return None
    restored0, line = found
    generation = [p for p in _of(probes, "restored", fault) if p["round"] == restored0["round"]]
    load_starts = [p["time"] for p in _of(probes, "load_started", fault) if p["round"] == restored0["round"]]
    first, reassigned = agents_reaction(fault, events, restored0["round"])
    return {
        "fault": fault,
        "detected": first.get("time"),
        "launched": reassigned,
        "spawned": None,
        "started": max(load_starts, default=None),
        "resumed": max(p["time"] for p in generation),
        "first_step": line["time"],
        "detected_by": first.get("event", "") + (f" ({first['reason']})" if first.get("reason") else ""),
        "resumed_step": restored0["step"],
        "world_size": restored0["world_size"],
        "load_start_by": "session.load (" + ",".join(sorted({p["source"] for p in generation})) + ")",
    }


def steady_step_s(probes: list[dict[str, Any]], before: float) -> float | None:
    """Median ``step_time_s`` of rank 0 at world size 2 before ``before``, the first 10 steps left out."""
    times = [
        p["step_time_s"]
        for p in probes
        if p.get("probe") == "step"
        and p["time"] < before
        and p["rank"] == 0
        and p["world_size"] == 2
        and p["step"] > 10
        and p.get("step_time_s") is not None
    ]
    return round(statistics.median(times), 5) if times else None
