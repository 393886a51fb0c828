"""Where a job's device time went: one accounting and one set of names for every tool.

``ftrain status`` (each agent's :class:`DeviceTime`, published in its status), the agents'
``device_time`` events, Prometheus (``ftrain_device_hours{cause}``) and ``ftrain report`` (the
agents' events, or, for a job run without agents, its metrics lines through the same
:class:`DeviceTime`) all split device time into :data:`CAUSES` and present it with
:func:`summary`. A device is one worker (one rank). The causes, in device-seconds:

- ``productive``: steps done for the first time (each step's interval since the step before),
  less their checkpoint staging and their waiting for a straggler;
- ``recomputation``: steps done again after going back to an older state;
- ``checkpoint_stalls``: staging state for checkpoints and the memory tier;
- ``stragglers``: ranks waiting for the slowest rank;
- ``startup``: from the first launch to the first step (interpreter, imports, the first
  rendezvous and load, the first step of a round, which warms caches and is not counted as a step);
- ``idle``: devices held outside any round after that (a node waiting to join or left out, or,
  counted on a job's largest world size, the devices a smaller round leaves unused);
- ``recovery``: the rest: detecting a failure, forming the next round, rendezvous, loads,
  backoff, and the first step of every later round.

They add up to the devices' wall time since the first launch. Productive time needs the steps'
intervals: from the workers' step phases (``ftrain train``), or, for a loop that sends only its
step number (``ftrain.Session``), measured between the step beats the agent receives.

Pure: time is passed in; nothing here reads a clock, a file or the network. Standard library only.
"""

from __future__ import annotations

import math
from typing import Any

CAUSES = ("productive", "recomputation", "checkpoint_stalls", "stragglers", "startup", "recovery", "idle")
#: what the causes were called before this accounting: ``restarts`` held startup, recovery and idle
FORMER_NAMES = {"restarts": "recovery"}


class DeviceTime:
    """Device time by cause, fed as it happens (see the module doc).

    ``start(now)`` at the first launch; ``step(...)`` for each newly seen step; ``staged`` and
    ``waited`` for staging and straggler waits; ``outside(seconds)`` for wall time with no round
    after the first step; :meth:`seconds` at any time. ``devices`` may change (a smaller round)."""

    def __init__(self, devices: int = 1) -> None:
        self.devices = devices
        self._measured = dict.fromkeys(("productive", "recomputation", "checkpoint_stalls", "stragglers"), 0.0)
        self._started_at: float | None = None
        self._first_step_at: float | None = None
        self._idle_s = 0.0  #: device-seconds outside any round after the first step
        self._best = -1  #: the highest step done
        self._last = -1  #: the last step seen

    @property
    def started(self) -> bool:
        return self._started_at is not None

    def start(self, now: float) -> None:
        """The first launch (later calls change nothing)."""
        if self._started_at is None:
            self._started_at = now

    def step(self, step: int, interval_s: float | None, now: float, *, devices: int | None = None) -> None:
        """The newest step seen is ``step`` (a sample: an agent looks at its workers' newest beat,
        which may have moved several steps, or none), each step ``interval_s`` long (None: not
        known, e.g. the first step of a round: not counted as a step). The steps since the last
        one seen above the best so far are productive, those at or below it recomputed."""
        devices = self._first(now, devices)
        interval_s = _usable(interval_s)
        if interval_s is not None:
            if self._last < 0:  # the first step seen: one interval
                new, again = (1 if step > self._best else 0), (0 if step > self._best else 1)
            else:  # from the last step seen: below the best again, above it new (a jump back counts nothing)
                new = max(0, step - max(self._best, self._last))
                again = max(0, min(step, self._best) - self._last)
            self._measured["productive"] += interval_s * devices * new
            self._measured["recomputation"] += interval_s * devices * again
        self._best = max(self._best, step)
        self._last = step

    def step_done(self, step: int, interval_s: float | None, now: float, *, devices: int | None = None) -> None:
        """One step, ``step``, was done ``interval_s`` after the one before (a metrics line: each
        is one step done): productive above the best so far, else recomputed."""
        devices = self._first(now, devices)
        interval_s = _usable(interval_s)
        if interval_s is not None:
            cause = "productive" if step > self._best else "recomputation"
            self._measured[cause] += interval_s * devices
        self._best = max(self._best, step)
        self._last = step

    def _first(self, now: float, devices: int | None) -> int:
        """The first step ends the start-up; the devices a step ran on."""
        if self._first_step_at is None:
            self.start(now)
            self._first_step_at = now
        return self.devices if devices is None else devices

    def staged(self, device_s: float) -> None:
        """Device-seconds the ranks spent staging checkpoints (inside their step intervals)."""
        self._measured["checkpoint_stalls"] += max(0.0, device_s)

    def waited(self, device_s: float) -> None:
        """Device-seconds the ranks waited for a straggler (inside their step intervals)."""
        self._measured["stragglers"] += max(0.0, device_s)

    def outside(self, seconds: float, *, devices: int | None = None) -> None:
        """``seconds`` of wall time with the devices outside any round (before the first step it
        is start-up, counted as such)."""
        if self._first_step_at is not None and seconds > 0:
            self._idle_s += seconds * (self.devices if devices is None else devices)

    def seconds(self, now: float) -> dict[str, float]:
        """Device-seconds by cause (:data:`CAUSES`) from the first launch to ``now``; they add up
        to the devices' wall time (or to what was measured, if that is more)."""
        m = self._measured
        productive = max(0.0, m["productive"] - m["checkpoint_stalls"] - m["stragglers"])
        out = {
            "productive": productive,
            "recomputation": m["recomputation"],
            "checkpoint_stalls": m["checkpoint_stalls"],
            "stragglers": m["stragglers"],
            "startup": 0.0,
            "recovery": 0.0,
            "idle": self._idle_s,
        }
        if self._started_at is None:
            return out
        wall = max(0.0, now - self._started_at) * self.devices
        first = self._first_step_at if self._first_step_at is not None else now
        out["startup"] = min(wall, max(0.0, first - self._started_at) * self.devices)
        out["recovery"] = max(0.0, wall - sum(out.values()))
        return out


