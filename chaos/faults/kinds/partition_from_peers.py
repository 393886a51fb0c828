"""``partition_from_peers``: a node reaches etcd and S3 but not the other nodes, for ``duration_s``
(default 6 s) or until ``heal_at_step``. Asymmetric: each peer drops what it sends to the node, so
the node's packets arrive and are never answered (its side hangs) while the peers' own sends to
it fail at once. The node's lease stays alive while its collectives stall; the job must not
wedge on a member that etcd says is alive. A cut shorter than the collectives' timeouts is
ridden out: TCP retransmits once it heals (measured: 6 s cut, training stalled 7.4 s, no new
round); a longer one ends the round like any hang, and the node must then rejoin after the heal.
Needs ``network = "netns"``."""

from __future__ import annotations

from typing import Any

from ftrain.chaos.faults.cuts import cut_off_from, target
from ftrain.chaos.faults.registry import FAULTS, Fault, Outcome
from ftrain.chaos.faults.spec import Context, FaultSpec


def _act(ctx: Context, spec: FaultSpec) -> dict[str, Any]:
    ctx.need_net(spec.kind)
    node = target(ctx, spec)
    peers = sorted(n for n in ctx.cluster.agents if n != node)
    return cut_off_from(ctx, spec, node, peers, default_s=6.0)


FAULT = FAULTS.register(Fault(kind="partition_from_peers", act=_act, outcome=Outcome.RIDDEN_OUT, cuts_node=True))
