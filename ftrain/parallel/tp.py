"""Tensor parallelism (Megatron-style column/row splits), alone or under FSDP (2-D).

A model opts in with a tensor-parallel plan in its layout (``ModelLayout.tp_plan``, see
:mod:`ftrain.models.layout`; a ``tp_plan()`` method is honoured too): ``{module_fqn: "colwise" |
"rowwise"}``, ``*`` standing for each block. The built-in models split q/k/v and the MLP input by
columns and the attention output and MLP projection by rows, so each block needs one all-reduce
forward and one backward. Embeddings, norms and the head stay replicated (their gradients are
identical on every TP rank).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from ftrain.config import ConfigError
from ftrain.models.layout import tp_plan_of

_STYLES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh) -> nn.Module:
    plan = tp_plan_of(model)
    if plan is None:
        raise ConfigError(
            "parallel.strategy",
            f"{type(model).__name__} has no tensor-parallel plan: declare one in its ftrain_layout() "
            '(tp_plan = {"blocks.*.attn.q": "colwise", ...}; see docs/models.md) to use tensor parallelism',
        )
    return parallelize_module(model, tp_mesh, {fqn: _STYLES[style]() for fqn, style in plan.items()})
