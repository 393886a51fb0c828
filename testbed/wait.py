"""Waiting on a condition with a deadline: the one way tests, benchmarks, chaos and the demo wait
(never a bare sleep as synchronisation)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


class WaitTimeout(AssertionError):
    """A condition did not come true in time (an AssertionError so tests report it as a failure)."""


def wait_for(
    predicate: Callable[[], Any],
    timeout_s: float,
    what: str,
    *,
    poll_s: float = 0.05,
    alive: Callable[[], bool] | None = None,
    context: Callable[[], str] | None = None,
) -> Any:
    """Poll ``predicate`` until it returns something truthy, and return that.

    :class:`WaitTimeout` at the deadline, or as soon as ``alive()`` says that what could make it
    true is gone (one last look at ``predicate`` first: its final output may have just landed).
    ``context()`` (logs, say) is added to the message.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if alive is not None and not alive():
            value = predicate()
            if value:
                return value
            why = f"what could make it true exited while waiting for {what}"
            break
        if time.monotonic() > deadline:
            why = f"timed out after {timeout_s:.0f}s waiting for {what}"
            break
        time.sleep(poll_s)
    raise WaitTimeout(why + (f"\n{context()}" if context is not None else ""))
