"""``parallelize`` turns a CPU fp32 model into a :class:`~ftrain.parallel.base.Parallel` the way
its strategy (:mod:`ftrain.parallel.strategies`) says.

The order is the same for every strategy and follows torchtitan: build the device mesh of the
layout, tensor parallelism, activation checkpointing, data parallelism (DDP or FSDP2), then the
optimizer and the :class:`~ftrain.parallel.base.Parallel` the train loop drives. A pipeline
(``parallel.pp_size`` > 1) is built by :mod:`ftrain.parallel.pipeline`, which runs the same steps
per stage.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from ftrain.config import Config, ModelConfig
from ftrain.model import build_model
from ftrain.models.deferred_init import RECIPES, build_deferred, materialize
from ftrain.optim import param_groups
from ftrain.parallel import strategies
from ftrain.parallel.activation_checkpointing import checkpoint_blocks
from ftrain.parallel.base import Parallel
from ftrain.parallel.strategies import Layout

__all__ = ["build_for", "parallelize"]


def build_for(cfg: ModelConfig, layout: Layout) -> nn.Module:
    """The model ``cfg`` describes, as :func:`parallelize` takes it for ``layout``: parameters on the
    meta device where the layout shards them (:mod:`ftrain.models.deferred_init`; the same weights
    come out), a whole CPU fp32 model otherwise. Seed the CPU generator first."""
    if strategies.shards_model(layout):
        return build_deferred(lambda: build_model(cfg))
    return build_model(cfg)


def parallelize(
    model: nn.Module, cfg: Config, layout: Layout, device: torch.device, compute_dtype: torch.dtype, micro_per_step: int
) -> Parallel:
    """``model`` (from :func:`build_for`: whole on the CPU, or deferred) made parallel as ``layout`` says."""
    if layout.pp_size > 1:
        from ftrain.parallel.pipeline import build_pipeline

        return build_pipeline(model, cfg, layout, device, compute_dtype, micro_per_step // layout.dp_size)
    strategy = strategies.get(layout.strategy)
    recipes = getattr(model, RECIPES, None)
    if recipes is None:
        model = model.to(device)
    mesh = None
    if layout.mesh_shape is not None:
        shape, names = layout.mesh_shape
        mesh = init_device_mesh(device.type, shape, mesh_dim_names=names)
    strategy.apply_tensor_parallel(model, mesh, sequence_parallel=cfg.parallel.sequence_parallel)
    if cfg.parallel.activation_checkpointing:
        checkpoint_blocks(model)
    model = strategy.apply_data_parallel(model, cfg.parallel, layout, mesh, device, compute_dtype)
    if recipes is not None:
        materialize(model, device, recipes)
    optimizer = strategy.make_optimizer(param_groups(model, cfg.optim), cfg.optim)
    return strategy.make_parallel(model, optimizer, layout, device, compute_dtype, micro_per_step)
