"""The phases of one live recovery (``ftrain agent --recovery live``), read from the event log.

A live recovery starts no process and loads nothing from storage on the critical path, so its
marks are other events than a restart's (``bench/recovery.py`` reads those): the agents'
reaction, the new round's ``workers_reassigned``, and each rank's ``live_restored`` (which says
how long joining the round's process group and building the trainer took, and how long getting
the state took). The columns of the recovery table are filled as:

- detect: fault -> an agent's first reaction (workers_exited, hang, round_formed);
- rendezvous: -> the last agent assigned the new round to its workers (workers_reassigned);
- launcher: none (no process is started);
- worker start: -> the last rank has joined the round's process group and built its trainer;
- ckpt load: -> the last rank has its state (a live peer, its own memory, or storage: ``source``);
- first step: -> rank 0's first metrics line with a step past the restored one.
"""

from __future__ import annotations

from typing import Any

from ftrain.contract.events import Event

REACTIONS = (Event.WORKERS_EXITED, Event.HANG, Event.ROUND_FORMED)


def first_live_step_after(
    since: float, events: list[dict[str, Any]], metrics: list[dict[str, Any]]
) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """(rank 0's ``live_restored`` event, metrics line) of the first step completed after a live
    restore that came after ``since``; None if there is none yet."""
    restored = sorted(
        (e for e in events if e.get("event") == Event.LIVE_RESTORED and e.get("rank") == 0 and e["time"] > since),
        key=lambda e: e["time"],
    )
    for line in sorted((m for m in metrics if restored and m["time"] > restored[0]["time"]), key=lambda m: m["time"]):
        latest = [e for e in restored if e["time"] < line["time"]][-1]
        if line["step"] > latest["step"]:
            return latest, line
    return None


def agents_reaction(fault: float, events: list[dict[str, Any]], round_: int) -> tuple[dict[str, Any], float | None]:
    """(the agents' first reaction to ``fault``, or {}; when the last agent assigned round
    ``round_`` to its workers, or None)."""
    reactions = sorted(
        (e for e in events if e.get("rank") == -1 and e.get("event") in REACTIONS and e["time"] >= fault),
        key=lambda e: e["time"],
    )
    reassigned = [
        e["time"] for e in events if e.get("event") == Event.WORKERS_REASSIGNED and e.get("worker_round") == round_
    ]
    return (reactions[0] if reactions else {}), max(reassigned, default=None)


def live_marks(fault: float, events: list[dict[str, Any]], metrics: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The marks of the first live recovery after ``fault`` (as ``bench.recovery.Marks`` fields),
    or None if it has not completed."""
    found = first_live_step_after(fault, events, metrics)
    if found is None:
        return None
    restored0, line = found
    generation = [
        e
        for e in events
        if e.get("event") == Event.LIVE_RESTORED and e.get("round") == restored0["round"] and e["time"] > fault
    ]
    first, reassigned = agents_reaction(fault, events, restored0["round"])
    return {
        "fault": fault,
        "detected": first.get("time"),
        "launched": reassigned,
        "spawned": None,
        "started": max(e["time"] - e["state_s"] for e in generation),
        "resumed": max(e["time"] for e in generation),
        "first_step": line["time"],
        "detected_by": first.get("event", "") + (f" ({first['reason']})" if first.get("reason") else ""),
        "resumed_step": restored0["step"],
        "world_size": restored0["world_size"],
        "load_start_by": "live_restored (" + ",".join(sorted({e["source"] for e in generation})) + ")",
    }
