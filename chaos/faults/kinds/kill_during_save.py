"""``kill_during_save``: with S3 slowed by ``latency_s`` (default 0.2 s) to widen the window, a
worker is SIGKILLed while a checkpoint upload is in flight (staged, neither committed nor failed).
The job restarts its workers; the half-written step must never be loaded."""

from __future__ import annotations

import signal
from typing import Any

from ftrain.chaos.faults.registry import FAULTS, Fault, Outcome
from ftrain.chaos.faults.spec import Context, FaultSpec
from ftrain.chaos.faults.targets import pick_worker, send_signal
from ftrain.chaos.faults.windows import with_slow_storage
from ftrain.contract.events import Event
from ftrain.testbed.wait import wait_for


def _in_flight_upload(ctx: Context) -> int | None:
    """The newest step staged and neither committed nor failed yet."""
    committed = {e["step"] for e in ctx.cluster.events(Event.CKPT_COMMITTED)}
    failed = {e["step"] for e in ctx.cluster.events(Event.CKPT_FAILED)}
    staged = [e["step"] for e in ctx.cluster.events(Event.CKPT_STAGED)]
    pending = [s for s in staged if s not in committed and s not in failed]
    return pending[-1] if pending else None


def _act(ctx: Context, spec: FaultSpec) -> dict[str, Any]:
    def act() -> dict[str, Any]:
        step = wait_for(lambda: _in_flight_upload(ctx), 120, "a checkpoint upload in flight", poll_s=0.01)
        node, pid = pick_worker(ctx, spec.node)
        record = ctx.emit(spec.kind, node=node, pid=pid, ckpt_step=step, step=ctx.cluster.step())  # the time it acts
        send_signal(pid, signal.SIGKILL)
        return record

    return with_slow_storage(ctx, float(spec.params.get("latency_s", 0.2)), act)


FAULT = FAULTS.register(Fault(kind="kill_during_save", act=_act, outcome=Outcome.NEW_ROUND))
