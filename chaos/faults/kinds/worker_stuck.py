"""``worker_stuck``: a live worker of the current round gets stuck in its own code after its next
optimizer update (``FTRAIN_FAULT_REQUESTS_DIR``, ``ftrain/faults.py``): its training thread waits
for good outside any collective while the process stays alive and its other threads (the "alive"
datagrams) run on, as under a deadlocked data loader. No collective timeout reaches it and its
peers wait for it in their next collective; the agents must find it (no step for
``hang_timeout_s``, alive, in no collective: the culprit), end it and go on in a new round."""

from __future__ import annotations

from typing import Any

from ftrain.chaos.faults.registry import FAULTS, Fault, Outcome
from ftrain.chaos.faults.spec import Context, FaultSpec
from ftrain.chaos.faults.targets import ask_worker, pick_worker
from ftrain.faults import STUCK


def _act(ctx: Context, spec: FaultSpec) -> dict[str, Any]:
    node, pid = pick_worker(ctx, spec.node)
    record = ctx.emit(spec.kind, node=node, pid=pid, step=ctx.cluster.step())
    ask_worker(ctx, pid, STUCK)
    return record


FAULT = FAULTS.register(Fault(kind="worker_stuck", act=_act, outcome=Outcome.NEW_ROUND))
