"""How a round's workers are doing on this node, judged from their heartbeats: pure functions
of the beats, the settings and the time (the agent acts on the answers).

- :func:`exit_report`: how the round ended here, from the launcher's exit code and the workers'
  last messages (or, when none gave an error, the last Python error line of their log:
  :func:`last_error_line`); :func:`drained_report`: a drain's (this node leaves its round).
- :func:`hung_ranks`: the local ranks past their limits (no step beat, or no "alive").
- :func:`frozen_ranks`: which of them are frozen themselves.
- :func:`stalls`: this node's ranks that are not making progress, as the agent publishes them
  (``NodeStatus.stalled``) for the others; :func:`member_moving` reads another member's.
- :func:`judge`: what to do about it: the ranks hung (the round is over on this node) and the
  ones to end (no interruption frees them).
- :func:`left_ranks`: live workers that left their round on their own (a collective failed, the
  round's store could not be hosted) and wait for the next one, past :func:`left_round_grace_s`.

The rule for collectives (what must stay true): **a rank is hung when it has been inside one
collective (its oldest in flight, as its "alive" datagrams say) for over** ``hang_timeout_s``
**with no step beat meanwhile, and nobody in its round is making progress** — whatever its
heartbeat thread says, in any phase. Progress is what a legitimately long wait is waiting for,
so it must not be called a hang while there is some:

- a collective that completes is progress: the age is that of the *oldest* one not completed,
  so a long first step, a long load or a big exchange made of many collectives never ages one;
- a step beat is progress: a background thread waiting in a collective on a slow peer (an
  asynchronous save's last gather behind a slow upload) while the training thread steps on is
  not a hang of the rank;
- a member outside any collective, alive and within its own limits (``hang_timeout_s`` between
  training steps, ``start_timeout_s`` in start-up, loads and saves) is progress: the ranks that
  wait in a collective for it (a spare still importing, a peer reading its shards) are waiting,
  not hung, and that member is judged by its own limit. Another node's ranks are known from its
  agent's status (``stalled``); a member with no fresh status counts as moving (its own agent
  judges its ranks; a lost agent's lease ends the round).

A single collective whose transfer itself outlasts ``hang_timeout_s`` is not told from a stuck
one (no backend reports partial progress): keep ``hang_timeout_s`` above the longest single
collective, as the process group's own timeout (``parallel.timeout_s``) already requires.
Ranks hung in a collective are not killed under live recovery: the round formed for the hang
makes their round watchdog end the round's connections and they rejoin in-process; a frozen rank,
or one stuck outside any collective, is ended (no interruption reaches it).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass

from ftrain.agents.heartbeat import Beat
from ftrain.agents.records import (
    FAILED,
    FATAL,
    FROZEN,
    NO_PROGRESS,
    RANK_LEFT,
    STOPPED,
    SUCCEEDED,
    WAITING,
    WORKER_EXIT,
    YIELDED,
    NodeStatus,
    RankStall,
    Report,
)


def exit_report(
    rc: int,
    beats: dict[int, Beat],
    nproc: int,
    log_path: str,
    agent_uid: str,
    now: float,
    *,
    draining: bool,
    exited: str = "torchrun",
    log_error: str = "",
) -> Report:
    """How a round ended on this node, from torchrun's exit code and the workers' last messages.

    Success needs every local rank's exit message saying it finished: the loop ran to its end and
    its last step committed before the message went. A non-zero exit after that is the process's
    teardown, not the run (on CPU, gloo's threads can abort an interpreter's exit; measured here
    about once in 25 runs of a 2-rank FSDP loop under load): still a success, its exit code in the
    report's detail; restarting would only train nothing from the final step. Exit code 0
    without those messages is a graceful stop: this node's drain (``draining``: it leaves) or another's (the
    ranks stop together: this node yields and stays for the next round). A failure
    carries the newest step any worker reported and the first worker error (by local rank); when
    no worker said one (it died before its heartbeat was set up: an import, the script's first
    lines), ``log_error``, the last error line of their log (:func:`last_error_line`), stands for
    it, so that the same failure at start, round after round, is told as deterministic; a worker
    that said its error is fatal makes the report fatal.
    """
    finished = len(beats) == nproc and all(b.finished for b in beats.values())
    if finished:
        detail = "" if rc == 0 else f"every worker said it finished, then {exited} exited with {rc}; log {log_path}"
        return Report(SUCCEEDED, detail=detail[:1000], agent_uid=agent_uid, time=now)
    if rc == 0 and draining:
        return drained_report(agent_uid, now)
    if rc == 0:
        return Report(YIELDED, detail="workers stopped early (another node drained)", agent_uid=agent_uid, time=now)
    step = max((b.step for b in beats.values()), default=-1)
    errors = [b for _, b in sorted(beats.items()) if b.error]
    fatal = [b for b in errors if b.fatal]
    first = next(iter(fatal or errors), None)
    error = first.error if first else log_error
    detail = f"{exited} exited with {rc}; log {log_path}"
    if first:
        detail += f"; local rank {first.local_rank}: {error}"
    elif error:
        detail += f"; its log says: {error}"
    return Report(FAILED, FATAL if fatal else WORKER_EXIT, detail[:1000], agent_uid, now, step=step, error=error)


def drained_report(agent_uid: str, now: float) -> Report:
    """This node drains and leaves its round (``stopped``): the leader forms the next one without it
    for ``node_left``. Its workers stopped early for the drain, or it had none in the round (the
    round formed as the drain began: they never started in it)."""
    return Report(STOPPED, detail="workers stopped early (drain)", agent_uid=agent_uid, time=now)


#: the end of a worker log read for its last error (a traceback's last line is near the end)
LOG_TAIL_BYTES = 64 * 1024
#: the last line of a Python traceback: ``SessionError: message`` (a dotted class name ending in
#: Error or Exception, then the message); torchrun's own report of a child's failure is not one
_ERROR_LINE = re.compile(r"^(?:[A-Za-z_][\w]*\.)*[A-Za-z_]\w*(?:Error|Exception): \S.*$")
_NOT_THE_WORKERS = ("ChildFailedError",)


def last_error_line(log_path: str, *, tail_bytes: int = LOG_TAIL_BYTES) -> str:
    """The last line of ``log_path``'s end that is the last line of a Python traceback
    (``ValueError: bad value``), cut to 500 characters; empty when there is none or the log
    cannot be read. The log is the workers' (untrusted): only read, never acted on but as text."""
    try:
        with open(log_path, "rb") as fh:
            fh.seek(max(0, os.fstat(fh.fileno()).st_size - tail_bytes))
            tail = fh.read(tail_bytes).decode("utf-8", "replace")
    except OSError:
        return ""
    for line in reversed(tail.splitlines()):
        line = line.rstrip()  # a traceback's last line starts at the margin
        if _ERROR_LINE.match(line) and not any(name in line for name in _NOT_THE_WORKERS):
            return line[:500]
    return ""


