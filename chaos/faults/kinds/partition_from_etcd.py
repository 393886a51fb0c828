"""``partition_from_etcd``: a node still reaches its peers and S3 but not etcd: every etcd member
drops what it would send back to the node (silent: the node's requests hang), for ``duration_s``
(default 6 s) or until ``heal_at_step``. Its lease expires while its collectives still work: its
agent must stop its workers, and its workers must not commit (the commit record needs etcd); the
others go on in a new round, and the node rejoins after the heal. Needs ``network = "netns"``."""

from __future__ import annotations

from typing import Any

from chaos.faults.cuts import held, target
from chaos.faults.registry import FAULTS, Fault, Outcome
from chaos.faults.spec import Context, FaultSpec
from chaos.hosts import ETCD_HOSTS


def _act(ctx: Context, spec: FaultSpec) -> dict[str, Any]:
    net = ctx.need_net(spec.kind)
    node = target(ctx, spec)

    def cut() -> None:
        for member in ETCD_HOSTS:
            net.cut(node, member)

    def heal() -> None:
        for member in ETCD_HOSTS:
            net.heal(node, member)

    return held(ctx, spec, node, cut, heal, default_s=6.0, cut_from=list(ETCD_HOSTS))


FAULT = FAULTS.register(Fault(kind="partition_from_etcd", act=_act, outcome=Outcome.NEW_ROUND, cuts_node=True))
