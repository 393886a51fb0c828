"""Whom a fault acts on: the job's current round, its nodes with running workers, a live worker,
and signals to processes that may already be gone."""

from __future__ import annotations

import os
import signal
import time

from ftrain.agent_link.heartbeat import process_gone
from ftrain.agents.etcd import EtcdClient
from ftrain.agents.job_keys import JobKeys
from ftrain.chaos.faults.spec import Context, FaultError
from ftrain.contract import events as ev
from ftrain.contract.events import Event
from ftrain.contract.local_files import replace_file
from ftrain.testbed.wait import WaitTimeout, wait_for


def current_round(ctx: Context) -> int:
    rounds = ctx.cluster.events(Event.ROUND_FORMED)
    return max((e["new_round"] for e in rounds), default=0)


def running_nodes(ctx: Context) -> list[str]:
    """Live nodes whose workers of the current round have started."""
    g = current_round(ctx)
    return sorted(n for n in ctx.cluster.live_nodes() if ctx.cluster.worker_pids(n, g))


def pick_node(ctx: Context, node: str) -> str:
    """``node`` once it runs workers; if ``node`` is empty, a seeded choice among running nodes."""
    nodes = wait_for(lambda: running_nodes(ctx), 120, "a node with running workers")
    if node:
        wait_for(lambda: node in running_nodes(ctx), 120, f"node {node} to run workers")
        return node
    return ctx.rng.choice(nodes)


def pick_worker(ctx: Context, node: str) -> tuple[str, int]:
    """A live worker of the current round on ``node`` (any node if empty), waiting while a
    restart is under way."""

    def pick() -> tuple[str, int] | None:
        chosen = pick_node(ctx, node)
        pids = [p for p in ctx.cluster.worker_pids(chosen, current_round(ctx)) if not process_gone(p)]
        return (chosen, ctx.rng.choice(sorted(pids))) if pids else None

    try:
        return wait_for(pick, 120, "a live worker", poll_s=0.1)
    except WaitTimeout:
        raise FaultError("no live worker to act on within 120 s") from None


def round_workers(ctx: Context) -> list[int]:
    """Every live worker of the current round, on every node."""
    g = current_round(ctx)
    return sorted(p for n in ctx.cluster.live_nodes() for p in ctx.cluster.worker_pids(n, g) if not process_gone(p))


def send_signal(pid: int, sig: int) -> None:
    """Signal ``pid``; a process already gone is not an error."""
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def is_stopped(pid: int) -> bool:
    """Whether ``pid`` is stopped (SIGSTOP): state T in ``/proc``."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def continue_process(pid: int) -> None:
    """SIGCONT ``pid`` if it is still there."""
    send_signal(pid, signal.SIGCONT)


def bring_back(ctx: Context, node: str, after_s: float, *, unless_stopped: bool = False) -> None:
    """Start ``node``'s agent again once the job has seen it gone (its lease is gone: a node id
    whose lease is alive is refused), ``after_s`` later; recorded as ``chaos_node_back`` (part of
    the fault, not a new one). ``unless_stopped``: not once the run is over."""
    with EtcdClient(ctx.cluster.etcd_endpoints, timeout_s=2.0, retry_timeout_s=10.0) as client:
        key = JobKeys(ctx.cluster.job).node(node)
        wait_for(lambda: ctx.stop() or client.get(key) is None, 60, f"node {node}'s lease to go", poll_s=0.1)
    time.sleep(after_s)  # the time the node stays away: the fault's parameter, not synchronisation
    if unless_stopped and ctx.stop():
        return
    ctx.cluster.restart(node)
    ctx.events.emit(ev.ChaosNodeBack(node=node))


def ask_worker(ctx: Context, pid: int, request: str) -> None:
    """Ask worker ``pid`` for a fault it makes itself after its next optimizer update
    (``FTRAIN_FAULT_REQUESTS_DIR``, :mod:`ftrain.faults`): ``param``, ``exp_avg`` or ``stuck``."""
    where = ctx.cluster.requests_dir
    where.mkdir(exist_ok=True)
    replace_file(where / str(pid), request.encode())  # whole, at once: the worker reads it at a step boundary
