"""Cross-replica consistency: ranks that must hold identical copies compare digests.

Which ranks hold identical copies, and of what, is each strategy's rule
(:meth:`ftrain.parallel.strategies.Strategy.replica_group` and ``replicated_tensors``): every rank under
ddp (and the fixed-order reduction), the parameters under zero1, each shard position across HSDP
replicate groups, the replicated (non-DTensor) parameters of tensor-parallel ranks; fsdp, zero2
and fsdp+tp hold only shards, so there is nothing to compare. A silent divergence (bit flip, a
rank that skipped an update) shows up as a digest that differs from the rest of its group.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist
import xxhash

from ftrain.contract import events as ev
from ftrain.contract.events import EventLog
from ftrain.parallel import strategies
from ftrain.parallel.base import Parallel

log = logging.getLogger(__name__)


class ConsistencyError(RuntimeError):
    """Replicas that must be identical differ."""


@dataclass(frozen=True, slots=True)
class Mismatch:
    group: int
    ranks: list[int]  #: ranks that disagree with their group's majority (every rank of it when there is none)
    nodes: list[str]  #: the node of each of those ranks ("" where no agent named one)
    #: a strict majority agreed, so ``ranks`` are the corrupt ones; False: no majority (two
    #: replicas, or a tie), the culprit is unknown and ``ranks`` is the whole group
    decided: bool = True


@dataclass(frozen=True, slots=True)
class Verdict:
    """What a list of mismatches says, the same on every rank: the ranks whose copies differ
    (with their nodes), whether every group had a majority, and whether this rank is a culprit."""

    ranks: list[int]
    nodes: list[str]
    decided: bool
    mine: bool  #: a majority of this rank's replicas disagreed with it (a corruption of its own)

    @classmethod
    def of(cls, mismatches: list[Mismatch], rank: int) -> Verdict:
        named = sorted((r, n) for m in mismatches for r, n in zip(m.ranks, m.nodes, strict=True))
        mine = any(m.decided and rank in m.ranks for m in mismatches)
        decided = all(m.decided for m in mismatches)
        return cls([r for r, _ in named], [n for _, n in named], decided, mine)

    def say(self, step: int, policy: str, events: EventLog) -> None:
        """The ``replica_mismatch`` event and the error line (``policy``: what follows)."""
        events.emit(
            ev.ReplicaMismatch(step=step, ranks=self.ranks, policy=policy, nodes=self.nodes, decided=self.decided)
        )
        where = ", ".join(f"{r} on {n}" if n else str(r) for r, n in zip(self.ranks, self.nodes, strict=True))
        unknown = "" if self.decided else " (no majority among the replicas: any of them may be the corrupt one)"
        log.error("step %d: replicas differ: rank(s) %s%s (policy %s)", step, where, unknown, policy)


def _replicated_tensors(par: Parallel) -> tuple[int, list[torch.Tensor]] | None:
    """(replica group key, tensors that must match within the group), or None if none: the
    strategy's rule (:meth:`ftrain.parallel.strategies.Strategy.replica_group`)."""
    layout = par.layout
    strategy = strategies.get(layout.strategy)
    group = strategy.replica_group(layout)
    if group is None:
        return None
    # under a pipeline each stage's ranks hold their own part: replicas are within a stage
    return group * layout.pp_size + layout.pp_rank, strategy.replicated_tensors(par)


def _digest(tensors: list[torch.Tensor]) -> str:
    h = xxhash.xxh3_64()
    for t in tensors:
        h.update(t.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().data)
    return h.hexdigest()


def check_replicas(par: Parallel, node: str = "") -> list[Mismatch]:
    """Collective: every rank calls it (``node``: this rank's node); returns the same list of
    mismatches on every rank."""
    return compare_replicas(_replicated_tensors(par), node)


def compare_replicas(mine: tuple[int, list[torch.Tensor]] | None, node: str = "") -> list[Mismatch]:
    """Collective: each rank's (replica group key, the tensors its group must hold alike), or
    None where it holds no replica; the same list of mismatches on every rank."""
    entry = (None, None, node) if mine is None else (mine[0], _digest(mine[1]), node)
    world = dist.get_world_size()
    gathered: list = [None] * world
    dist.all_gather_object(gathered, entry)
    groups: dict[int, dict[int, str]] = defaultdict(dict)
    nodes = {rank: e[2] for rank, e in enumerate(gathered)}
    for rank, e in enumerate(gathered):
        if e[0] is not None:
            groups[e[0]][rank] = e[1]
    mismatches = []
    for key, digests in sorted(groups.items()):
        counts: dict[str, int] = defaultdict(int)
        for d in digests.values():
            counts[d] += 1
        if len(counts) > 1:
            top = sorted(counts.values(), reverse=True)
            if top[0] > top[1]:  # a strict majority: the others are the corrupt ones
                majority = max(counts, key=lambda d: counts[d])
                ranks = sorted(r for r, d in digests.items() if d != majority)
            else:
                ranks = sorted(digests)
            mismatches.append(Mismatch(key, ranks, [nodes[r] for r in ranks], decided=top[0] > top[1]))
    return mismatches
