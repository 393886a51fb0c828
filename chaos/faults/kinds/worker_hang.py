"""``worker_hang``: a live worker of the current round is stopped (``SIGSTOP``) and never
continued; the agent's hang detection must notice and the job restart its workers."""

from __future__ import annotations

import signal
from typing import Any

from ftrain.chaos.faults.registry import FAULTS, Fault, Outcome
from ftrain.chaos.faults.spec import Context, FaultSpec
from ftrain.chaos.faults.targets import pick_worker, send_signal


def _act(ctx: Context, spec: FaultSpec) -> dict[str, Any]:
    node, pid = pick_worker(ctx, spec.node)
    record = ctx.emit(spec.kind, node=node, pid=pid, step=ctx.cluster.step())  # the time it acts
    send_signal(pid, signal.SIGSTOP)
    return record


FAULT = FAULTS.register(Fault(kind="worker_hang", act=_act, outcome=Outcome.NEW_ROUND))