def hung_ranks(
    beats: dict[int, Beat],
    *,
    nproc_per_node: int,
    started_at: float,
    now: float,
    hang_timeout_s: float,
    start_timeout_s: float,
) -> list[int]:
    """Local ranks that made no progress within their limit (``hang_timeout_s`` between steps,
    ``start_timeout_s`` in start-up, loads and saves, counted from ``started_at`` before the
    first beat), or that stopped saying they are alive for ``hang_timeout_s`` in any phase (a
    frozen process: no need to wait out the start timeout) — except one that sent its exit
    message: it is leaving, and torchrun's exit (which can take seconds) decides how the round
    ended. Every time is on the agent's monotonic clock."""
    hung = []
    for local_rank in range(nproc_per_node):
        beat = beats.get(local_rank)
        since = beat.received_at if beat else started_at
        limit = hang_timeout_s if beat and beat.phase == "training" else start_timeout_s
        frozen = (
            beat is not None
            and beat.finished is None
            and beat.phase != "exiting"
            and beat.alive_at > 0
            and now - beat.alive_at > hang_timeout_s
        )  # said goodbye: not frozen, leaving
        if now - since > limit or frozen:
            hung.append(local_rank)
    return hung


#: how much longer than a lost member's lease takes to run out a rank that left its round waits
#: for the leader to see a cause before its agent reports the round over (:func:`left_round_grace_s`)
LEFT_ROUND_MARGIN_S = 5.0


def left_round_grace_s(lease_ttl_s: float, settle_s: float) -> float:
    """How long a live worker that left its round waits for a cause the leader acts on (a peer's
    death reported, a lost member's lease run out, a drain) before its own agent reports the
    round over (:data:`ftrain.agents.records.RANK_LEFT`): two lease lifetimes, the settle time
    and :data:`LEFT_ROUND_MARGIN_S`. A rank leaves at once when a collective with a dead peer
    fails; the cause then shows well within this, and the round is formed for it."""
    return 2 * lease_ttl_s + settle_s + LEFT_ROUND_MARGIN_S


