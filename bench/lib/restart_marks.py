"""The phases of one restart recovery (``ftrain agent --recovery restart``, torchrun, the floor),
read from what the processes wrote: events, metrics lines and torchrun's glog lines. Pure
functions of those; the phases are defined in ``bench/recovery.py``'s docstring, and a live
recovery's in :mod:`bench.lib.live_marks`."""

from __future__ import annotations

import re
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ftrain.contract.events import Event

PHASES = ("detect", "rendezvous", "launcher", "worker_start", "ckpt_load", "first_step")
AGENT_REACTIONS = (Event.WORKERS_EXITED, Event.HANG, Event.ROUND_FORMED, Event.WORKERS_STOPPED)
TORCHRUN_REACTION = "will restart worker group"
TORCHRUN_LAUNCH = "Starting worker group"


# -- the analysis: pure functions of what was written -------------------------------------------
_GLOG = re.compile(r"^[IWEF](\d\d)(\d\d) (\d\d):(\d\d):(\d\d)(\.\d+) ")


def glog_time(text: str, year: int) -> float | None:
    """Unix time of a glog-prefixed line (``I1129 20:02:15.820000 PID file:line] ...``, local time)."""
    m = _GLOG.match(text)
    if m is None:
        return None
    month, day, hour, minute, second = (int(g) for g in m.groups()[:5])
    return time.mktime((year, month, day, hour, minute, second, 0, 0, -1)) + float(m.group(6))


def stamped(lines: Iterable[tuple[float, str]]) -> list[tuple[float, str]]:
    """(time, text) with each line's own glog time where it has one, else its arrival time."""
    out = []
    for arrived, text in lines:
        own = glog_time(text, time.localtime(arrived).tm_year)
        out.append((arrived if own is None else own, text))
    return out


def read_glog_lines(paths: Iterable[Path]) -> list[tuple[float, str]]:
    year = time.localtime().tm_year
    out = []
    for path in paths:
        with open(path, errors="replace") as fh:
            for text in fh:
                t = glog_time(text, year)
                if t is not None:
                    out.append((t, text.rstrip("\n")))
    return out


@dataclass(frozen=True, slots=True)
class Marks:
    """Wall-clock times (unix s) of one recovery; None where the run gives no such mark."""

    fault: float
    detected: float | None
    launched: float | None
    spawned: float | None
    started: float | None
    resumed: float | None
    first_step: float
    detected_by: str = ""
    resumed_step: int = -1
    world_size: int = 0
    load_start_by: str = ""  #: the event that marked the load's start (resume_started or worker_started)

    def phases(self) -> dict[str, float | None]:
        """Seconds per phase (see PHASES); a missing mark folds its phase into the next one."""
        points = (self.detected, self.launched, self.spawned, self.started, self.resumed, self.first_step)
        out: dict[str, float | None] = {}
        last = self.fault
        for name, point in zip(PHASES, points, strict=True):
            out[name] = None if point is None else round(point - last, 3)
            last = last if point is None else point
        return out

    @property
    def total_s(self) -> float:
        return round(self.first_step - self.fault, 3)


def first_step_after(
    since: float, events: list[dict[str, Any]], metrics: list[dict[str, Any]]
) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """(rank 0's ``resumed`` event, metrics line) of the first step completed after a resume that
    came after ``since``; None if there is none yet."""
    resumed = sorted(
        (e for e in events if e.get("event") == Event.RESUMED and e.get("rank") == 0 and e["time"] > since),
        key=lambda e: e["time"],
    )
    if not resumed:
        return None
    for line in sorted((m for m in metrics if m["time"] > resumed[0]["time"]), key=lambda m: m["time"]):
        latest = [e for e in resumed if e["time"] < line["time"]][-1]
        if line["step"] > latest["step"]:
            return latest, line
    return None


