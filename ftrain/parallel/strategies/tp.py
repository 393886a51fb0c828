"""tp: tensor parallelism on every rank (Megatron column/row splits of the layers the model's
``tp_plan()`` names). One data stream: all ranks read the same micro-batches. Split weights are
DTensors; embeddings, norms and the head stay replicated plain tensors, identical on every rank
(one replica group). Model states are split, so no gradient sync is needed.

fsdp+tp reuses :func:`tp_degree` and :func:`split_layers`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ftrain.contract.config import ConfigError
from ftrain.parallel.strategies.base import Layout, Strategy, Wrapper

if TYPE_CHECKING:
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh

    from ftrain.config import ParallelConfig
    from ftrain.planning.memory import MemoryEstimate


def tp_degree(tp: int, *, world_size: int, n_head: int | None) -> int:
    """``tp`` if it divides the world and the heads; a ConfigError naming ``parallel.tp_size`` if not."""
    if world_size % tp:
        raise ConfigError("parallel.tp_size", f"{tp} does not divide the world size {world_size}")
    if n_head is not None and n_head % tp:
        raise ConfigError("parallel.tp_size", f"{tp} does not divide model.n_head={n_head}")
    return tp


def split_layers(model: nn.Module, mesh: DeviceMesh | None, *, sequence_parallel: bool) -> None:
    """Apply the model's tensor-parallel (and sequence-parallel) plan over the mesh's "tp" dimension, in place."""
    from ftrain.parallel.tp import apply_tensor_parallel

    assert mesh is not None, "every tensor-parallel layout has a mesh_shape"
    apply_tensor_parallel(model, mesh["tp"], sequence_parallel=sequence_parallel)


def local_numel(num_params: int, *, tp_split: int, tp: int) -> int:
    """Parameters a TP rank holds: its part of the split ones, all of the replicated ones."""
    return tp_split // tp + (num_params - tp_split)


class TP(Strategy):
    name = "tp"
    position = 5
    preference = 6
    needs_tp_plan = True
    needs_several_ranks = True
    wrapper = Wrapper.NONE

    def layout(
        self, parallel: ParallelConfig, *, world_size: int, rank: int, local_world_size: int, n_head: int | None
    ) -> Layout:
        tp = parallel.tp_size or world_size
        if tp != world_size:
            raise ConfigError(
                "parallel.tp_size",
                f"strategy tp uses every rank for tensor parallelism (tp_size={tp}, world={world_size}); "
                "use fsdp+tp to combine it with data parallelism",
            )
        tp = tp_degree(tp, world_size=world_size, n_head=n_head)
        return Layout(
            self.name, world_size, rank, world_size // tp, rank // tp, tp_size=tp, mesh_shape=((tp,), ("tp",))
        )

    def apply_tensor_parallel(self, model: nn.Module, mesh: DeviceMesh | None, *, sequence_parallel: bool) -> None:
        split_layers(model, mesh, sequence_parallel=sequence_parallel)

    def replica_group(self, layout: Layout) -> int | None:
        return 0

    def shard_count(self, layout: Layout) -> int:
        return 1

    def textbook_model_state_bytes(self, num_params: int, *, shard: int, tp_split: int, tp: int) -> int:
        return 16 * local_numel(num_params, tp_split=tp_split, tp=tp)

    def layout_text(self, estimate: MemoryEstimate) -> str:
        return f"tp={estimate.tp_size}"


STRATEGY = TP()
