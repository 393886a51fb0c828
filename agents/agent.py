"""The node agent: membership, leadership, rounds and supervision of this node's workers.

One loop, level-triggered: every tick (woken early when the job's keys change) the agent takes
the job's state from its local view (:mod:`ftrain.agents.job_view`: listed once, then fed by a
watch; the membership and round keys for every agent, every node's status for the leader) and
acts on the whole of it:

- **session**: a lease kept alive; ``nodes/<id>`` on it; while the lease is lost the agent keeps
  its workers, acts on no round, and registers again once etcd answers
  (:mod:`ftrain.agents.agent_membership`).
- **leader**: whoever creates ``leader`` on its lease; it runs :func:`ftrain.agents.leader.decide` and
  forms rounds with a compare-and-swap on ``round``.
- **follower** (every agent, the leader too): when the current round lists this agent, start
  its workers (torchrun, static rendezvous at the round's master) unless they already run; when
  it does not, stop any workers of an older round. Watch the workers: exit code, heartbeats,
  hangs (:mod:`ftrain.agents.supervision`: no progress, silence, or a collective waited in too long
  with nobody in the round moving). Report how the round ended on this node.
- **hangs**: the finder takes its workers' flight records and reports at once, and ends the
  workers that must go only once every other member took its own (:mod:`ftrain.agents.agent_hangs`).
- **status**: ``status/<id>`` for ``ftrain status`` (:mod:`ftrain.agents.agent_status`); Prometheus
  metrics.

The agent is assembled from parts passed in (:mod:`ftrain.agents.assemble` wires the production ones):
a job store (:mod:`ftrain.agents.jobstore`), a clock, the heartbeat channel, metrics, an event sink and
a worker launcher (:mod:`ftrain.agents.parts`, :mod:`ftrain.agents.workers`), with its options
(:mod:`ftrain.agents.agent_options`). It reads no clock and starts no process or thread of its own, so
a unit test drives it tick by tick on a fake clock (:meth:`Agent.start`, :meth:`Agent.tick`);
:meth:`Agent.run` is the production loop. Its membership, hang handling and status are mixins
(the modules named above): one class, one state (set up in ``Agent.__init__``), the methods
kept by responsibility; each mixin declares the state it uses, so that mypy checks it.

Exit codes (:mod:`ftrain.contract.exits`): 0 when the job succeeded, 75 when this agent drained on
SIGTERM before the job's end (start it again to go on), 1 when the job failed (restart budget, a
deterministic or fatal worker error), 2 for bad arguments or a node id in use.

What is read from etcd, the heartbeat socket or the environment is checked, never trusted:

- unreadable job records are skipped and logged once (:mod:`ftrain.agents.agent_membership`); the agent
  never acts on a round it cannot read: while the ``round`` key or the current round's record is
  unreadable it keeps its workers and starts none (the leader forms a new round); it never
  launches with a malformed master address.
- worker PIDs from heartbeats are signalled only while they are still descendants of this
  round's torchrun with the start time first seen (:class:`ftrain.agents.workers.WorkerGroup`).
- workers reach etcd (the checkpoint fence) with the agent's credentials through a 0600 file,
  never a command line (:mod:`ftrain.agents.agent_options`).

**Size.** Over 600 lines: the agent's round state machine (register, lead, follow, supervise,
drain) after membership (:mod:`ftrain.agents.agent_membership`), hangs and dumps
(:mod:`ftrain.agents.agent_hangs`) and the published status (:mod:`ftrain.agents.agent_status`)
were cut out; what is left moves between states together.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import socket
import threading
import uuid
from collections.abc import Callable

from ftrain.agents.agent_hangs import AgentHangs
from ftrain.agents.agent_membership import AgentMembership
from ftrain.agents.agent_options import AgentOptions
from ftrain.agents.agent_status import AgentStatus
from ftrain.agents.errors import EtcdUnavailableError, LeaseExpiredError
from ftrain.agents.etcd import Compare, Op
from ftrain.agents.heartbeat import Beat, BusyWindow
from ftrain.agents.job_keys import JobKeys
from ftrain.agents.job_view import JobView
from ftrain.agents.jobstore import JobStore, LeaseSession
from ftrain.agents.leader import Finish, FormRound, LeaderMemory, decide
from ftrain.agents.live_workers import LiveWorkers
from ftrain.agents.metrics import AgentMetrics
from ftrain.agents.netif import collective_interface
from ftrain.agents.parts import Clock, EventSink, Heartbeats
from ftrain.agents.records import (
    FAILED,
    HANG,
    INTERRUPTING_CAUSES,
    START,
    SUCCEEDED,
    FinalStatus,
    JobState,
    Member,
    RankStall,
    Report,
    RoundRecord,
    parse_master,
)
from ftrain.agents.supervision import (
    drained_report,
    exit_report,
    last_error_line,
    stalls,
)
from ftrain.agents.workers import Launch, Launcher, Workers
from ftrain.contract import events as ev
from ftrain.contract import exits, flight
from ftrain.contract.worker_env import WorkerEnv, worker_environment

log = logging.getLogger(__name__)

#: live recovery: starts this node's worker processes before any round (environment, log path)
Standby = Callable[[dict[str, str], str], LiveWorkers]

TICK_S = 0.2
CRASH_GRACE_S = 0.3
ROUNDS_KEPT = 8  #: round records (and their reports) kept in etcd behind the current one
#: how long an agent that stopped leading or judging a hang keeps following every node's status
LEADER_KEYS_LINGER_S = 10.0


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class Agent(AgentMembership, AgentHangs, AgentStatus):
    """One node's agent, assembled from its parts (see the module docstring); ``run_dir`` holds
    the worker logs and stack dumps, ``client_file`` the workers' etcd settings (if any)."""

    def __init__(
        self,
        opts: AgentOptions,
        *,
        store: JobStore,
        clock: Clock,
        heartbeats: Heartbeats,
        metrics: AgentMetrics,
        events: EventSink,
        launcher: Launcher,
        run_dir: str,
        client_file: str | None = None,
        standby: Standby | None = None,
    ):
        opts.validate()
        self.opts = opts
        self.cfg = opts.config
        self.store, self.clock, self.heartbeats = store, clock, heartbeats
        self.metrics, self.events, self.launcher = metrics, events, launcher
        self.standby = standby
        self.pool: LiveWorkers | None = None  #: live recovery: this node's worker processes, kept across rounds
        self.run_dir = run_dir
        self.client_file = client_file
        self.uid = uuid.uuid4().hex[:12]
        self.me = Member(self.cfg.node_id, self.uid)
        self.keys = JobKeys(self.cfg.job)
        self.policy = opts.policy()
        self.stack_dir = os.path.join(run_dir, "stacks")
        self._problems_seen: set[tuple[str, int]] = set()  #: (key, mod_revision) already logged
        self._held_why = ""  #: why the follower last held (logged once per reason)
        self._ckpt_failures_seen = 0  #: failed commits in a row the workers last reported
        self._ckpt_error = ""  #: the last failed commit's error while failures are in a row
        self.corruptions = 0  #: times the consistency check found this node's ranks corrupt, all rounds
        self._corruptions_seen: dict[int, int] = {}  #: worker pid -> the count it last reported
        self.hang_verdict = ""  #: the newest hang's verdict from the flight records (shown by ftrain status)
        self.hang_dumped_round = -1  #: the newest round whose hang this node's workers' records were taken for
        self._held = None  #: a hang found here, its workers kept until the others dumped
        self._stalled: list[RankStall] = []  #: this node's ranks not making progress (status)
        self._state: JobState | None = None  #: the newest job state read (the other members, for a hang)
        self.dump_nonce = ""  #: the newest dump request seen (ftrain status --dump)
        self.dump_verdict = ""  #: what the workers' flight records said when it was answered
        self.started_at_wall = self.clock.time()
        self.straggler_lines: list[str] = []  #: the leader's view of the stragglers (status)
        self.round_pending = ""  #: the leader's: a round needed and not formed, and why (status)
        self.workers_error = ""  #: live: this node's worker processes fail at start, and why (status)
        self._device_time_said_at: float | None = None  #: monotonic: the last device_time event
        self._pending_said = ""  #: the last pending decision logged and evented (numbers masked)
        self._stragglers_seen: set[tuple[int, str, float]] = set()  #: (round, node, slow since) reported
        self._busy: tuple[int, float] = (-1, 0.0)  #: this node's busiest rank, its busy time per step lately
        self._busy_window = BusyWindow()  #: each local rank's busy time over its last few statuses
        self._busy_round = -1
        self.session: LeaseSession | None = None
        self.workers: Workers | None = None
        self.finished_rounds: set[int] = set()  #: rounds whose workers ran and ended here
        self.pending_reports: dict[int, Report] = {}
        self.memory: LeaderMemory | None = None
        self.wake = threading.Event()
        self.draining = False
        self.drain_deadline = 0.0
        self.exit_code: int | None = None
        self._etcd_down_since: float | None = None
        self._next_register_at = 0.0
        self._register_backoff_s = 0.2
        self._last_status_at = 0.0
        self.committed_step = -1  #: newest committed checkpoint step the workers reported
        self._gone_since: dict[int, float] = {}  #: worker pid -> when it was first seen gone
        self._last_status_gist: tuple[object, ...] = ()
        self._stragglers_written: tuple[int, list[str]] = (0, [])  #: the last rounds/<g>/stragglers written
        self.view = JobView(store, self.keys, wake=self.wake.set, progress_timeout_s=max(2.0, self.cfg.lease_ttl_s))
        self._leader_keys_until = 0.0  #: monotonic: follow every node's status until then

    # -- lifecycle ---------------------------------------------------------------------------
    def run(self) -> int:
        """Register (raising :class:`NodeIdTakenError` if the id is in use), then loop until the
        job ends or the agent drains; SIGTERM and SIGINT drain."""
        # before registering: a SIGTERM while the agent starts (etcd slow to answer) drains too
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        self.start()
        try:
            while self.exit_code is None:
                self.tick()
                self.wake.wait(TICK_S)
                self.wake.clear()
        finally:
            self.close()
        return self.exit_code

    def start(self) -> None:
        """Register (raising :class:`NodeIdTakenError` if the id is in use), serve the metrics
        if asked to, watch the job's keys, and (live recovery) start the workers warming up."""
        self._register(first=True)
        self.pool = self._standby()
        if self.cfg.metrics_port >= 0:
            port = self.metrics.serve(self.cfg.metrics_port)
            log.info("metrics on http://127.0.0.1:%d/metrics", port)
            self.events.emit(ev.AgentMetrics(node=self.cfg.node_id, port=port))

    def _on_signal(self, signum: int, frame: object) -> None:
        self.drain(f"signal {signum}")

    def drain(self, why: str) -> None:
        """Drain: the workers finish the step, save and exit; a second call stops at once."""
        if self.draining:
            log.warning("asked again (%s): killing workers and leaving", why)
            self.exit_code = exits.DRAINED
        else:
            log.info("%s: draining (workers finish the step, save, exit)", why)
            self.draining = True
            self.drain_deadline = self.clock.monotonic() + self.cfg.drain_timeout_s
        self.wake.set()

    def close(self) -> None:
        """Kill any workers, flush reports, give up the lease and close every part."""
        for workers in (self.workers, self.pool):
            if workers is not None:
                workers.kill()
        self.workers = self.pool = None
        self.view.close()
        self._flush_reports()
        if self.session is not None:
            self.session.close(revoke=True)
        self.heartbeats.close()
        self.metrics.close()
        if self._state is None or self._state.final is None:  # at the job's end, its final status said it
            self._say_device_time()
        self.events.emit(ev.AgentExit(node=self.cfg.node_id, exit_code=self.exit_code))
        self.events.close()
        self.store.close()

    # -- one tick ----------------------------------------------------------------------------
    def tick(self) -> None:
        """One pass of the loop: read the job, supervise the workers, lead, follow, report."""
        self._ensure_session()
        state = self._read()
        if state is not None:
            self._state = state
        self._supervise()
        if self.draining:
            self._drain_step()
        if state is None:
            self._release_held()
            return
        if state.final is not None:
            self._finish(state, state.final)
            return
        try:
            if self._registered():
                self._repair_own_record(state)
                self._lead(state)
                self._follow(state)
            self._flush_reports()
            self._answer_dump(state)
            self._publish_status(state)
        except EtcdUnavailableError as e:  # etcd went away mid-tick: the next tick re-reads
            log.warning("etcd request failed, retrying next tick: %s", e)
        self._release_held()  # last: a leader forms the hang's round before the stacks are dumped
        self.metrics.tick(serving=self.workers is not None)

    def _wants_leader_keys(self) -> bool:
        """Follow every node's status (and every round's per-node keys) while leading, and while
        this node's workers are stalled or a hang is held here (what the others' statuses say
        about their ranks decides the hang), and for :data:`LEADER_KEYS_LINGER_S` after."""
        now = self.clock.monotonic()
        state = self._state
        if (state is not None and state.leader == self.cfg.node_id) or self._stalled or self._held is not None:
            self._leader_keys_until = now + LEADER_KEYS_LINGER_S
        return now < self._leader_keys_until

    def _leading(self, state: JobState) -> bool:
        return self.memory is not None and state.leader == self.cfg.node_id

    # -- leader ------------------------------------------------------------------------------
    def _lead(self, state: JobState) -> None:
        lease = self._lease_id()
        if state.leader is None:
            try:
                if state.leader_mod_revision:  # an unusable leader key (no lease, unreadable): replace it
                    taken = self.store.put_if_mod_revision(
                        self.keys.leader, self.cfg.node_id, state.leader_mod_revision, lease=lease
                    )
                else:
                    taken = self.store.put_if_absent(self.keys.leader, self.cfg.node_id, lease=lease)
                if taken:
                    log.info("elected leader of job %s", self.cfg.job)
                    self.events.emit(ev.LeaderElected(node=self.cfg.node_id))
                    self.wake.set()
            except (EtcdUnavailableError, LeaseExpiredError):
                pass
            return
        leading = state.leader == self.cfg.node_id and state.leader_lease == lease
        self.metrics.leader.set(1 if leading else 0)
        if not leading:
            self.memory = None
            self._note_pending(None)
            return
        if not self.view.following_leader_keys:  # just elected: decide once every status is read
            self.view.follow_leader_keys(True)
            self.wake.set()
            return
        now = self.clock.time()
        if self.memory is None:
            self.memory = LeaderMemory(leader_since=now, live=frozenset(state.live_members()), live_changed_at=now)
        decision, self.memory = decide(state, self.policy, self.memory, now)
        self._note_stragglers(state, self.memory, now)
        self._note_pending(decision)
        try:
            if isinstance(decision, FormRound):
                self._form_round(state, decision)
            elif isinstance(decision, Finish):
                if self.store.put_if_mod_revision(
                    self.keys.final, decision.final.to_json(), state.final_mod_revision
                ):  # 0: absent; else unreadable
                    log.info("job %s: %s (%s)", decision.final.status, self.cfg.job, decision.final.reason)
                    self.events.emit(
                        ev.JobFinal(node=self.cfg.node_id, status=decision.final.status, reason=decision.final.reason)
                    )
        except EtcdUnavailableError as e:
            log.warning("leader action failed, retrying: %s", e)

    def _form_round(self, state: JobState, decision: FormRound) -> None:
        record = decision.record
        guard = [
            Compare(self.keys.round, "mod_revision", "==", state.round_mod_revision),
            Compare(self.keys.leader, "lease", "==", self._lease_id()),
        ]
        ops = [
            Op.put(self.keys.round, str(record.round)),
            Op.put(self.keys.round_record(record.round), record.to_json()),
        ]
        old = record.round - ROUNDS_KEPT  # the state read stays small however many rounds a job has
        if old > 0:
            ops += [
                Op.delete(self.keys.round_record(old)),
                Op.delete(self.keys.round_record(old) + "/", prefix=True),
                Op.delete(self.keys.tally(old), prefix=True),
            ]
        if not self.store.txn(guard, ops).succeeded:
            log.info("round %d not formed: the job state moved on (re-reading)", record.round)
            return
        members = [m.node_id for m in record.members]
        log.info("formed round %d (%s): %s, world size %d", record.round, record.reason, members, record.world_size)
        if decision.note:
            log.warning("round %d: %s", record.round, decision.note)
        self.events.emit(
            ev.RoundFormed(
                node=self.cfg.node_id,
                new_round=record.round,
                reason=record.reason,
                members=members,
                world_size=record.world_size,
            )
        )
        self.wake.set()

    # -- follower ----------------------------------------------------------------------------
    def _hold(self, why: str) -> None:
        if why != self._held_why:
            self._held_why = why
            log.error("not acting on the current round: %s", why)
            self.events.emit(ev.RoundHeld(node=self.cfg.node_id, why=why))

    def _follow(self, state: JobState) -> None:
        if not state.round_known:  # never stop or start workers on a round we cannot read
            self._hold(
                f"the round key or the record of round {state.round} is unreadable; waiting for the leader "
                "to form a new round"
            )
            return
        cur = state.current
        self._dump_for_hang_elsewhere(state)
        if self._held is not None:  # a hang found here: its workers stay until the others dumped
            return
        if self._left_out(cur):
            assert isinstance(self.workers, LiveWorkers) and cur is not None
            self._park(self.workers, f"round {cur.round} goes on without this node until its workers are warm")
        if (
            self.workers is not None
            and (cur is None or self.workers.round != cur.round)
            and not self._keeps_workers(cur)
        ):
            why = f"round {cur.round if cur else '?'} replaced round {self.workers.round}"
            self._stop_workers(self.workers, why)
        if cur is None or self.draining:
            return
        node_rank = cur.node_rank(self.me)
        if cur.reason != START:
            self.metrics.count_restart(cur.round, cur.reason)
        self.metrics.round.set(cur.round)
        self.metrics.members.set(len(cur.members))
        if node_rank is None or cur.round in self.finished_rounds:
            return
        if self.workers is not None and self.workers.round == cur.round:
            return
        if cur.round in state.bad_masters:  # the leader fails the round (bad_record) and forms a new one
            self._hold(f"round {cur.round}: {state.bad_masters[cur.round]}; not launching")
            return
        master = state.masters.get(cur.round)
        if master is None:
            if node_rank == 0:
                self.store.put_if_absent(self.keys.master(cur.round), f"{self.cfg.host}:{free_port(self.cfg.host)}")
                self.wake.set()
            return
        addr, port = parse_master(master)  # JobState.parse let only well-formed addresses through
        self._held_why = ""
        self._launch(
            Launch(
                round=cur.round,
                nnodes=len(cur.members),
                node_rank=node_rank,
                nproc_per_node=cur.nproc_per_node,
                master_addr=addr,
                master_port=port,
                worker_args=tuple(self.opts.worker_args),
                interrupt=cur.reason in INTERRUPTING_CAUSES,
                committed_step=state.newest_commit,
                script=self.opts.script,
            )
        )

    def _keeps_workers(self, cur: RoundRecord | None) -> bool:
        """Live recovery: this node's workers move to round ``cur`` in-process (no restart)."""
        return (
            isinstance(self.workers, LiveWorkers)
            and cur is not None
            and cur.node_rank(self.me) is not None
            and not self.draining
            and not self.workers.terminating
        )

    def _left_out(self, cur: RoundRecord | None) -> bool:
        """Live recovery: a newer round was formed without this (live) node — a worker failed
        here with no warm replacement, or this node's lease lapsed. Its surviving workers keep
        what they hold and wait, warm, for the round that takes the node back."""
        return (
            isinstance(self.workers, LiveWorkers)
            and cur is not None
            and cur.round > self.workers.round
            and cur.node_rank(self.me) is None
            and not self.draining
            and not self.workers.terminating
        )

    def _park(self, pool: LiveWorkers, why: str) -> None:
        self.workers = None
        self.finished_rounds.add(pool.round)
        pool.refill(self.cfg.nproc_per_node)
        log.info("round %d: %s; %d warm of %d needed", pool.round, why, pool.ready(), self.cfg.nproc_per_node)
        self.events.emit(ev.WorkersStopped(node=self.cfg.node_id, worker_round=pool.round, why=f"{why} (kept)"))

    def _carry_beats(self, pool: LiveWorkers, last_beats: dict[int, Beat], launch: Launch) -> None:
        """The last beats of the processes kept for ``launch``'s round stand for them until they
        beat in it: one that froze as the round changed (SIGSTOP a moment before) is hung after
        ``hang_timeout_s`` of silence, not after the start timeout."""
        kept, serving = set(pool.last_kept), pool.pids()
        self.heartbeats.carry(
            {
                local_rank: dataclasses.replace(beat, rank=launch.node_rank * launch.nproc_per_node + local_rank)
                for local_rank, beat in last_beats.items()
                if beat.pid in kept and serving.get(local_rank) == beat.pid
            },
            self.clock.monotonic(),
        )

    def _launch(self, launch: Launch) -> None:
        if self.pool is not None and not self.pool.terminating:
            self._drop_frozen(self.pool)  # before the beats of the old round are forgotten
        last_beats = self.heartbeats.beats()
        self.heartbeats.reset(launch.round)
        self._ckpt_failures_seen = 0
        if self.pool is None or self.pool.terminating:  # gone (the job's end, a drain): start anew
            self.pool = self._standby()
        pool = self.pool
        if pool is not None:
            self.workers = pool
            pool.reassign(launch)
            self._carry_beats(pool, last_beats, launch)
            self.metrics.launched()
            self.metrics.workers_kept.set(len(pool.last_kept))
            self.metrics.workers_new.set(len(pool.last_started))
            self.events.emit(
                ev.WorkersReassigned(
                    node=self.cfg.node_id,
                    worker_round=launch.round,
                    node_rank=launch.node_rank,
                    nnodes=launch.nnodes,
                    kept=pool.last_kept,
                    started=pool.last_started,
                )
            )
            self._record_start(launch.round)
            return
        log_path = os.path.join(self.run_dir, f"round-{launch.round:04d}.log")
        self.workers = self.launcher(launch, self._worker_env(launch.round), log_path)
        self.metrics.launched()
        self.metrics.workers_kept.set(0)
        self.metrics.workers_new.set(launch.nproc_per_node)
        self.events.emit(
            ev.WorkersStarted(
                node=self.cfg.node_id,
                worker_round=launch.round,
                node_rank=launch.node_rank,
                nnodes=launch.nnodes,
                pid=self.workers.pid,
                log=log_path,
            )
        )
        self._record_start(launch.round)

    def _standby(self) -> LiveWorkers | None:
        """Live recovery: this node's worker processes, started now to warm up (None: restart mode)."""
        if self.standby is None:
            return None
        return self.standby(self._worker_env(0), os.path.join(self.run_dir, "workers.log"))

    def _worker_env(self, round_: int) -> dict[str, str]:
        """The workers' whole environment (``round_`` 0: live workers, told their round later)."""
        ours = WorkerEnv(
            job=self.cfg.job,
            round=round_,
            node=self.cfg.node_id,
            etcd=tuple(self.cfg.endpoints),
            fence_key=self.keys.round,
            commits_key=self.keys.commits,
            heartbeat=self.heartbeats.path,
            agent_pid=os.getpid(),
            stack_dir=self.stack_dir,
            etcd_client_file=self.client_file or "",
            # a script's session writes its events (memory tier, restores) beside the agent's
            events=os.path.abspath(self.opts.events_path) if self.opts.script and self.opts.events_path else "",
        )
        interface = collective_interface(self.cfg.host, os.environ, self.opts.worker_env)
        return worker_environment(
            os.environ,
            self.opts.worker_env,
            {**ours.to_env(), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", **interface, **self._recorder_env()},
        )

    def _recorder_env(self) -> dict[str, str]:
        return flight.script_recorder_env(os.environ, self.opts.worker_env) if self.opts.script else {}

    def _record_start(self, round_: int) -> None:
        try:
            self.store.put(self.keys.started(round_, self.cfg.node_id), self.uid)
        except EtcdUnavailableError as e:
            log.warning("could not record the start of round %d: %s", round_, e)

    def _stop_workers(self, workers: Workers, why: str, *, rewarm: bool = True) -> None:
        self.workers = None
        rc = workers.kill()
        if workers is self.pool:  # warm up new ones now: a node that is not warm is not let back in
            self.pool = self._standby() if rewarm and not self.draining else None
        self.finished_rounds.add(workers.round)
        log.info("stopped the workers of round %d (%s), %s %s", workers.round, why, _ended(workers), rc)
        self.events.emit(ev.WorkersStopped(node=self.cfg.node_id, worker_round=workers.round, why=why))

    # -- supervision -------------------------------------------------------------------------
    def _supervise(self) -> None:
        self._note_startup_failures(self.pool)
        workers = self.workers
        if workers is None:
            self._stalled = []
            if self.pool is not None and not self.pool.terminating:  # between rounds: stay ready
                self.pool.refill(self.cfg.nproc_per_node)
            return
        beats = self.heartbeats.beats()
        workers.note_pids(b.pid for b in beats.values())
        if beats:
            newest = max(beats.values(), key=lambda b: b.step)
            if newest.phase == "training":
                interval_s = sum(newest.phases_s.values()) if newest.phases_s else None
                self.metrics.stepped(newest.step, newest.step_time_s, interval_s, at=newest.received_at)
            self.committed_step = max(self.committed_step, *(b.committed_step for b in beats.values()))
            self.metrics.committed_step.set(self.committed_step)
            self.metrics.ckpt_duration.set(max(b.ckpt_duration_s for b in beats.values()))
            self.metrics.heartbeat_age.set(self.clock.monotonic() - min(b.received_at for b in beats.values()))
            self._note_ckpt_failures(workers.round, beats)
            self._note_corruptions(beats)
            self.metrics.ranks_stepped(workers.round, {b.rank: b.phases_s for b in beats.values() if b.rank >= 0})
        self._stalled = stalls(
            beats,
            self._hung(workers, beats),
            now=self.clock.monotonic(),
            now_wall=self.clock.time(),
            hang_timeout_s=self.cfg.hang_timeout_s,
        )
        if self._held is not None:  # the round is over here: its hung workers wait for the others' dumps
            return  # (released at the end of the tick)
        rc = workers.poll()
        if isinstance(workers, LiveWorkers) and (rc is None or (rc != 0 and not workers.terminating)):
            self._supervise_live(workers, beats)  # a failed worker is replaced, even the node's last one
            return
        crashed = self._crashed_workers(workers, beats)
        if rc is None and crashed:  # do not wait for torchrun to notice and tear down: seconds
            log.info(
                "round %d: worker %d (local rank %d) died without saying goodbye",
                workers.round,
                crashed[0].pid,
                crashed[0].local_rank,
            )
            rc = workers.kill()
            rc = 1 if rc in (None, 0) else rc
        if rc is not None:
            self.workers = None
            if isinstance(workers, LiveWorkers):
                workers.kill()  # the spares: this node's part of the job is over
                self.pool = None
            self.finished_rounds.add(workers.round)
            report = exit_report(
                rc,
                beats,
                workers.launch.nproc_per_node,
                workers.log_path,
                self.uid,
                self.clock.time(),
                draining=self.draining,
                exited=_exited(workers),
                log_error=self._log_error(rc, beats, workers.log_path),
            )
            teardown = report.outcome == SUCCEEDED and rc != 0  # every worker finished, then crashed at exit
            (log.warning if teardown else log.info)(
                "round %d: workers exited (%s %d): %s", workers.round, _ended(workers), rc, report.outcome
            )
            self.events.emit(
                ev.WorkersExited(
                    node=self.cfg.node_id, worker_round=workers.round, exit_code=rc, outcome=report.outcome
                )
            )
            self.pending_reports[workers.round] = report
            return
        if self.hang_dumped_round >= workers.round:  # its hang, reported by another member, was dumped
            return  # here already: not found again (a late second dump would catch workers leaving)
        call = self._judge(workers, beats, live=False)
        if call is not None:
            self._on_hang(workers, call, beats)

    def _supervise_live(self, workers: LiveWorkers, beats: dict[int, Beat]) -> None:
        """Live workers: a dead or hung worker is reported (its siblings keep running and wait
        for the next round); once reported, the round is over on this node."""
        if workers.round in self.finished_rounds:
            return
        now = self.clock.monotonic()

        def settled(local_rank: int, pid: int, code: int) -> bool:
            """Its exit message is in, or it had CRASH_GRACE_S to arrive (a death without one). A
            process a signal ended (a SIGKILL: the most common fault) said nothing: no wait, the
            others go on at once."""
            beat = beats.get(local_rank)
            if code < 0 or (beat is not None and beat.pid == pid and beat.finished is not None):
                return True
            return now - self._gone_since.setdefault(pid, now) >= CRASH_GRACE_S

        crashed = workers.crashed(settled)
        for local_rank in crashed:
            self._gone_since.pop(workers.pids().get(local_rank, -1), None)
        if crashed:
            local_rank, rc = next(iter(crashed.items()))
            log.info("round %d: worker of local rank %d exited with %d; the others stay", workers.round, local_rank, rc)
            said = {r: b for r, b in beats.items() if r in crashed and b.pid == workers.pids().get(r)}
            report = exit_report(
                rc,
                said,
                len(crashed),
                workers.log_path,
                self.uid,
                self.clock.time(),
                draining=self.draining,
                exited=f"the worker of local rank {local_rank}",
                log_error=self._log_error(rc, said, workers.log_path),
            )
            self.events.emit(
                ev.WorkersExited(
                    node=self.cfg.node_id, worker_round=workers.round, exit_code=rc, outcome=report.outcome
                )
            )
            self.finished_rounds.add(workers.round)
            self.pending_reports[workers.round] = dataclasses.replace(report, workers_ready=workers.ready())
            self.wake.set()
            return
        if self._report_left(workers, beats, now):
            return
        # Frozen ranks are ended; ranks hung in a collective are not (the next round's watchdog
        # frees them); see ftrain.agents.supervision.judge.
        call = self._judge(workers, beats, live=True)
        if call is not None:
            self._on_hang(workers, call, beats)

    @staticmethod
    def _log_error(rc: int, beats: dict[int, Beat], log_path: str) -> str:
        """The last error line of the workers' log, when they failed on their own (an exit code
        above 0, not a signal) and none of them said why: it died before it could (an import, the
        first lines of a script)."""
        if rc <= 0 or any(b.error for b in beats.values()):
            return ""
        return last_error_line(log_path)

    def _crashed_workers(self, workers: Workers, beats: dict[int, Beat]) -> list[Beat]:
        """Workers gone for CRASH_GRACE_S without the exit message a clean exit sends first (the
        grace lets the heartbeat thread read a message already on its way)."""
        now = self.clock.monotonic()
        gone = {b.pid for b in beats.values() if b.finished is None and workers.gone(b.pid)}
        self._gone_since = {pid: self._gone_since.get(pid, now) for pid in gone}
        return [b for b in beats.values() if b.pid in gone and now - self._gone_since[b.pid] >= CRASH_GRACE_S]

    def _drain_step(self) -> None:
        if self.workers is None:
            self._leave_current_round()
            self.exit_code = exits.DRAINED  # the report of the drained round is flushed on the way out
            return
        if not self.workers.terminating:
            self.workers.terminate()
            self.events.emit(ev.Drain(node=self.cfg.node_id, worker_round=self.workers.round))
        elif self.clock.monotonic() > self.drain_deadline:
            round_ = self.workers.round
            self._stop_workers(self.workers, "drain timed out")
            # a departure all the same (flushed on the way out): the leader forms the next round
            # for node_left at once, not for a node loss once this agent's lease is gone
            self.pending_reports.setdefault(round_, drained_report(self.uid, self.clock.time()))
            self.exit_code = exits.DRAINED

    def _leave_current_round(self) -> None:
        """A draining agent with no workers left that the current round lists, and that has no
        report for it, says it left that round (``stopped``, as when its workers stop for the
        drain): its workers never started there (the round formed as the SIGTERM came, and the
        ones of the round it replaced were killed), and without a report the next leader would
        tell its departure as a node loss when its lease goes."""
        state = self._state
        cur = state.current if state is not None and state.round_known else None
        if cur is None or cur.node_rank(self.me) is None or cur.round in self.finished_rounds:
            return
        self.finished_rounds.add(cur.round)
        self.pending_reports.setdefault(cur.round, drained_report(self.uid, self.clock.time()))
        log.info("round %d: drained before its workers started here; reporting it left", cur.round)

    def _flush_reports(self) -> None:
        """Write the reports of ended rounds; a hang's also names its finder in ``rounds/<g>/hang``
        (if nobody did first): the other members, who do not read reports, dump for it."""
        for round_, report in sorted(self.pending_reports.items()):
            put = Op.put(self.keys.report(round_, self.cfg.node_id), report.to_json())
            try:
                if report.outcome == FAILED and report.reason == HANG:
                    hang = self.keys.hang(round_)
                    self.store.txn([Compare.absent(hang)], [put, Op.put(hang, self.cfg.node_id)], [put])
                else:
                    self.store.put(put.key, put.value)
            except EtcdUnavailableError:
                return
            del self.pending_reports[round_]
            self.wake.set()

    def _finish(self, state: JobState, final: FinalStatus) -> None:
        if self._held is not None:  # the job is over: nobody else is to be waited for
            self._held.due_at, self._held.fresh = 0.0, False
            self._release_held()
        if self.workers is not None:
            if self.workers.wait(timeout_s=10.0) is None:
                self._stop_workers(self.workers, "job finished", rewarm=False)
        self.exit_code = exits.OK if final.status == SUCCEEDED else exits.FAILED
        log.info("job %s %s: %s", self.cfg.job, final.status, final.reason)
        self._publish_status(state, state_name="done", force=True)


def _exited(workers: Workers) -> str:
    """What ended when a round's workers exit: torchrun (restart recovery), or this node's own
    worker processes (live recovery: no torchrun there)."""
    return "the worker processes" if isinstance(workers, LiveWorkers) else "torchrun"


def _ended(workers: Workers) -> str:
    """How the exit status is named in the log: ``torchrun exit 1`` or ``worker processes' exit 0``."""
    return "worker processes' exit" if isinstance(workers, LiveWorkers) else "torchrun exit"


__all__ = ["Agent"]