def _usable(interval_s: float | None) -> float | None:
    """A step interval that can be counted (positive, finite), else None."""
    return interval_s if interval_s is not None and interval_s > 0 and math.isfinite(interval_s) else None


def summary(
    seconds: dict[str, float], *, devices: int, wall_s: float, device_hour_price: float = 0.0
) -> dict[str, Any]:
    """What every tool shows of ``seconds`` (device-seconds by cause, :data:`CAUSES`; other keys
    and former names are folded in): goodput (productive over the total), and per cause its
    device-hours, share and cost (None without a price)."""
    by_cause = dict.fromkeys(CAUSES, 0.0)
    for cause, value in seconds.items():
        name = FORMER_NAMES.get(cause, cause)
        if name in by_cause and isinstance(value, (int, float)) and math.isfinite(value) and value > 0:
            by_cause[name] += float(value)
    total = sum(by_cause.values())
    return {
        "devices": devices,
        "wall_s": round(wall_s, 3),
        "device_hour_price": device_hour_price,
        "goodput": round(by_cause["productive"] / total, 4) if total else 0.0,
        "lost_device_hours": round((total - by_cause["productive"]) / 3600, 6),
        "causes": [
            {
                "cause": cause,
                "device_hours": round(by_cause[cause] / 3600, 6),
                "share": round(by_cause[cause] / total, 4) if total else 0.0,
                "cost": round(by_cause[cause] / 3600 * device_hour_price, 4) if device_hour_price else None,
            }
            for cause in CAUSES
        ],
    }


def describe(s: dict[str, Any]) -> str:
    """One line of a :func:`summary`: ``device time: 1.2 device-hours, goodput 83.0%; lost: ...``."""
    total = sum(c["device_hours"] for c in s["causes"])
    price = s.get("device_hour_price") or 0.0
    lost = [c for c in s["causes"] if c["cause"] != "productive" and c["device_hours"] > 0]
    cost = f" (cost {s['lost_device_hours'] * price:.2f} at {price:g} per device-hour)" if price else ""
    parts = ", ".join(f"{c['cause']} {c['device_hours']:.4f} ({100 * c['share']:.1f}%)" for c in lost)
    return (
        f"device time: {total:.4f} device-hours on {s['devices']} device(s), goodput {100 * s['goodput']:.1f}%; "
        f"lost {s['lost_device_hours']:.4f}{cost}" + (f": {parts}" if parts else "")
    )


__all__ = ["CAUSES", "FORMER_NAMES", "DeviceTime", "describe", "summary"]
