"""Frees a live worker that is stuck in a collective after its agent has moved to a newer round.

A live worker leaves a round at a step boundary when its agent assigns a newer one, or at once
when a collective fails because a peer died. Neither happens when a peer is *paused* (SIGSTOP,
a frozen node, a partition that drops packets): gloo waits on it until the process-group
timeout, NCCL until its watchdog. The agent, though, has already decided — a lease expired, a
heartbeat went silent — and written a newer round into the worker's control file. This thread
acts on that decision: when the train loop has not left the round ``grace_s`` after a newer
assignment (or a stop) appeared, it ends the round's communication from the side:

- NCCL (any backend but gloo): aborts every process group (``ncclCommAbort`` is safe from
  another thread and unblocks the collective);
- gloo: shuts down the round's TCP connections (``SHUT_RDWR``); the blocked receive reads
  end-of-file and fails with "Connection closed by peer". Measured here (torch 2.13, gloo):
  ``abort()`` from another thread does not unblock a gloo collective; the shutdown does.

The train loop then sees a failed collective and leaves the round as after any peer's failure.
Some waits no shutdown reaches: a rendezvous (a new process group) retrying to connect to a peer
that died has no connection to shut down, and gloo retries until the process-group timeout. If
the loop has still not left the round :data:`GIVE_UP_S` after the interruption, the watchdog
writes every thread's stack to stderr and ends the process (exit :data:`ftrain.contract.exits.STUCK`):
its agent replaces it like any failed worker, which costs one process, not a timeout.
How long it waits first depends on why the round changed. When the new round replaces one that
lost a member (``Assignment.interrupt``: a worker died or hung, a node's lease expired), that
round cannot finish its step anyway: the watchdog acts at once. Otherwise (a node joins, one
leaves gracefully) it allows a grace of three recent step times, at least :data:`MIN_GRACE_S`,
which leaves the normal path alone: every rank reaches the next step boundary well within it
and leaves in agreement, losing no work.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import sys
import threading
import time
from collections.abc import Callable

import torch.distributed as dist

from ftrain.contract import exits
from ftrain.contract.control import Assignment, ControlFile
from ftrain.distributed import sever_connections

log = logging.getLogger(__name__)

MIN_GRACE_S = 1.0
GIVE_UP_S = 10.0
POLL_S = 0.05


def grace_for(step_time_s: float) -> float:
    """How long a rank may take to reach a step boundary once a newer round is assigned."""
    return max(MIN_GRACE_S, 3.0 * step_time_s)


def interrupt_collectives(keep_ports: set[int]) -> str:
    """Make whatever collective this process is blocked in fail now; what was done."""
    backend = dist.get_backend() if dist.is_initialized() else "none"
    if backend != "gloo" and dist.is_initialized():
        dist.distributed_c10d._abort_process_group()  # noqa: SLF001 - aborts every group's communicators
        return f"aborted the {backend} process groups"
    return f"shut down {sever_connections(keep_ports)} connection(s)"


class RoundWatchdog:
    """While a worker serves ``current_round``: watch ``control_path`` for a newer assignment."""

    def __init__(
        self,
        control_path: str,
        current_round: int,
        step_time_s: Callable[[], float],
        keep_ports: set[int],
        give_up_s: float = GIVE_UP_S,
    ):
        self._control = ControlFile(control_path)
        self._give_up_s = give_up_s
        self._round = current_round
        self._step_time_s = step_time_s
        self._keep_ports = keep_ports
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name=f"round-watchdog-{current_round}", daemon=True)
        #: why the watchdog interrupted the round ("" while it has not)
        self.fired = ""

    def __enter__(self) -> RoundWatchdog:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _newer_assignment(self) -> Assignment | None:
        if not self._control.changed():
            return None
        try:
            assignment = self._control.read()
        except ValueError:
            return None
        if assignment is None or not (assignment.stop or assignment.round > self._round):
            return None
        return assignment

    def _watch(self) -> None:
        seen_at, newer = 0.0, None
        while not self._stop.wait(POLL_S):
            if newer is None:
                newer = self._newer_assignment()
                seen_at = time.monotonic()
                if newer is None:
                    continue
            grace_s = 0.0 if newer.interrupt else grace_for(self._step_time_s())
            if time.monotonic() - seen_at < grace_s:
                continue
            done = interrupt_collectives(self._keep_ports)
            why = "it lost a member" if newer.interrupt else "it had not reached a step boundary"
            self.fired = (
                f"a newer round was assigned {time.monotonic() - seen_at:.2f}s ago; left round {self._round} "
                f"because {why}: {done}"
            )
            log.warning("round watchdog: %s", self.fired)
            if not self._stop.wait(self._give_up_s):
                self._give_up()
            return

    def _give_up(self) -> None:
        log.error(
            "round watchdog: still in round %d %.0fs after interrupting it; ending this worker (exit %d) "
            "so that its agent replaces it. Every thread's stack:",
            self._round,
            self._give_up_s,
            exits.STUCK,
        )
        for handler in logging.getLogger().handlers:
            handler.flush()
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        os._exit(exits.STUCK)  # the main thread is blocked: no orderly exit can run


__all__ = ["RoundWatchdog", "grace_for", "interrupt_collectives", "MIN_GRACE_S", "GIVE_UP_S"]