def _generation(
    since: float, resumed0: dict[str, Any], step_line: dict[str, Any], events: list[dict[str, Any]]
) -> tuple[float | None, float | None, str, float | None]:
    """Over the ranks of the generation that resumed (same round and world size as rank 0's
    resume, after ``since``; per rank its latest worker): (first ``worker_started``, last load
    start, the event that gave it, last ``resumed``). The load start is ``resume_started``, or
    ``worker_started`` (emitted just before the load) where workers predate that event."""

    def latest_per_rank(name: str, until: float) -> dict[int, dict[str, Any]]:
        last: dict[int, dict[str, Any]] = {}
        for e in sorted(events, key=lambda e: e["time"]):
            if (
                e.get("event") == name
                and e.get("round") == resumed0.get("round")
                and since < e["time"] <= until
                and e.get("world_size") == resumed0["world_size"]
            ):
                last[e["rank"]] = e
        return last

    started = latest_per_rank(Event.WORKER_STARTED, resumed0["time"])
    resumed = latest_per_rank(Event.RESUMED, step_line["time"])
    pids = {e["pid"] for e in started.values()}
    load_starts = [
        e["time"]
        for e in events
        if e.get("event") == Event.RESUME_STARTED and e.get("pid") in pids and since < e["time"] <= step_line["time"]
    ]
    if load_starts:
        load_start, load_start_by = max(load_starts), Event.RESUME_STARTED
    else:
        load_start, load_start_by = max((e["time"] for e in started.values()), default=None), Event.WORKER_STARTED
    return (
        min((e["time"] for e in started.values()), default=None),
        load_start,
        load_start_by,
        max((e["time"] for e in resumed.values()), default=None),
    )


def recovery_marks(
    fault: float,
    events: list[dict[str, Any]],
    metrics: list[dict[str, Any]],
    launcher_lines: list[tuple[float, str]],
    *,
    agents: bool,
    launched_at: float | None = None,
) -> Marks | None:
    """The marks of the first recovery after ``fault``, or None if it has not completed.

    ``agents``: ftrain, whose agents' events give the reaction and the launch. Otherwise torchrun,
    whose reaction is a log line; ``launched_at`` given: the floor, started here, no reaction.
    ``launcher_lines``: (time, text) of torchrun's log lines (ftrain: the rounds' logs)."""
    found = first_step_after(fault, events, metrics)
    if found is None:
        return None
    resumed0, line = found
    first_start, started, load_start_by, resumed = _generation(fault, resumed0, line, events)
    detected, detected_by, launched = None, "", launched_at
    if agents:
        reactions = sorted(
            (e for e in events if e.get("rank") == -1 and e.get("event") in AGENT_REACTIONS and e["time"] >= fault),
            key=lambda e: e["time"],
        )
        if reactions:
            detected = reactions[0]["time"]
            detected_by = reactions[0]["event"] + (f" ({reactions[0]['reason']})" if reactions[0].get("reason") else "")
        launched = max(
            (
                e["time"]
                for e in events
                if e.get("event") == Event.WORKERS_STARTED and e.get("worker_round") == resumed0.get("round")
            ),
            default=None,
        )
    elif launched_at is None:
        reactions = sorted((t, text) for t, text in launcher_lines if t >= fault and TORCHRUN_REACTION in text)
        if reactions:
            message = reactions[0][1].split("] ", 1)[-1]  # after the glog prefix
            detected, detected_by = reactions[0][0], re.sub(r"^\[\w+\] ", "", message).split(";")[0]
    until = first_start if first_start is not None else resumed0["time"]
    spawned = max((t for t, text in launcher_lines if fault < t <= until and TORCHRUN_LAUNCH in text), default=None)
    if not agents and launched_at is None:
        launched = spawned  # torchrun's launcher lives on: its rendezvous ends where it spawns workers
    return Marks(
        fault,
        detected,
        launched,
        spawned,
        started,
        resumed,
        line["time"],
        detected_by,
        resumed0["step"],
        resumed0["world_size"],
        load_start_by,
    )
