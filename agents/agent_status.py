"""What a node agent publishes about itself: ``status/<id>`` (read by ``ftrain status`` and by
the other agents: the leader's stragglers, a hang's stalled ranks and whether this node's
workers' flight records were taken) and the events and metrics of stragglers and failed
checkpoint commits.

What must stay true:

- the status is written when what it says changes (state, round, stalled ranks, hang, dump,
  commits, workers: :meth:`AgentStatus._status_gist`), at most once per
  :data:`STATUS_INTERVAL_S`, and otherwise (steps, timings, device time) once per
  :func:`status_interval_s` of the job's size: a job of N nodes writes at most
  ~:data:`STATUS_WRITES_PER_S` routine statuses a second in all (the lease keep-alive, not the
  status, says that an agent lives). Forced writes (a hang found or dumped, a dump answered, the
  job's end) go out at once. Only while registered, on this agent's lease (it vanishes with the
  agent); the error and verdict texts in it are cut short.
- a straggler is reported (event and error log) once per round and node; failed commits once
  each time their count in a row grows.
- nothing here stops the loop: etcd unreachable or the lease lost just skips the write.

A mixin of :class:`ftrain.agents.agent.Agent`: the annotations below are the agent's state and parts
that it uses (set up in ``Agent.__init__``).
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable
from typing import Protocol

from ftrain.agents.agent_options import AgentOptions
from ftrain.agents.config import AgentConfig
from ftrain.agents.errors import EtcdUnavailableError, LeaseExpiredError
from ftrain.agents.heartbeat import Beat, BusyWindow
from ftrain.agents.job_keys import JobKeys
from ftrain.agents.jobstore import JobStore
from ftrain.agents.leader import SETTLING, Decision, LeaderMemory, Wait, waiting_reasons
from ftrain.agents.live_workers import LiveWorkers
from ftrain.agents.metrics import AgentMetrics
from ftrain.agents.parts import Clock, EventSink, Heartbeats
from ftrain.agents.policy import Policy
from ftrain.agents.records import DRAINING, JobState, NodeStatus, RankStall
from ftrain.agents.supervision import last_error_line
from ftrain.agents.workers import Workers
from ftrain.contract import events as ev

log = logging.getLogger(__name__)

STATUS_INTERVAL_S = 1.0  #: the shortest time between two status writes of an agent (unless forced)
#: the longest between two ``device_time`` events of an agent (also one with every status that
#: changes what it says, and at its end): ``ftrain report`` adds up each node's newest
DEVICE_TIME_EVENT_S = 60.0
_NUMBERS = re.compile(r"\d+(\.\d+)?")
#: routine status writes (nothing but steps and timings changed) of a whole job, per second
STATUS_WRITES_PER_S = 100.0


def status_interval_s(nodes: int) -> float:
    """How often an agent of a job of ``nodes`` nodes writes its status when only its steps and
    timings changed: every second up to 100 nodes, then slower, so that the job as a whole
    writes ~:data:`STATUS_WRITES_PER_S` a second (10 s at 1,000 nodes, 41 s at 4,096)."""
    return max(STATUS_INTERVAL_S, nodes / STATUS_WRITES_PER_S)


class PublishStatus(Protocol):
    """The signature of :meth:`AgentStatus._publish_status`, for the parts that call it."""

    def __call__(self, state: JobState, *, state_name: str | None = None, force: bool = False) -> None: ...


class AgentStatus:
    """Publishing this node's status, stragglers and failed commits."""

    cfg: AgentConfig
    opts: AgentOptions
    policy: Policy
    clock: Clock
    store: JobStore
    keys: JobKeys
    heartbeats: Heartbeats
    metrics: AgentMetrics
    events: EventSink
    workers: Workers | None
    pool: LiveWorkers | None
    draining: bool
    corruptions: int  #: times the consistency check found this node's ranks corrupt, all rounds
    _corruptions_seen: dict[int, int]  #: worker pid -> the count it last reported
    drain: Callable[[str], None]
    finished_rounds: set[int]
    committed_step: int
    hang_verdict: str
    hang_dumped_round: int
    dump_nonce: str
    dump_verdict: str
    _stalled: list[RankStall]
    _registered: Callable[[], bool]
    _leading: Callable[[JobState], bool]
    memory: LeaderMemory | None
    _lease_id: Callable[[], int]
    # this part's own state
    straggler_lines: list[str]
    round_pending: str
    _pending_said: str
    workers_error: str
    _device_time_said_at: float | None
    _stragglers_seen: set[tuple[int, str, float]]
    _ckpt_failures_seen: int
    _ckpt_error: str
    _busy: tuple[int, float]
    _busy_window: BusyWindow
    _busy_round: int
    _last_status_at: float
    _last_status_gist: tuple[object, ...]
    _stragglers_written: tuple[int, list[str]]

    def _status_gist(self, state_name: str) -> tuple[object, ...]:
        """What a status says that others act on: a change of it is written at once."""
        workers = self.workers
        return (
            state_name,
            workers.round if workers else max(self.finished_rounds, default=0),
            [(s.rank, s.why, s.seq) for s in self._stalled] if workers is not None else [],
            self.hang_verdict,
            self.hang_dumped_round,
            self.dump_nonce,
            self.committed_step,
            self._ckpt_failures_seen,
            self.pool.ready() if self.pool is not None else 0,
            self.straggler_lines != [],
            _NUMBERS.sub("#", self.round_pending),
            self.workers_error,
        )

    def _publish_status(self, state: JobState, *, state_name: str | None = None, force: bool = False) -> None:
        now = self.clock.monotonic()
        if not self._registered() or (not force and now - self._last_status_at < STATUS_INTERVAL_S):
            return
        name = state_name or (DRAINING if self.draining else "running" if self.workers else "waiting")
        gist = self._status_gist(name)
        routine_s = status_interval_s(len(state.nodes))
        if not force and gist == self._last_status_gist and now - self._last_status_at < routine_s:
            return
        changed = force or gist != self._last_status_gist
        self._last_status_at, self._last_status_gist = now, gist
        beats = self.heartbeats.beats() if self.workers is not None else {}
        totals = self.heartbeats.take_totals() if self.workers is not None else {}
        round_ = self.workers.round if self.workers is not None else -1
        self.metrics.phases_taken([t.seconds for t in totals.values()], straggling=bool(state.stragglers.get(round_)))
        if not beats or round_ != self._busy_round or (self.pool is not None and self.pool.warming()):
            self._busy_window.clear()  # a new round, or a spare's start-up slowing the workers: start over
            self._busy_round = round_
        else:
            self._busy_window.add(totals.values())
        self._busy = self._busy_window.busiest() or (-1, 0.0)
        device_s = self.metrics.device_seconds()
        if changed or self._device_time_said_at is None or now - self._device_time_said_at >= DEVICE_TIME_EVENT_S:
            self._say_device_time(device_s)
        status = NodeStatus(
            round=self.workers.round if self.workers else max(self.finished_rounds, default=0),
            state=name,
            step=max((b.step for b in beats.values()), default=-1),
            step_time_s=max((b.step_time_s for b in beats.values()), default=0.0),
            heartbeat_age_s=round(now - min(b.received_at for b in beats.values()), 3) if beats else None,
            committed_step=self.committed_step,
            restarts=self.metrics.restarts(),
            host=self.cfg.host,
            pid=os.getpid(),
            updated_at=self.clock.time(),
            ckpt_failures=self._ckpt_failures_seen if self.workers else 0,
            ckpt_failures_total=self.metrics.ckpt_failures_total(),
            ckpt_error=self._ckpt_error[:300],
            hang_verdict=self.hang_verdict[:500],
            productive_s=round(self.metrics.productive_s(), 3),
            lost_s=round(self.metrics.lost_s(), 3),
            device_hours={k: round(v / 3600, 6) for k, v in device_s.items()},
            devices=self.cfg.nproc_per_node,
            device_hour_price=self.opts.device_hour_price,
            busy_s=round(self._busy[1], 6),
            busy_rank=self._busy[0],
            stragglers=self.straggler_lines if self._leading(state) else [],
            round_pending=self.round_pending[:500],
            workers_error=self.workers_error[:500],
            waiting={k: v[:300] for k, v in self._waiting(state).items()},
            dump_nonce=self.dump_nonce,
            dump_verdict=self.dump_verdict[:500],
            stalled=self._stalled if self.workers is not None else [],
            hang_dumped_round=self.hang_dumped_round,
            recovery=self.cfg.recovery,
            workers_ready=self.pool.ready() if self.pool is not None else 0,
            workers_kept=len(self.workers.last_kept) if isinstance(self.workers, LiveWorkers) else 0,
            workers_new=(
                len(self.workers.last_started)
                if isinstance(self.workers, LiveWorkers)
                else self.workers.launch.nproc_per_node
                if self.workers
                else 0
            ),
        )
        try:
            self.store.put(self.keys.status(self.cfg.node_id), status.to_json(), lease=self._lease_id())
        except (EtcdUnavailableError, LeaseExpiredError):
            pass

    def _say_device_time(self, device_s: dict[str, float] | None = None) -> None:
        """A ``device_time`` event: this node's device time so far by cause (what its status
        says; ``ftrain report`` adds up each node's newest). None before the first launch."""
        if not self.metrics.device_time.started:
            return
        device_s = self.metrics.device_seconds() if device_s is None else device_s
        self._device_time_said_at = self.clock.monotonic()
        self.events.emit(
            ev.DeviceTime(
                node=self.cfg.node_id,
                devices=self.cfg.nproc_per_node,
                wall_s=round(sum(device_s.values()) / max(1, self.cfg.nproc_per_node), 3),
                seconds={k: round(v, 3) for k, v in device_s.items()},
            )
        )

    def _waiting(self, state: JobState) -> dict[str, str]:
        """The leader's: why each live node outside the current round waits (``ftrain status``)."""
        if self.memory is None or not self._leading(state):
            return {}
        return waiting_reasons(state, self.policy, self.memory, self.clock.time())

    def _note_pending(self, decision: Decision | None) -> None:
        """The leader states a round it needs and does not form (``decision``, None: not leading)
        at once: in its status (``round_pending``, shown by ``ftrain status``) and, unless it only
        waits for membership to settle, once per state (numbers aside: a backoff that counts down
        is one state) as a ``round_pending`` event and a log line (an error when it cannot form
        until the nodes change)."""
        if not isinstance(decision, Wait) or not decision.need:
            self.round_pending = self._pending_said = ""
            return
        self.round_pending = f"new round needed for {decision.need}; not formed: {decision.why}"
        said = _NUMBERS.sub("#", self.round_pending)
        if said == self._pending_said or decision.kind == SETTLING:  # settling: the status says it, briefly
            return
        self._pending_said = said
        (log.error if decision.blocked else log.info)("%s", self.round_pending)
        self.events.emit(
            ev.RoundPending(node=self.cfg.node_id, need=decision.need, why=decision.why, blocked=decision.blocked)
        )

    def _note_startup_failures(self, pool: LiveWorkers | None) -> None:
        """Live recovery: once this node's worker processes failed at start
        ``agent.deterministic_failures`` times in a row (:meth:`LiveWorkers.failing_at_start`: no
        more spares are started ahead of need), say it once, with their error (the last one of
        their log): status (``workers_error``), a ``workers_failing`` event and an error log; a
        process that gets ready clears it."""
        if pool is None or not pool.failing_at_start():
            self.workers_error = "" if pool is None or pool.startup_failures == 0 else self.workers_error
            return
        if self.workers_error:
            return
        error = last_error_line(pool.log_path) or "no error line in their log"
        self.workers_error = (
            f"{pool.startup_failures} worker process(es) in a row exited with {pool.startup_exit_code} before they "
            f"were ready: {error} (log {pool.log_path}); no spare is started ahead of need until one starts"
        )
        log.error("%s", self.workers_error)
        self.events.emit(
            ev.WorkersFailing(
                node=self.cfg.node_id, exits=pool.startup_failures, exit_code=pool.startup_exit_code, error=error
            )
        )

    def _note_stragglers(self, state: JobState, memory: LeaderMemory, now: float) -> None:
        """The leader: an event (and an error log) per straggler episode (a member slow without a
        break since a time: a node slow again later in the same round is reported again), the
        metric, and a line each in this agent's status (``ftrain status`` shows them)."""
        cur = state.current
        self.straggler_lines = [
            s.describe(now) + (f"; policy {self.policy.on_straggler}" if self.policy.on_straggler != "warn" else "")
            for s in memory.stragglers
        ]
        self.metrics.stragglers.set(len(memory.stragglers))
        self._write_stragglers(cur.round if cur else 0, sorted({s.node for s in memory.stragglers}))
        episodes = {(cur.round if cur else 0, s.node, s.since): s for s in memory.stragglers}
        new = [(key, s) for key, s in episodes.items() if key not in self._stragglers_seen]
        self._stragglers_seen = set(episodes)  # an episode that ended is forgotten: the next is new
        for key, s in new:
            log.error("straggler: %s (policy %s)", s.describe(now), self.policy.on_straggler)
            self.events.emit(
                ev.StragglerDetected(
                    node=s.node,
                    worker_round=key[0],
                    busy_rank=s.rank,
                    busy_s=round(s.busy_s, 6),
                    others_s=round(s.others_s, 6),
                    slow_for_s=round(now - s.since, 3),
                    policy=self.policy.on_straggler,
                )
            )

    def _write_stragglers(self, round_: int, nodes: list[str]) -> None:
        """``rounds/<g>/stragglers`` when the set changes (the followers' straggler time)."""
        if round_ < 1 or (round_, nodes) == self._stragglers_written:
            return
        try:
            self.store.put(self.keys.stragglers(round_), json.dumps(nodes))
            self._stragglers_written = (round_, nodes)
        except EtcdUnavailableError:
            pass

    def _note_ckpt_failures(self, round_: int, beats: dict[int, Beat]) -> None:
        """Failed checkpoint commits: metrics always, an event (and an error log) each time the
        count of failures in a row grows."""
        failures = max(b.ckpt_failures for b in beats.values())
        total = max(b.ckpt_failures_total for b in beats.values())
        error = next((b.ckpt_error for b in beats.values() if b.ckpt_failures == failures and b.ckpt_error), "")
        self.metrics.ckpt_failed(round_, total, failures)
        if failures > self._ckpt_failures_seen:
            log.error("round %d: %d checkpoint commit(s) in a row failed; last error: %s", round_, failures, error)
            self.events.emit(
                ev.CheckpointFailing(node=self.cfg.node_id, worker_round=round_, failures=failures, error=error)
            )
        self._ckpt_failures_seen = failures
        self._ckpt_error = error if failures else ""

    def _note_corruptions(self, beats: dict[int, Beat]) -> None:
        """Silent data corruption: count what the workers report (each process counts the times
        the consistency check found its rank corrupt), and drain this node once the count reaches
        ``agent.drain_after_corruptions``."""
        for beat in beats.values():
            seen = self._corruptions_seen.get(beat.pid, 0)
            if beat.corruptions != seen:  # a lower count: the process's trainer started anew
                self.corruptions += beat.corruptions - seen if beat.corruptions > seen else beat.corruptions
                self._corruptions_seen[beat.pid] = beat.corruptions
        limit = self.cfg.drain_after_corruptions
        if limit and self.corruptions >= limit and not self.draining:
            log.error(
                "the consistency check found this node's ranks corrupt %d time(s) (silent data corruption): "
                "its hardware is suspect, draining (agent.drain_after_corruptions=%d)",
                self.corruptions,
                limit,
            )
            self.events.emit(ev.NodeSuspect(node=self.cfg.node_id, corruptions=self.corruptions, limit=limit))
            self.drain(f"{self.corruptions} silent data corruption(s) on this node")


__all__ = ["STATUS_INTERVAL_S", "STATUS_WRITES_PER_S", "AgentStatus", "PublishStatus", "status_interval_s"]
