"""The leader's decisions: when to form a new round, with whom, and when the job is over.

:func:`decide` is pure: it looks at one :class:`~ftrain.agents.records.JobState`, what this leader
remembers (:class:`LeaderMemory`, immutable) and the time, and says what to do and what to
remember next (it changes none of its arguments). The agent's loop reads etcd, calls it, keeps
the returned memory, and applies the answer with a compare-and-swap on the ``round`` key, so two
agents that both believe they lead cannot both form round g+1.

Rules, in order:

1. Every member of the current round reported success → the job succeeded.
2. A new round is needed when there is none yet, a member reported a failure or a drain, a
   member's agent is gone (lease expired) or was replaced (new agent process, same node id),
   a member did not start its workers within ``start_timeout_s``, or nodes are waiting to join
   (``scale_up``: at the next committed checkpoint, or at once; under live recovery only once
   their workers are warm, so that the running members never wait for a cold start).
3. It is formed once at least ``min_nodes`` agents are live and membership has been quiet for
   ``settle_s`` — skipped when the live agents are exactly the members that all reported (a
   plain crash restarts at once) and when a node was lost and nobody joins (no last call to wait
   for: a node loss costs the lease TTL, not TTL + settle; a leader elected less than
   ``settle_s`` ago still waits, it starts careful) — and after the backoff owed to recent
   failures. More failures
   in ``restart_window_s`` than ``max_restarts`` end the job as failed instead.
4. **Stragglers** (:func:`watch_stragglers`): a member whose busiest rank is busy (not blocked on
   communication) ``straggler_factor`` times longer per step than the other members' median, for
   ``straggler_after_s`` without a break, is a straggler; under ``on_straggler = evict`` a round
   is formed without it (``straggler``, not a failure) while ``min_nodes`` remain, and it is kept
   out for ``straggler_rejoin_s`` (``RoundRecord.excluded``, carried from round to round), then
   joins like any node (rule 2); still slow, it is evicted again.
5. Members: the live agents in join order, at most ``max_nodes``, and as many of them as give a
   world size the job's layout can use (a pipeline of ``pp_size`` stages over tensor-parallel
   groups needs a multiple of ``pp_size x tp_size`` ranks, or of a fallback degree's
   ``parallel.pp_fallback``; the newest are left waiting, and joiners that would not make a
   larger usable size do not trigger a round). The oldest live agent is node
   rank 0 and hosts the rendezvous, so that role migrates when its host is lost. Under live
   recovery, after a worker failure, a node with no warm replacement for it is left out while
   at least ``min_nodes`` remain, and so is, in any round, a node that is not a member yet and
   whose workers are still warming: the others go on at the smaller world size and it joins
   again once warm (rule 2), instead of everyone waiting for a cold process start.
6. The job fails at once, without spending the restart budget, when a member reports a
   ``fatal`` error (the workers said a restart cannot help, e.g. too many failed checkpoint
   commits), or on a **deterministic failure**: the workers failed with the same error message
   at the same step ``deterministic_failures`` times in a row (default 3; 0: off). Only failures
   the workers described themselves (a Python exception in the exit message) count: a signal
   death or a hang says nothing about determinism (chaos kills workers at the same point on
   purpose) and is left to the restart budget. The final reason names the error and the step.
7. Unreadable records (see :mod:`ftrain.agents.records`) are never acted on: an unreadable ``round``
   key or current round record makes the leader form a new round above every round number in
   etcd (``round_repair``, not a failure); a malformed master address of the current round,
   while some member has not started, fails the round (``bad_record``, a failure).

8. **A round needed and not formed is a decision, stated at once**: the :class:`Wait` carries
   why a round is needed (``need``) and what the wait is (``kind``: settling, backoff, or blocked:
   too few nodes, or nodes whose world size the layout cannot run, said with the layout and the
   fix, e.g. ``parallel.pp_fallback``); the agent puts it in its status and, unless it only
   settles, an event and the log. :func:`waiting_reasons` says why each live node outside the
   round waits (warming, the next commit, a size the layout cannot use, kept out as a straggler).
   The settings and their words are :class:`~ftrain.agents.policy.Policy`'s.
9. **A world size the job cannot run is refused once** (``Policy.refused``: no round of it, rule 5),
   and so is one whose workers stop on a config error (``LeaderMemory.refused``, said once in
   :attr:`FormRound.note`): with no node count of ``--nnodes`` left, the job fails naming the setting.

**Size.** Over 600 lines: the rules above are one decision over one read of the state, kept
together so that their order reads top to bottom; their words are :class:`Policy`'s and the
straggler arithmetic :mod:`ftrain.agents.straggler_peers`'s.

Cost: the leader decides on every change of the job, so :func:`decide` stays O(N log N) at N
nodes (a few ms at 4,096: ``bench/lib/control_plane_micro.py``): what it reads of the state more
than once is read once per call (``_Seen``), node ids are looked up in dicts, never in lists,
and stragglers come from :mod:`ftrain.agents.straggler_peers`.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from ftrain.agents.policy import Policy, workers_refused
from ftrain.agents.records import (
    BAD_RECORD,
    DRAINING,
    FAILED,
    FAILURE_CAUSES,
    FATAL,
    HANG,
    NODE_LEFT,
    NODE_LOST,
    ROUND_REPAIR,
    SCALE_UP,
    START,
    START_TIMEOUT,
    STOPPED,
    STRAGGLER,
    SUCCEEDED,
    WORKER_EXIT,
    YIELDED,
    FinalStatus,
    JobState,
    Member,
    Report,
    RoundRecord,
)
from ftrain.agents.straggler_peers import slow_members

_DIGITS = re.compile(r"\d+")


@dataclass(frozen=True, slots=True)
class Straggler:
    """A member whose busiest rank computes persistently longer per step than the other nodes'."""

    node: str
    rank: int
    busy_s: float  #: its busy time per step (not blocked on communication), lately
    others_s: float  #: the median of the other members'
    since: float  #: slow without a break since (wall clock)

    def describe(self, now: float) -> str:
        return (
            f"{self.node} (rank {self.rank}): busy {self.busy_s:.3f} s per step vs {self.others_s:.3f} s on the other "
            f"nodes ({self.busy_s / self.others_s:.2f}x) for {now - self.since:.1f} s"
        )


