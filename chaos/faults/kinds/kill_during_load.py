"""``kill_during_load``: with S3 slowed by ``latency_s`` (default 0.3 s), a kill forces a restart
(the fault starts there); the restarted workers are killed while they load, recorded as a
``chaos_fault_step`` of the same fault. The job restarts its workers again."""

from __future__ import annotations

import signal
import time
from typing import Any

from chaos.faults.registry import FAULTS, Fault, Outcome
from chaos.faults.spec import Context, FaultSpec
from chaos.faults.targets import pick_worker, send_signal
from chaos.faults.windows import with_slow_storage
from contract import events as ev
from contract.events import Event
from testbed.wait import wait_for


def _loading(ctx: Context, after: float) -> bool:
    """A worker started a resume after ``after`` and has not finished it."""
    started = [e for e in ctx.cluster.events(Event.RESUME_STARTED) if e["time"] > after]
    done = {(e["round"], e["rank"]) for e in ctx.cluster.events(Event.RESUMED)}
    return any((e["round"], e["rank"]) not in done for e in started)


def _act(ctx: Context, spec: FaultSpec) -> dict[str, Any]:
    def act() -> dict[str, Any]:
        node, pid = pick_worker(ctx, spec.node)
        t0 = time.time()
        send_signal(pid, signal.SIGKILL)
        record = ctx.emit(spec.kind, node=node, pid=pid, step=ctx.cluster.step())
        wait_for(lambda: _loading(ctx, t0), 120, "a checkpoint load", poll_s=0.01)
        victim_node, victim = pick_worker(ctx, spec.node)
        send_signal(victim, signal.SIGKILL)
        ctx.events.emit(ev.ChaosFaultStep(kind=spec.kind, node=victim_node, pid=victim, during="load"))
        record.update(load_victim=victim)
        return record

    return with_slow_storage(ctx, float(spec.params.get("latency_s", 0.3)), act)


FAULT = FAULTS.register(Fault(kind="kill_during_load", act=_act, outcome=Outcome.NEW_ROUND))
