"""The agent's Prometheus metrics, served over HTTP (``agent.metrics_port``; 0 picks a free port).

Checkpoint health: ``ftrain_checkpoint_failures_total`` counts failed commits the workers
reported (each worker process counts from zero; the agent adds what is new per round), and
``ftrain_checkpoint_consecutive_failures`` is the current run of failures (0 after a commit).

``ftrain_step_phase_seconds{rank, phase}``: where each of this node's ranks spent its newest
step (``ftrain.observability.step_phases``): a straggler has more ``data``/``forward``/``backward``, its
peers more ``comm_wait``.

Productive time is the step time of steps this node had not completed before (the first time
step n finishes); everything else since the first launch — detection, rendezvous, process start,
checkpoint load, and steps recomputed after a rollback to a checkpoint — is lost time.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server


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
            "This node's device time since the first launch by cause: productive, recomputation, "
            "checkpoint_stalls, stragglers, restarts (see agents/metrics.py).",
            [*names, "cause"],
            registry=self.registry,
        )
        self._device_cost = Gauge(
            "ftrain_device_cost",
            "ftrain_device_hours times accounting.device_hour_price (0 when not priced).",
            [*names, "cause"],
            registry=self.registry,
        )
        self._measured_s = dict.fromkeys(("recomputation", "checkpoint_stalls", "stragglers"), 0.0)  #: device-s
        self._last_step = -1
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
        self._best_step = -1
        self._productive_s = 0.0
        self._first_launch: float | None = None
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
        if self._first_launch is None:
            self._first_launch = self._clock()

    def stepped(self, step: int, step_time_s: float, interval_s: float | None = None) -> None:
        """The newest step of this node's workers; ``interval_s``: its whole interval since the
        step before (the phases' sum; the step time when unknown)."""
        self.step.set(step)
        self.step_time.set(step_time_s)
        per_step_s = interval_s if interval_s is not None else step_time_s
        if step > self._best_step:
            if self._best_step >= 0:
                self._productive_s += per_step_s * (step - self._best_step)
            self._best_step = step
        elif 0 <= self._last_step < step:  # going over steps done before (after going back)
            self._measured_s["recomputation"] += per_step_s * (step - self._last_step) * self._devices
        self._last_step = step
        self.productive.set(self._productive_s)

    def phases_taken(self, seconds: list[dict[str, float]], *, straggling: bool) -> None:
        """The local ranks' phase totals since the last call: checkpoint staging, and the time
        they waited while the leader saw a straggler, are device time lost to those causes."""
        self._measured_s["checkpoint_stalls"] += sum(s.get("ckpt_staging", 0.0) for s in seconds)
        if straggling:
            self._measured_s["stragglers"] += sum(s.get("comm_wait", 0.0) for s in seconds)

    def device_seconds(self) -> dict[str, float]:
        """This node's device time since its first launch, by cause (they add up to its devices'
        wall time): ``productive`` (first-time steps, less their staging and waiting for a
        straggler), ``recomputation``, ``checkpoint_stalls``, ``stragglers``, and ``restarts``
        (the rest: detection, rendezvous, start-up, loads, waiting without a round)."""
        wall = (self._clock() - self._first_launch) * self._devices if self._first_launch is not None else 0.0
        measured = dict(self._measured_s)
        productive = max(
            0.0, self._productive_s * self._devices - measured["checkpoint_stalls"] - measured["stragglers"]
        )
        restarts = max(0.0, wall - productive - sum(measured.values()))
        return {"productive": productive, **measured, "restarts": restarts}

    def ranks_stepped(self, round_: int, phases: dict[int, dict[str, float]]) -> None:
        """Each rank's newest step breakdown; a new round drops the ranks of the old one."""
        if round_ != self._phases_round:
            self._phases.clear()
            self._phases_round = round_
        for rank, by_phase in phases.items():
            for phase, seconds in by_phase.items():
                self._phases.labels(**self._labels, rank=str(rank), phase=phase).set(seconds)

    def productive_s(self) -> float:
        return self._productive_s

    def lost_s(self) -> float:
        """Wall time since the first launch that was not productive (0 before it)."""
        if self._first_launch is None:
            return 0.0
        return max(0.0, self._clock() - self._first_launch - self._productive_s)

    def tick(self) -> None:
        if self._first_launch is not None:
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
