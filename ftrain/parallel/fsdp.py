"""Sharded data parallelism with FSDP2 ``fully_shard``: ZeRO-2, ZeRO-3 (fsdp) and HSDP.

Each transformer block is its own FSDP unit, then the root. ZeRO-2 keeps parameters unsharded
between forward and backward (``reshard_after_forward=False``); fsdp re-shards them (ZeRO-3);
HSDP shards within groups of ``shard_size`` ranks and replicates across groups (a 2-D mesh).
bf16 runs as a MixedPrecisionPolicy: bf16 parameters for compute, fp32 gradient reduction.
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from typing import cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from ftrain.models.layout import block_list
from ftrain.parallel.base import Parallel


def shard_model(
    model: nn.Module, mesh: DeviceMesh, *, reshard_after_forward: bool, compute_dtype: torch.dtype
) -> nn.Module:
    mp = (
        MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
        if compute_dtype != torch.float32
        else MixedPrecisionPolicy()
    )
    for block in block_list(model):
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp)
    return model


class FSDPParallel(Parallel):
    uses_autocast = False  # the MixedPrecisionPolicy casts

    def grad_sync(self, is_last: bool) -> AbstractContextManager:
        cast(FSDPModule, self.model).set_requires_gradient_sync(is_last)
        return contextlib.nullcontext()
