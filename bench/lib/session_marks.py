"""The phases of one live recovery of a user's loop (``ftrain.Session.run`` under ``ftrain agent
--script --recovery live``: ``bench/recovery.py``'s ``session_live`` rows), read as ``ftrain
train``'s are (:mod:`bench.lib.live_marks`): the agents' events and each rank's ``live_restored``,
which the session logs into the job's event log as ``ftrain worker`` does. A user's loop writes
no metrics lines, so rank 0's ``step`` marks (:mod:`bench.lib.session_loop`'s ``--probe-log``)
stand in for them; the columns of the recovery table are filled as:

- detect: fault -> an agent's first reaction (workers_exited, hang, round_formed);
- rendezvous: -> the last agent assigned the new round to its processes (workers_reassigned);
- launcher: none (no process is started: a warm spare takes the lost rank);
- worker start: -> the last rank of the new round entered ``session.load`` (its process group
  joined, and the loop's ``train`` rebuilt its model, DDP wrapper, optimizer and data);
- ckpt load: -> the last rank's state was restored (a live peer, its own memory, the memory
  tier or storage: ``source``);
- first step: -> rank 0's first step completed past the restored one.
"""

from __future__ import annotations

import statistics
from typing import Any


def step_lines(probes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rank 0's ``step`` marks, as the metrics lines ``ftrain train``'s rank 0 writes."""
    return [p for p in probes if p.get("probe") == "step" and p["rank"] == 0]


def steady_step_s(probes: list[dict[str, Any]], before: float) -> float | None:
    """Median ``step_time_s`` of rank 0 at world size 2 before ``before``, the first 10 steps left out."""
    times = [
        p["step_time_s"]
        for p in step_lines(probes)
        if p["time"] < before and p["world_size"] == 2 and p["step"] > 10 and p.get("step_time_s") is not None
    ]
    return round(statistics.median(times), 5) if times else None
