"""``worker_kill``: a live worker of the current round gets ``signal`` (default ``SIGKILL``; also
``SIGTERM``, ``SIGSEGV``, ``SIGABRT``, ``SIGINT``). The job restarts its workers in a new round."""

from __future__ import annotations

import signal
from typing import Any

from ftrain.chaos.faults.registry import FAULTS, Fault, Outcome
from ftrain.chaos.faults.spec import Context, FaultSpec
from ftrain.chaos.faults.targets import pick_worker, send_signal

SIGNALS = {
    "SIGKILL": signal.SIGKILL,
    "SIGTERM": signal.SIGTERM,
    "SIGSEGV": signal.SIGSEGV,
    "SIGABRT": signal.SIGABRT,
    "SIGINT": signal.SIGINT,
}


def _act(ctx: Context, spec: FaultSpec) -> dict[str, Any]:
    node, pid = pick_worker(ctx, spec.node)
    name = spec.params.get("signal", "SIGKILL")
    record = ctx.emit(spec.kind, node=node, pid=pid, signal=name, step=ctx.cluster.step())  # the time it acts
    send_signal(pid, SIGNALS[name])
    return record


FAULT = FAULTS.register(Fault(kind="worker_kill", act=_act, outcome=Outcome.NEW_ROUND))
