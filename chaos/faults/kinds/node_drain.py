"""``node_drain``: planned maintenance. The node's agent gets ``SIGTERM``: its workers finish the
step, save and exit, and the agent gives up its lease and exits 75 (``exits.DRAINED``; a drain that exits otherwise,
or not within ``drain_timeout_s``, default 60 s, is an error of the run, ``faults_injected``). The
job forms a new round without the node (``node_left``), so the kind owes a new round and its
detection is that round (:attr:`~ftrain.contract.events.Event.ROUND_FORMED`: a drain announces
itself; what the job pays is the time to reorganise). With ``restart_after_s`` the node comes back
that long after its agent exited (its agent started again as agent_kill does, recorded as
``chaos_node_back``) and joins a later round. The drained agent's exit code is checked here, not
skipped: unlike a killed agent, a drained one owes 0."""

from __future__ import annotations

import signal
import subprocess
from typing import Any

from ftrain.chaos.faults.registry import FAULTS, Fault, Outcome
from ftrain.chaos.faults.spec import Context, FaultError, FaultSpec
from ftrain.chaos.faults.targets import bring_back, pick_node
from ftrain.contract import exits
from ftrain.contract.events import Event


def _act(ctx: Context, spec: FaultSpec) -> dict[str, Any]:
    node = pick_node(ctx, spec.node)
    agent = ctx.cluster.agents[node]
    record = ctx.emit(spec.kind, node=node, pid=agent.pid, step=ctx.cluster.step())
    ctx.cluster.kill_agent(node, signal.SIGTERM)
    timeout_s = float(spec.params.get("drain_timeout_s", 60.0))
    try:
        exit_code = agent.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise FaultError(f"{spec.kind}: agent {node} still running {timeout_s:.0f} s after SIGTERM") from None
    record["exit_code"] = exit_code
    if exit_code != exits.DRAINED:
        raise FaultError(f"{spec.kind}: the drained agent of {node} exited {exit_code}, not {exits.DRAINED}")
    restart_after_s = spec.params.get("restart_after_s")
    if restart_after_s is not None and not ctx.stop():
        bring_back(ctx, node, float(restart_after_s), unless_stopped=True)
    return record


FAULT = FAULTS.register(
    Fault(kind="node_drain", act=_act, outcome=Outcome.NEW_ROUND, detected_by=(Event.ROUND_FORMED,))
)
