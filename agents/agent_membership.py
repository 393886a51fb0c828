"""A node agent's membership of its job: the lease session, its ``nodes/<id>`` record, and
reading the job's state from etcd.

What must stay true:

- a lease kept alive; ``nodes/<id>`` on it. Registering an id that a live agent holds is
  refused (:class:`NodeIdTakenError`); our own earlier registration (a lease etcd restored after
  we gave it up for lost) is revoked rather than waited for.
- if the lease is lost (etcd unreachable longer than the TTL), the agent keeps its workers
  running, registers again with a new lease once etcd answers (with backoff), and forgets that
  it led: until then it acts on no round at all.
- the job is read from the agent's view of it (:mod:`ftrain.agents.job_view`: listed once, then
  followed by a watch): every agent follows the membership and round keys, the leader (and an
  agent judging a hang) every node's status too. etcd unreachable (the view cannot list, or its
  watch is down) is logged and recorded once per outage, and then the agent keeps its workers
  and acts on no state (None).
- unreadable job records are skipped (:mod:`ftrain.agents.records`), logged once per key and revision
  (``bad_record`` event, bounded memory); the agent puts back its own ``nodes/<id>`` record if
  that became unreadable, with a compare-and-swap that keeps a record another agent wrote since.

A mixin of :class:`ftrain.agents.agent.Agent`: the annotations below are the agent's state and parts
that it uses (set up in ``Agent.__init__``).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable

from ftrain.agents.config import AgentConfig
from ftrain.agents.errors import EtcdUnavailableError, LeaseExpiredError, NodeIdTakenError
from ftrain.agents.job_keys import JobKeys
from ftrain.agents.job_view import JobView
from ftrain.agents.jobstore import JobStore, LeaseSession
from ftrain.agents.leader import LeaderMemory
from ftrain.agents.parts import Clock, EventSink
from ftrain.agents.records import MAX_RECORD_BYTES, JobState, NodeRecord, Problem
from ftrain.contract import events as ev
from ftrain.contract.bounded_json import loads, printable

log = logging.getLogger(__name__)


class AgentMembership:
    """Registering, keeping registered, and reading the job."""

    cfg: AgentConfig
    clock: Clock
    store: JobStore
    keys: JobKeys
    events: EventSink
    uid: str
    wake: threading.Event
    memory: LeaderMemory | None
    view: JobView
    _wants_leader_keys: Callable[[], bool]
    # this part's own state
    session: LeaseSession | None
    _problems_seen: set[tuple[str, int]]
    _etcd_down_since: float | None
    _next_register_at: float
    _register_backoff_s: float

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
            detail = printable(holder.value[:200].decode("utf-8", "replace")) if holder else "(gone since)"
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
            record = loads(holder.value, max_bytes=MAX_RECORD_BYTES, what=key)
        except ValueError:  # not ours (we never write garbage); the key is someone else's problem
            return False
        ours = isinstance(record, dict) and record.get("agent_uid") == self.uid
        if ours and holder.lease:
            log.info("revoking this agent's previous lease %x to register again", holder.lease)
            self.store.revoke(holder.lease)
        return ours

    def _read(self) -> JobState | None:
        self.view.follow_leader_keys(self._wants_leader_keys())
        try:
            state = self.view.snapshot()
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


__all__ = ["AgentMembership"]
