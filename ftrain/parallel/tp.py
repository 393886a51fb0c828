"""Tensor parallelism (Megatron-style column/row splits), alone or under FSDP (2-D).

A model opts in by defining ``tp_plan() -> {module_fqn: "colwise" | "rowwise"}``; the
built-in GPT splits q/k/v and the MLP input by columns and the attention output and MLP
projection by rows, so each block needs one all-reduce forward and one backward. Embeddings,
norms and the head stay replicated (their gradients are identical on every TP rank).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from ftrain.config import ConfigError

_STYLES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh) -> nn.Module:
    plan_fn = getattr(model, "tp_plan", None)
    if plan_fn is None:
        raise ConfigError(
            "parallel.strategy",
            f"{type(model).__name__} has no tp_plan(); define one returning "
            '{"module.fqn": "colwise"|"rowwise"} to use tensor parallelism',
        )
    plan = {fqn: _STYLES[style]() for fqn, style in plan_fn().items()}
    return parallelize_module(model, tp_mesh, plan)
