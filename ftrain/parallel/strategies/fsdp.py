"""fsdp: FSDP2 ``fully_shard`` (ZeRO-3). Parameters, gradients and optimizer state sharded over
every rank; each transformer block is a unit, then the root; a unit is gathered for its forward
and again for its backward, and gradients are reduce-scattered. bf16 runs as a
MixedPrecisionPolicy (bf16 compute, fp32 shards and reduction). No rank holds a replica.

Under gradient accumulation ``parallel.gradient_reduce`` says when gradients are reduced:
``last_micro_batch`` keeps the whole (TP-local) model's unsharded fp32 gradients from the first
micro-batch's backward to the last one's, which reduce-scatters once (4 bytes per parameter more
than the shards, the least communication); ``every_micro_batch`` reduce-scatters after every
micro-batch into the sharded gradients (one reduction per micro-batch, sharded memory); ``auto``
picks by the rule ``ftrain plan`` applies to its estimates too
(:mod:`ftrain.parallel.strategies._gradient_reduce`).

zero2, hsdp and fsdp+tp build on :class:`FSDP`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ftrain.parallel.strategies._gradient_reduce import GRADIENT_REDUCE_ATTR, LAST_MICRO_BATCH
from ftrain.parallel.strategies.base import Layout, Strategy, Wrapper

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh

    from ftrain.config import ParallelConfig
    from ftrain.parallel.base import Parallel


class FSDP(Strategy):
    name = "fsdp"
    position = 3
    preference = 4
    wrapper = Wrapper.FSDP

    def layout(
        self, parallel: ParallelConfig, *, world_size: int, rank: int, local_world_size: int, n_head: int | None
    ) -> Layout:
        return Layout(self.name, world_size, rank, world_size, rank, mesh_shape=((world_size,), ("dp",)))

    def shard_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        """The (sub)mesh FSDP2 shards over."""
        return mesh

    def apply_data_parallel(
        self,
        model: nn.Module,
        parallel: ParallelConfig,
        layout: Layout,
        mesh: DeviceMesh | None,
        device: torch.device,
        compute_dtype: torch.dtype,
    ) -> nn.Module:
        from ftrain.parallel.fsdp import shard_model

        assert mesh is not None, "every FSDP layout has a mesh_shape"
        shard_model(
            model, self.shard_mesh(mesh), reshard_after_forward=self.reshard_after_forward, compute_dtype=compute_dtype
        )
        setattr(model, GRADIENT_REDUCE_ATTR, parallel.gradient_reduce)
        return model

    def make_parallel(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        layout: Layout,
        device: torch.device,
        compute_dtype: torch.dtype,
        micro_per_step: int,
    ) -> Parallel:
        from ftrain.parallel.fsdp import FSDPParallel

        return FSDPParallel(
            model,
            optimizer,
            layout,
            device,
            compute_dtype,
            gradient_reduce=getattr(model, GRADIENT_REDUCE_ATTR, LAST_MICRO_BATCH),
            accum_steps=-(-micro_per_step // layout.dp_size),  # this rank's micro-batches (the largest block)
            shard_count=self.shard_count(layout),
        )

    def replica_group(self, layout: Layout) -> int | None:
        return None

    def shard_count(self, layout: Layout) -> int:
        return layout.dp_size  # the whole world, or one pipeline stage's ranks

    def textbook_model_state_bytes(self, num_params: int, *, shard: int, tp_split: int, tp: int) -> int:
        return 16 * num_params // shard


STRATEGY = FSDP()