def left_ranks(beats: dict[int, Beat], *, now: float, grace_s: float) -> list[int]:
    """Local ranks whose process said it left its round (``recovering``, received: not a kept
    process's beat carried into a new round) over ``grace_s`` ago, and said nothing since. Such a
    rank waits for a round that, when no member failed, was lost or drained, nobody forms: a
    collective failed on it alone (a connection reset between live peers), or, as rank 0, it
    could not host the round's store (its port taken since the agent picked it). Its peers wait
    on it in that round (for the store, in a collective) up to the process group's timeout."""
    return sorted(
        r
        for r, b in beats.items()
        if b.phase == "recovering" and not b.carried and b.finished is None and now - b.received_at > grace_s
    )


def left_report(
    ranks: list[int], beats: dict[int, Beat], grace_s: float, agent_uid: str, now: float, *, workers_ready: int
) -> Report:
    """The round is over on this node: local ranks ``ranks`` left it and no cause showed within
    ``grace_s`` (:func:`left_ranks`); their processes live on, holding their state."""
    detail = (
        f"local rank(s) {ranks} left the round (a collective or the round's store failed there) and no member "
        f"failed, was lost or drained within {grace_s:.0f}s"
    )
    step = max((b.step for b in beats.values()), default=-1)
    return Report(FAILED, RANK_LEFT, detail, agent_uid, now, step=step, workers_ready=workers_ready)


#: a worker's background thread says "alive" every second (``ftrain.agent_link.heartbeat``) even while its
#: main thread waits in a collective; silent this long, the process itself is frozen
FROZEN_AFTER_S = 3.0


def frozen_ranks(beats: dict[int, Beat], local_ranks: list[int], *, now: float) -> list[int]:
    """Of ``local_ranks`` (hung: no step progress), those whose process stopped saying it is
    alive: the cause of the hang, not its victims (workers blocked in a collective with a frozen
    peer still send "alive"). A rank that never sent anything counts as frozen."""
    return [r for r in local_ranks if r not in beats or now - beats[r].alive_at > FROZEN_AFTER_S]


#: a rank inside one collective for this share of ``hang_timeout_s`` (with no step beat) is
#: published as waiting: by the time another rank's wait reaches the full timeout, the status
#: (written every second) says so
WAITING_SHARE = 0.5
#: another member's status older than this says nothing about its ranks now
STATUS_FRESH_S = 5.0
MAX_STALLS = 4096  #: entries of another node's ``stalled`` list looked at (it is read from etcd)


def silent_limit_s(hang_timeout_s: float) -> float:
    """How long a rank may send nothing before its agent publishes it as frozen: FROZEN_AFTER_S,
    or less with a short hang timeout (never under 1.5 "alive" intervals)."""
    return max(1.5, min(FROZEN_AFTER_S, WAITING_SHARE * hang_timeout_s))


def waiting(beat: Beat, *, now: float, limit_s: float) -> bool:
    """Inside one collective (its oldest in flight) for over ``limit_s``, with no step beat in
    that time, and not leaving (no exit message)."""
    return (
        beat.recording
        and beat.in_flight_seq >= 0
        and beat.in_flight_since > 0
        and beat.finished is None
        and now - beat.in_flight_since > limit_s
        and now - beat.received_at > limit_s
    )


def stalls(
    beats: dict[int, Beat], hung: Iterable[int], *, now: float, now_wall: float, hang_timeout_s: float
) -> list[RankStall]:
    """This node's ranks that are not making progress (see the module doc), as published in its
    status: waiting in one collective for ``WAITING_SHARE`` of the timeout, silent for
    :func:`silent_limit_s`, or ``hung`` (past a limit of :func:`hung_ranks`). ``now`` is the
    monotonic clock of the beats, ``now_wall`` the wall clock the others compare with."""
    hung = set(hung)
    out = []
    for local_rank, b in sorted(beats.items()):
        if b.rank < 0 or b.finished is not None:
            continue
        if b.alive_at > 0 and now - b.alive_at > silent_limit_s(hang_timeout_s):
            out.append(RankStall(b.rank, FROZEN, now_wall - (now - b.alive_at)))
        elif waiting(b, now=now, limit_s=WAITING_SHARE * hang_timeout_s):
            since = now_wall - (now - b.in_flight_since)
            out.append(RankStall(b.rank, WAITING, since, b.in_flight_seq, b.in_flight_group, b.in_flight))
        elif local_rank in hung:
            out.append(RankStall(b.rank, NO_PROGRESS, now_wall - (now - b.received_at)))
    return out


def member_moving(status: NodeStatus | None, *, round_: int, nproc_per_node: int, now_wall: float) -> bool:
    """Whether another member of round ``round_`` has a rank making progress, by its agent's
    status: it does unless a fresh status of this round lists every one of its ranks as stalled
    (no fresh status: nothing says it is stuck)."""
    if status is None or status.round != round_ or status.state != "running":
        return True
    if now_wall - status.updated_at > STATUS_FRESH_S:
        return True
    return len({s.rank for s in status.stalled[:MAX_STALLS]}) < nproc_per_node


