"""ddp: DistributedDataParallel. Parameters, gradients and optimizer state replicated on every
rank; gradients all-reduced in buckets during backward (``no_sync`` while accumulating).

With ``parallel.deterministic`` the DDP wrapper is left out and gradients are reduced in a fixed,
world-size-independent order (``ftrain.parallel.deterministic``): bitwise identical results at
any world size. Every rank is one replica group.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ftrain.parallel.strategies.base import Layout, Strategy, Wrapper

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh

    from ftrain.config import ParallelConfig
    from ftrain.parallel.base import Parallel


class DDP(Strategy):
    name = "ddp"
    position = 0
    preference = 0
    supports_deterministic = True
    full_replica = True
    wrapper = Wrapper.DDP

    def layout(
        self, parallel: ParallelConfig, *, world_size: int, rank: int, local_world_size: int, n_head: int | None
    ) -> Layout:
        return Layout(self.name, world_size, rank, world_size, rank, deterministic=parallel.deterministic)

    def apply_data_parallel(
        self,
        model: nn.Module,
        parallel: ParallelConfig,
        layout: Layout,
        mesh: DeviceMesh | None,
        device: torch.device,
        compute_dtype: torch.dtype,
    ) -> nn.Module:
        if layout.deterministic:
            return model  # the fixed-order reduction replaces DDP's all-reduce
        from ftrain.parallel.ddp import wrap_ddp

        return wrap_ddp(model, device, bucket_cap_mb=parallel.bucket_cap_mb, static_graph=parallel.static_graph)

    def make_parallel(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        layout: Layout,
        device: torch.device,
        compute_dtype: torch.dtype,
        micro_per_step: int,
    ) -> Parallel:
        if layout.deterministic:
            from ftrain.parallel.deterministic import DeterministicParallel

            return DeterministicParallel(model, optimizer, layout, device, compute_dtype, micro_per_step=micro_per_step)
        from ftrain.parallel.ddp import DDPParallel

        return DDPParallel(model, optimizer, layout, device, compute_dtype)

    def replica_group(self, layout: Layout) -> int | None:
        return 0

    def shard_count(self, layout: Layout) -> int:
        return 1

    def textbook_model_state_bytes(self, num_params: int, *, shard: int, tp_split: int, tp: int) -> int:
        return 16 * num_params


STRATEGY = DDP()
