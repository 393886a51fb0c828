"""zero1: DDP with AdamW state sharded across ranks (``ZeroRedundancyOptimizer``, ZeRO-1).

Parameters and gradients are replicated and all-reduced as under ddp; each rank steps and keeps
the optimizer state of its partition only, so the replica check compares parameters alone.
It cannot be checkpointed with DCP yet (zero2 shards state and checkpoints like fsdp).
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

from ftrain.contract.config import ConfigError
from ftrain.parallel.strategies.base import Layout
from ftrain.parallel.strategies.ddp import DDP

if TYPE_CHECKING:
    import torch
    from torch import nn

    from ftrain.config import Config, OptimConfig
    from ftrain.parallel.base import Parallel
    from ftrain.planning.memory import ModelStats


def zero1_partition(stats: ModelStats, world_size: int) -> list[int]:
    """Parameters per rank as ZeroRedundancyOptimizer assigns them: group by group, largest
    first, each to the rank with the fewest so far (ties to the lowest rank)."""
    sizes = [0] * world_size
    heap = [(0, rank) for rank in range(world_size)]  # (size, rank): the minimum, ties to the lowest rank
    for g in sorted({p.group for p in stats.params}):
        for p in sorted((p for p in stats.params if p.group == g), key=lambda p: p.numel, reverse=True):
            size, rank = heapq.heappop(heap)
            sizes[rank] = size + p.numel
            heapq.heappush(heap, (sizes[rank], rank))
    return sizes


class Zero1(DDP):
    name = "zero1"
    position = 1
    preference = 1
    supports_deterministic = False
    textbook_difference = "DDP keeps fp32 params and grads replicated: 8Ψ + 8Ψ/N, not 4Ψ + 12Ψ/N"

    def check_config(self, cfg: Config) -> None:
        if cfg.checkpoint.uri:
            raise ConfigError(
                "parallel.strategy",
                "zero1 (ZeroRedundancyOptimizer) cannot be checkpointed with DCP yet; use zero2, which "
                "shards optimizer state and gradients and checkpoints/reshards like fsdp",
            )

    def make_optimizer(self, groups: list[dict[str, object]], optim: OptimConfig) -> torch.optim.Optimizer:
        from ftrain.parallel.ddp import make_zero1_optimizer

        return make_zero1_optimizer(groups, **optim.adamw_kwargs())

    def make_parallel(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        layout: Layout,
        device: torch.device,
        compute_dtype: torch.dtype,
        micro_per_step: int,
    ) -> Parallel:
        from ftrain.parallel.ddp import Zero1Parallel

        return Zero1Parallel(model, optimizer, layout, device, compute_dtype)

    def replicated_tensors(self, par: Parallel) -> list[torch.Tensor]:
        from torch.distributed.tensor import DTensor

        return [p for p in par.model.parameters() if not isinstance(p, DTensor)]  # the state is sharded

    def shard_count(self, layout: Layout) -> int:
        return layout.world_size

    def optimizer_numel(self, stats: ModelStats, layout: Layout, local_numel: int) -> int:
        return max(zero1_partition(stats, layout.world_size))

    def textbook_model_state_bytes(self, num_params: int, *, shard: int, tp_split: int, tp: int) -> int:
        return 4 * num_params + 12 * num_params // shard


STRATEGY = Zero1()
