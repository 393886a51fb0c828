"""``partition``: a node is cut off from everyone — its link taken off the bridge, so nothing it
sends arrives and nothing reaches it (silent: TCP hangs, as behind a dead switch port) — for
``duration_s`` (default 6 s) or until the job reaches ``heal_at_step``; then it is put back. Its
lease expires, the others go on in a new round without it, and after the heal it rejoins without
a human. Needs ``network = "netns"``."""

from __future__ import annotations

from typing import Any

from ftrain.chaos.faults.cuts import held, target
from ftrain.chaos.faults.registry import FAULTS, Fault, Outcome
from ftrain.chaos.faults.spec import Context, FaultSpec


def _act(ctx: Context, spec: FaultSpec) -> dict[str, Any]:
    net = ctx.need_net(spec.kind)
    node = target(ctx, spec)
    return held(ctx, spec, node, lambda: net.isolate(node), lambda: net.rejoin(node), default_s=6.0)


FAULT = FAULTS.register(Fault(kind="partition", act=_act, outcome=Outcome.NEW_ROUND, cuts_node=True))
