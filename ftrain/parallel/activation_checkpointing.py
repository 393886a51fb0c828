"""Activation checkpointing: each transformer block's activations recomputed in its backward
(``parallel.activation_checkpointing``), for any strategy and inside a pipeline stage."""

from __future__ import annotations

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from ftrain.models.layout import block_container


def checkpoint_blocks(model: nn.Module) -> None:
    """Recompute each block's activations in its backward (``parallel.activation_checkpointing``)."""
    blocks = block_container(model)
    if blocks is None:
        return
    keys = list(blocks.keys()) if isinstance(blocks, nn.ModuleDict) else range(len(blocks))
    for key in keys:
        blocks[key] = checkpoint_wrapper(blocks[key])  # type: ignore[index]
