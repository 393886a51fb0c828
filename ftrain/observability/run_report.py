"""What a job's logs say about it, as one report: ``ftrain report RUN_DIR`` (the page is
:mod:`ftrain.observability.report_page`).

:func:`collect` reads every ``metrics*.jsonl`` and ``events*.jsonl`` under a run directory (each
node's, when each keeps its own; torn lines skipped) and :func:`build` turns them into plain
data: the steps (loss, gradient norm, throughput, phases, per-rank busy and waiting time),
rounds, faults, hangs with their verdicts, commits, stragglers, goodput, and where the
device time went (:func:`lost_time`).

Device time is :mod:`ftrain.contract.accounting`'s, the one accounting of ``ftrain status`` and
the agents' metrics, with the same causes (productive, recomputation, checkpoint_stalls,
stragglers, startup, recovery, idle): when the agents wrote ``device_time`` events, the newest of
each node, added up (what ``ftrain status`` showed, whatever ran the loop: a ``ftrain.Session``
script writes no metrics lines); for a job without agents, the metrics lines fed to the same
:class:`~ftrain.contract.accounting.DeviceTime` on the job's largest world size, from its first
round to its last step (a smaller round's unused devices are idle).

With a price per device-hour (``accounting.device_hour_price``), each cause also has its cost.
The report also lists what the control plane decided (``ftrain analyze``'s decisions: a round
the leader could not form, workers failing at start, how the job ended and why).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from ftrain.contract.accounting import CAUSES, DeviceTime, summary
from ftrain.contract.events import Event, read_jsonl
from ftrain.contract.local_files import replace_file
from ftrain.observability.decisions import decisions

MAX_WORLD_SIZE = 1 << 24  #: a larger world size in a log line is not believed (it would overflow the sums)
MAX_STEPS_SHOWN = 2000  #: steps kept for the curves and the heatmap (evenly thinned beyond)


def collect(run_dir: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[Path]]:
    """(metrics lines, events, the files read) of everything under ``run_dir`` (or one file)."""
    paths = [run_dir] if run_dir.is_file() else sorted(p for p in run_dir.rglob("*.jsonl") if p.is_file())
    metrics: list[dict[str, Any]] = []
    events: list[dict[str, Any]] = []
    used = []
    for path in paths:
        if path.name.startswith("metrics"):
            metrics += [m for m in read_jsonl(path) if isinstance(m, dict) and isinstance(m.get("step"), int)]
        elif path.name.startswith("events"):
            events += [e for e in read_jsonl(path) if isinstance(e, dict) and isinstance(e.get("event"), str)]
        else:
            continue
        used.append(path)
    metrics.sort(key=lambda m: _num(m.get("time")))
    events.sort(key=lambda e: _num(e.get("time")))
    return metrics, events, used


def build(
    metrics: list[dict[str, Any]], events: list[dict[str, Any]], *, title: str = "", device_hour_price: float = 0.0
) -> dict[str, Any]:
    """The report's data (JSON-ready)."""
    rounds: list[dict[str, Any]] = [
        {
            "round": _int(e.get("new_round")),
            "time": _num(e.get("time")),
            "reason": str(e.get("reason", "")),
            "members": _names(e.get("members")),
            "world_size": _int(e.get("world_size")),
        }
        for e in _of(events, Event.ROUND_FORMED)
    ]
    commits: dict[int, dict[str, Any]] = {}
    for e in _of(events, Event.CKPT_COMMITTED):
        if isinstance(e.get("step"), int):
            commit = {"step": e["step"], "time": _num(e.get("time")), "round": _int(e.get("round"))}
            commits.setdefault(e["step"], commit)
    started = min([r["time"] for r in rounds] + [_num(m.get("time")) for m in metrics[:1]], default=0.0)
    ended = max([_num(m.get("time")) for m in metrics[-1:]] + [started], default=started)
    report = {
        "title": title,
        "started_at": started,
        "ended_at": ended,
        "steps": _thin([_step(m) for m in metrics]),
        "rounds": rounds,
        "faults": [
            {"time": _num(e.get("time")), "kind": str(e.get("kind", "")), "node": str(e.get("node", ""))}
            for e in _of(events, Event.CHAOS_FAULT)
        ],
        "hangs": [
            {
                "time": _num(e.get("time")),
                "node": str(e.get("node", "")),
                "round": _int(e.get("worker_round")),
                "verdict": str(e.get("verdict", ""))[:500],
            }
            for e in _of(events, Event.HANG)
        ],
        "checkpoints": sorted(commits.values(), key=lambda c: c["step"]),
        "stragglers": [
            {
                "time": _num(e.get("time")),
                "node": str(e.get("node", "")),
                "rank": _int(e.get("busy_rank")),
                "busy_s": _num(e.get("busy_s")),
                "others_s": _num(e.get("others_s")),
                "policy": str(e.get("policy", "")),
            }
            for e in _of(events, Event.STRAGGLER_DETECTED)
        ],
        "accounting": agents_time(events, device_hour_price=device_hour_price)
        or lost_time(metrics, started, ended, device_hour_price=device_hour_price),
        "final": _final(events),
        "decisions": decisions(events),
    }
    return report


def _final(events: list[dict[str, Any]]) -> dict[str, Any] | None:
    """How the job ended and why (the newest ``job_final`` event), if it did."""
    final = _of(events, Event.JOB_FINAL)
    if not final:
        return None
    e = final[-1]
    return {
        "time": _num(e.get("time")),
        "status": str(e.get("status", ""))[:50],
        "reason": str(e.get("reason", ""))[:2000],
    }


