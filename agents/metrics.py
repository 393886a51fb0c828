"""The agent's Prometheus metrics, served over HTTP (``agent.metrics_port``; 0 picks a free port).

Checkpoint health: ``ftrain_checkpoint_failures_total`` counts failed commits the workers
reported (each worker process counts from zero; the agent adds what is new per round), and
``ftrain_checkpoint_consecutive_failures`` is the current run of failures (0 after a commit).

``ftrain_step_phase_seconds{rank, phase}``: where each of this node's ranks spent its newest
step (``ftrain.observability.step_phases``): a straggler has more ``data``/``forward``/``backward``, its
peers more ``comm_wait``.

Device time by cause (``ftrain_device_hours{cause}``, and this node's status for ``ftrain
status``) is :class:`ftrain.contract.accounting.DeviceTime`'s, the one accounting ``ftrain report``
uses too: productive time is the interval of steps this node had not completed before (from the
workers' step phases, else their step time, else measured between their step beats: a
``ftrain.Session`` loop sends only its step), everything else since the first launch is split
into recomputation, checkpoint stalls, stragglers, start-up, recovery and idle.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from ftrain.contract.accounting import CAUSES, DeviceTime


class AgentMetrics:
    """``clock``: the agent's monotonic clock (lost time is measured on it)."""

    def __init__(
        self,
        job: str,
        node_id: str,
        *,
        clock: Callable[[], float] = time.monotonic,
        devices: int = 1,
        device_hour_price: float = 0.0,
    ):
        self._clock = clock
        self._devices, self._price = devices, device_hour_price
        self.registry = CollectorRegistry()
        labels = {"job": job, "node": node_id}
        names = list(labels)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, names, registry=self.registry).labels(**labels)

        self.round = gauge("ftrain_round", "Current rendezvous round (fencing token) of this node's workers.")
        self.leader = gauge("ftrain_is_leader", "1 while this agent is the job's leader.")
        self.workers_kept = gauge(
            "ftrain_round_workers_kept",
            "Worker processes of the current round that served the previous one (live recovery; 0 on a restart).",
        )
        self.workers_new = gauge(
            "ftrain_round_workers_new", "Worker processes new to the current round (started, or spares taken)."
        )
        self.members = gauge("ftrain_round_nodes", "Nodes in the current round.")
        self.heartbeat_age = gauge("ftrain_heartbeat_age_seconds", "Age of the oldest newest worker heartbeat.")
        self.step = gauge("ftrain_step", "Last completed training step reported by this node's workers.")
        self.step_time = gauge("ftrain_step_time_seconds", "Duration of the last training step.")
        self.committed_step = gauge("ftrain_last_committed_step", "Newest committed checkpoint step.")
        self.ckpt_duration = gauge(
            "ftrain_checkpoint_duration_seconds",
            "Staging to commit of the newest committed checkpoint, as the workers saw it.",
        )
        self.productive = gauge("ftrain_productive_seconds", "Step time of first-time steps since the first launch.")
        self.lost = gauge("ftrain_lost_seconds", "Wall time since the first launch that was not productive.")
        self.lost_device_hours = gauge(
            "ftrain_lost_device_hours", "ftrain_lost_seconds times this node's devices (workers), in hours."
        )
        self.lost_cost = gauge(
            "ftrain_lost_cost", "ftrain_lost_device_hours times accounting.device_hour_price (0 when not priced)."
        )
        self.stragglers = gauge(
            "ftrain_stragglers", "Members the leader sees as stragglers now (0 on agents that do not lead)."
        )
        self.ckpt_consecutive_failures = gauge(
            "ftrain_checkpoint_consecutive_failures", "Checkpoint commits failed in a row (0 after a commit)."
        )
        self._ckpt_failures = Counter(
            "ftrain_checkpoint_failures", "Checkpoint commits that failed.", names, registry=self.registry
        ).labels(**labels)
        self._ckpt_failures_by_round: dict[int, int] = {}
        self._device_hours = Gauge(
            "ftrain_device_hours",
            f"This node's device time since the first launch by cause: {', '.join(CAUSES)} "
            "(see ftrain/contract/accounting.py).",
            [*names, "cause"],
            registry=self.registry,
        )
        self._device_cost = Gauge(
            "ftrain_device_cost",
            "ftrain_device_hours times accounting.device_hour_price (0 when not priced).",
            [*names, "cause"],
            registry=self.registry,
        )
        self.device_time = DeviceTime(devices)
        self._fresh_round = True  #: the next step is a round's first: its interval is not known
        self._beat: tuple[int, float] = (-1, 0.0)  #: the last new step seen and when (to measure intervals)
        self._last_tick: float | None = None
        self._restarts = Counter(
            "ftrain_restarts", "Rounds after the first, by cause.", [*names, "cause"], registry=self.registry
        )
        self._phases = Gauge(
            "ftrain_step_phase_seconds",
            "A worker's time between its last two training beats, by phase (data, forward, backward, comm_wait, "
            "optimizer, ckpt_staging, other), per global rank.",
            [*names, "rank", "phase"],
            registry=self.registry,
        )
        self._phases_round = -1
        self._labels = labels
        self._counted_rounds: set[int] = set()
        self._server: WSGIServer | None = None
        self.port = 0

    def serve(self, port: int, addr: str = "127.0.0.1") -> int:
        self._server, _thread = start_http_server(port, addr=addr, registry=self.registry)
        self.port = self._server.server_port
        return self.port

    def count_restart(self, round_: int, cause: str) -> None:
        if round_ not in self._counted_rounds:
            self._counted_rounds.add(round_)
            self._restarts.labels(**self._labels, cause=cause).inc()

    def ckpt_failed(self, round_: int, total: int, consecutive: int) -> None:
        """``total``: failures the workers of ``round_`` counted so far (never decreases within
        a round); ``consecutive``: the current run of failures."""
        new = total - self._ckpt_failures_by_round.get(round_, 0)
        if new > 0:
            self._ckpt_failures.inc(new)
            self._ckpt_failures_by_round[round_] = total
        self.ckpt_consecutive_failures.set(consecutive)

    def ckpt_failures_total(self) -> int:
        return sum(self._ckpt_failures_by_round.values())

    def restarts(self) -> int:
        return len(self._counted_rounds)

    def launched(self) -> None:
        """This node's workers start serving a round: the first launch starts the accounting,
        and a round's first step is not counted as a step (it warms up; its interval is unknown)."""
        self.device_time.start(self._clock())
        self._fresh_round = True

    def stepped(self, step: int, step_time_s: float, interval_s: float | None = None, *, at: float = 0.0) -> None:
        """The newest step of this node's workers, beaten at ``at`` (the agent's monotonic clock);
        ``interval_s``: its whole interval since the step before (the phases' sum), else its
        step time, else measured from the beats: the time since the last new step seen over the
        steps between (a loop that sends only its step number)."""
        self.step.set(step)
        self.step_time.set(step_time_s)
        last_step, last_at = self._beat
        if step == last_step:
            return
        per_step_s = interval_s if interval_s is not None else step_time_s if step_time_s > 0 else None
        if per_step_s is None and 0 <= last_step < step and at > last_at:
            per_step_s = (at - last_at) / (step - last_step)
        if self._fresh_round:
            per_step_s, self._fresh_round = None, False
        self._beat = (step, at)
        self.device_time.step(step, per_step_s, self._clock())
        self.productive.set(self.productive_s())

    def phases_taken(self, seconds: list[dict[str, float]], *, straggling: bool) -> None:
        """The local ranks' phase totals since the last call: checkpoint staging, and the time
        they waited while the leader saw a straggler, are device time lost to those causes."""
        self.device_time.staged(sum(s.get("ckpt_staging", 0.0) for s in seconds))
        if straggling:
            self.device_time.waited(sum(s.get("comm_wait", 0.0) for s in seconds))

    def device_seconds(self) -> dict[str, float]:
        """This node's device time since its first launch, by cause
        (:data:`ftrain.contract.accounting.CAUSES`; they add up to its devices' wall time)."""
        return self.device_time.seconds(self._clock())

    def ranks_stepped(self, round_: int, phases: dict[int, dict[str, float]]) -> None:
        """Each rank's newest step breakdown; a new round drops the ranks of the old one."""
        if round_ != self._phases_round:
            self._phases.clear()
            self._phases_round = round_
        for rank, by_phase in phases.items():
            for phase, seconds in by_phase.items():
                self._phases.labels(**self._labels, rank=str(rank), phase=phase).set(seconds)

    def productive_s(self) -> float:
        """Productive device time over this node's devices: wall seconds of first-time steps."""
        return self.device_seconds()["productive"] / max(1, self._devices)

    def lost_s(self) -> float:
        """Wall time since the first launch that was not productive (0 before it)."""
        return max(0.0, sum(self.device_seconds().values()) / max(1, self._devices) - self.productive_s())

    def tick(self, *, serving: bool = True) -> None:
        """Once per agent tick; ``serving``: this node's workers serve a round (else the time
        since the last tick is idle, once the first step is done)."""
        now = self._clock()
        if not serving and self._last_tick is not None:
            self.device_time.outside(now - self._last_tick)
        self._last_tick = now
        if self.device_time.started:
            lost = self.lost_s()
            self.lost.set(lost)
            self.lost_device_hours.set(lost * self._devices / 3600)
            self.lost_cost.set(lost * self._devices / 3600 * self._price)
            for cause, seconds in self.device_seconds().items():
                self._device_hours.labels(**self._labels, cause=cause).set(seconds / 3600)
                self._device_cost.labels(**self._labels, cause=cause).set(seconds / 3600 * self._price)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
