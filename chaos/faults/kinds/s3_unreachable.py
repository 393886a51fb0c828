"""``s3_unreachable``: one node cannot reach S3 while the others can: the S3 host drops what it
would send back to that node (silent: its requests hang), for ``duration_s`` (default 6 s) or
until ``heal_at_step``. Saves in that window fail (or retry past it); training rides it out, and
nothing half-written counts as committed. Needs ``network = "netns"``."""

from __future__ import annotations

from typing import Any

from ftrain.chaos.faults.cuts import held, target
from ftrain.chaos.faults.registry import FAULTS, Fault, Outcome
from ftrain.chaos.faults.spec import Context, FaultSpec
from ftrain.chaos.hosts import S3_HOST


def _act(ctx: Context, spec: FaultSpec) -> dict[str, Any]:
    net = ctx.need_net(spec.kind)
    node = target(ctx, spec)
    return held(ctx, spec, node, lambda: net.cut(node, S3_HOST), lambda: net.heal(node, S3_HOST), default_s=6.0)


FAULT = FAULTS.register(Fault(kind="s3_unreachable", act=_act, outcome=Outcome.RIDDEN_OUT))
