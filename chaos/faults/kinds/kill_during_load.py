"""``kill_during_load``: with S3 slowed by ``latency_s`` (default 0.3 s), every worker of the
current round is SIGKILLed (the fault starts there): nobody holds the state any more, so under
either recovery mode the next round loads it from storage; one of the loading workers is killed
while it loads, recorded as a ``chaos_fault_step`` of the same fault. The job recovers again.
(Killing one worker would not do: under live recovery its replacement heals from a live peer.
Nor does a scenario with ``job.memory_tier``: the new workers restore from their nodes' memory.)"""

from __future__ import annotations

import signal
import time
from typing import Any

from ftrain.chaos.faults.registry import FAULTS, Fault, Outcome
from ftrain.chaos.faults.spec import Context, FaultError, FaultSpec
from ftrain.chaos.faults.targets import pick_worker, round_workers, send_signal
from ftrain.chaos.faults.windows import with_slow_storage
from ftrain.contract import events as ev
from ftrain.contract.events import Event
from ftrain.testbed.wait import wait_for


def _loading(ctx: Context, after: float) -> bool:
    """A worker started a resume after ``after`` and has not finished it."""
    started = [e for e in ctx.cluster.events(Event.RESUME_STARTED) if e["time"] > after]
    done = {(e["round"], e["rank"]) for e in ctx.cluster.events(Event.RESUMED)}
    return any((e["round"], e["rank"]) not in done for e in started)


def _act(ctx: Context, spec: FaultSpec) -> dict[str, Any]:
    if ctx.memory_dir is not None:
        raise FaultError(
            f"{spec.kind}: with job.memory_tier the new workers restore from the snapshots their nodes "
            "kept, not from storage: there is no load to kill during (run it in a scenario without memory_tier)"
        )

    def act() -> dict[str, Any]:
        node, pid = pick_worker(ctx, spec.node)
        everyone = round_workers(ctx)
        step = ctx.cluster.step()
        t0 = time.time()
        record = ctx.emit(spec.kind, node=node, pid=pid, pids=everyone, step=step)  # its time: the kill's
        for victim in everyone:
            send_signal(victim, signal.SIGKILL)
        wait_for(lambda: _loading(ctx, t0), 120, "a checkpoint load", poll_s=0.01)
        victim_node, victim = pick_worker(ctx, spec.node)
        send_signal(victim, signal.SIGKILL)
        ctx.events.emit(ev.ChaosFaultStep(kind=spec.kind, node=victim_node, pid=victim, during="load"))
        record.update(load_victim=victim)
        return record

    return with_slow_storage(ctx, float(spec.params.get("latency_s", 0.3)), act)


FAULT = FAULTS.register(Fault(kind="kill_during_load", act=_act, outcome=Outcome.NEW_ROUND))
