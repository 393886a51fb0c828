"""How a node agent handles a hang of its workers, and dumps them on request.

- **found here** (:meth:`AgentHangs._judge`, :mod:`ftrain.agents.supervision`: no progress, silence,
  or a collective waited in too long with nobody in the round moving): the agent takes its
  workers' flight records, reports the hang and (while registered) says in its status that its
  records are in, all in the same tick. It ends the workers that must go (frozen ones; every one
  under restart recovery) only once every other member has taken its own workers' records (or
  after :data:`HANG_HOLD_S`), and never before the end of the next tick (a leader forms the
  hang's round first): ending a rank first lets its peers' collectives fail, and then their
  records no longer show where they waited. Their stacks are taken then, before any kill
  (dumping continues a stopped worker, so never before the records). Workers hung in a
  collective under live recovery are not killed: the next round's watchdog frees them.
- **found elsewhere**: every other member takes its workers' records as soon as it sees a hang
  reported in its round (or a round formed for one), once per round, in both recovery modes,
  before its workers move on, and says so in its status at once (the finder waits for it).
- **a rank left alone** (:meth:`AgentHangs._report_left`, live recovery): a worker that left its
  round on its own (a collective or the round's store failed there) while no member failed, was
  lost or drained is not hung, but its round is as stuck: past the grace the agent reports the
  round over (``rank_left``), so that the next one forms.
- **ftrain status --dump**: answered once per request (one made before this agent started is
  not its to answer), with the verdict in this node's status.

A verdict names what the flight records show (:mod:`ftrain.agents.flight`, :mod:`ftrain.agents.flight_verdict`)
and, on a hang, what the other members' statuses say about their stalled ranks
(:mod:`ftrain.agents.hang_view`).

A mixin of :class:`ftrain.agents.agent.Agent`: the annotations below are the agent's state and parts
that it uses (set up in ``Agent.__init__``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from ftrain.agents import flight, flight_verdict, hang_view
from ftrain.agents.agent_status import PublishStatus
from ftrain.agents.config import AgentConfig
from ftrain.agents.heartbeat import Beat
from ftrain.agents.leader import round_has_cause
from ftrain.agents.live_workers import LiveWorkers
from ftrain.agents.parts import Clock, EventSink, Heartbeats
from ftrain.agents.records import FAILED, HANG, JobState, RankStall, Report
from ftrain.agents.supervision import (
    FROZEN_AFTER_S,
    HangCall,
    frozen_ranks,
    hung_ranks,
    judge,
    left_ranks,
    left_report,
    left_round_grace_s,
    waiting,
)
from ftrain.agents.workers import Workers
from ftrain.contract import events as ev

log = logging.getLogger(__name__)

#: the longest a hang's workers are kept (frozen or stuck) for the other members to take their
#: own workers' flight records first (a running worker answers in milliseconds; see ftrain.agents.flight)
HANG_HOLD_S = 2.0


@dataclass(slots=True)
class _HeldHang:
    """A hang found here whose workers are not ended yet (see the module doc, **found here**)."""

    workers: Workers
    call: HangCall
    evidence: flight.Evidence
    verdict: str
    due_at: float  #: monotonic: end them by then, whoever has dumped
    fresh: bool = True  #: found in this tick: the report is not in the state a leader reads until the next


class AgentHangs:
    """Hangs found here or elsewhere in the round, and dumps on request."""

    cfg: AgentConfig
    clock: Clock
    heartbeats: Heartbeats
    events: EventSink
    uid: str
    stack_dir: str
    started_at_wall: float
    wake: threading.Event
    workers: Workers | None
    finished_rounds: set[int]
    pending_reports: dict[int, Report]
    draining: bool
    _state: JobState | None
    _stalled: list[RankStall]
    _registered: Callable[[], bool]
    _flush_reports: Callable[[], None]
    _publish_status: PublishStatus
    # this part's own state
    _held: _HeldHang | None
    hang_verdict: str
    hang_dumped_round: int
    dump_nonce: str
    dump_verdict: str

    def _judge(self, workers: Workers, beats: dict[int, Beat], *, live: bool) -> HangCall | None:
        now = self.clock.monotonic()
        # the other members' statuses are read only when a rank here has waited the whole timeout
        waited = any(waiting(b, now=now, limit_s=self.cfg.hang_timeout_s) for b in beats.values())
        return judge(
            beats,
            nproc_per_node=workers.launch.nproc_per_node,
            started_at=workers.started_at,
            now=now,
            hang_timeout_s=self.cfg.hang_timeout_s,
            start_timeout_s=self.cfg.start_timeout_s,
            others_moving=waited
            and hang_view.others_moving(self._state, workers.round, self.cfg.node_id, now_wall=self.clock.time()),
            live=live,
        )

    def _hung(self, workers: Workers, beats: dict[int, Beat]) -> list[int]:
        return hung_ranks(
            beats,
            nproc_per_node=workers.launch.nproc_per_node,
            started_at=workers.started_at,
            now=self.clock.monotonic(),
            hang_timeout_s=self.cfg.hang_timeout_s,
            start_timeout_s=self.cfg.start_timeout_s,
        )

    def _on_hang(self, workers: Workers, call: HangCall, beats: dict[int, Beat]) -> None:
        """A hang found here: the workers' flight records now (before anything moves), the report
        at once; their stacks and the end of the ones to end at the end of a later tick, once the
        others dumped (:meth:`_release_held`; this node's workers are not moved to a new round before)."""
        log.error("round %d: hang: %s: taking the workers' flight records", workers.round, call.why)
        evidence, verdict = self._evidence(workers, ev.Hang)
        ready = workers.ready() if isinstance(workers, LiveWorkers) else -1
        self._report_hang(workers.round, call, beats, workers_ready=ready)
        self.hang_dumped_round = max(self.hang_dumped_round, workers.round)
        self.hang_verdict = f"round {workers.round}: {verdict}"
        log.error("round %d: flight records: %s", workers.round, verdict)
        self._held = _HeldHang(workers, call, evidence, verdict, self.clock.monotonic() + HANG_HOLD_S)
        if self._registered():
            self._flush_reports()  # now: the others dump on seeing it
            if self._state is not None:  # and that this node's records are in (hang_dumped_round)
                self._publish_status(self._state, force=True)
        self.wake.set()  # the stacks at the end of the next tick (they take a while): the round is formed first

    def _report_left(self, workers: LiveWorkers, beats: dict[int, Beat], now: float) -> bool:
        """A rank here left the round on its own and, past the grace, the leader still has no cause
        to end it (:func:`ftrain.agents.leader.round_has_cause`): report the round over here, so
        that the next one forms now, not after the start timeout; the process keeps its state."""
        grace_s = left_round_grace_s(self.cfg.lease_ttl_s, self.cfg.settle_s)
        left = left_ranks(beats, now=now, grace_s=grace_s)
        if not left or self.draining or self._state is None or round_has_cause(self._state, workers.round):
            return False
        report = left_report(left, beats, grace_s, self.uid, self.clock.time(), workers_ready=workers.ready())
        log.warning("round %d: %s: reporting the round over here", workers.round, report.detail)
        self.finished_rounds.add(workers.round)
        self.pending_reports[workers.round] = report
        self.wake.set()
        return True

    def _report_hang(self, round_: int, call: HangCall, beats: dict[int, Beat], *, workers_ready: int = -1) -> None:
        """The round ended here on a hang of local ranks ``call.ranks``."""
        self.finished_rounds.add(round_)
        self.pending_reports[round_] = Report(
            FAILED,
            HANG,
            f"{call.why}; local rank(s) {call.ranks}"[:1000],
            self.uid,
            self.clock.time(),
            step=max((b.step for b in beats.values()), default=-1),
            workers_ready=workers_ready,
        )

    def _release_held(self) -> None:
        """End the held hang's workers once every other live member took its records (or at the
        deadline): first their stacks (dumping continues a stopped worker), then the kill."""
        held = self._held
        if held is None:
            return
        if held.fresh:  # the round for it first (next tick); its stacks and kills after
            held.fresh = False
            return
        round_ = held.workers.round
        if (
            held.call.kill
            and self.clock.monotonic() < held.due_at
            and not hang_view.others_dumped(self._state, round_, self.cfg.node_id)
        ):
            return
        self._held = None
        stacks = held.workers.dump_stacks(self.stack_dir)
        self._emit_dump(ev.Hang, held.workers, held.call.why, held.call.ranks, held.evidence, held.verdict, stacks)
        for pid, text in stacks.items():
            log.error("stack of worker %d:\n%s", pid, text)
        if not held.call.kill:
            return
        if isinstance(held.workers, LiveWorkers):
            killed = held.workers.kill_ranks(held.call.kill)
            log.error("round %d: ended hung worker(s) %s; the others stay", round_, killed)
        else:
            if self.workers is held.workers:
                self.workers = None
            held.workers.kill()
            log.error("round %d: ended the workers", round_)

    def _drop_frozen(self, pool: LiveWorkers) -> None:
        """Before a new round: end the serving processes that stopped saying they are alive (a
        hang found elsewhere first leaves them here), so that spares take their places."""
        now = self.clock.monotonic()
        pids = pool.pids()
        frozen = [
            r
            for r, b in self.heartbeats.beats().items()
            if pids.get(r) == b.pid and b.finished is None and b.alive_at > 0 and now - b.alive_at > FROZEN_AFTER_S
        ]
        if frozen:
            killed = pool.kill_ranks(frozen)
            log.error("round %d: ended frozen worker(s) %s before the next round", pool.round, killed)

    def _dump_for_hang_elsewhere(self, state: JobState) -> None:
        """Another member reported a hang in this node's round, or a round was formed for one: take
        this node's workers' flight records while they still wait (once per round, in both
        recovery modes), say so in the status at once (the finder waits for it), then their stacks
        when they are about to be replaced (restart recovery)."""
        workers, cur = self.workers, state.current
        if workers is None or cur is None or self.hang_dumped_round >= workers.round:
            return
        by = hang_view.hang_reported_by(state, workers.round, self.cfg.node_id)
        if by is None and not (cur.round > workers.round and cur.reason == HANG):
            return
        why = f"a hang reported by {by}" if by else f"round {cur.round} formed after a hang elsewhere"
        log.error("round %d: %s: taking the workers' flight records", workers.round, why)
        evidence, verdict = self._evidence(workers, ev.Hang)
        self.hang_dumped_round = workers.round
        self._publish_status(state, force=True)
        stacks = {} if isinstance(workers, LiveWorkers) else workers.dump_stacks(self.stack_dir)  # kept: records only
        self._emit_dump(ev.Hang, workers, why, [], evidence, verdict, stacks)
        log.error("round %d: flight records: %s", workers.round, verdict)

    def _answer_dump(self, state: JobState) -> None:
        """``ftrain status --dump``: dump once per request (one asked before this agent started
        is not its to answer), then say so in this node's status at once."""
        request = state.dump
        if request is None or request.nonce == self.dump_nonce:
            return
        self.dump_nonce = request.nonce
        if request.time < self.started_at_wall:
            return
        if self.workers is None:
            self.dump_verdict = "no workers running on this node"
        else:
            line = self._dump(self.workers, "requested by ftrain status --dump", record=ev.Dumped)
            self.dump_verdict = f"round {self.workers.round}: {line}"
        self._publish_status(state, force=True)

    def _dump(self, workers: Workers, why: str, *, record: type[ev.Hang] = ev.Hang) -> str:
        """Every worker's flight record and Python stack into the event log (and this agent's
        log), with the verdict the records give (returned). The records first: dumping the
        stacks continues a stopped worker."""
        log.error("round %d: %s: dumping the flight records and stacks of the workers", workers.round, why)
        evidence, verdict = self._evidence(workers, record)
        stacks = workers.dump_stacks(self.stack_dir)
        self._emit_dump(record, workers, why, [], evidence, verdict, stacks)
        log.error("round %d: flight records: %s", workers.round, verdict)
        return verdict

    def _evidence(self, workers: Workers, record: type[ev.Hang]) -> tuple[flight.Evidence, str]:
        """This node's workers' flight records and their verdict, with where each rank runs, and
        (on a hang) what the other members' statuses say about their stalled ranks."""
        beats = self.heartbeats.beats()
        silent = frozen_ranks(beats, list(beats), now=self.clock.monotonic())
        where = hang_view.where(self._state, workers.round)
        evidence = flight.hang_evidence(
            {b.pid: b.rank for b in beats.values() if b.rank >= 0},
            self.stack_dir,
            silent=[beats[r].rank for r in silent if r in beats],
            min_wait_s=0.0 if record is ev.Hang else flight_verdict.REQUESTED_MIN_WAIT_S,
            where=where,
        )
        verdict = evidence.verdict.line
        elsewhere = hang_view.stalls_of(self._state, workers.round, self.cfg.node_id)
        if record is ev.Hang and elsewhere:
            mine = [hang_view.as_stall(s) for s in self._stalled]
            seen = flight_verdict.from_stalls([*mine, *elsewhere], now=self.clock.time(), where=where)
            verdict = f"{verdict}; across the round: {seen.line}"
        return evidence, verdict

    def _emit_dump(
        self,
        record: type[ev.Hang],
        workers: Workers,
        why: str,
        local_ranks: list[int],
        evidence: flight.Evidence,
        verdict: str,
        stacks: dict[int, str],
    ) -> None:
        self.events.emit(
            record(
                node=self.cfg.node_id,
                worker_round=workers.round,
                why=why,
                local_ranks=local_ranks,
                stacks={str(pid): text for pid, text in stacks.items()},
                flight={str(rank): rec.to_dict() for rank, rec in evidence.records.items()},
                missing={str(rank): reason for rank, reason in evidence.missing.items()},
                frozen=evidence.frozen,
                verdict=verdict,
            )
        )


__all__ = ["HANG_HOLD_S", "AgentHangs"]
