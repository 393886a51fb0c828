"""The parts a simulated node agent runs with instead of worker processes (the control-plane
benchmark, ``bench/control_plane.py``): workers that never exit, heartbeats of steadily advancing
steps for each local rank, and an event sink that keeps nothing.

What must stay true:

- they satisfy the agent's protocols (:class:`ftrain.agents.workers.Workers`,
  :class:`ftrain.agents.parts.Heartbeats`, :class:`ftrain.agents.parts.EventSink`) using only
  names that exist both in today's tree and at commit 1465eee (the old code the benchmark runs
  side by side): ``Beat``, ``RankTotals`` and ``Launch`` with the fields used here;
- no process is started and no PID is ever signalled: a simulated agent costs only what its
  control plane costs (etcd requests, parsing, deciding, publishing status);
- the workers look healthy: a beat per local rank every ``step_s``, a committed checkpoint every
  ``ckpt_every_steps`` steps, nothing in flight, so no agent ever judges them hung or failed.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ftrain.agents.heartbeat import Beat, RankTotals
from ftrain.agents.workers import Launch

#: a step's time by phase (sums to 1: scaled by the step time); a healthy rank, no straggler
PHASE_SHARES = {"data": 0.05, "forward": 0.3, "backward": 0.45, "comm_wait": 0.1, "optimizer": 0.1}


class SteadyHeartbeats:
    """This node's heartbeat channel, fed by nothing: every local rank of the round finished a
    step every ``step_s`` since the round's workers were launched (:meth:`launched`)."""

    def __init__(
        self,
        path: str,
        *,
        step_s: float = 0.5,
        ckpt_every_steps: int = 100,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.path = path
        self.step_s, self.ckpt_every_steps, self._clock = step_s, ckpt_every_steps, clock
        self._round = -1
        self._launch: Launch | None = None
        self._launched_at = 0.0
        self._taken_step = -1  #: the step up to which take_totals() has accounted

    def reset(self, round_: int) -> None:
        self._round, self._launch, self._taken_step = round_, None, -1

    def carry(self, beats: Mapping[int, Beat], now: float) -> None:
        pass  # restart recovery: nothing is kept across rounds

    def launched(self, launch: Launch) -> None:
        """The round's (fake) workers started now: their steps count from here."""
        if launch.round == self._round:
            self._launch, self._launched_at = launch, self._clock()

    def _step(self, now: float) -> int:
        return int((now - self._launched_at) / self.step_s) - 1  # -1: none finished yet

    def beats(self) -> dict[int, Beat]:
        launch = self._launch
        if launch is None:
            return {}
        now = self._clock()
        step = self._step(now)
        if step < 0:
            return {}
        stepped_at = self._launched_at + (step + 1) * self.step_s
        committed = (step // self.ckpt_every_steps) * self.ckpt_every_steps if step >= self.ckpt_every_steps else -1
        phases_s = {phase: share * self.step_s for phase, share in PHASE_SHARES.items()}
        return {
            local_rank: Beat(
                local_rank=local_rank,
                rank=launch.node_rank * launch.nproc_per_node + local_rank,
                pid=os.getpid(),  # a real PID, never signalled: the fake workers signal nothing
                step=step,
                step_time_s=self.step_s,
                committed_step=committed,
                received_at=stepped_at,
                alive_at=now,
                phases_s=phases_s,
            )
            for local_rank in range(launch.nproc_per_node)
        }

    def take_totals(self) -> dict[int, RankTotals]:
        launch = self._launch
        if launch is None:
            return {}
        step = self._step(self._clock())
        new_steps = max(0, step - self._taken_step)
        self._taken_step = max(self._taken_step, step)
        totals = {}
        for local_rank in range(launch.nproc_per_node):
            t = RankTotals(launch.node_rank * launch.nproc_per_node + local_rank)
            for _ in range(min(new_steps, 20)):
                t.add({p: s * self.step_s for p, s in PHASE_SHARES.items()}, judged=True)
            totals[local_rank] = t
        return totals

    def close(self) -> None:
        pass


class IdleWorkers:
    """One round's workers that run until killed (:class:`ftrain.agents.workers.Workers`)."""

    def __init__(self, launch: Launch, log_path: str, clock: Callable[[], float]):
        self.launch, self.log_path = launch, log_path
        self.started_at = clock()
        self.terminating = False
        self.rc: int | None = None

    @property
    def round(self) -> int:
        return self.launch.round

    @property
    def pid(self) -> int:
        return os.getpid()

    def poll(self) -> int | None:
        return self.rc

    def note_pids(self, pids: Iterable[int]) -> None:
        pass

    def gone(self, pid: int) -> bool:
        return self.rc is not None

    def terminate(self) -> None:
        """A drain: they finish the step and leave at once."""
        self.terminating, self.rc = True, 0

    def kill(self, timeout_s: float = 5.0) -> int | None:
        if self.rc is None:
            self.rc = -9
        return self.rc

    def wait(self, timeout_s: float) -> int | None:
        return self.rc

    def dump_stacks(self, stack_dir: str) -> dict[int, str]:
        return {}


def idle_launcher(heartbeats: SteadyHeartbeats, clock: Callable[[], float] = time.monotonic):
    """The agent's ``launcher``: starts :class:`IdleWorkers` and tells ``heartbeats`` they run."""

    def launch(launch: Launch, env: dict[str, str], log_path: str) -> IdleWorkers:
        heartbeats.launched(launch)
        return IdleWorkers(launch, log_path, clock)

    return launch


class NullEvents:
    """An event sink that keeps nothing (the benchmark reads etcd, not the event log)."""

    def emit(self, record: Any) -> None:
        return None

    def close(self) -> None:
        pass


__all__ = ["IdleWorkers", "NullEvents", "SteadyHeartbeats", "idle_launcher"]