@dataclass(frozen=True, slots=True)
class LeaderMemory:
    """What one leader remembers between reads; a new leader starts blank (and careful).
    Immutable: :func:`decide` returns the next one."""

    leader_since: float
    live: frozenset[Member] = frozenset()
    live_changed_at: float = 0.0
    #: committed step when nodes were first seen waiting to join; grow once it advances
    grow_baseline_step: int | None = None
    slow_since: tuple[tuple[str, float], ...] = ()  #: (node, since): members slow without a break
    stragglers: tuple[Straggler, ...] = ()  #: members slow for straggler_after_s or longer
    #: (nodes, why): node counts whose workers stopped on a config error at that world size (rule 9)
    refused: tuple[tuple[int, str], ...] = ()

    def observed(self, state: JobState, now: float) -> LeaderMemory:
        """This memory after seeing ``state`` at ``now`` (membership changes restart the quiet time)."""
        return self.seen_live(_live_uids(state), state.live_members, now)

    def seen_live(
        self, live_uids: dict[str, str], live_members: Callable[[], list[Member]], now: float
    ) -> LeaderMemory:
        """:meth:`observed`, given the live agents' uids by node id: compared with :attr:`live`
        member by member, so that the set of members (N objects) is built only when it changed."""
        same = len(live_uids) == len(self.live) and all(live_uids.get(m.node_id) == m.agent_uid for m in self.live)
        return self if same else dataclasses.replace(self, live=frozenset(live_members()), live_changed_at=now)


