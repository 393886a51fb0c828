"""Faults that hold a condition for a while: a server down for ``duration_s``, or S3 slowed down
while an action waits for its window (uploads and loads take a fraction of a second here)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ftrain.chaos.faults.spec import Context, FaultSpec
from ftrain.chaos.s3proxy import FaultRates


def outage(
    ctx: Context, spec: FaultSpec, default_s: float, begin: Callable[[], None], end: Callable[[], None]
) -> dict[str, Any]:
    """A server is unavailable for ``duration_s`` (the fault's own length), then back: ``end``
    runs even if the wait is interrupted."""
    duration_s = float(spec.params.get("duration_s", default_s))
    begin()
    record = ctx.emit(spec.kind, duration_s=duration_s, step=ctx.cluster.step())
    try:
        time.sleep(duration_s)
    finally:
        end()
    return record


def with_slow_storage(ctx: Context, latency_s: float, action: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run ``action`` with every S3 request delayed by ``latency_s``; the proxy is clean after."""
    proxy = ctx.need_proxy("a fault that slows storage down")
    proxy.set_faults(FaultRates(latency=1.0, latency_s=latency_s))
    try:
        return action()
    finally:
        proxy.set_faults(None)
