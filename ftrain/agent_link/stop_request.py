"""A request to stop this process at the next step boundary: SIGTERM, from its agent draining the
node, or from ``scancel``/a time limit/a pod's eviction, which signal every process of the node's
job.

One flag per process, set by the handler :func:`install` puts in place once: not per trainer or
per round. A live worker builds a new trainer for every round, and a SIGTERM that arrived while it
joined, built, restored or waited between rounds was recorded on the trainer it was leaving and
lost: the workers trained on until the agent's drain timeout killed them (a SIGTERM about 2 s
after a node rejoined, 3 of 3 tries on a real Slurm). Now whatever the worker does when it
arrives, the next step boundary stops (the step saved) or, between rounds, the worker leaves.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType

_requested = threading.Event()


def install() -> bool:
    """Make SIGTERM request a stop (idempotent); False where signals cannot be set (not the main
    thread): then only the agent's kill stops this process."""
    try:
        signal.signal(signal.SIGTERM, _on_sigterm)
    except (ValueError, TypeError):
        return False
    return True


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    _requested.set()


def request() -> None:
    """Ask this process to stop at its next step boundary (what SIGTERM does)."""
    _requested.set()


def requested() -> bool:
    """Whether this process was asked to stop."""
    return _requested.is_set()


__all__ = ["install", "request", "requested"]
