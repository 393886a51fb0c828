"""The node agent: membership, leadership, rounds and supervision of this node's workers.

One loop, level-triggered: every tick (woken early by a watch on the job's keys) the agent
reads the whole job state from etcd in one range request and acts on it:

- **session**: a lease kept alive; ``nodes/<id>`` on it. Registering an id that a live agent
  holds is refused (:class:`NodeIdTakenError`). If the lease is lost (etcd unreachable longer
  than the TTL), the agent keeps its workers running, registers again with a new lease once etcd
  answers, and until then acts on no round at all.
- **leader**: whoever creates ``leader`` on its lease; it runs :func:`agents.leader.decide` and
  forms rounds with a compare-and-swap on ``round``.
- **follower** (every agent, the leader too): when the current round lists this agent, start
  its workers (torchrun, static rendezvous at the round's master) unless they already run; when
  it does not, stop any workers of an older round. Watch the workers: exit code, heartbeats,
  hangs (:mod:`agents.supervision`: no progress, silence, or a collective waited in too long
  with nobody in the round moving). Report how the round ended on this node.
- **hangs**: the agent that finds one takes its workers' flight records, reports the hang, and
  ends the workers that must go (frozen ones; every one under restart recovery) only once every
  other member has taken its own workers' records (or after :data:`HANG_HOLD_S`): ending a
  rank first lets its peers' collectives fail, and then their records no longer show where
  they waited. Every other member takes them as soon as it sees a hang reported in its round (or
  a round formed for one), in both recovery modes, before its workers move on. Workers hung in
  a collective under live recovery are not killed: the next round's watchdog frees them.
- **status**: ``status/<id>`` for ``ftrain status``; Prometheus metrics.

The agent is assembled from parts passed in (:mod:`agents.assemble` wires the production ones):
a job store (:mod:`agents.jobstore`), a clock, the heartbeat channel, metrics, an event sink and
a worker launcher (:mod:`agents.parts`, :mod:`agents.workers`). It reads no clock and starts no
process or thread of its own, so a unit test drives it tick by tick on a fake clock
(:meth:`Agent.start`, :meth:`Agent.tick`); :meth:`Agent.run` is the production loop.

Exit codes: 0 when the job succeeded or this agent drained on SIGTERM, 1 when the job failed
(restart budget, a deterministic or fatal worker error), 2 for bad arguments or a node id in use.

What is read from etcd, the heartbeat socket or the environment is checked, never trusted:

- unreadable job records are skipped (:mod:`agents.records`), logged once per key and
  revision (``bad_record`` event); the agent never acts on a round it cannot read: while the
  ``round`` key or the current round's record is unreadable it keeps its workers and starts
  none (the leader forms a new round); it never launches with a malformed master address;
  it puts back its own ``nodes/<id>`` record if that became unreadable.
- worker PIDs from heartbeats are signalled only while they are still descendants of this
  round's torchrun with the start time first seen (:class:`agents.workers.WorkerGroup`).
- workers reach etcd (the checkpoint fence) with the agent's credentials and TLS files through
  a 0600 file in the run dir named by ``FTRAIN_ETCD_CLIENT_FILE``: no secret on a command
  line, and ``FTRAIN_ETCD_PASSWORD`` is removed from the workers' environment.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import socket
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from agents import flight, flight_verdict, hang_view
from agents.config import AgentConfig
from agents.errors import AgentError, EtcdUnavailableError, LeaseExpiredError, NodeIdTakenError
from agents.etcd import Compare, Op
from agents.heartbeat import Beat, BusyWindow
from agents.jobstore import Closable, JobStore, LeaseSession
from agents.leader import Finish, FormRound, LeaderMemory, Policy, decide
from agents.live_workers import LiveWorkers
from agents.metrics import AgentMetrics
from agents.netif import collective_interface
from agents.parts import Clock, EventSink, Heartbeats
from agents.records import (
    FAILED,
    HANG,
    INTERRUPTING_CAUSES,
    START,
    SUCCEEDED,
    FinalStatus,
    JobKeys,
    JobState,
    Member,
    NodeRecord,
    NodeStatus,
    Problem,
    RankStall,
    Report,
    RoundRecord,
    parse_master,
    validate_id,
)
from agents.supervision import (
    FROZEN_AFTER_S,
    HangCall,
    exit_report,
    frozen_ranks,
    hung_ranks,
    judge,
    stalls,
    waiting,
)
from agents.workers import Launch, Launcher, Workers
from contract import events as ev
from contract import exits
from contract.worker_env import WorkerEnv, worker_environment

log = logging.getLogger(__name__)

#: live recovery: starts this node's worker processes before any round (environment, log path)
Standby = Callable[[dict[str, str], str], LiveWorkers]

TICK_S = 0.2
STATUS_INTERVAL_S = 1.0
CRASH_GRACE_S = 0.3
ROUNDS_KEPT = 8  #: round records (and their reports) kept in etcd behind the current one
#: the longest a hang's workers are kept (frozen or stuck) for the other members to take their
#: own workers' flight records first (a running worker answers in milliseconds; see agents.flight)
HANG_HOLD_S = 2.0


@dataclass(slots=True)
class _HeldHang:
    """A hang found here whose workers are not ended yet (see the module doc, **hangs**)."""

    workers: Workers
    call: HangCall
    evidence: flight.Evidence
    verdict: str
    due_at: float  #: monotonic: end them by then, whoever has dumped
    fresh: bool = True  #: found in this tick: the report is not in the state a leader reads until the next


@dataclass(kw_only=True)
class AgentOptions:
    """What one agent runs with: its settings (``config``, the ``[agent]`` keys: their one
    definition and default is :class:`AgentConfig`) and what is not a key of the config file."""

    config: AgentConfig
    worker_args: list[str]  #: CONFIG.toml and --section.key=value overrides for ``ftrain train``
    events_path: str = ""
    worker_env: dict[str, str] = field(default_factory=dict)
    etcd_username: str | None = None
    etcd_password: str | None = None
    etcd_ca_cert: str | None = None
    etcd_cert: str | None = None  #: client certificate (PEM) for https endpoints that require one
    etcd_key: str | None = None  #: its private key (PEM), if not in the certificate file
    device_hour_price: float = 0.0  #: accounting.device_hour_price: lost time's cost in the metrics and status
    pipeline_degrees: tuple[int, ...] = (1,)  #: the training layout's pipeline degrees (see :class:`Policy`)
    fixed_tp_size: int = 1  #: and its fixed tensor-parallel degree

    @classmethod
    def of(cls, **kwargs: Any) -> AgentOptions:
        """From flat keyword arguments: this class's fields, and ``[agent]`` keys that go into
        ``config`` (as :meth:`AgentConfig.of` takes them); ``node_id`` defaults to the host name."""
        own = {f.name for f in dataclasses.fields(cls)} - {"config"}
        settings = {k: v for k, v in kwargs.items() if k not in own}
        settings.setdefault("node_id", socket.gethostname())
        return cls(config=AgentConfig.of(**settings), **{k: v for k, v in kwargs.items() if k in own})

    def policy(self) -> Policy:
        return Policy.from_config(self.config, pipeline_degrees=self.pipeline_degrees, fixed_tp_size=self.fixed_tp_size)

    def validate(self) -> None:
        """What :class:`AgentConfig` cannot check alone: the ids as they reach key paths, the
        training config, the etcd credentials and TLS files (ValueError naming the option)."""
        validate_id(self.config.job, "--job")
        validate_id(self.config.node_id, "--node-id")
        if not self.worker_args:
            raise ValueError("no training config: pass it after '--', e.g. -- configs/demo.toml")
        policy = self.policy()
        if policy.usable_nodes(self.config.max_nodes) < self.config.min_nodes:
            raise ValueError(
                f"--nnodes {self.config.nnodes} with --nproc-per-node {self.config.nproc_per_node} gives no world size "
                f"the training layout can use ({policy.layout_needs()}: the pipeline x tensor-parallel degrees): "
                "change --nnodes or --nproc-per-node, or parallel.pp_size / pp_fallback / tp_size"
            )
        if (self.etcd_username is None) != (self.etcd_password is None):
            raise ValueError("--etcd-user needs the password in FTRAIN_ETCD_PASSWORD (set it, or drop --etcd-user)")
        for option, path in (
            ("--etcd-ca-cert", self.etcd_ca_cert),
            ("--etcd-cert", self.etcd_cert),
            ("--etcd-key", self.etcd_key),
        ):
            if path and not os.path.isfile(path):
                raise ValueError(f"{option}: no such file {path!r}")

    def etcd_client_settings(self) -> dict[str, str]:
        """What a worker needs to reach etcd as this agent does (credentials, TLS files as
        absolute paths); empty when the agent uses none."""
        settings = {
            "username": self.etcd_username,
            "password": self.etcd_password,
            "ca_cert": self.etcd_ca_cert and os.path.abspath(self.etcd_ca_cert),
            "cert": self.etcd_cert and os.path.abspath(self.etcd_cert),
            "key": self.etcd_key and os.path.abspath(self.etcd_key),
        }
        return {k: v for k, v in settings.items() if v}


def write_client_file(run_dir: str, settings: dict[str, str]) -> str | None:
    """Write ``settings`` as JSON to ``<run_dir>/etcd-client.json``, readable by this user only
    (created 0600, never widened); its path, or None when there is nothing to write."""
    if not settings:
        return None
    path = os.path.join(run_dir, "etcd-client.json")
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, json.dumps(settings).encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return path


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class Agent:
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
        self.hang_verdict = ""  #: the newest hang's verdict from the flight records (shown by ftrain status)
        self.hang_dumped_round = -1  #: the newest round whose hang this node's workers' records were taken for
        self._held: _HeldHang | None = None  #: a hang found here, its workers kept until the others dumped
        self._stalled: list[RankStall] = []  #: this node's ranks not making progress (status)
        self._state: JobState | None = None  #: the newest job state read (the other members, for a hang)
        self.dump_nonce = ""  #: the newest dump request seen (ftrain status --dump)
        self.dump_verdict = ""  #: what the workers' flight records said when it was answered
        self.started_at_wall = self.clock.time()
        self.straggler_lines: list[str] = []  #: the leader's view of the stragglers (status)
        self._stragglers_seen: set[tuple[int, str]] = set()  #: (round, node) already reported
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
        self._watch: Closable | None = None

    # -- lifecycle ---------------------------------------------------------------------------
    def run(self) -> int:
        """Register (raising :class:`NodeIdTakenError` if the id is in use), then loop until the
        job ends or the agent drains; SIGTERM and SIGINT drain."""
        self.start()
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
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
        self._watch = self.store.watch(
            self.keys.prefix, self.wake.set, progress_timeout_s=max(2.0, self.cfg.lease_ttl_s)
        )

    def _on_signal(self, signum: int, frame: object) -> None:
        self.drain(f"signal {signum}")

    def drain(self, why: str) -> None:
        """Drain: the workers finish the step, save and exit; a second call stops at once."""
        if self.draining:
            log.warning("asked again (%s): killing workers and leaving", why)
            self.exit_code = exits.OK
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
        if self._watch is not None:
            self._watch.close()
        self._flush_reports()
        if self.session is not None:
            self.session.close(revoke=True)
        self.heartbeats.close()
        self.metrics.close()
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
        self.metrics.tick()

    def _leading(self, state: JobState) -> bool:
        return self.memory is not None and state.leader == self.cfg.node_id

    def _registered(self) -> bool:
        return self.session is not None and not self.session.done.is_set()

    def _lease_id(self) -> int:
        """The lease of the current session (only called while registered)."""
        if self.session is None:
            raise LeaseExpiredError("not registered")
        return self.session.lease_id

    def _ensure_session(self) -> None:
        if self._registered() or self.clock.monotonic() < self._next_register_at:
            return
        if self.session is not None:
            log.warning("lease lost (%s): re-registering as a new member", self.session.lost_reason)
            self.events.emit(ev.LeaseLost(node=self.cfg.node_id, reason=self.session.lost_reason))
            self.session, self.memory = None, None
        try:
            self._register(first=False)
            self._register_backoff_s = 0.2
        except (EtcdUnavailableError, NodeIdTakenError, LeaseExpiredError) as e:
            self._next_register_at = self.clock.monotonic() + self._register_backoff_s
            self._register_backoff_s = min(5.0, self._register_backoff_s * 2)
            log.info("re-registration failed (%s); retrying in %.1fs", e, self._register_backoff_s)

    def _node_record(self) -> NodeRecord:
        return NodeRecord(
            self.cfg.node_id, self.uid, self.cfg.host, os.getpid(), self.cfg.nproc_per_node, self.clock.time()
        )

    def _register(self, *, first: bool) -> None:
        session = self.store.session(self.cfg.lease_ttl_s, on_lost=lambda _reason: self.wake.set())
        record = self._node_record()
        key = self.keys.node(self.cfg.node_id)
        try:
            created = self.store.put_if_absent(key, record.to_json(), lease=session.lease_id)
            if not created and self._reclaim(key):
                created = self.store.put_if_absent(key, record.to_json(), lease=session.lease_id)
        except BaseException:
            session.close(revoke=True)
            raise
        if not created:
            session.close(revoke=True)
            holder = self.store.get(self.keys.node(self.cfg.node_id))
            detail = holder.value.decode() if holder else "(gone since)"
            raise NodeIdTakenError(
                f"node id {self.cfg.node_id!r} is already registered in job {self.cfg.job!r} "
                f"by a live agent: {detail}; pick another --node-id or stop that agent"
            )
        self.session = session
        log.info(
            "registered node %s (agent %s, lease %x, ttl %ds)",
            self.cfg.node_id,
            self.uid,
            session.lease_id,
            session.ttl_s,
        )
        self.events.emit(ev.AgentRegistered(node=self.cfg.node_id, agent=self.uid, first=first))
        self.events.emit(ev.NodeHost(node=self.cfg.node_id, host=self.cfg.host, hostname=socket.gethostname()))

    def _reclaim(self, key: str) -> bool:
        """Our own earlier registration still holds the key (etcd restored the lease we gave up
        for lost, as it does after a restart): revoke that lease rather than wait for it."""
        holder = self.store.get(key)
        if holder is None:
            return True
        try:
            record = json.loads(holder.value)
        except ValueError:  # not ours (we never write garbage); the key is someone else's problem
            return False
        ours = isinstance(record, dict) and record.get("agent_uid") == self.uid
        if ours and holder.lease:
            log.info("revoking this agent's previous lease %x to register again", holder.lease)
            self.store.revoke(holder.lease)
        return ours

    def _read(self) -> JobState | None:
        try:
            listing = self.store.list_prefix(self.keys.prefix)
        except EtcdUnavailableError as e:
            if self._etcd_down_since is None:
                self._etcd_down_since = self.clock.monotonic()
                log.warning("etcd unreachable (%s); workers keep running", e)
                self.events.emit(ev.EtcdUnreachable(node=self.cfg.node_id, error=str(e)))
            return None
        if self._etcd_down_since is not None:
            down_s = self.clock.monotonic() - self._etcd_down_since
            log.info("etcd reachable again after %.1fs", down_s)
            self.events.emit(ev.EtcdReachable(node=self.cfg.node_id, down_s=round(down_s, 3)))
            self._etcd_down_since = None
        state = JobState.parse(self.keys, listing.kvs, listing.revision)
        self._note_problems(state.problems)
        return state

    def _note_problems(self, problems: list[Problem]) -> None:
        """Log and record each unreadable record once per (key, mod_revision), not every tick."""
        for problem in problems:
            seen = (problem.key, problem.mod_revision)
            if seen in self._problems_seen:
                continue
            if len(self._problems_seen) > 10_000:  # bounded: a flood of garbage must not grow memory
                self._problems_seen.clear()
            self._problems_seen.add(seen)
            log.error("%s: skipped (fix or delete the key)", problem)
            self.events.emit(
                ev.BadRecord(
                    node=self.cfg.node_id, key=problem.key, mod_revision=problem.mod_revision, error=problem.error
                )
            )

    def _repair_own_record(self, state: JobState) -> None:
        """Our ``nodes/<id>`` became unreadable (someone overwrote it): put ours back on our
        lease, with a compare-and-swap so a record another agent wrote meanwhile is kept."""
        key = self.keys.node(self.cfg.node_id)
        bad = [p for p in state.problems if p.key == key]
        if not bad or self.cfg.node_id in state.nodes:
            return
        try:
            if self.store.put_if_mod_revision(
                key, self._node_record().to_json(), bad[0].mod_revision, lease=self._lease_id()
            ):
                log.warning("rewrote this agent's unreadable record %s", key)
                self.events.emit(ev.RecordRepaired(node=self.cfg.node_id, key=key))
        except LeaseExpiredError:
            pass

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
            return
        now = self.clock.time()
        if self.memory is None:
            self.memory = LeaderMemory(leader_since=now, live=frozenset(state.live_members()), live_changed_at=now)
        decision, self.memory = decide(state, self.policy, self.memory, now)
        self._note_stragglers(state, self.memory, now)
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

    def _note_stragglers(self, state: JobState, memory: LeaderMemory, now: float) -> None:
        """The leader: an event (and an error log) per new straggler, the metric, and a line each
        in this agent's status (``ftrain status`` shows them)."""
        cur = state.current
        self.straggler_lines = [
            s.describe(now) + (f"; policy {self.policy.on_straggler}" if self.policy.on_straggler != "warn" else "")
            for s in memory.stragglers
        ]
        self.metrics.stragglers.set(len(memory.stragglers))
        for s in memory.stragglers:
            key = (cur.round if cur else 0, s.node)
            if key in self._stragglers_seen:
                continue
            self._stragglers_seen.add(key)
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
            ops += [Op.delete(self.keys.round_record(old)), Op.delete(self.keys.round_record(old) + "/", prefix=True)]
        if not self.store.txn(guard, ops).succeeded:
            log.info("round %d not formed: the job state moved on (re-reading)", record.round)
            return
        members = [m.node_id for m in record.members]
        log.info("formed round %d (%s): %s, world size %d", record.round, record.reason, members, record.world_size)
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

    def _launch(self, launch: Launch) -> None:
        if self.pool is not None and not self.pool.terminating:
            self._drop_frozen(self.pool)  # before the beats of the old round are forgotten
        self.heartbeats.reset(launch.round)
        self._ckpt_failures_seen = 0
        if self.pool is None or self.pool.terminating:  # gone (the job's end, a drain): start anew
            self.pool = self._standby()
        pool = self.pool
        if pool is not None:
            self.workers = pool
            pool.reassign(launch)
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
        )
        interface = collective_interface(self.cfg.host, os.environ, self.opts.worker_env)
        return worker_environment(
            os.environ,
            self.opts.worker_env,
            {**ours.to_env(), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", **interface},
        )

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
        log.info("stopped the workers of round %d (%s), torchrun exit %s", workers.round, why, rc)
        self.events.emit(ev.WorkersStopped(node=self.cfg.node_id, worker_round=workers.round, why=why))

    # -- supervision -------------------------------------------------------------------------
    def _supervise(self) -> None:
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
                self.metrics.stepped(newest.step, newest.step_time_s, interval_s)
            self.committed_step = max(self.committed_step, *(b.committed_step for b in beats.values()))
            self.metrics.committed_step.set(self.committed_step)
            self.metrics.ckpt_duration.set(max(b.ckpt_duration_s for b in beats.values()))
            self.metrics.heartbeat_age.set(self.clock.monotonic() - min(b.received_at for b in beats.values()))
            self._note_ckpt_failures(workers.round, beats)
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
                rc, beats, workers.launch.nproc_per_node, workers.log_path, self.uid, self.clock.time()
            )
            log.info("round %d: workers exited (torchrun %d): %s", workers.round, rc, report.outcome)
            self.events.emit(
                ev.WorkersExited(
                    node=self.cfg.node_id, worker_round=workers.round, exit_code=rc, outcome=report.outcome
                )
            )
            self.pending_reports[workers.round] = report
            return
        call = self._judge(workers, beats, live=False)
        if call is not None:
            self._on_hang(workers, call, beats)

    def _supervise_live(self, workers: LiveWorkers, beats: dict[int, Beat]) -> None:
        """Live workers: a dead or hung worker is reported (its siblings keep running and wait
        for the next round); once reported, the round is over on this node."""
        if workers.round in self.finished_rounds:
            return
        crashed = workers.crashed()
        if crashed:
            local_rank, rc = next(iter(crashed.items()))
            log.info("round %d: worker of local rank %d exited with %d; the others stay", workers.round, local_rank, rc)
            report = exit_report(
                rc,
                {r: b for r, b in beats.items() if r in crashed},
                len(crashed),
                workers.log_path,
                self.uid,
                self.clock.time(),
                exited=f"the worker of local rank {local_rank}",
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
        # Frozen ranks are ended; ranks hung in a collective are not (the next round's watchdog
        # frees them); see agents.supervision.judge.
        call = self._judge(workers, beats, live=True)
        if call is not None:
            self._on_hang(workers, call, beats)

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

    def _crashed_workers(self, workers: Workers, beats: dict[int, Beat]) -> list[Beat]:
        """Workers gone for CRASH_GRACE_S without the exit message a clean exit sends first (the
        grace lets the heartbeat thread read a message already on its way)."""
        now = self.clock.monotonic()
        gone = {b.pid for b in beats.values() if b.finished is None and workers.gone(b.pid)}
        self._gone_since = {pid: self._gone_since.get(pid, now) for pid in gone}
        return [b for b in beats.values() if b.pid in gone and now - self._gone_since[b.pid] >= CRASH_GRACE_S]

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

    def _hung(self, workers: Workers, beats: dict[int, Beat]) -> list[int]:
        return hung_ranks(
            beats,
            nproc_per_node=workers.launch.nproc_per_node,
            started_at=workers.started_at,
            now=self.clock.monotonic(),
            hang_timeout_s=self.cfg.hang_timeout_s,
            start_timeout_s=self.cfg.start_timeout_s,
        )

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

    def _drain_step(self) -> None:
        if self.workers is None:
            self.exit_code = exits.OK  # the report of the drained round is flushed on the way out
            return
        if not self.workers.terminating:
            self.workers.terminate()
            self.events.emit(ev.Drain(node=self.cfg.node_id, worker_round=self.workers.round))
        elif self.clock.monotonic() > self.drain_deadline:
            self._stop_workers(self.workers, "drain timed out")
            self.exit_code = exits.OK

    def _flush_reports(self) -> None:
        for round_, report in sorted(self.pending_reports.items()):
            try:
                self.store.put(self.keys.report(round_, self.cfg.node_id), report.to_json())
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

    def _publish_status(self, state: JobState, *, state_name: str | None = None, force: bool = False) -> None:
        now = self.clock.monotonic()
        if not self._registered() or (not force and now - self._last_status_at < STATUS_INTERVAL_S):
            return
        self._last_status_at = now
        beats = self.heartbeats.beats() if self.workers is not None else {}
        totals = self.heartbeats.take_totals() if self.workers is not None else {}
        leader_status = state.status.get(state.leader or "")
        self.metrics.phases_taken(
            [t.seconds for t in totals.values()], straggling=bool(leader_status and leader_status.stragglers)
        )
        round_ = self.workers.round if self.workers is not None else -1
        if not beats or round_ != self._busy_round or (self.pool is not None and self.pool.warming()):
            self._busy_window.clear()  # a new round, or a spare's start-up slowing the workers: start over
            self._busy_round = round_
        else:
            self._busy_window.add(totals.values())
        self._busy = self._busy_window.busiest() or (-1, 0.0)
        name = state_name or ("stopping" if self.draining else "running" if self.workers else "waiting")
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
            device_hours={k: round(v / 3600, 6) for k, v in self.metrics.device_seconds().items()},
            devices=self.cfg.nproc_per_node,
            device_hour_price=self.opts.device_hour_price,
            busy_s=round(self._busy[1], 6),
            busy_rank=self._busy[0],
            stragglers=self.straggler_lines if self._leading(state) else [],
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


__all__ = ["Agent", "AgentError", "AgentOptions"]
