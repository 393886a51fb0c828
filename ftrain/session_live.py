"""A user's loop under live recovery (:meth:`ftrain.Session.run` under ``ftrain agent --script
--recovery live``): what a rank holds when its round ends, and how the ranks of the next round
agree on the state to go on from.

**What a rank holds.** :meth:`ftrain.Session.step` marks each step boundary (:class:`Boundary`:
the step, the objects of the state, and the plain-JSON entries as they were then). The loop's
objects move past that boundary as soon as an optimizer steps again, and a round can end anywhere
in the next step: a peer dies in the backward pass (the update never happens, the objects are
still at the boundary), or after the update (they are not). Every optimizer of the state carries
a post-step hook that says which: a rank whose optimizer stepped since the boundary holds no state
to offer (only its step number), and takes the state from a peer or storage like a new process.

**Which state the next round goes on from** (:func:`restore_round`, collective; ``ftrain
train``'s rounds make the same choice through it, their :class:`~ftrain.train.Trainer` marking its
boundaries with a :class:`BoundaryWatch` over its state as a session's): the ranks
compare what they hold (:func:`ftrain.recovery.peer_state.take_held_state`). When the model is replicated on every
rank (a plain module or DDP: no parameter is a DTensor, and the loop did not say
``Session(replicated=False)``), the newest step held, if it is not older
than the newest commit anyone knows of, comes from its holder over the process group
(``live_peer``; ``memory`` when every rank holds it), checked against the digest the holder
announced, never unpickled. When it is spread over the ranks (FSDP, TP: each rank holds only its
shards, and the lost rank's are gone with it; pipeline stages), the newest memory-tier snapshot that the live ranks
hold between them, their own shards and their buddies' copies (``memory_tier``,
:mod:`ftrain.session_tier`). Otherwise (replicas that disagree, a transfer or a snapshot any rank
refused, a commit newer than anything held) every rank loads the newest verified checkpoint
(``storage``).
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ftrain import optim_state
from ftrain.agent_link import heartbeat
from ftrain.agent_link.heartbeat import Heartbeat
from ftrain.contract import events as ev
from ftrain.contract.control import Assignment, ControlFile
from ftrain.contract.events import EventLog
from ftrain.recovery.peer_state import HeldState, PeerStateError, Restored, held_on, take_held_state
from ftrain.recovery.round_control import AssignmentTimeout, StopRequested, newer_round_assigned, wait_for_assignment
from ftrain.recovery.rounds import RoundOver, said_left, said_restored
from ftrain.session_state import SessionError, StateParts
from ftrain.session_tier import SessionTierView

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Boundary:
    """The last step boundary of a round: ``step`` done, ``user_state`` the non-tensor entries as
    they were then (encoded: name -> :func:`ftrain.state_codec.encode` text); ``moved``: an
    optimizer stepped since (the objects are past the boundary)."""

    step: int
    user_state: dict[str, Any]
    module: nn.Module | None
    optimizers: list[torch.optim.Optimizer]
    own: dict[str, str]  #: this rank's per-rank entries then, encoded (never sent to a peer)
    replicated: bool = True  #: every rank holds the whole module (StateParts.replicated)
    moved: bool = False


@dataclass
class BoundaryWatch:
    """The step boundaries of one round, and whether the loop's optimizers moved past the last."""

    boundary: Boundary | None = None
    _hooked: dict[int, Any] = field(default_factory=dict)  #: id(optimizer) -> its hook's handle

    def mark(self, step: int, parts: StateParts, user_state: dict[str, Any]) -> None:
        for optimizer in parts.optimizers:
            if id(optimizer) not in self._hooked:
                self._hooked[id(optimizer)] = optimizer.register_step_post_hook(self._moved)
        own = parts.own_state(step) if parts.replicated else {}  # spread: the tier's snapshots carry them
        self.boundary = Boundary(step, user_state, parts.module, list(parts.optimizers), own, parts.replicated)

    def _moved(self, *_: Any) -> None:
        if self.boundary is not None:
            self.boundary.moved = True

    def held(self, committed_step: int) -> HeldState | None:
        """What this rank offers the next round (None: it reached no boundary this round)."""
        b = self.boundary
        if b is None:
            return None
        if b.moved or not b.replicated:
            return HeldState(step=b.step, committed_step=committed_step, own=b.own)
        assert b.module is not None
        model, optim = optim_state.model_and_optim(b.module, b.optimizers, optim_state.PER_PARAM)
        return HeldState(b.step, committed_step, model, optim, b.user_state, own=b.own)

    def release(self) -> None:
        """Drop the hooks (the round is over; its objects may be used again in the next)."""
        for handle in self._hooked.values():
            handle.remove()
        self._hooked.clear()
        self.boundary = None


