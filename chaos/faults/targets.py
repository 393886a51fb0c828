"""Whom a fault acts on: the job's current round, its nodes with running workers, a live worker,
and signals to processes that may already be gone."""

from __future__ import annotations

import os
import signal

from ftrain.agent_link.heartbeat import process_gone
from ftrain.chaos.faults.spec import Context, FaultError
from ftrain.contract.events import Event
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
