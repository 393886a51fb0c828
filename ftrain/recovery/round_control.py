"""How a process that serves rounds (``ftrain worker``, or a user's loop under
:meth:`ftrain.Session.run`) hears of them: the assignments its agent writes into its control file,
the store of a new round, and which errors mean that a peer is gone rather than a bug of its own.
Light on purpose (no trainer, no model): a user's loop imports it."""

from __future__ import annotations

import logging
import socket
import time
import urllib.parse
from collections.abc import Callable

import torch.distributed as dist

from ftrain.contract.control import Assignment, ControlFile

log = logging.getLogger(__name__)

POLL_S = 0.01


class RoundEnded(Exception):  # noqa: N818 - a signal to the loop that serves rounds, not an error
    """A newer round was assigned: every rank left at the same step boundary, with the step complete."""


#: substrings of the errors a collective raises when a peer is gone (gloo, NCCL, the store);
#: any other error is the worker's own and ends it (a peer waiting on it then sees it gone)
PEER_FAILURE_MARKERS = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "connection refused",
    "socket timeout",
    "timed out",
    "nccl",
    "gloo",
)


class AssignmentTimeout(RuntimeError):
    """No (newer) assignment arrived in time: the agent gave up on this worker."""


def is_peer_failure(e: BaseException) -> bool:
    """Whether ``e`` looks like a failed collective (a peer died or left), not a local error."""
    if isinstance(e, dist.DistError):
        return True
    if not isinstance(e, RuntimeError) or isinstance(e, RoundEnded):
        return False
    text = str(e).lower()
    return any(marker in text for marker in PEER_FAILURE_MARKERS)


class StopRequested(Exception):  # noqa: N818 - not an error: the process was asked to stop
    """This process was asked to stop (SIGTERM) while it waited for an assignment."""


def wait_for_assignment(
    control: ControlFile,
    newer_than: int,
    timeout_s: float | None,
    stop_requested: Callable[[], bool] = lambda: False,
) -> Assignment:
    """The first assignment in ``control`` for a round above ``newer_than``; AssignmentTimeout
    after ``timeout_s`` (None: wait as long as the agent lives; its death ends this process);
    StopRequested as soon as ``stop_requested()`` says so."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    first = True  # the file may have changed before this call (the train loop saw it): read it once
    while True:
        if stop_requested():
            raise StopRequested(f"asked to stop while waiting for a round after {newer_than}")
        if control.changed() or first:
            first = False
            try:
                assignment = control.read()
            except ValueError as e:  # written by our own agent: log, keep waiting for a good one
                log.error("unusable assignment in %s: %s", control.path, e)
                assignment = None
            if assignment is not None and (assignment.stop or assignment.round > newer_than):
                return assignment
        if deadline is not None and time.monotonic() > deadline:
            raise AssignmentTimeout(f"no assignment for a round after {newer_than} within {timeout_s:.0f}s")
        time.sleep(POLL_S)


def newer_round_assigned(control: ControlFile, current: int) -> Callable[[], bool]:
    """A cheap check for the train loop (one ``stat`` unless the file changed)."""
    pending = False

    def check() -> bool:
        nonlocal pending
        if not pending and control.changed():
            try:
                assignment = control.read()
            except ValueError:
                return False
            pending = assignment is not None and (assignment.stop or assignment.round > current)
        return pending

    return check


def wait_for_store(host: str, port: int, timeout_s: float, newer: Callable[[], bool] = lambda: False) -> None:
    """Until the round's store (hosted by rank 0) accepts connections. torch's store client
    backs off for about a second after a refused connection, and the ranks of a new round read
    their assignments within milliseconds of each other, so most would otherwise pay it: measured
    here, joining a round took 1.1 s that way and a few ms after this wait. On timeout it
    returns and lets the store client report the error. RoundEnded once ``newer()`` says a newer
    round was assigned (rank 0 never hosted this one: it failed or left), so that this rank
    leaves with what it holds instead of waiting out the timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if newer():
            raise RoundEnded(f"a newer round was assigned while waiting for the round's store at {host}:{port}")
        try:
            with socket.create_connection((host, port), timeout=1.0):
                return
        except OSError:
            time.sleep(0.005)


def service_ports(*urls: str) -> set[int]:
    """Remote ports whose connections survive a round change: those of ``urls`` (the checkpoint
    storage's endpoint, etcd's: their clients pool connections across rounds), and HTTP(S)."""
    ports = {80, 443}
    for url in urls:
        port = urllib.parse.urlsplit(url).port if url else None
        if port:
            ports.add(port)
    return ports


__all__ = [
    "AssignmentTimeout",
    "RoundEnded",
    "is_peer_failure",
    "service_ports",
    "newer_round_assigned",
    "wait_for_assignment",
    "wait_for_store",
]