def restore_round(
    held: HeldState | None,
    parts: StateParts,
    device: torch.device,
    committed: int,
    heal: Callable[[int], tuple[int, int] | None] | None = None,
    newest_listed: Callable[[], int] | None = None,
    events: EventLog | None = None,
) -> tuple[Restored, int] | None:
    """Collective, at a live round's first load (``ftrain train``'s rounds and a session's): the
    state the ranks hold put into ``parts``, from a live peer (or every rank itself) when the model
    is replicated, else ``heal(agreed commit)`` (the memory tier: the step it put into ``parts``,
    and the commit it went by); where it came from and the newest commit the ranks agreed on.
    None (every rank alike) when storage must be read. ``held``: what this rank held when the
    round began; ``committed``: the newest commit this rank knows of (``newest_listed``: storage's
    listing, which decides when that commit is newer than any rank knows). A transfer any rank
    refused is an event (``live_peer_refused``) before storage is read."""
    module = parts.module

    def reference(step: int) -> HeldState:  # this rank's own state, what a peer's is checked against
        model, optim = optim_state.model_and_optim(module, parts.optimizers, optim_state.PER_PARAM)  # type: ignore[arg-type]
        return HeldState(step, -1, model, optim, parts.user_state(-1))

    mine = held_on(held, device)
    choice = take_held_state(mine, parts.replicated, device, committed, reference, newest_listed)
    got, src, committed = choice.state, choice.from_rank, choice.committed_step
    if choice.refused and events is not None:
        events.emit(ev.LivePeerRefused(from_rank=src, step=choice.newest_step, problem=choice.refused[:500]))
    if got is None:
        healed = heal(committed) if heal is not None else None
        return None if healed is None else (Restored("memory_tier", healed[0]), healed[1])
    assert parts.module is not None and got.model is not None and got.optim is not None and got.cursor
    optim_state.load_into(parts.module, parts.optimizers, got.model, got.optim, optim_state.PER_PARAM)
    for key, obj in parts.others.items():
        try:  # the encoded entries a rank held (the sender's digest-checked): exact, as from storage
            value = got.entry(key)
        except PeerStateError as e:
            raise SessionError(str(e)) from e
        obj.load_state_dict(value)
    if mine is not None and mine.step == got.step and mine.own is not None:  # else a new rank's are the loop's
        parts.apply_own(mine.own)
    return Restored("memory" if src < 0 else "live_peer", got.step, src), committed


def refuse_start_under_live(control: str, timeout_s: float) -> SessionError:
    """The error for :meth:`ftrain.Session.start` in a process of ``ftrain agent --recovery live``
    (whose workers serve round after round: only :meth:`ftrain.Session.run` can), told to the
    agent first, in the round it gives this process, as fatal: a restart cannot help."""
    refused = SessionError(
        "this process was started by `ftrain agent --recovery live`, whose workers serve round after round: "
        "put the loop in a function and call session.run(train) (docs/library.md), or run the agent with "
        "--recovery restart"
    )
    hb = heartbeat.from_env(-1, 0)
    if hb is not None:
        try:
            got = wait_for_assignment(ControlFile(control), newer_than=-1, timeout_s=timeout_s)
            hb.assign(got.round, got.rank, got.local_rank)
            hb.exit(-1, finished=False, error=f"SessionError: {refused}", fatal=True)
        except AssignmentTimeout:
            pass
        hb.close()
    return refused


class Drained(Exception):  # noqa: N818 - a signal to Session.run, not an error
    """This rank stopped at a step boundary, its step committed, because it was asked to."""


def on_sigterm(handler: Any) -> Any:
    """Install ``handler`` for SIGTERM; the one it replaces (None where signals cannot be set:
    not the main thread, whose loop then stops only by the agent's kill)."""
    try:
        return signal.signal(signal.SIGTERM, handler)
    except (ValueError, TypeError):
        return None


