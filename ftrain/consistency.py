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

from ftrain.parallel import strategies
from ftrain.parallel.base import Parallel

log = logging.getLogger(__name__)


class ConsistencyError(RuntimeError):
    """Replicas that must be identical differ."""


@dataclass(frozen=True, slots=True)
class Mismatch:
    group: int
    ranks: list[int]  # ranks that disagree with their group's majority


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


def check_replicas(par: Parallel) -> list[Mismatch]:
    """Collective: every rank calls it; returns the same list of mismatches on every rank."""
    mine = _replicated_tensors(par)
    entry = None if mine is None else (mine[0], _digest(mine[1]))
    world = dist.get_world_size()
    gathered: list = [None] * world
    dist.all_gather_object(gathered, entry)
    groups: dict[int, dict[int, str]] = defaultdict(dict)
    for rank, e in enumerate(gathered):
        if e is not None:
            groups[e[0]][rank] = e[1]
    mismatches = []
    for key, digests in sorted(groups.items()):
        counts: dict[str, int] = defaultdict(int)
        for d in digests.values():
            counts[d] += 1
        if len(counts) > 1:
            majority = max(counts, key=lambda d: (counts[d], d == digests[min(digests)]))
            mismatches.append(Mismatch(key, sorted(r for r, d in digests.items() if d != majority)))
    return mismatches
