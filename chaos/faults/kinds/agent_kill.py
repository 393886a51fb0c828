"""``agent_kill``: node loss. The node's agent is SIGKILLed and, unless ``with_workers = false``,
its workers too (the whole host is gone, with its memory: the node's memory-tier directory where
the scenario keeps one). With ``restart_after_s`` the node comes back that long
after the job saw it gone (its lease expired: a node id whose lease is alive is refused), recorded
as ``chaos_node_back``. The job goes on in a new round; the killed agent's exit code is not judged."""

from __future__ import annotations

import shutil
import signal
from typing import Any

from ftrain.chaos.faults.registry import FAULTS, Fault, Outcome
from ftrain.chaos.faults.spec import Context, FaultSpec
from ftrain.chaos.faults.targets import bring_back, pick_node, send_signal
from ftrain.recovery.tier_store import TierStore


def _act(ctx: Context, spec: FaultSpec) -> dict[str, Any]:
    node = pick_node(ctx, spec.node)
    workers = ctx.cluster.worker_pids(node)
    ctx.cluster.kill_agent(node)
    if spec.params.get("with_workers", True):  # the whole host is gone, not just its agent
        for pid in workers:
            send_signal(pid, signal.SIGKILL)
        if ctx.memory_dir is not None:  # and its host memory with it
            shutil.rmtree(TierStore(str(ctx.memory_dir), ctx.cluster.job, node, 0).node_dir, ignore_errors=True)
    record = ctx.emit(spec.kind, node=node, pid=ctx.cluster.agents[node].pid, step=ctx.cluster.step())
    ctx.cluster.agents[node].wait()
    restart_after_s = spec.params.get("restart_after_s")
    if restart_after_s is not None:
        bring_back(ctx, node, float(restart_after_s))
    return record


FAULT = FAULTS.register(Fault(kind="agent_kill", act=_act, outcome=Outcome.NEW_ROUND, kills_agent=True))