class Round:
    """One round that :meth:`ftrain.Session.run` serves under live recovery: its assignment, the
    heartbeat, whether a newer round was assigned, and the step boundaries it marks."""

    def __init__(self, assignment: Assignment, hb: Heartbeat | None, newer: Callable[[], bool], held: HeldState | None):
        self.assignment, self.hb, self.newer = assignment, hb, newer
        self.held = held  #: what this process held when the round began (until the load uses it)
        self.held_step = held.step if held else -1
        #: time.monotonic() of the assignment read, the process group joined, the first load called
        self.began, self.joined, self._built = time.monotonic(), 0.0, 0.0
        self.watch = BoundaryWatch()
        self.loaded = False  #: the round's state is restored: what it holds is its last boundary
        self.step_time_s = 0.0  #: between the last two boundaries (the round watchdog's grace)
        self._last_at = 0.0
        #: the memory tier's view of the state, when the round's model is sharded (Session.load joins it)
        self.tier: SessionTierView | None = None
        self._tier_hooks: list[Any] = []  #: the optimizers' pre-step waits for a snapshot's copy
        self._wait_staged: Callable[[], object] = lambda: None

    def boundary(self, step: int, parts: StateParts) -> None:
        """Step ``step`` is done: mark it (what this rank holds if the round ends before the next);
        the non-tensor entries are kept encoded (:mod:`ftrain.state_codec`: what a peer receives
        decodes exactly), which refuses what could never be stored."""
        now = time.monotonic()
        if self._last_at:
            self.step_time_s = now - self._last_at
        self._last_at = now
        entries = parts.user_state(step)
        self.watch.mark(step, parts, entries)
        if self.tier is not None:
            self.tier.mark(step, parts, entries, self.step_time_s)

    def load_began(self) -> None:
        """The loop asked for its state: what it built at the round's layout is done."""
        if not self.loaded:
            self._built = time.monotonic()

    def restored(self, restored: Restored | None, events: ev.EventLog, world_size: int) -> None:
        """The state is loaded: the round's first load says where from (``live_restored``, as
        ``ftrain train``'s rounds do); what this rank holds from here is its step boundaries."""
        if not self.loaded and restored is not None:
            joined = self.joined or self.began
            built = self._built or joined
            said_restored(
                events,
                restored,
                world_size=world_size,
                held_step=self.held_step,
                began=self.began,
                joined=joined,
                built=built,
            )
        self.loaded = True

    def join_tier(self, view: SessionTierView, wait_staged: Callable[[], object]) -> None:
        """Snapshots of this round's state go to the memory tier: before any optimizer updates the
        parameters, the copy of the last snapshot (taken in the background) is waited for."""
        self.tier, self._wait_staged = view, wait_staged

        def before_update(*_: Any) -> None:
            wait_staged()

        for optimizer in view.parts.optimizers:
            self._tier_hooks.append(optimizer.register_step_pre_hook(before_update))

    def rejoin_tier(self, parts: StateParts) -> None:
        """The loop rebuilt its state within this round (a rollback): snapshots and the waits
        before an update follow its new objects."""
        if self.tier is None:
            return
        for handle in self._tier_hooks:
            handle.remove()
        self._tier_hooks.clear()
        self.tier.parts = parts
        self.join_tier(self.tier, self._wait_staged)

    def left(self, why: BaseException | str, held: HeldState | None, events: ev.EventLog | None = None) -> None:
        """Say that this rank left the round (``why``) holding ``held``; the agent hears it waits
        (and the round's event log, once the session joined it, ``live_round_left``)."""
        said_left(self.assignment, why, held.step if held else -1, self.hb, events)

    def release(self) -> None:
        """The round is over: its hooks leave the loop's optimizers (used again in the next round)."""
        self.watch.release()
        for handle in self._tier_hooks:
            handle.remove()
        self._tier_hooks.clear()
        self.tier = None


class SessionRounds:
    """:meth:`ftrain.Session.run`'s part of the engine of rounds (:mod:`ftrain.recovery.rounds`):
    a :class:`Round` per assignment, served by the session (``serve_round``: join the group, run
    the user's ``train``); what the rank holds between rounds is kept here."""

    def __init__(
        self,
        control: ControlFile,
        hb: Heartbeat | None,
        serve_round: Callable[[Round], Any],
        close: Callable[..., None],
        leave_round: Callable[[BaseException | str, set[int]], HeldState | None],
        keep_ports: set[int],
    ):
        self.control, self.hb, self.keep_ports = control, hb, keep_ports
        self._serve_round, self._close, self._leave_round = serve_round, close, leave_round
        self.held: HeldState | None = None
        self.round: Round | None = None
        self._joined = False  #: the session joined the round (serve_round began)

    def enter(self, assignment: Assignment) -> int:
        held, self.held = self.held, None  # the round holds it until its load used it (then lets go)
        self.round = Round(assignment, self.hb, newer_round_assigned(self.control, assignment.round), held)
        self._joined = False
        return held.step if held else -1

    def step_time_s(self) -> float:
        return self.round.step_time_s if self.round else 0.0

    def serve(self, assignment: Assignment) -> RoundOver:
        assert self.round is not None and self.round.assignment is assignment
        self._joined = True
        return RoundOver(done=True, value=self._serve_round(self.round))

    def finish(self, over: RoundOver) -> Any:
        self._close()
        return over.value

    def failed(self, error: BaseException) -> None:
        if not isinstance(error, Drained):  # Session.run closes a drained session itself
            self._close(error=error)

    def leave(self, why: BaseException | str) -> None:
        rnd = self.round
        if rnd is not None and not self._joined:  # it ended before the session joined it (no store came up)
            self.held = rnd.held
            rnd.left(why, rnd.held)
        else:
            self.held = self._leave_round(why, self.keep_ports)
        self.round = None

    def stopped(self, why: StopRequested) -> None:
        log.warning("%s: leaving; the other ranks hold the state", why)


__all__ = [
    "Boundary",
    "BoundaryWatch",
    "Drained",
    "Round",
    "SessionRounds",
    "on_sigterm",
    "refuse_start_under_live",
    "restore_round",
]
