"""When the memory tier takes a snapshot: pure functions of figures every rank of a round agrees on.

A snapshot's exchange is collective over the tier's group, so every rank of a round must take the
same snapshots, at the same steps. The schedule's whole state is ``(next_step, interval)``, and it
changes only at points every rank passes together, from values every rank holds alike:

- a round starts (:meth:`ftrain.recovery.memory_tier.MemoryTier.join_round`): ``interval =
  base_interval(setting)`` and ``next_step = 0`` (a snapshot at the round's first step boundary),
  whatever a rank did in earlier rounds — a kept rank's measured interval is not a fresh spare's;
- a snapshot is due at a step boundary when :func:`is_due` (the step reached ``next_step``, or it
  was just checkpointed: every rank checkpoints the same steps);
- as one starts, the one before it is complete on every rank (while it is still exchanging on
  any rank, every rank puts the new one off to the next step boundary, :func:`put_off`: no
  training thread blocks on a slow exchange, and a checkpointed step's snapshot is still owed, so
  the tier catches up with storage as soon as it can), and the ranks have told each other, on
  the training group, whether theirs succeeded: ``interval = next_interval(setting, interval,
  figures)``, with the slowest rank's figures of the one before
  (:class:`Figures`, agreed by the tier's all-reduce) or ``None`` when any rank's failed (the
  interval then stays); ``next_step = step + interval``.

So a snapshot that fails on one rank leaves every rank with the same schedule, and a rank that
joins a round (a spare) starts from the same state as the ranks that were kept.
"""

from __future__ import annotations

import math
from typing import NamedTuple

#: with ``checkpoint.memory_interval = -1``: the share of training time a snapshot may block
AUTO_BLOCKED_SHARE = 0.02
#: the longest interval chosen (a snapshot at least this often, whatever was measured)
MAX_INTERVAL = 1_000_000


class Figures(NamedTuple):
    """What a completed snapshot measured, the maximum over the round's ranks."""

    blocked_s: float  #: the training thread's share: staging the state into host memory
    seconds: float  #: staging to a complete exchange with the buddy
    step_time_s: float  #: the last training step's wall time


def base_interval(setting: int) -> int:
    """The interval a round starts with (``checkpoint.memory_interval``; -1: every step until a
    snapshot was measured)."""
    return max(1, setting)


def next_interval(setting: int, current: int, figures: Figures | None) -> int:
    """``setting = -1``: as often as blocking stays within :data:`AUTO_BLOCKED_SHARE` of the
    training time, and no more often than a snapshot completes; ``current`` when nothing (or
    nothing usable) was measured, or the setting is a fixed interval."""
    if setting != -1 or figures is None:
        return current
    blocked_s, seconds, step_time_s = figures
    if not all(math.isfinite(v) and v >= 0 for v in figures) or step_time_s <= 0:
        return current
    wanted = max(1.0, blocked_s / (AUTO_BLOCKED_SHARE * step_time_s), seconds / step_time_s)
    return min(MAX_INTERVAL, math.ceil(wanted))


def is_due(step: int, next_step: int, checkpointed: bool) -> bool:
    """A snapshot at this step boundary: the schedule reached it, or the step was just
    checkpointed (the tier is then never older than storage, which a restore would prefer)."""
    return checkpointed or step >= next_step


def put_off(step: int, next_step: int) -> int:
    """``next_step`` after a snapshot due at ``step`` was put off (the one before still exchanging
    on some rank): due at the next step boundary. Without it, a snapshot due only because its step
    was checkpointed would wait for the schedule, and until then the tier would be older than
    storage: a restore would refuse it and read storage."""
    return min(next_step, step + 1)


__all__ = ["AUTO_BLOCKED_SHARE", "Figures", "MAX_INTERVAL", "base_interval", "is_due", "next_interval", "put_off"]
