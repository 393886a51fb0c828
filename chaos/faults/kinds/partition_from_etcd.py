"""``partition_from_etcd``: a node still reaches its peers and S3 but not etcd: every etcd member
drops what it would send back to the node (silent: the node's requests hang), for ``duration_s``
(default 6 s) or until ``heal_at_step``. Its lease expires while its collectives still work: its
agent must stop its workers, and its workers must not commit (the commit record needs etcd); the
others go on in a new round, and the node rejoins after the heal. Needs ``network = "netns"``."""

from __future__ import annotations

from typing import Any

from ftrain.chaos.faults.cuts import cut_off_from, target
from ftrain.chaos.faults.registry import FAULTS, Fault, Outcome
from ftrain.chaos.faults.spec import Context, FaultSpec
from ftrain.chaos.hosts import ETCD_HOSTS


def _act(ctx: Context, spec: FaultSpec) -> dict[str, Any]:
    ctx.need_net(spec.kind)
    return cut_off_from(ctx, spec, target(ctx, spec), list(ETCD_HOSTS), default_s=6.0)


FAULT = FAULTS.register(Fault(kind="partition_from_etcd", act=_act, outcome=Outcome.NEW_ROUND, cuts_node=True))