@dataclass(frozen=True, slots=True)
class Wait:
    why: str
    #: why a new round is needed though none is formed now, as ``reason (detail)`` (empty: none is
    #: needed: the round is healthy or the job is over); the agent states it (status, event, log)
    need: str = ""
    #: what the wait is: SETTLING or BACKOFF end by themselves; BLOCKED lasts until the nodes
    #: change (too few live, or a layout they cannot run); empty when no round is needed
    kind: str = ""

    @property
    def blocked(self) -> bool:
        return self.kind == BLOCKED


#: :attr:`Wait.kind`: membership settles; the backoff owed to recent failures; no round can be formed
SETTLING, BACKOFF, BLOCKED = "settling", "backoff", "blocked"


@dataclass(frozen=True, slots=True)
class FormRound:
    record: RoundRecord
    note: str = ""  #: what the agent says once with it (a world size the workers refused: rule 9)


@dataclass(frozen=True, slots=True)
class Finish:
    final: FinalStatus


Decision = Wait | FormRound | Finish


@dataclass(slots=True)
class _Need:
    reason: str
    detail: str = ""
    failures: list[str] = field(default_factory=list)
    report: Report | None = None  #: the failing report the decision is about (first by node id)
    #: every failing member's report: a node that died without an error of its own (a signal)
    #: makes the others' errors symptoms ("connection closed by peer"), not evidence
    reports: list[Report] = field(default_factory=list)
    evict: list[str] = field(default_factory=list)  #: members to leave out (stragglers)

    def signature(self) -> str:
        """Equal for two failures that look deterministic: the same reason, step and worker
        errors, numbers aside (a round number, a port or a PID in the message changes with every
        restart). Empty (matches nothing) unless every failing member gave an error of its own."""
        r = self.report
        if r is None or self.reason != WORKER_EXIT or not all(x.error for x in self.reports or [r]):
            return ""
        errors = sorted({_DIGITS.sub("#", x.error) for x in self.reports or [r]})
        return f"{self.reason}|{r.step}|{' / '.join(errors)}"


@dataclass(slots=True)
class _Seen:
    """What :func:`decide` reads of one state more than once, read once per call: each is O(N)
    at N nodes, and read again at every use they made up most of a decision at thousands."""

    state: JobState
    live_uids: dict[str, str]  #: node id -> agent uid of the live agents
    member_uids: dict[str, str]  #: node id -> agent uid of the current round's members (empty: no round)
    reports: dict[str, Report]  #: the current round's members' reports (empty: no round)
    waiting: list[Member]  #: live agents that are not members of the current round, in join order
    _live: list[Member] | None = None

    @classmethod
    def of(cls, state: JobState) -> _Seen:
        cur = state.current
        member_uids = {m.node_id: m.agent_uid for m in cur.members} if cur else {}
        waiting = [n for n in state.nodes.values() if member_uids.get(n.node_id) != n.agent_uid]
        return cls(
            state,
            _live_uids(state),
            member_uids,
            state.member_reports(cur.round) if cur else {},
            [n.member() for n in sorted(waiting, key=lambda n: n.create_revision)],
        )

    def live(self) -> list[Member]:
        """The registered agents in join order (:meth:`JobState.live_members`), built on first use."""
        if self._live is None:
            self._live = self.state.live_members()
        return self._live

    def is_member(self, member: Member) -> bool:
        """``member`` (this agent process of its node) is a member of the current round."""
        return self.member_uids.get(member.node_id) == member.agent_uid

    def is_live(self, member: Member) -> bool:
        """``member`` (this agent process of its node) is registered."""
        return self.live_uids.get(member.node_id) == member.agent_uid


def _live_uids(state: JobState) -> dict[str, str]:
    """The registered agents' uids by node id (:meth:`JobState.live_members`, unordered)."""
    return {n.node_id: n.agent_uid for n in state.nodes.values()}


def committed_step(state: JobState, members: list[Member]) -> int:
    ids = {m.node_id for m in members}
    return max((s.committed_step for n, s in state.status.items() if n in ids), default=-1)


