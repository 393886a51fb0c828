"""``etcd_pause``: the etcd server is paused (``SIGSTOP``) for ``duration_s`` (default 4 s), then
resumed. The job rides it out."""

from __future__ import annotations

from typing import Any

from ftrain.chaos.faults.registry import FAULTS, Fault, Outcome
from ftrain.chaos.faults.spec import Context, FaultSpec
from ftrain.chaos.faults.windows import outage


def _act(ctx: Context, spec: FaultSpec) -> dict[str, Any]:
    return outage(ctx, spec, 4.0, ctx.etcd.pause, ctx.etcd.resume)


FAULT = FAULTS.register(Fault(kind="etcd_pause", act=_act, outcome=Outcome.RIDDEN_OUT))
