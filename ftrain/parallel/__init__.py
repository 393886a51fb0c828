"""Parallel strategies: ``parallelize`` turns a CPU fp32 model into a :class:`Parallel`.

| strategy | parameters | gradients | optimizer state | module |
|---|---|---|---|---|
| ddp | replicated | all-reduced | replicated | ddp.py |
| zero1 | replicated | all-reduced | sharded | ddp.py |
| zero2 | sharded between steps | reduce-scattered | sharded | fsdp.py |
| fsdp | sharded (ZeRO-3) | reduce-scattered | sharded | fsdp.py |
| hsdp | sharded in groups, replicated across | both | sharded in groups | fsdp.py |
| tp | split per layer | local | split | tp.py |
| fsdp+tp | 2-D | 2-D | 2-D | tp.py + fsdp.py |

``parallel.deterministic`` swaps DDP's all-reduce for a fixed-order reduction
(deterministic.py). Order of wrapping follows torchtitan: TP, then activation checkpointing,
then FSDP.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh

from ftrain.config import Config
from ftrain.distributed import Layout
from ftrain.model import block_container
from ftrain.optim import adamw_kwargs, param_groups
from ftrain.parallel.base import Parallel
from ftrain.parallel.ddp import DDPParallel, Zero1Parallel, make_zero1_optimizer, wrap_ddp
from ftrain.parallel.deterministic import DeterministicParallel
from ftrain.parallel.fsdp import FSDPParallel, shard_model
from ftrain.parallel.tp import apply_tensor_parallel

__all__ = ["Parallel", "parallelize"]


def _checkpoint_blocks(model: nn.Module) -> None:
    blocks = block_container(model)
    for i, block in enumerate(blocks if blocks is not None else []):
        blocks[i] = checkpoint_wrapper(block)


def parallelize(model: nn.Module, cfg: Config, layout: Layout, device: torch.device,
                compute_dtype: torch.dtype, accum_steps: int) -> Parallel:
    strategy = layout.strategy
    model = model.to(device)
    mesh = None
    if layout.mesh_shape is not None:
        shape, names = layout.mesh_shape
        mesh = init_device_mesh(device.type, shape, mesh_dim_names=names)
    if strategy in ("tp", "fsdp+tp"):
        apply_tensor_parallel(model, mesh["tp"])
    if cfg.parallel.activation_checkpointing:
        _checkpoint_blocks(model)
    if strategy in ("zero2", "fsdp"):
        shard_model(model, mesh, reshard_after_forward=strategy == "fsdp", compute_dtype=compute_dtype)
    elif strategy == "hsdp":
        shard_model(model, mesh, reshard_after_forward=True, compute_dtype=compute_dtype)
    elif strategy == "fsdp+tp":
        shard_model(model, mesh["dp"], reshard_after_forward=True, compute_dtype=compute_dtype)
    elif strategy in ("ddp", "zero1") and not layout.deterministic:
        model = wrap_ddp(model, device, bucket_cap_mb=cfg.parallel.bucket_cap_mb,
                         static_graph=cfg.parallel.static_graph)

    groups = param_groups(model, cfg.optim)
    if strategy == "zero1":
        optimizer = make_zero1_optimizer(groups, **adamw_kwargs(cfg.optim))
    else:
        optimizer = torch.optim.AdamW(groups, **adamw_kwargs(cfg.optim))

    args = (model, optimizer, layout, device, compute_dtype)
    if layout.deterministic:
        return DeterministicParallel(*args, accum_steps=accum_steps)
    if strategy == "ddp":
        return DDPParallel(*args)
    if strategy == "zero1":
        return Zero1Parallel(*args)
    if strategy in ("zero2", "fsdp", "hsdp", "fsdp+tp"):
        return FSDPParallel(*args)
    return Parallel(*args)  # tp: no data parallelism, nothing to sync