def _status_newer_than(state: JobState, members: list[Member], joiners: list[Member]) -> bool:
    """Every member's status was written after the joiners registered, so the committed step it
    shows is a baseline from which a higher step means a commit made after they joined (the
    status is refreshed about every second; wall clocks of different hosts are compared, so a
    skew between them shifts this by as much)."""
    joined_at = max((state.nodes[m.node_id].registered_at for m in joiners if m.node_id in state.nodes), default=0.0)
    return all(m.node_id in state.status and state.status[m.node_id].updated_at >= joined_at for m in members)


def _warm(state: JobState, member: Member, policy: Policy) -> bool:
    """Under live recovery a joiner counts once its status says its workers are warm, so that
    the running members do not wait for a cold start (interpreter, imports) in the new round."""
    status = state.status.get(member.node_id)
    return policy.recovery != "live" or (status is not None and status.workers_ready >= policy.nproc_per_node)


def _without_cold(state: JobState, seen: _Seen, need: _Need, policy: Policy, members: list[Member]) -> list[Member]:
    """Live recovery: the survivors need not wait for a cold start. Left out of the next round,
    while the others go on at the smaller world size — if at least ``min_nodes`` remain — are a
    node whose failed worker has no warm replacement (its report counts fewer warm processes
    than ``nproc_per_node``), and a node that is not a member of the current round and whose
    workers are not warm yet (:func:`_warm`: an agent that came back after a node loss starts its
    processes cold; a round formed for any reason would otherwise wait for them, 10-20 s on a
    loaded machine). Each joins once it is warm, at a step boundary. Otherwise (restart mode,
    the first round, too few nodes without them) the round keeps them."""
    cur = state.current
    if policy.recovery != "live" or cur is None:
        return members
    cold = {m.node_id for m in members if not seen.is_member(m) and not _warm(state, m, policy)}
    if need.reason in (WORKER_EXIT, HANG):
        cold |= {
            n for n, r in seen.reports.items() if r.outcome == FAILED and 0 <= r.workers_ready < policy.nproc_per_node
        }
    kept = [m for m in members if m.node_id not in cold]
    if not cold or len(kept) < policy.min_nodes:
        return members
    return kept


#: the longest a slowdown takes to show in the statuses the leader judges: an agent publishes its
#: busiest rank's busy time per step every STATUS_INTERVAL_S (1 s), averaged over its last two
#: statuses (:class:`ftrain.agents.heartbeat.BusyWindow`), and the leader judges the next one it reads
STRAGGLER_LAG_S = 3.0
#: how far above ``straggler_factor`` a slowdown's nominal factor must be to be told for sure:
#: part of a slow rank's lost time lands inside collectives, where it counts as waiting, not busy
SLOWDOWN_MARGIN = 1.2


def slowdown_flagged(factor: float, duration_s: float, policy: Policy) -> bool:
    """Whether a member whose busy time per step is ``factor`` times its peers' for ``duration_s``
    must be called a straggler (the rule that :func:`watch_stragglers` keeps and the chaos
    invariants hold it to): judging is on, the slowdown is clearly over ``straggler_factor``
    (:data:`SLOWDOWN_MARGIN`), and it lasts ``straggler_after_s`` after it can show
    (:data:`STRAGGLER_LAG_S`). A shorter or milder one may be flagged, and need not be. It also
    needs peers to compare with: members of the same round running the same stages, judged
    (their agents' busy windows not reset by a new round or a warming spare)."""
    return (
        policy.on_straggler != "off"
        and factor >= SLOWDOWN_MARGIN * policy.straggler_factor
        and duration_s >= policy.straggler_after_s + STRAGGLER_LAG_S
    )


