"""A check, its result, the mode the checks run in, and running checks side by side.

A check is a function of its :class:`Deadline` that returns its figures (a dict of JSON values),
raises :class:`Skip` (it does not apply here, and why) or :class:`CheckFailed` (it ran and
failed: the message, the output's last lines, and the figures it had). Any other exception is a
failure too, reported with its traceback's last lines: one check's bug never stops the others.

What must stay true: each check gets ``min(its timeout_s, what is left of the budget)`` and passes
what remains of it to every process it starts (``ftrain.testbed.jobs.run_within`` kills the
process's whole tree at that limit), so the run ends within the budget plus a few seconds; a
check that cannot start with :data:`MIN_START_S` left is reported failed, never silently dropped.
"""

from __future__ import annotations

import os
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

OK, FAILED, SKIPPED = "ok", "failed", "skipped"
#: lines of a failed process's output kept in its check's ``error``
ERROR_LINES = 20
#: a check is not started with less than this left of the budget
MIN_START_S = 15.0
#: how long past its deadline a check's thread may take to return before it is reported stuck
GRACE_S = 30.0


class Skip(Exception):
    """The check does not apply in this mode or on this machine: ``reason`` says why."""

    def __init__(self, reason: str, figures: dict[str, Any] | None = None):
        super().__init__(reason)
        self.reason = reason
        self.figures = figures or {}


class CheckFailed(Exception):
    """The check ran and failed: ``message``, the last lines of what it ran, what it measured."""

    def __init__(self, message: str, output: str = "", figures: dict[str, Any] | None = None):
        super().__init__(message)
        self.message = message
        self.output = output
        self.figures = figures or {}


@dataclass(frozen=True, slots=True)
class Mode:
    """Where the checks run: on the CUDA device (``dry`` False), or the dry run's CPU stand-ins."""

    dry: bool

    @property
    def cuda(self) -> bool:
        return not self.dry

    @property
    def device(self) -> str:
        return "cpu" if self.dry else "cuda"

    @property
    def dtype(self) -> str:
        return "fp32" if self.dry else "bf16"

    @property
    def collective_backend(self) -> str:
        """The backend of one-rank jobs and of the flight recorder's group (nccl on the device)."""
        return "gloo" if self.dry else "nccl"

    def train_overrides(self) -> list[str]:
        return [f"--train.device={self.device}", f"--train.dtype={self.dtype}"]

    def env(self, **extra: str) -> dict[str, str]:
        """Children's environment (``ftrain.testbed.jobs.worker_env``); dry runs see no GPU at all."""
        from ftrain.testbed.jobs import worker_env

        hide = {"CUDA_VISIBLE_DEVICES": ""} if self.dry else {}
        return worker_env(**hide, **extra)


class Deadline:
    """The monotonic time a check must be done by."""

    def __init__(self, end: float):
        self.end = end

    def remaining(self, at_least_s: float = 1.0) -> float:
        """Seconds left (at least ``at_least_s``, so a last short wait still reports its result)."""
        return max(at_least_s, self.end - time.monotonic())


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    run: Callable[[Deadline], dict[str, Any]]
    timeout_s: float


@dataclass(slots=True)
class Result:
    name: str
    status: str
    wall_s: float
    figures: dict[str, Any] = field(default_factory=dict)
    reason: str = ""  #: why it was skipped
    error: str = ""  #: on failure: what failed, then the last lines of what it ran

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "status": self.status, "wall_s": round(self.wall_s, 1)}
        if self.reason:
            out["reason"] = self.reason
        if self.error:
            out["error"] = self.error
        out["figures"] = self.figures
        return out


def tail(text: str, lines: int = ERROR_LINES) -> str:
    """The last ``lines`` non-empty lines of ``text``."""
    kept = [ln.rstrip() for ln in text.splitlines() if ln.strip()]
    return "\n".join(kept[-lines:])


def run_one(check: Check, end: float) -> Result:
    """Run ``check`` with its timeout, cut at ``end`` (the budget's); never raises."""
    began = time.monotonic()
    if end - began < MIN_START_S:
        return Result(check.name, FAILED, 0.0, error=f"not started: {end - began:.0f}s of the budget were left")
    deadline = Deadline(min(began + check.timeout_s, end))
    try:
        figures = check.run(deadline)
        return Result(check.name, OK, time.monotonic() - began, figures)
    except Skip as s:
        return Result(check.name, SKIPPED, time.monotonic() - began, s.figures, reason=s.reason)
    except CheckFailed as f:
        error = f.message + (f"\n{tail(f.output)}" if f.output else "")
        return Result(check.name, FAILED, time.monotonic() - began, f.figures, error=error)
    except Exception as e:  # noqa: BLE001 - a check's own bug is that check's failure, not the run's
        error = f"{type(e).__name__}: {e}\n{tail(traceback.format_exc())}"
        return Result(check.name, FAILED, time.monotonic() - began, error=error)


def run_checks(
    checks: Sequence[Check], *, budget_s: float, lanes: int, report: Callable[[Result], None]
) -> list[Result]:
    """Run ``checks`` on ``lanes`` threads, the longest timeouts first, all inside ``budget_s``;
    ``report`` is called with each result as it comes. Results come back in ``checks``' order."""
    end = time.monotonic() + budget_s
    lock = threading.Lock()

    def one(check: Check) -> Result:
        result = run_one(check, end)
        with lock:
            report(result)
        return result

    pool = ThreadPoolExecutor(max_workers=lanes, thread_name_prefix="gpu-check")
    try:
        futures = {c.name: pool.submit(one, c) for c in sorted(checks, key=lambda c: -c.timeout_s)}
        results = []
        for c in checks:
            try:
                results.append(futures[c.name].result(timeout=max(0.0, end - time.monotonic()) + GRACE_S))
            except FutureTimeout:
                results.append(Result(c.name, FAILED, budget_s, error="did not return within the budget"))
        return results
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


def lanes_for(mode: Mode) -> int:
    """Checks run side by side: 2 on a small CPU machine (dry), up to 5 on a GPU host."""
    cores = os.cpu_count() or 2
    return 2 if mode.dry and cores <= 4 else max(2, min(5, cores // 3))
