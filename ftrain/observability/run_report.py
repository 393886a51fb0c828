"""What a job's logs say about it, as one report: ``ftrain report RUN_DIR`` (the page is
:mod:`ftrain.observability.report_page`).

:func:`collect` reads every ``metrics*.jsonl`` and ``events*.jsonl`` under a run directory (each
node's, when each keeps its own; torn lines skipped) and :func:`build` turns them into plain
data: the steps (loss, gradient norm, throughput, phases, per-rank busy and waiting time),
rounds, faults, hangs with their verdicts, commits, stragglers, the heals (:func:`heals`: where
each round's state came from and what it cost), goodput, and where the device time went
(:func:`lost_time`).

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
MAX_HEAL_S = 7 * 86400.0  #: a longer restore in a log line is not believed (it would stretch the timeline)
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
        "heals": heals(metrics, events),
        "accounting": agents_time(events, device_hour_price=device_hour_price)
        or lost_time(metrics, started, ended, device_hour_price=device_hour_price),
        "final": _final(events),
        "decisions": decisions(events),
    }
    return report


#: the events that say a rank has its state: a live worker's (from its own memory, a live peer, the
#: memory tier or storage), restarted workers' from the memory tier's directory, a load from storage
_RESTORES = {Event.LIVE_RESTORED: "", Event.MEMORY_RESTORED: "memory_tier", Event.RESUMED: "storage"}
_REFUSALS = (Event.LIVE_PEER_REFUSED, Event.MEMORY_REFUSED, Event.RESUME_FAILED)


def heals(metrics: list[dict[str, Any]], events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """How each round's ranks got their state back, from the workers' events (``ftrain train``'s
    and a ``ftrain.Session``'s say the same ones), in time order. One heal is one round's
    restores: per rank its newest ``live_restored``, ``memory_restored`` or ``resumed`` (whose
    time is counted from the rank's ``resume_started``); a rank that restores again in the same
    round from another process (restarts that all log round 0) begins the next heal. A round in
    which every rank started fresh is the job's start, not a heal. ``steps_redone``: the newest
    step done before the heal (the metrics lines, the steps live ranks kept as they left their
    round, what the ranks held) less the step training went on from; None when no log says."""
    found: list[dict[str, Any]] = []  # {"round", "ranks": {rank: restore}}
    newest: dict[int | None, dict[str, Any]] = {}  # round -> its latest heal
    asked: dict[tuple[Any, ...], float] = {}  # (round, rank, pid) -> its resume_started time
    refused: dict[int | None, int] = {}
    kept: list[tuple[float, int]] = []  # (time, step) a live rank kept as it left its round
    for e in sorted(events, key=lambda e: _num(e.get("time"))):
        kind, round_, rank = str(e.get("event")), _int(e.get("round")), _int(e.get("rank"))
        who = (round_, rank, _int(e.get("pid")))
        if kind == Event.RESUME_STARTED:
            asked[who] = _num(e.get("time"))
        elif kind in _REFUSALS:
            refused[round_] = refused.get(round_, 0) + 1
        elif kind == Event.LIVE_ROUND_LEFT and (step := _int(e.get("step"))) is not None:
            kept.append((_num(e.get("time")), step))
        elif kind in _RESTORES and (got := _restore(e, asked.get(who))) is not None:
            heal = newest.get(round_)
            if heal is None or heal["ranks"].get(rank, got)["pid"] != got["pid"]:
                heal = newest[round_] = {"round": round_, "ranks": {}}
                found.append(heal)
            heal["ranks"][rank] = got
    out = [_heal(h, refused.get(h["round"], 0), metrics, kept) for h in found]
    return [h for h in out if set(h["sources"]) != {"fresh"}]


def _restore(e: dict[str, Any], asked_at: float | None) -> dict[str, Any] | None:
    """One rank's restore (None where its step is not a number)."""
    step = _int(e.get("step"))
    if step is None:
        return None
    kind = Event(e["event"])
    if kind != Event.RESUMED:
        seconds: float | None = min(max(0.0, _num(e.get("seconds"))), MAX_HEAL_S)
    else:
        seconds = None if asked_at is None else min(max(0.0, _num(e.get("time")) - asked_at), MAX_HEAL_S)
    source = _RESTORES[kind] or str(e.get("source", ""))[:40]
    if source == "live_peer" and _int(e.get("from_rank")) == _int(e.get("rank")):
        source = "memory"  # the peer that sent its state to the others kept its own
    return {
        "time": _num(e.get("time")),
        "pid": _int(e.get("pid")),
        "step": step,
        "source": source,
        "world_size": _int(e.get("world_size")),
        "held_step": _int(e.get("held_step")),
        "seconds": seconds,
        "phases_s": {k: _num(e.get(k)) for k in ("join_s", "build_s", "state_s") if _is_num(e.get(k))},
    }


def _heal(
    heal: dict[str, Any], refused: int, metrics: list[dict[str, Any]], kept: list[tuple[float, int]]
) -> dict[str, Any]:
    ranks = heal["ranks"]
    # from the first rank's start (a restore's time is when it ended) to the last rank's end
    at = min(r["time"] - (r["seconds"] or 0.0) for r in ranks.values())
    step = max(r["step"] for r in ranks.values())
    sources: dict[str, int] = {}
    for r in ranks.values():
        sources[r["source"]] = sources.get(r["source"], 0) + 1
    timed = [(rank, r) for rank, r in ranks.items() if r["seconds"] is not None]
    slowest_rank, slowest = max(timed, key=lambda t: t[1]["seconds"], default=(None, None))
    done = [m["step"] for m in metrics if _num(m.get("time")) < at]
    done += [s for t, s in kept if t < at] + [h for r in ranks.values() if (h := r["held_step"]) is not None]
    return {
        "round": heal["round"],
        "time": at,
        "done_at": max(r["time"] for r in ranks.values()),
        "ranks": len(ranks),
        "world_size": max((r["world_size"] or 0 for r in ranks.values()), default=0),
        "step": step,
        "sources": sources,
        "seconds": slowest["seconds"] if slowest else None,
        "slowest_rank": slowest_rank,
        "phases_s": slowest["phases_s"] if slowest else {},
        "steps_redone": max(0, max(done) - step) if done else None,
        "refused": refused,
    }


def said_heal(heal: dict[str, Any]) -> str:
    """One heal in words (``ftrain report``'s lines)."""
    sources = ", ".join(f"{source} x{n}" for source, n in heal["sources"].items())
    slowest = "" if heal["seconds"] is None else f", slowest rank {heal['slowest_rank']} in {heal['seconds']:.2f}s"
    redone = "" if heal["steps_redone"] is None else f", {heal['steps_redone']} step(s) redone"
    refused = f", {heal['refused']} refusal(s)" if heal["refused"] else ""
    return f"round {heal['round']}: state from {sources} at step {heal['step']}{slowest}{redone}{refused}"


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