def watch_stragglers(state: JobState, policy: Policy, memory: LeaderMemory, now: float) -> LeaderMemory:
    """The memory with the current round's slow members and stragglers, from their status:
    each agent publishes its busiest rank's busy time per step (about every second); a member
    is slow while that is over ``straggler_factor`` times the median of the other members', and
    a straggler once slow for ``straggler_after_s`` without a break. Under a pipeline a member
    is compared with the members that run the same stages only (stages differ in cost by design;
    :mod:`ftrain.agents.straggler_peers` finds them in O(N log N))."""
    cur = state.current
    if cur is None or policy.on_straggler == "off":
        return dataclasses.replace(memory, slow_since=(), stragglers=())
    previous = dict(memory.slow_since)
    slow_since: dict[str, float] = {}
    stragglers = []
    for slow in slow_members(state, cur, policy.stage_spans(len(cur.members)), policy.straggler_factor):
        since = slow_since[slow.node] = previous.get(slow.node, now)
        if now - since >= policy.straggler_after_s:
            stragglers.append(Straggler(slow.node, slow.status.busy_rank, slow.status.busy_s, slow.others_s, since))
    return dataclasses.replace(memory, slow_since=tuple(sorted(slow_since.items())), stragglers=tuple(stragglers))


def _came_back(seen: _Seen, node: str, report: Report) -> bool:
    """``node`` drained (``report``) and a new agent of it registered since: a resubmitted or
    requeued job, a restarted pod. It is not leaving: it joins the next round."""
    uid = seen.live_uids.get(node)
    return bool(report.agent_uid) and uid is not None and uid != report.agent_uid


def _draining(state: JobState) -> set[str]:
    """Nodes whose agent drains (its status says so; the status is the agent's registered now: a
    resubmitted node's newer registration outdates its predecessor's status). No round takes
    them, though their report of leaving has not come yet: a round that did would end as soon as
    it formed (a draining leader once formed one with itself)."""
    return {
        n
        for n, s in state.status.items()
        if s.state == DRAINING and n in state.nodes and s.updated_at >= state.nodes[n].registered_at
    }


def round_has_cause(state: JobState, round_: int) -> bool:
    """Whether the leader has, or will have without more news, a reason to end round ``round_``:
    a newer round (or none readable), a member's report of it, a member gone or draining. A
    member's agent whose rank left the round waits for one before it says so itself
    (:func:`ftrain.agents.supervision.left_ranks`)."""
    cur = state.current
    if cur is None or cur.round != round_:
        return True
    seen = _Seen.of(state)
    members = {m.node_id for m in cur.members}
    return bool(seen.reports) or any(not seen.is_live(m) for m in cur.members) or bool(members & _draining(state))


def _excluded(state: JobState, now: float) -> dict[str, float]:
    """Nodes the current round keeps out (evicted stragglers), until when."""
    cur = state.current
    return {n: t for n, t in (cur.excluded if cur else {}).items() if t > now}


