"""The small parts an :class:`ftrain.agents.agent.Agent` is assembled from, as protocols: its clock,
its workers' heartbeats and its event sink (the job store is :mod:`ftrain.agents.jobstore`, the worker
launcher :mod:`ftrain.agents.workers`, the metrics :class:`ftrain.agents.metrics.AgentMetrics`).

Production parts: :class:`SystemClock`, :class:`ftrain.agents.heartbeat.HeartbeatServer` and
:class:`ftrain.contract.events.EventLog`; :mod:`ftrain.agents.assemble` wires them. Unit tests pass in-memory
ones and a fake clock. What must stay true: every monotonic time the agent compares (beats'
``received_at``, the workers' ``started_at``) comes from the same clock as ``Clock.monotonic``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, Protocol

from ftrain.agents.heartbeat import Beat, RankTotals
from ftrain.contract.events import Record


class Clock(Protocol):
    def time(self) -> float:
        """Wall-clock seconds since the epoch: times written to records other hosts read."""
        ...

    def monotonic(self) -> float:
        """Seconds on a clock that never goes back: intervals and deadlines on this host."""
        ...


class SystemClock:
    """The real clocks (:func:`time.time`, :func:`time.monotonic`)."""

    def time(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.monotonic()


class Heartbeats(Protocol):
    """This node's end of the worker heartbeat channel (see :mod:`ftrain.agents.heartbeat`)."""

    path: str  #: where the workers send their beats (``FTRAIN_HEARTBEAT``)

    def reset(self, round_: int) -> None:
        """Forget the beats of earlier rounds; accept only ``round_`` from now on."""
        ...

    def carry(self, beats: Mapping[int, Beat], now: float) -> None:
        """After :meth:`reset`: let the last beats of kept processes (local rank -> beat) stand
        for them until their first beat of the new round, so that one that froze as the round
        changed is found by its silence (``hang_timeout_s``), not by the start timeout."""
        ...

    def beats(self) -> dict[int, Beat]:
        """The newest beat of each local rank of the current round (``received_at`` and
        ``alive_at`` on the agent's monotonic clock)."""
        ...

    def take_totals(self) -> dict[int, RankTotals]:
        """Local rank -> what its training beats since the last call add up to."""
        ...

    def close(self) -> None: ...


class EventSink(Protocol):
    """Where lifecycle events go (:class:`ftrain.contract.events.EventLog` writes JSON lines)."""

    def emit(self, record: Record) -> Any: ...

    def close(self) -> None: ...
