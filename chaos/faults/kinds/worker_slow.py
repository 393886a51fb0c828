"""``worker_slow``: a live worker runs on a stop/continue duty cycle (``stop_s`` stopped,
``run_s`` running) for ``duration_s``; it is always continued at the end. Slow is not dead: the
job rides it out, but the leader must flag the node as a straggler (``straggler_detected``;
under ``agent.on_straggler = evict`` it also leaves it out for a while)."""

from __future__ import annotations

import signal
import time
from typing import Any

from chaos.faults.registry import FAULTS, Fault, Outcome
from chaos.faults.spec import Context, FaultSpec
from chaos.faults.targets import pick_worker, send_signal
from contract.events import Event
from ftrain.heartbeat import process_gone


def _act(ctx: Context, spec: FaultSpec) -> dict[str, Any]:
    node, pid = pick_worker(ctx, spec.node)
    duration_s = float(spec.params.get("duration_s", 5.0))
    stop_s, run_s = float(spec.params.get("stop_s", 0.1)), float(spec.params.get("run_s", 0.2))
    record = ctx.emit(spec.kind, node=node, pid=pid, duration_s=duration_s, step=ctx.cluster.step())
    end = time.monotonic() + duration_s
    try:
        while time.monotonic() < end and not process_gone(pid):
            send_signal(pid, signal.SIGSTOP)
            time.sleep(stop_s)
            send_signal(pid, signal.SIGCONT)
            time.sleep(run_s)
    finally:
        send_signal(pid, signal.SIGCONT)
    return record


FAULT = FAULTS.register(
    Fault(
        kind="worker_slow",
        act=_act,
        outcome=Outcome.RIDDEN_OUT,
        detected_by=(Event.STRAGGLER_DETECTED,),
        must_be_detected=True,
    )
)
