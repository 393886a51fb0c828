"""fsdp+tp: 2-D parallelism on a (dp, tp) mesh. Tensor parallelism inside groups of
``parallel.tp_size`` consecutive ranks (default 2), FSDP2 across the groups over the TP-local
tensors; each TP group reads one data stream. Every parameter is a DTensor on the 2-D mesh, so
no rank holds a replica.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ftrain.parallel.strategies.base import Layout
from ftrain.parallel.strategies.fsdp import FSDP
from ftrain.parallel.strategies.tp import local_numel, split_layers, tp_degree

if TYPE_CHECKING:
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh

    from ftrain.config import ParallelConfig
    from ftrain.planning.memory import MemoryEstimate


class FSDPTP(FSDP):
    name = "fsdp+tp"
    position = 6
    preference = 5
    needs_tp_plan = True
    needs_several_ranks = True

    def layout(
        self, parallel: ParallelConfig, *, world_size: int, rank: int, local_world_size: int, n_head: int | None
    ) -> Layout:
        tp = tp_degree(parallel.tp_size or 2, world_size=world_size, n_head=n_head)
        return Layout(
            self.name,
            world_size,
            rank,
            world_size // tp,
            rank // tp,
            tp_size=tp,
            mesh_shape=((world_size // tp, tp), ("dp", "tp")),
        )

    def apply_tensor_parallel(self, model: nn.Module, mesh: DeviceMesh | None, *, sequence_parallel: bool) -> None:
        split_layers(model, mesh, sequence_parallel=sequence_parallel)

    def shard_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        return mesh["dp"]

    def shard_count(self, layout: Layout) -> int:
        return layout.dp_size

    def textbook_model_state_bytes(self, num_params: int, *, shard: int, tp_split: int, tp: int) -> int:
        return 16 * local_numel(num_params, tp_split=tp_split, tp=tp) // shard

    def layout_text(self, estimate: MemoryEstimate) -> str:
        return f"dp={estimate.dp_size} tp={estimate.tp_size}"


STRATEGY = FSDPTP()
