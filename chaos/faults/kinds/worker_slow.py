"""``worker_slow``: a live worker runs on a stop/continue duty cycle (``stop_s`` stopped,
``run_s`` running) for ``duration_s``; it is always continued at the end. Slow is not dead: the
job rides it out, and the leader must flag the node as a straggler (``straggler_detected``;
under ``agent.on_straggler = evict`` it also leaves it out for a while) when the slowdown is one
the agents' rule says they flag (:func:`ftrain.agents.leader.slowdown_flagged`: its nominal factor
``(stop_s + run_s) / run_s`` and its length, against the job's straggler settings), and the
node had peers the leader was judging it against when it began (and no longer looked slow from
a slowdown just before: each slowdown is a straggler episode of its own). The fault's record says which
(``detection_owed``, and ``why`` not); ``ftrain.chaos.invariants.faults_handled`` holds the job to it.
"""

from __future__ import annotations

import signal
import statistics
import time
from typing import Any

from ftrain.agent_link.heartbeat import process_gone
from ftrain.agents.config import settings_of_flags
from ftrain.agents.etcd import EtcdClient
from ftrain.agents.job_keys import JobKeys
from ftrain.agents.leader import Policy, slowdown_flagged
from ftrain.agents.records import MAX_RECORD_BYTES
from ftrain.chaos.faults.registry import FAULTS, Fault, Outcome
from ftrain.chaos.faults.spec import Context, FaultSpec
from ftrain.chaos.faults.targets import current_round, pick_worker, running_nodes, send_signal
from ftrain.contract.bounded_json import VALUE_ERRORS, loads
from ftrain.contract.events import Event
from ftrain.testbed.wait import WaitTimeout, wait_for

#: how long the fault waits for the leader to be judging the target against a peer
JUDGED_WAIT_S = 30.0


def _judged(ctx: Context, node: str, policy: Policy) -> bool:
    """Whether ``node`` and a peer in the current round publish a busy time the leader compares
    (their agents' windows hold judged beats: not reset by a new round or a warming spare), and
    ``node``'s does not look slow: a slowdown just before (another fault) must have ended in the
    statuses, so that this one is a new straggler episode, reported on its own."""
    g = current_round(ctx)
    keys = JobKeys(ctx.cluster.job)
    busy: dict[str, float] = {}
    with EtcdClient(ctx.cluster.etcd_endpoints, timeout_s=2.0, retry_timeout_s=5.0) as client:
        for n in running_nodes(ctx):
            kv = client.get(keys.status(n))
            try:
                status = loads(kv.value, max_bytes=MAX_RECORD_BYTES, what="status") if kv is not None else {}
                busy_s = float(status.get("busy_s", 0))
            except VALUE_ERRORS:  # not a status object, or no number in it (a 400-digit one: OverflowError)
                continue
            if status.get("round") == g and status.get("state") == "running" and busy_s > 0:
                busy[n] = busy_s
    others = [b for n, b in busy.items() if n != node]
    return node in busy and bool(others) and busy[node] <= policy.straggler_factor * statistics.median(others)


def _act(ctx: Context, spec: FaultSpec) -> dict[str, Any]:
    node, pid = pick_worker(ctx, spec.node)
    duration_s = float(spec.params.get("duration_s", 5.0))
    stop_s, run_s = float(spec.params.get("stop_s", 0.1)), float(spec.params.get("run_s", 0.2))
    factor = (stop_s + run_s) / run_s
    policy = Policy.of(**settings_of_flags(ctx.cluster.agent_options))
    why = ""
    if not slowdown_flagged(factor, duration_s, policy):
        why = (
            f"a {factor:.2f}x slowdown for {duration_s:g} s is not one the agents must flag "
            f"(agent.straggler_factor {policy.straggler_factor:g}, straggler_after_s {policy.straggler_after_s:g}, "
            f"on_straggler {policy.on_straggler})"
        )
    else:
        try:
            wait_for(lambda: ctx.stop() or _judged(ctx, node, policy), JUDGED_WAIT_S, f"node {node} judged", poll_s=0.2)
        except WaitTimeout:
            why = (
                f"node {node} had no judged peer in round {current_round(ctx)}, or still looked slow, "
                "when the slowdown began"
            )
    record = ctx.emit(
        spec.kind,
        node=node,
        pid=pid,
        duration_s=duration_s,
        stop_s=stop_s,
        run_s=run_s,
        step=ctx.cluster.step(),
        detection_owed=not why,
        **({"why": why} if why else {}),
    )
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