def _need(
    state: JobState, seen: _Seen, policy: Policy, memory: LeaderMemory, now: float
) -> tuple[_Need | None, LeaderMemory]:
    """Why a new round is needed (None: it is not), and the memory after looking."""
    cur = state.current
    if cur is None:
        if state.round_unreadable or state.round > 0:
            return _Need(ROUND_REPAIR, f"round key or record of round {state.round} unreadable"), memory
        return _Need(START), memory
    reports = seen.reports
    failed = {n: r for n, r in reports.items() if r.outcome == FAILED}
    if failed:
        # the first failure is the cause: a hung rank's agent reports before it kills, and the
        # peers that fail after the kill report later (by node id, a victim could win the race)
        node, report = min(failed.items(), key=lambda kv: (kv[1].time, kv[0]))
        failing = sorted(failed)
        return _Need(
            report.reason or WORKER_EXIT, f"{node}: {report.detail}", failing, report, [failed[n] for n in failing]
        ), memory
    stopped = sorted(n for n, r in reports.items() if r.outcome == STOPPED)
    if stopped:
        return _Need(NODE_LEFT, f"drained: {', '.join(stopped)}"), memory
    yielded = sorted(n for n, r in reports.items() if r.outcome == YIELDED)
    if yielded and set(yielded) >= {m.node_id for m in cur.members}:  # a stop nobody's drain asked for
        return _Need(NODE_LEFT, f"workers stopped early on {', '.join(yielded)}, no node drained"), memory
    gone = [m.node_id for m in cur.members if not seen.is_live(m)]
    if gone:
        return _Need(NODE_LOST, f"agent gone: {', '.join(gone)}"), memory
    started = state.started.get(cur.round, set())
    late = [m.node_id for m in cur.members if m.node_id not in started]
    if late and cur.round in state.bad_masters:
        return _Need(BAD_RECORD, f"{state.bad_masters[cur.round]}; not started on {', '.join(late)}"), memory
    if late and now - cur.created_at > policy.start_timeout_s:
        return _Need(
            START_TIMEOUT, f"no workers started within {policy.start_timeout_s:.0f}s on {', '.join(late)}"
        ), memory
    if policy.on_straggler == "evict":
        members = {m.node_id for m in cur.members}
        evict = [s for s in memory.stragglers if s.node in members]
        if evict and len(cur.members) - len(evict) >= policy.min_nodes:
            detail = "; ".join(s.describe(now) for s in evict)
            return _Need(STRAGGLER, f"evicting straggler(s) {detail}", evict=[s.node for s in evict]), memory
    excluded = _excluded(state, now).keys() | _draining(state)
    joiners = [m for m in seen.waiting if m.node_id not in excluded and _warm(state, m, policy)]
    if not joiners or policy.usable_nodes(len(cur.members) + len(joiners)) <= len(cur.members):
        return None, dataclasses.replace(memory, grow_baseline_step=None)
    joined = ", ".join(m.node_id for m in joiners)
    if policy.scale_up == "immediate":
        return _Need(SCALE_UP, f"joined: {joined}"), memory
    step = committed_step(state, cur.members)
    if memory.grow_baseline_step is None:
        if not _status_newer_than(state, cur.members, joiners):
            return None, memory  # a stale status could hide a commit made before they joined
        return None, dataclasses.replace(memory, grow_baseline_step=step)
    if step > memory.grow_baseline_step:
        return _Need(SCALE_UP, f"joined: {joined} (at checkpoint step {step})"), memory
    return None, memory


#: the waiting nodes a leader explains in its status (the rest are counted, not named)
MAX_WAITING_SHOWN = 64


def waiting_reasons(
    state: JobState, policy: Policy, memory: LeaderMemory, now: float, *, limit: int = MAX_WAITING_SHOWN
) -> dict[str, str]:
    """Why each live node outside the current round is not in it (at most ``limit``, oldest
    first): the rule of :func:`_need` that keeps it waiting, in words (``ftrain status`` shows
    them). Empty when there is no round (the leader's pending decision says why) or the job is over."""
    cur = state.current
    if cur is None or state.final is not None:
        return {}
    policy = policy.refusing(*memory.refused)
    seen = _Seen.of(state)
    excluded, draining = _excluded(state, now), _draining(state)
    kept_out = excluded.keys() | draining
    members = len(cur.members)
    joiners = [m for m in seen.waiting if m.node_id not in kept_out and _warm(state, m, policy)]
    grows = policy.usable_nodes(members + len(joiners)) > members
    out = {}
    for m in seen.waiting[:limit]:
        status = state.status.get(m.node_id)
        if m.node_id in draining:
            why = "it drains (its agent was asked to stop): no round takes it"
        elif m.node_id in excluded:
            why = (
                f"kept out as a straggler for {excluded[m.node_id] - now:.0f}s more (agent.straggler_rejoin_s), "
                "then it joins like any node"
            )
        elif not _warm(state, m, policy):
            ready = status.workers_ready if status else 0
            why = (
                f"its workers are warming ({ready} of {policy.nproc_per_node} warm): under live recovery a node "
                "joins once they are, so that the running members never wait for a cold start"
            )
        elif members >= policy.max_nodes:
            why = f"the round has the most nodes --nnodes {policy.min_nodes}:{policy.max_nodes} allows"
        elif not grows and (refused := policy.refused_round(members + len(joiners))):
            why = refused
        elif not grows:
            why = (
                f"with it the nodes would not make a larger world size {policy.layout_text()} can run "
                f"({policy.layout_needs()}, {policy.nproc_per_node} per node); it joins with more nodes"
            )
        elif policy.scale_up == "immediate":
            why = "joins at the next round, once membership is quiet for settle_s (agent.scale_up=immediate)"
        elif memory.grow_baseline_step is None:
            why = (
                "joins at the next checkpoint commit (agent.scale_up=checkpoint); waiting for the members' status "
                "to show the newest commit"
            )
        else:
            why = (
                f"joins at the next checkpoint commit after step {memory.grow_baseline_step} "
                "(agent.scale_up=checkpoint)"
            )
        out[m.node_id] = why
    return out


