"""Tensor parallelism (Megatron-style column/row splits), alone or under FSDP (2-D), optionally
with sequence parallelism.

A model opts in with a tensor-parallel plan in its layout (``ModelLayout.tp_plan``, see
:mod:`ftrain.models.layout`; a ``tp_plan()`` method is honoured too): ``{module_fqn: "colwise" |
"rowwise"}``, ``*`` standing for each block. The built-in models split q/k/v and the MLP input by
columns and the attention output and MLP projection by rows, so each block needs one all-reduce
forward and one backward. Embeddings, norms and the head stay replicated (their gradients are
identical on every TP rank).

``parallel.sequence_parallel`` (a model that declares ``ModelLayout.sp_plan``): between the
blocks' column and row splits, the residual stream and the norms run on each rank's slice of the
sequence (Megatron's sequence parallelism, torch's ``SequenceParallel``): the row-split layers
reduce-scatter instead of all-reduce, and the attention and MLP all-gather their input, so the
norms' and residuals' activations are split by the tp degree for the same communication volume.
The embedding's output is sliced into the region, the head's input gathered out of it; norm
weights become replicated DTensors (their gradients all-reduced by DTensor).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from ftrain.config import ConfigError
from ftrain.models.layout import sp_plan_of, tp_plan_of


def _tp_style(style: str, sequence_parallel: bool) -> ParallelStyle:
    if style == "colwise":
        return ColwiseParallel()
    return RowwiseParallel(output_layouts=Shard(1)) if sequence_parallel else RowwiseParallel()


def _sp_style(style: str) -> ParallelStyle:
    if style == "enter":
        return PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1))
    if style == "sequence":
        return SequenceParallel()
    if style == "gather":  # stays a DTensor: the column-split layers inside see the gradient as partial
        return PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    return PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True)


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, *, sequence_parallel: bool = False) -> nn.Module:
    plan = tp_plan_of(model)
    if plan is None:
        raise ConfigError(
            "parallel.strategy",
            f"{type(model).__name__} has no tensor-parallel plan: declare one in its ftrain_layout() "
            '(tp_plan = {"blocks.*.attn.q": "colwise", ...}; see docs/models.md) to use tensor parallelism',
        )
    styles = {fqn: _tp_style(style, sequence_parallel) for fqn, style in plan.items()}
    if sequence_parallel:
        sp_plan = sp_plan_of(model)
        if sp_plan is None:
            raise ConfigError(
                "parallel.sequence_parallel",
                f"{type(model).__name__} declares no sp_plan in its ftrain_layout(): set it false, or declare one "
                "(docs/models.md)",
            )
        styles |= {fqn: _sp_style(style) for fqn, style in sp_plan.items()}
    return parallelize_module(model, tp_mesh, styles)
