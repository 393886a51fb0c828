"""``agent_kill``: node loss. The node's agent is SIGKILLed and, unless ``with_workers = false``,
its workers too (the whole host is gone). With ``restart_after_s`` the node comes back that long
after the job saw it gone (its lease expired: a node id whose lease is alive is refused), recorded
as ``chaos_node_back``. The job goes on in a new round; the killed agent's exit code is not judged."""

from __future__ import annotations

import signal
import time
from typing import Any

from ftrain.agents.etcd import EtcdClient
from ftrain.agents.job_keys import JobKeys
from ftrain.chaos.faults.registry import FAULTS, Fault, Outcome
from ftrain.chaos.faults.spec import Context, FaultSpec
from ftrain.chaos.faults.targets import pick_node, send_signal
from ftrain.contract import events as ev
from ftrain.testbed.wait import wait_for


def _act(ctx: Context, spec: FaultSpec) -> dict[str, Any]:
    node = pick_node(ctx, spec.node)
    workers = ctx.cluster.worker_pids(node)
    ctx.cluster.kill_agent(node)
    if spec.params.get("with_workers", True):  # the whole host is gone, not just its agent
        for pid in workers:
            send_signal(pid, signal.SIGKILL)
    record = ctx.emit(spec.kind, node=node, pid=ctx.cluster.agents[node].pid, step=ctx.cluster.step())
    ctx.cluster.agents[node].wait()
    restart_after_s = spec.params.get("restart_after_s")
    if restart_after_s is not None:
        # the host comes back once the job has seen it gone (its lease expired: a node id whose
        # lease is alive is refused), plus restart_after_s
        with EtcdClient(ctx.cluster.etcd_endpoints, timeout_s=2.0, retry_timeout_s=10.0) as client:
            key = JobKeys(ctx.cluster.job).node(node)
            wait_for(lambda: ctx.stop() or client.get(key) is None, 60, f"node {node}'s lease to expire", poll_s=0.1)
        time.sleep(float(restart_after_s))
        ctx.cluster.restart(node)
        ctx.events.emit(ev.ChaosNodeBack(node=node))  # part of this fault, not a new one
    return record


FAULT = FAULTS.register(Fault(kind="agent_kill", act=_act, outcome=Outcome.NEW_ROUND, kills_agent=True))
