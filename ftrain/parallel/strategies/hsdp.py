"""hsdp: FSDP2 on a 2-D (replicate, shard) mesh. Model states are sharded within groups of
``parallel.shard_size`` ranks (default: the ranks of a node, or 2 if one node is the whole
world) and replicated across groups, so gradients are reduce-scattered within a group and
all-reduced across. Ranks at the same position of their shard group hold identical shards.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ftrain.contract.config import ConfigError
from ftrain.parallel.strategies.base import Layout
from ftrain.parallel.strategies.fsdp import FSDP

if TYPE_CHECKING:
    import torch

    from ftrain.config import ParallelConfig
    from ftrain.parallel.base import Parallel
    from ftrain.planning.memory import MemoryEstimate


class HSDP(FSDP):
    name = "hsdp"
    position = 4
    preference = 3
    needs_several_ranks = True

    def layout(
        self, parallel: ParallelConfig, *, world_size: int, rank: int, local_world_size: int, n_head: int | None
    ) -> Layout:
        shard = parallel.shard_size or (local_world_size if local_world_size < world_size else 2)
        if world_size % shard or shard > world_size:
            raise ConfigError(
                "parallel.shard_size",
                f"HSDP shard groups of {shard} ranks do not tile a world of {world_size}; "
                "choose a divisor of the world size",
            )
        return Layout(
            self.name,
            world_size,
            rank,
            world_size,
            rank,
            shard_size=shard,
            mesh_shape=((world_size // shard, shard), ("replicate", "shard")),
        )

    def replica_group(self, layout: Layout) -> int | None:
        return layout.rank % layout.shard_size

    def replicated_tensors(self, par: Parallel) -> list[torch.Tensor]:
        """This rank's shards of the parameters and of the optimizer state."""
        import torch
        from torch.distributed.tensor import DTensor

        tensors = [p.to_local() if isinstance(p, DTensor) else p for p in par.model.parameters()]
        tensors += [
            t.to_local() if isinstance(t, DTensor) else t
            for s in par.optimizer.state.values()
            for t in s.values()
            if torch.is_tensor(t)
        ]
        return tensors

    def shard_count(self, layout: Layout) -> int:
        return layout.shard_size

    def layout_text(self, estimate: MemoryEstimate) -> str:
        return f"{estimate.world_size // estimate.shard_size}x{estimate.shard_size}"


STRATEGY = HSDP()