def _failure_time(state: JobState, seen: _Seen, need: _Need, policy: Policy, now: float) -> float:
    """When the failure happened (fixed, so the backoff after it ends): the failing reports'
    time, or for a start timeout the moment the round ran out of time."""
    cur = state.current
    if cur is None:
        return now
    if need.reason == START_TIMEOUT:
        return cur.created_at + policy.start_timeout_s
    if need.reason == BAD_RECORD:
        return now
    failing = set(need.failures)
    return max((r.time for n, r in seen.reports.items() if n in failing), default=now)


def _fatal(state: JobState, seen: _Seen, cur: RoundRecord, now: float) -> Finish | None:
    """A member said its workers stopped on an error a restart cannot fix: the job fails now."""
    fatal = sorted((n, r) for n, r in seen.reports.items() if r.outcome == FAILED and r.reason == FATAL)
    if not fatal:
        return None
    node, report = fatal[0]
    return Finish(
        FinalStatus(
            FAILED,
            f"fatal error on {node} at step {report.step}, not restarting: {report.error or report.detail}",
            cur.round,
            now,
            committed_step(state, cur.members),
        )
    )


def _deterministic(
    need: _Need, signatures: list[str], policy: Policy, round_: int, state: JobState, members: list[Member], now: float
) -> Finish | None:
    """The last ``deterministic_failures`` failures were the same worker error at the same step."""
    n, report = policy.deterministic_failures, need.report
    if n < 1 or len(signatures) < n or not signatures[-1] or len(set(signatures[-n:])) != 1 or report is None:
        return None  # (a non-empty signature has a report)
    return Finish(
        FinalStatus(
            FAILED,
            f"deterministic failure: the workers failed {n} times in a row at step {report.step} with the "
            f"same error, not restarting (deterministic_failures={n}): {report.error} ({need.detail})",
            round_,
            now,
            committed_step(state, members),
        )
    )


