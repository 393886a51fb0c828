"""The engine of rounds: one loop that serves round after round in one process, for both
``ftrain worker`` (:func:`ftrain.recovery.live.serve`) and a user's loop under
:meth:`ftrain.Session.run`.

What the loop does is the same for both, and written once here: it says it is ready (a spare),
waits for an assignment, sets the round's environment contract, beats ``starting``, guards the
round with its watchdog, waits for the round's store, runs the round's body, and when the round
ends early (a peer lost, a newer round assigned, the watchdog's verdict) keeps what the rank holds
and waits for the next round; a stop between rounds ends it. What differs — what a round builds,
how it restores, how it trains, what it keeps — is the :class:`RoundOwner`'s. Light on purpose
(no trainer, no model): a user's loop imports it."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from ftrain.agent_link.heartbeat import Heartbeat
from ftrain.contract import events as ev
from ftrain.contract.control import Assignment, ControlFile
from ftrain.recovery.peer_state import PeerStateError, Restored
from ftrain.recovery.round_control import (
    RoundEnded,
    StopRequested,
    is_peer_failure,
    newer_round_assigned,
    wait_for_assignment,
    wait_for_store,
)
from ftrain.recovery.round_watchdog import RoundWatchdog

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RoundOver:
    """How a round's body ended without an error: the job is done or this node drained
    (``done``: the owner finishes, ``value`` is the body's), or the round ended for this rank
    and the process serves the next (``why``)."""

    done: bool
    value: Any = None
    why: str = ""


class RoundOwner(Protocol):
    """What a process that serves rounds brings to the engine."""

    def enter(self, assignment: Assignment) -> int:
        """Before the round's watchdog: what the round needs from the assignment (its device,
        the round's objects); returns the step this rank holds (-1: none). What a rank holds
        between rounds is the owner's: it lets go of it once the round's restore took it."""

    def step_time_s(self) -> float:
        """The round's last step time (the watchdog's patience scales with it); 0 before one."""

    def serve(self, assignment: Assignment) -> RoundOver:
        """Join the round's process group, restore, train; under the round's watchdog."""

    def finish(self, over: RoundOver) -> Any:
        """The job is done (or this node drained): close what the process holds, after the
        round's watchdog; what it returns, the loop returns."""

    def failed(self, error: BaseException) -> None:
        """An error that is not a peer's failure ends the process (after this, it is raised)."""

    def leave(self, why: BaseException | str) -> None:
        """The round ended for this rank: end its groups at once, keep what the rank holds."""

    def stopped(self, why: StopRequested) -> None:
        """Asked to stop (SIGTERM) while in no round: nothing to save, the other ranks hold it."""


def ends_round(e: BaseException) -> bool:
    """Whether ``e`` ends only the round (a peer lost, a newer round, a refused transfer), not
    the process."""
    return isinstance(e, (RoundEnded, PeerStateError)) or is_peer_failure(e)


def said_left(
    assignment: Assignment,
    why: BaseException | str,
    held_step: int,
    hb: Heartbeat | None,
    events: ev.EventLog | None = None,
) -> None:
    """Say that this rank left ``assignment``'s round (``why``) holding step ``held_step`` (-1:
    none): in its log, in the job's event log (``live_round_left``), and to its agent, that it
    waits for the next round (``recovering``)."""
    reason = why if isinstance(why, str) else f"{type(why).__name__}: {why}"
    where = reason.splitlines()[0] if reason else ""
    held = held_step if held_step >= 0 else "none"
    log.warning(
        "round %d ended for rank %d (%s); holding step %s", assignment.round, assignment.rank, where[:200], held
    )
    if events is not None:
        events.emit(ev.LiveRoundLeft(step=held_step, why=where[:300]))
    if hb is not None:
        hb.beat(held_step, phase="recovering")


def said_restored(
    events: ev.EventLog,
    restored: Restored,
    *,
    world_size: int,
    held_step: int,
    began: float,
    joined: float,
    built: float,
) -> None:
    """The round's state is restored (``live_restored``): from where, and how long each phase took
    since the assignment was read (``began``; ``joined`` the process group, ``built`` what the
    loop builds at the round's layout; ``time.monotonic()`` seconds)."""
    done = time.monotonic()
    events.emit(
        ev.LiveRestored(
            source=restored.source,
            step=restored.step,
            from_rank=restored.from_rank,
            world_size=world_size,
            held_step=held_step,
            seconds=round(done - began, 4),
            join_s=round(joined - began, 4),
            build_s=round(built - joined, 4),
            state_s=round(done - built, 4),
        )
    )


def serve_rounds(
    owner: RoundOwner,
    control: ControlFile,
    hb: Heartbeat | None,
    keep_ports: set[int],
    store_timeout_s: float,
    stop_requested: Any,
    warm_up: Callable[[], object] | None = None,
) -> Any:
    """Serve rounds until the job is done (what ``owner.finish`` returns), an assignment says stop, or a stop
    is asked between rounds (None); an error that is not a peer's failure is raised after
    ``owner.failed``. As long as the agent lives (its death ends this process) a rank waits for
    the next round holding its state: a leader that cannot form one yet says why. ``warm_up``:
    run once before the process says it is ready, to pay what its first round would otherwise
    pay on the critical path (imports, a model built, a first step); its failure costs only that."""
    if warm_up is not None:
        began = time.monotonic()
        try:
            warm_up()
            log.info("spare ready: warmed up in %.2fs", time.monotonic() - began)
        except Exception as e:  # noqa: BLE001 - only an optimisation: the first round pays instead
            log.warning("warm-up failed (the first round will be slower): %s: %s", type(e).__name__, e)
    control.mark_ready()  # a spare: imported and built what it could, waiting for its round
    newer_than = -1
    while True:
        try:
            assignment = wait_for_assignment(control, newer_than, None, stop_requested)
        except StopRequested as e:
            owner.stopped(e)
            return None
        if assignment.stop:
            return None
        os.environ.update(assignment.env())
        held_step = owner.enter(assignment)
        if hb is not None:
            hb.assign(assignment.round, assignment.rank, assignment.local_rank)
            hb.beat(held_step, phase="starting")
        watchdog = RoundWatchdog(control.path, assignment.round, owner.step_time_s, keep_ports)
        try:
            with watchdog:
                if assignment.rank != 0:
                    newer = newer_round_assigned(ControlFile(control.path), assignment.round)
                    wait_for_store(assignment.master_addr, assignment.master_port, store_timeout_s, newer)
                over = owner.serve(assignment)
        except BaseException as e:
            if not ends_round(e):
                owner.failed(e)
                raise
            owner.leave(watchdog.fired or e)
        else:
            if over.done:
                return owner.finish(over)
            owner.leave(over.why)
        newer_than = assignment.round


__all__ = ["RoundOver", "RoundOwner", "ends_round", "said_left", "serve_rounds"]
