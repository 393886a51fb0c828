"""``s3_outage``: the S3 server is stopped for ``duration_s`` (default 4 s), then restarted.
Saves fail or retry meanwhile; the job rides it out."""

from __future__ import annotations

from typing import Any

from ftrain.chaos.faults.registry import FAULTS, Fault, Outcome
from ftrain.chaos.faults.spec import Context, FaultSpec
from ftrain.chaos.faults.windows import outage


def _act(ctx: Context, spec: FaultSpec) -> dict[str, Any]:
    return outage(ctx, spec, 4.0, ctx.s3.stop, lambda: ctx.s3.restart(timeout_s=60))


FAULT = FAULTS.register(Fault(kind="s3_outage", act=_act, outcome=Outcome.RIDDEN_OUT))
