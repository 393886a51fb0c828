"""``degraded_link``: a token-bucket bandwidth limit (``rate``, default ``2mbit``; ``tc ... tbf``)
on the link towards one node, for ``duration_s`` (default 6 s) or until ``heal_at_step``, then
lifted. Training slows down and rides it out. Needs ``network = "netns"``."""

from __future__ import annotations

from typing import Any

from ftrain.chaos.faults.cuts import held, target
from ftrain.chaos.faults.registry import FAULTS, Fault, Outcome
from ftrain.chaos.faults.spec import Context, FaultSpec


def _act(ctx: Context, spec: FaultSpec) -> dict[str, Any]:
    net = ctx.need_net(spec.kind)
    node = target(ctx, spec)
    rate = str(spec.params.get("rate", "2mbit"))
    return held(ctx, spec, node, lambda: net.limit(node, rate), lambda: net.unlimit(node), default_s=6.0, rate=rate)


FAULT = FAULTS.register(Fault(kind="degraded_link", act=_act, outcome=Outcome.RIDDEN_OUT))
