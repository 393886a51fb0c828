"""Where a user's loop spends its steps, for the agent's accounting and its straggler verdicts.

A session cannot time a loop's forward and backward (the loop is the user's), but it sees enough
to split each interval between two :meth:`ftrain.Session.step` calls the way the agents judge
``ftrain train``'s (:mod:`ftrain.observability.step_phases`):

- ``comm_wait``: time blocked on peers. After backward's last gradient is accumulated (a hook on
  every parameter of the state's module says when) the rank waits for the gradient all-reduce
  that DDP overlapped with backward, then clips and reduces what the loop reduces; that wait ends
  when the state's optimizer starts its update (its step pre-hook). Under :meth:`Session.run`
  the step boundary's agreement (one all-reduce) is a wait too.
- ``ckpt_staging``: saves and memory-tier snapshots taken in ``step()``.
- ``other``: the rest (the loop's data, forward, backward's compute, the update).

A slow rank has more busy time (all but ``comm_wait``) per step than its peers, which wait for it
in ``comm_wait``: the agents' straggler signal. Where gradients are not accumulated through
autograd (FSDP2 assigns its sharded gradients) no hook fires and backward's wait counts as busy;
the boundary's agreement still shows a slow rank's lag under ``run``.
"""

from __future__ import annotations

import contextlib
import math
import time
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from ftrain.observability.metrics import MetricsWriter
from ftrain.session_state import SessionError

#: the phases a session times itself; the rest of an interval is ``other``
TIMED = ("ckpt_staging", "comm_wait")


