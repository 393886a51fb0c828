"""The replica check in a user's loop: ``Session(replica_check_steps=N)`` compares, every ``N``
steps, a digest of what every rank must hold alike — the module's parameters that are not
DTensors (all of them under DDP; the replicated ones beside TP's shards; none under FSDP) and
their optimizer state — the check ``ftrain train`` runs (:mod:`ftrain.consistency`), with its
policies (``on_replica_mismatch``: ``warn``, ``halt`` or ``rollback``).

Off by default, unlike ``ftrain train``'s: only the loop's author knows that its ranks hold the
same plain parameters (a loop that puts a different pipeline stage on each rank does not).

``rollback`` needs :meth:`ftrain.Session.run`: every rank leaves the loop at the same step
(:class:`ReplicasDiffer`, raised on every rank alike: the comparison is collective) and ``run``
calls ``train`` again in the same process group; its ``load`` reads the newest verified commit
from storage (what the ranks hold is what differs). The step is checked before it is saved or
snapshotted, so a corruption found by the check never reaches a checkpoint or the memory tier."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import torch
from torch.distributed.tensor import DTensor

from ftrain.config import ConsistencyConfig
from ftrain.consistency import ConsistencyError, Mismatch, Verdict, compare_replicas
from ftrain.contract import events as ev
from ftrain.contract.events import EventLog
from ftrain.contract.worker_env import WorkerEnv
from ftrain.session_state import SessionError, StateParts

log = logging.getLogger(__name__)

#: ``consistency.on_mismatch``'s choices: one definition for ftrain train and a session
POLICIES: tuple[str, ...] = next(
    f.metadata["choices"] for f in dataclasses.fields(ConsistencyConfig) if f.name == "on_mismatch"
)


class ReplicasDiffer(Exception):  # noqa: N818 - a signal to Session.run, not an error
    """Replicas differ under ``on_replica_mismatch="rollback"``: every rank goes back to the
    newest commit (:meth:`ftrain.Session.run` catches it)."""


class ReplicaCheck:
    """The session's setting, and the check at a step boundary."""

    def __init__(self, every_steps: int, on_mismatch: str, replicated: bool | None = None):
        if not isinstance(every_steps, int) or isinstance(every_steps, bool) or every_steps < 0:
            raise SessionError(f"Session(replica_check_steps={every_steps!r}): an int >= 0 (0: never)")
        if replicated not in (None, False):
            raise SessionError(
                f"Session(replicated={replicated!r}): None (decided from the model: no DTensor parameter means every "
                "rank holds all of it) or False (the ranks hold different parameters: pipeline stages)"
            )
        if replicated is False and every_steps:
            raise SessionError(
                f"Session(replica_check_steps={every_steps}, replicated=False): the ranks hold different parameters, "
                "so there is nothing the check can compare; leave replica_check_steps at 0"
            )
        if on_mismatch not in POLICIES:
            raise SessionError(f"Session(on_replica_mismatch={on_mismatch!r}): one of {', '.join(POLICIES)}")
        self.every_steps, self.on_mismatch = every_steps, on_mismatch
        self.corruptions = 0  #: times this rank's copies were the odd ones (the agent drains after some)

    def due(self, step: int) -> bool:
        return self.every_steps > 0 and step % self.every_steps == 0

    def check(self, step: int, parts: StateParts, rank: int, events: EventLog, serving: bool) -> None:
        """Collective (every rank, at boundary ``step``): compare; on a mismatch act on the policy."""
        mismatches = compare_replicas((0, replicated_tensors(parts)), WorkerEnv.from_env().node)
        if mismatches:
            self._act(step, mismatches, rank, events, serving)

    def _act(self, step: int, mismatches: list[Mismatch], rank: int, events: EventLog, serving: bool) -> None:
        verdict = Verdict.of(mismatches, rank)
        self.corruptions += verdict.mine
        policy, ranks = self.on_mismatch, verdict.ranks
        verdict.say(step, policy, events)
        if policy == "rollback" and serving:
            raise ReplicasDiffer(f"replicas differ on ranks {ranks} at step {step}")
        if policy != "warn":
            fix = " (rollback needs Session.run)" if policy == "rollback" else ""
            raise ConsistencyError(f"step {step}: replicas differ on ranks {ranks} (on_replica_mismatch={policy}){fix}")


def replicated_tensors(parts: StateParts) -> list[torch.Tensor]:
    """What every rank holds alike: the module's plain (not DTensor) parameters, in order, and
    each optimizer's state tensors for them."""
    if parts.module is None:
        return []
    params = [p for p in parts.module.parameters() if not isinstance(p, DTensor)]
    out = [p.detach() for p in params]
    for optimizer in parts.optimizers:
        for p in params:
            state = optimizer.state.get(p, {})
            out += [state[k].detach() for k in sorted(state) if isinstance(state[k], torch.Tensor)]
    return out


def rolled_back(events: EventLog, step: int, why: str, say: Callable[[str], None]) -> None:
    """After the load that followed :class:`ReplicasDiffer`: said and recorded."""
    events.emit(ev.RolledBack(step=step, reason=why))
    say(f"rolled back to checkpoint step {step}: {why}")


__all__ = ["ReplicaCheck", "ReplicasDiffer", "replicated_tensors", "rolled_back"]