def agents_time(events: list[dict[str, Any]], *, device_hour_price: float = 0.0) -> dict[str, Any] | None:
    """The device time the agents accounted (each node's newest ``device_time`` event, added up:
    what ``ftrain status`` showed from their statuses); None when no agent wrote one."""
    newest: dict[str, dict[str, Any]] = {}
    for e in _of(events, Event.DEVICE_TIME):  # in time order: the later wins
        if isinstance(e.get("seconds"), dict) and _int(e.get("devices")) is not None:
            newest[str(e.get("node", ""))[:200]] = e
    if not newest:
        return None
    seconds = dict.fromkeys(CAUSES, 0.0)
    for e in newest.values():
        for cause, value in e["seconds"].items():
            if isinstance(cause, str) and _is_num(value):
                seconds[cause] = seconds.get(cause, 0.0) + float(value)
    devices = sum(min(MAX_WORLD_SIZE, max(0, e["devices"])) for e in newest.values())
    wall = max(_num(e.get("wall_s")) for e in newest.values())
    return {**summary(seconds, devices=devices, wall_s=wall, device_hour_price=device_hour_price), "source": "agents"}


def lost_time(
    metrics: list[dict[str, Any]], started: float, ended: float, *, device_hour_price: float = 0.0
) -> dict[str, Any]:
    """Device time by cause from the metrics lines (a job without agents; see the module doc)."""
    devices = max((w for m in metrics if (w := _world(m)) is not None), default=0)
    account = DeviceTime(devices)
    account.start(started)
    last_round, last_at = object(), started
    for m in metrics:
        world = _world(m) or devices
        at = _num(m.get("time"))
        raw = m.get("phases_s")
        phases: dict[str, Any] = raw if isinstance(raw, dict) else {}
        # the whole interval since the previous line (phases add up to it), else the step alone;
        # the first line of a round is its warm-up (not counted as a step: recovery or start-up)
        step_s = sum(_num(v) for v in phases.values()) if phases else _num(m.get("step_time_s"))
        first = m.get("round") != last_round
        staging = _num(phases.get("ckpt_staging"))
        if not first:
            account.staged(staging * world)
            waits = m.get("rank_comm_wait_s")
            waits = [_num(w) for w in waits] if isinstance(waits, list) else []
            if waits:
                account.waited(sum(w - min(waits) for w in waits))
        account.step_done(m["step"], None if first else step_s, at, devices=world)
        if world < devices:
            account.outside(max(0.0, at - last_at), devices=devices - world)
        last_round, last_at = m.get("round"), at
    seconds = account.seconds(max(ended, started))
    return {**summary(seconds, devices=devices, wall_s=ended - started, device_hour_price=device_hour_price),
            "source": "metrics"}  # fmt: skip


def _step(m: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"step": m["step"], "time": _num(m.get("time"))}
    for key in ("loss", "grad_norm", "tokens_per_s", "step_time_s"):
        out[key] = _num(m.get(key)) if _is_num(m.get(key)) else None  # a diverged run's NaN loss: no point
    for key in ("round", "world_size"):
        out[key] = _int(m.get(key))
    for key in ("rank_busy_s", "rank_comm_wait_s"):
        value = m.get(key)
        out[key] = [_num(v) for v in value] if isinstance(value, list) else []
    return out


def _thin(steps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    if len(steps) <= MAX_STEPS_SHOWN:
        return steps
    every = len(steps) / MAX_STEPS_SHOWN
    return [steps[int(i * every)] for i in range(MAX_STEPS_SHOWN)] + [steps[-1]]


def _of(events: list[dict[str, Any]], event: Event) -> list[dict[str, Any]]:
    return [e for e in events if e.get("event") == event.value]


def _is_num(value: Any) -> bool:
    """A finite number that a float holds (a 400-digit integer in a log line is not one)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return math.isfinite(value) if isinstance(value, float) else abs(value) < 2**1023


def _num(value: Any) -> float:
    """A finite number from a log line, else 0 (logs are untrusted: a wrong type is not fatal)."""
    return float(value) if _is_num(value) else 0.0


def _int(value: Any) -> int | None:
    """An integer from a log line, else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _world(m: dict[str, Any]) -> int | None:
    """A metrics line's world size, if it is one (1 to :data:`MAX_WORLD_SIZE`)."""
    value = _int(m.get("world_size"))
    return value if value is not None and 1 <= value <= MAX_WORLD_SIZE else None


def _names(value: Any) -> list[str]:
    """A list of names from a log line (anything else: none), each as text."""
    return [str(v)[:200] for v in value[:10_000]] if isinstance(value, list) else []


def write(out_dir: Path, report: dict[str, Any]) -> Path:
    """``report.json``, ``report.html`` and (with Chromium) ``report.png`` in ``out_dir``."""
    from ftrain.observability.browser import screenshot  # noqa: PLC0415 - only when writing
    from ftrain.observability.report_page import render

    out_dir.mkdir(parents=True, exist_ok=True)
    replace_file(out_dir / "report.json", json.dumps(report, indent=1).encode())  # never through a planted link
    html = out_dir / "report.html"
    replace_file(html, render(report).encode())
    screenshot(html, out_dir / "report.png", height=1400)
    return html