def decide(state: JobState, policy: Policy, memory: LeaderMemory, now: float) -> tuple[Decision, LeaderMemory]:
    """What the leader does now, and what it remembers for the next call (``memory`` itself is
    never changed: pass the returned one next time)."""
    if state.final is not None:
        return Wait(f"job finished: {state.final.status}"), memory
    policy = policy.refusing(*memory.refused)
    seen = _Seen.of(state)
    memory = watch_stragglers(state, policy, memory.seen_live(seen.live_uids, seen.live, now), now)
    cur = state.current
    if cur is not None:
        reports = seen.reports
        if len(reports) == len(cur.members) and all(r.outcome == SUCCEEDED for r in reports.values()):
            return Finish(
                FinalStatus(
                    SUCCEEDED, "every node finished training", cur.round, now, committed_step(state, cur.members)
                )
            ), memory
        fatal = _fatal(state, seen, cur, now)
        if fatal is not None:
            return fatal, memory
    need, memory = _need(state, seen, policy, memory, now)
    if need is None:
        return Wait("round healthy"), memory
    pending = f"{need.reason} ({need.detail})" if need.detail else need.reason
    note = ""
    # rule 9: did the workers refuse this world size (a config error, said once)?
    if cur is not None and need.reason == WORKER_EXIT and (why := workers_refused(need.reports)):
        refused = (len(cur.members), why)
        note = policy.refused_note(*refused)
    if cur is not None and note:
        memory = dataclasses.replace(memory, refused=(*memory.refused, refused))
        policy = policy.refusing(refused)
        if policy.usable_nodes(policy.max_nodes) < policy.min_nodes:
            why = f"{note}, and no other node count of --nnodes {policy.min_nodes}:{policy.max_nodes} can run the job"
            return Finish(FinalStatus(FAILED, why, cur.round, now, committed_step(state, cur.members))), memory

    prev = cur or state.newest_record()  # the budget's memory survives an unreadable current record
    failure_times = [t for t in (prev.failure_times if prev else []) if now - t <= policy.restart_window_s]
    signatures = list(prev.failure_signatures if prev else [])
    if need.reason in FAILURE_CAUSES:
        failure_time = _failure_time(state, seen, need, policy, now)
        failure_times.append(failure_time)
        signatures = (signatures + [need.signature()])[-max(1, policy.deterministic_failures) :]
        if len(failure_times) > policy.max_restarts:
            return Finish(
                FinalStatus(
                    FAILED,
                    f"restart budget exhausted: {len(failure_times)} failures within "
                    f"{policy.restart_window_s:.0f}s (max_restarts={policy.max_restarts}); last: {need.reason} "
                    f"({need.detail})",
                    cur.round if cur else 0,
                    now,
                    committed_step(state, cur.members) if cur else -1,
                )
            ), memory
        stop = _deterministic(need, signatures, policy, cur.round if cur else 0, state, cur.members if cur else [], now)
        if stop is not None:
            return stop, memory
        ready_at = failure_time + policy.backoff_s(len(failure_times))
        if now < ready_at:
            return Wait(f"backoff {ready_at - now:.1f}s after {need.reason}", pending, BACKOFF), memory

    leaving = {n for n, r in seen.reports.items() if r.outcome == STOPPED and not _came_back(seen, n, r)}
    leaving |= _draining(state)
    live = [m for m in seen.live() if m.node_id not in leaving]  # drained: its lease goes next
    excluded = _excluded(state, now) | {node: now + policy.straggler_rejoin_s for node in need.evict}
    eligible = [m for m in live if m.node_id not in excluded]
    if len(eligible) >= policy.min_nodes:  # never let an exclusion stop the job
        live = eligible
    if len(live) < policy.min_nodes:
        return Wait(policy.too_few(len(live)), pending, BLOCKED), memory
    members = live[: policy.max_nodes]
    all_reported = cur is not None and len(seen.reports) == len(cur.members) and set(cur.members) == set(members)
    # a node lost or drained and nobody joining: no last call to wait for (a new leader elected
    # because the drained node led would otherwise wait settle_s, and so would everyone after its
    # lease went)
    lost_only = need.reason in (NODE_LOST, NODE_LEFT) and cur is not None and all(seen.is_member(m) for m in members)
    quiet_s = now - max(memory.live_changed_at, memory.leader_since)
    if not (all_reported or lost_only) and quiet_s < policy.settle_s:
        return Wait(f"settling membership ({quiet_s:.1f}s of {policy.settle_s:.1f}s quiet)", pending, SETTLING), memory

    members = _without_cold(state, seen, need, policy, members)
    candidates = len(members)
    members = members[: policy.usable_nodes(candidates)]
    if len(members) < policy.min_nodes:
        return Wait(policy.unusable(candidates, len(members)), pending, BLOCKED), memory
    restarts = dict(prev.restarts_by_cause) if prev else {}
    if prev is not None:
        restarts[need.reason] = restarts.get(need.reason, 0) + 1
    return FormRound(
        RoundRecord(
            round=state.round + 1,
            members=members,
            nproc_per_node=policy.nproc_per_node,
            reason=need.reason,
            created_at=now,
            failure_times=failure_times,
            restarts_by_cause=restarts,
            failure_signatures=signatures,
            excluded=excluded,
        ),
        note,
    ), memory
