"""When a fault fires: its trigger (``at_time_s`` since the run began, then ``at_step``), then
its kind's action from the registry."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ftrain.chaos.faults.spec import Context, FaultSpec
from ftrain.testbed.wait import wait_for


def wait_trigger(ctx: Context, spec: FaultSpec, timeout_s: float) -> None:
    """Return once the trigger is met or the run is over (``ctx.stop()``)."""

    def until(predicate: Callable[[], Any], what: str) -> Any:
        return wait_for(lambda: predicate() or ctx.stop(), timeout_s, what, poll_s=0.01)

    if spec.at_time_s is not None:
        at_time_s = spec.at_time_s
        until(lambda: time.time() - ctx.started_at >= at_time_s, f"t={at_time_s}s")
    if spec.at_step is not None:
        at_step = spec.at_step
        until(lambda: ctx.cluster.step() >= at_step, f"step {at_step}")


def inject(ctx: Context, spec: FaultSpec, *, timeout_s: float = 300) -> dict[str, Any] | None:
    """Wait for the trigger, then apply the fault; None if the run ended first."""
    wait_trigger(ctx, spec, timeout_s)
    if ctx.stop():
        return None
    return spec.fault.act(ctx, spec)
