"""``etcd_minority``: one etcd member (``member``, default ``etcd0``: the first endpoint every
client tries) is cut off from the other two and from every client, for ``duration_s`` (default
6 s). The two others keep the quorum; clients of the cut member fail over to them, and the job
rides it out. Needs ``network = "netns"`` (a 3-member etcd, one member per host)."""

from __future__ import annotations

from typing import Any

from ftrain.chaos.faults.cuts import held
from ftrain.chaos.faults.registry import FAULTS, Fault, Outcome
from ftrain.chaos.faults.spec import Context, FaultError, FaultSpec
from ftrain.chaos.hosts import ETCD_HOSTS


def _act(ctx: Context, spec: FaultSpec) -> dict[str, Any]:
    net = ctx.need_net(spec.kind)
    member = str(spec.params.get("member", ETCD_HOSTS[0]))
    if member not in ETCD_HOSTS:
        raise FaultError(f"{spec.kind}: member {member!r} is not one of {', '.join(ETCD_HOSTS)}")
    return held(ctx, spec, member, lambda: net.isolate(member), lambda: net.rejoin(member), default_s=6.0)


FAULT = FAULTS.register(Fault(kind="etcd_minority", act=_act, outcome=Outcome.RIDDEN_OUT))
