"""``etcd_restart``: the etcd server is stopped for ``duration_s`` (default 3 s), then started
again on its data. The job rides it out."""

from __future__ import annotations

from typing import Any

from ftrain.chaos.faults.registry import FAULTS, Fault, Outcome
from ftrain.chaos.faults.spec import Context, FaultSpec
from ftrain.chaos.faults.windows import outage


def _act(ctx: Context, spec: FaultSpec) -> dict[str, Any]:
    return outage(ctx, spec, 3.0, ctx.etcd.stop, lambda: ctx.etcd.restart(timeout_s=30))


FAULT = FAULTS.register(Fault(kind="etcd_restart", act=_act, outcome=Outcome.RIDDEN_OUT))