@dataclass(frozen=True, slots=True)
class HangCall:
    """What a node's agent does about a hang (see :func:`judge`)."""

    ranks: list[int]  #: local ranks hung: the round is over on this node (reported)
    kill: list[int]  #: of all this node's local ranks, those to end: no interruption frees them
    why: str


def collective_hangs(
    beats: dict[int, Beat],
    *,
    nproc_per_node: int,
    hung: Iterable[int],
    now: float,
    hang_timeout_s: float,
    others_moving: bool,
) -> list[int]:
    """Local ranks hung inside a collective (the module doc's rule): waiting for over
    ``hang_timeout_s``, while none of this node's other ranks moves (each is waiting too, silent
    or past its own limit) and no other member of the round does (``others_moving``)."""
    stuck = [r for r, b in sorted(beats.items()) if waiting(b, now=now, limit_s=hang_timeout_s)]
    if not stuck or others_moving:
        return []
    hung = set(hung)
    share = WAITING_SHARE * hang_timeout_s
    for local_rank in range(nproc_per_node):
        if local_rank in stuck or local_rank in hung:
            continue
        b = beats.get(local_rank)
        if b is None or not (
            waiting(b, now=now, limit_s=share) or (b.alive_at > 0 and now - b.alive_at > silent_limit_s(hang_timeout_s))
        ):
            return []  # a sibling moves (or is starting): they wait for it
    return stuck


def judge(
    beats: dict[int, Beat],
    *,
    nproc_per_node: int,
    started_at: float,
    now: float,
    hang_timeout_s: float,
    start_timeout_s: float,
    others_moving: bool,
    live: bool,
) -> HangCall | None:
    """Whether this node's part of the round is hung, and which ranks to end (None: not hung).

    Frozen ranks (:func:`frozen_ranks` of those :func:`hung_ranks` finds) are ended; ranks hung in a
    collective (:func:`collective_hangs`) are not, under live recovery (the next round's watchdog
    frees them in-process); a rank past its limit outside any collective, by a worker that tells
    what is in flight, is ended (it waits for nothing a new round could interrupt); without that
    knowledge (flight recorder off) the old rule stays: with nobody frozen, a live agent waits
    twice the timeout and then ends every hung rank (a deadlock). Under restart recovery every
    worker of the node is ended, whichever ranks hung."""
    hung = hung_ranks(
        beats,
        nproc_per_node=nproc_per_node,
        started_at=started_at,
        now=now,
        hang_timeout_s=hang_timeout_s,
        start_timeout_s=start_timeout_s,
    )
    in_collective = collective_hangs(
        beats,
        nproc_per_node=nproc_per_node,
        hung=hung,
        now=now,
        hang_timeout_s=hang_timeout_s,
        others_moving=others_moving,
    )
    if not hung and not in_collective:
        return None
    everyone = list(range(nproc_per_node))
    frozen = frozen_ranks(beats, hung, now=now)
    share = WAITING_SHARE * hang_timeout_s
    known = [r for r in hung if r in beats and beats[r].recording]
    # past a limit with no collective in flight long enough to be what it waits for: no
    # interruption of the round's collectives reaches it
    outside = [r for r in known if r not in frozen and not waiting(beats[r], now=now, limit_s=share)]
    if in_collective and not frozen:
        where = "; ".join(
            f"local rank {r} in #{beats[r].in_flight_seq} {beats[r].in_flight} on group {beats[r].in_flight_group} "
            f"for {now - beats[r].in_flight_since:.1f} s"
            for r in in_collective
        )
        why = f"inside one collective past hang_timeout_s {hang_timeout_s:g} with nobody in the round moving: {where}"
        return HangCall(sorted(set(in_collective) | set(hung)), outside if live else everyone, why)
    why = f"no heartbeat from local rank(s) {hung} within the timeout"
    if not live:
        return HangCall(sorted(set(hung) | set(in_collective)), everyone, why)
    if frozen:
        return HangCall(sorted(set(frozen) | set(in_collective)), frozen, why)
    if outside:
        return HangCall(
            outside, outside, f"local rank(s) {outside} made no progress within the timeout, in no collective"
        )
    if known:
        return None  # they wait in a collective for a member that still moves: its own limit decides
    stuck_s = now - min((beats[r].received_at for r in hung if r in beats), default=started_at)
    if stuck_s < 2 * hang_timeout_s:
        return None
    return HangCall(hung, hung, why)
