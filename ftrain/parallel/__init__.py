"""Torch-side parallelism: ``parallelize`` turns a CPU fp32 model into a :class:`Parallel` the
way its strategy (:mod:`ftrain.strategies`) says.

The order is the same for every strategy and follows torchtitan: build the device mesh of the
layout, tensor parallelism, activation checkpointing, data parallelism (DDP or FSDP2), then the
optimizer and the :class:`Parallel` the train loop drives. The mechanisms strategies combine live
beside this file: ``ddp.py`` (DDP, ZeRO-1), ``fsdp.py`` (FSDP2 ``fully_shard``), ``tp.py``
(column/row splits), ``deterministic.py`` (the fixed-order reduction), ``grad_norm.py``
(clipping across meshes).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh

from ftrain import strategies
from ftrain.config import Config
from ftrain.model import block_container
from ftrain.optim import param_groups
from ftrain.parallel.base import Parallel
from ftrain.strategies import Layout

__all__ = ["Parallel", "parallelize"]


def checkpoint_blocks(model: nn.Module) -> None:
    """Recompute each block's activations in its backward (``parallel.activation_checkpointing``)."""
    blocks = block_container(model)
    if blocks is None:
        return
    keys = list(blocks.keys()) if isinstance(blocks, nn.ModuleDict) else range(len(blocks))
    for key in keys:
        blocks[key] = checkpoint_wrapper(blocks[key])  # type: ignore[index]


def parallelize(
    model: nn.Module, cfg: Config, layout: Layout, device: torch.device, compute_dtype: torch.dtype, micro_per_step: int
) -> Parallel:
    if layout.pp_size > 1:
        from ftrain.parallel.pipeline import build_pipeline

        return build_pipeline(model, cfg, layout, device, compute_dtype, micro_per_step // layout.dp_size)
    strategy = strategies.get(layout.strategy)
    model = model.to(device)
    mesh = None
    if layout.mesh_shape is not None:
        shape, names = layout.mesh_shape
        mesh = init_device_mesh(device.type, shape, mesh_dim_names=names)
    strategy.apply_tensor_parallel(model, mesh)
    if cfg.parallel.activation_checkpointing:
        checkpoint_blocks(model)
    model = strategy.apply_data_parallel(model, cfg.parallel, layout, mesh, device, compute_dtype)
    optimizer = strategy.make_optimizer(param_groups(model, cfg.optim), cfg.optim)
    return strategy.make_parallel(model, optimizer, layout, device, compute_dtype, micro_per_step)