class StepTiming:
    """A loop's step intervals and their phases for its heartbeat. The first step of a process
    (or of a round) has no interval: it is start-up, not a step."""

    def __init__(self) -> None:
        self._last_at: float | None = None
        self._spent = dict.fromkeys(TIMED, 0.0)  #: seconds of this interval in each timed phase
        self._last_grad_at: float | None = None  #: the newest gradient accumulated, not yet followed by an update
        self._watched: weakref.WeakSet[Any] = weakref.WeakSet()  #: modules and optimizers with our hooks

    def watch(self, module: nn.Module | None, optimizers: list[torch.optim.Optimizer]) -> None:
        """Hook a state's module and optimizers once each (a rollback's rebuilt objects are new)."""
        if module is not None and module not in self._watched:
            for p in module.parameters():
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(self._grad_ready)
            self._watched.add(module)
        for opt in optimizers:
            if opt not in self._watched:
                opt.register_step_pre_hook(self._update_begins)
                self._watched.add(opt)

    def _grad_ready(self, param: object) -> None:
        self._last_grad_at = time.monotonic()

    def _update_begins(self, optimizer: object, args: object, kwargs: object) -> None:
        if self._last_grad_at is not None:  # the first optimizer of a step: the wait ends here
            self._spent["comm_wait"] += time.monotonic() - self._last_grad_at
            self._last_grad_at = None

    def step_done(self) -> dict[str, Any]:
        """A step is done: its heartbeat's ``step_time_s`` and ``phases_s``."""
        now = time.monotonic()
        last, self._last_at = self._last_at, now
        spent, self._spent = self._spent, dict.fromkeys(TIMED, 0.0)
        if last is None:
            return {"step_time_s": 0.0, "phases_s": {}}
        interval_s = now - last
        phases, left_s = {}, interval_s
        for name in TIMED:  # never more than the interval holds
            phases[name] = min(spent[name], left_s)
            left_s -= phases[name]
        return {"step_time_s": interval_s, "phases_s": {"other": left_s, **phases}}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time spent in ``name`` (one of :data:`TIMED`): the session's saves and snapshots, or a
        collective of its own (the step boundary's agreement)."""
        began = time.monotonic()
        try:
            yield
        finally:
            self._spent[name] += time.monotonic() - began

    def restart(self) -> None:
        """A new round: its first step is its warm-up."""
        self._last_at, self._spent, self._last_grad_at = None, dict.fromkeys(TIMED, 0.0), None


#: every rank's busy and waiting seconds of a step, in rank order (None: not gathered)
RankTimes = tuple[list[float], list[float]] | None


def rank_times(timing: Mapping[str, Any]) -> tuple[float, float]:
    """A step's busy seconds (all but ``comm_wait``) and seconds waiting on peers, from
    :meth:`StepTiming.step_done`'s ``step_time_s`` and ``phases_s``."""
    waited = max(0.0, float(timing["phases_s"].get("comm_wait", 0.0)))
    return max(0.0, float(timing["step_time_s"]) - waited), waited


def boundary_values(flags: tuple[bool, bool], timing: Mapping[str, Any], rank: int, world: int) -> torch.Tensor:
    """What a rank brings to :meth:`ftrain.Session.run`'s step boundary (an all-reduce, MAX): two
    flags, then its busy and waiting seconds in its own slots of every rank's (the others' zero)."""
    values = torch.zeros(2 + 2 * world, dtype=torch.float64)
    values[0], values[1] = (float(flag) for flag in flags)
    values[2 + rank], values[2 + world + rank] = rank_times(timing)
    return values


def read_boundary(values: list[float], world: int) -> tuple[bool, bool, RankTimes]:
    """The reduced :func:`boundary_values`: the two flags of any rank, every rank's times."""
    return bool(values[0]), bool(values[1]), (values[2 : 2 + world], values[2 + world :])


class StepLines:
    """Rank 0's metrics lines (``Session(metrics_path=...)``), one per :meth:`ftrain.Session.step`,
    in ``ftrain train``'s form where the session knows the value: ``step``, ``time`` (the step's
    end), ``round``, ``world_size``, ``step_time_s`` and ``phases_s`` (rank 0's, as its heartbeat
    says them), and the loop's own numbers (``step(..., metrics={"loss": ...})``; ``loss``,
    ``grad_norm`` and ``tokens_per_s`` are ``ftrain report``'s curves). Under :meth:`Session.run`
    the step boundary's agreement brings every rank's busy and waiting seconds too
    (``rank_busy_s``, ``rank_comm_wait_s``: the report's heatmap). Each line is flushed: a killed
    process keeps every step it finished. Under live recovery the process that is rank 0 in a
    round writes that round's lines."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._writer: MetricsWriter | None = None
        self._rank = -1

    def open(self, rank: int) -> None:
        """This process is ``rank`` from now on (a new round may give it another)."""
        self._rank = rank
        if self.path and rank == 0 and self._writer is None:
            self._writer = MetricsWriter(self.path)

    def numbers(self, values: Mapping[str, Any] | None) -> dict[str, float]:
        """The loop's numbers for this step's line, checked on every rank (a mistake fails alike
        everywhere, before the step does anything) and read on the writing rank only (a
        tensor's ``.item()`` is a device sync)."""
        writing = self._writing()
        return {_metric_key(key): _metric_value(key, value, read=writing) for key, value in (values or {}).items()}

    def write(
        self,
        step: int,
        timing: Mapping[str, Any],
        numbers: Mapping[str, float],
        *,
        round_: int,
        world_size: int,
        ranks: RankTimes = None,
    ) -> None:
        writer = self._writer
        if writer is None or self._rank != 0:
            return
        line = {"step": step, "time": time.time(), "round": round_, "world_size": world_size, **timing}
        if ranks is not None and timing["step_time_s"] > 0:  # a round's first step is its warm-up: no times
            line["rank_busy_s"], line["rank_comm_wait_s"] = ([round(v, 6) for v in times] for times in ranks)
        writer.write({**line, **numbers})

    def _writing(self) -> bool:
        return self._writer is not None and self._rank == 0

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


#: what a session's metrics line holds before the loop's numbers
LINE_KEYS = ("step", "time", "round", "world_size", "step_time_s", "phases_s", "rank_busy_s", "rank_comm_wait_s")


def _metric_key(key: object) -> str:
    if not isinstance(key, str) or not key or key in LINE_KEYS:
        raise SessionError(
            f"Session.step(metrics=...): key {key!r} is not a new name (the line has {list(LINE_KEYS)}): "
            "give the loop's numbers their own names, such as 'loss'"
        )
    return key


def _metric_value(key: str, value: object, *, read: bool) -> float:
    """``value`` as a float (``read``: only the writing rank reads a tensor, a device sync)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item() if read else 0.0
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SessionError(
            f"Session.step(metrics=...): {key!r} is {type(value).__name__}, not a number (a float, an int or a "
            "one-element tensor)"
        )
    try:
        number = float(value)
    except OverflowError:  # an int past a float's range
        return math.nan
    return number if math.isfinite(number) else math.nan


__all__ = ["TIMED", "StepLines", "StepTiming"]
