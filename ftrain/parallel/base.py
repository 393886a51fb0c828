"""What every parallel strategy offers the train loop.

A :class:`Parallel` owns the wrapped model and its optimizer and answers four questions for
one optimizer step: how to run a micro-batch (precision, gradient sync), how gradients are
reduced, how the global gradient norm is clipped, and how to export the full state.
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)

from ftrain.parallel.grad_norm import clip_grad_norm

if TYPE_CHECKING:
    from ftrain.parallel.strategies import Layout


class Parallel:
    """A model made parallel. Subclasses wrap the model and override the hooks they need."""

    #: Whether bf16 is applied with torch.autocast (fp32 params) rather than by the wrapper.
    uses_autocast = True

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        layout: Layout,
        device: torch.device,
        compute_dtype: torch.dtype,
    ):
        self.model = model
        self.optimizer = optimizer
        self.layout = layout
        self.device = device
        self.compute_dtype = compute_dtype

    def autocast(self) -> AbstractContextManager:
        """Context for a micro-batch's forward (bf16 compute where the wrapper does not cast)."""
        if self.uses_autocast and self.compute_dtype != torch.float32:
            return torch.autocast(self.device.type, dtype=self.compute_dtype)
        return contextlib.nullcontext()

    def grad_sync(self, is_last: bool) -> AbstractContextManager:
        """Context for a micro-batch's forward and backward: skip gradient communication on all
        but the last micro-batch of a step."""
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor, micro_index: int, accum_steps: int) -> None:
        """Backward of one micro-batch's mean loss; the step's gradient is the mean over micro-batches."""
        (loss / accum_steps).backward()

    def reduce_gradients(self) -> None:
        """Finish the step's gradient reduction (wrappers that reduce in backward do nothing)."""

    def comm_overlap(self) -> float | None:
        """The share of gradient communication hidden behind backward's compute, where the
        wrapper measures it (None elsewhere)."""
        return None

    def clip_grad_norm(self, max_norm: float) -> float:
        return clip_grad_norm(self.model.parameters(), max_norm)

    def full_state_dict(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """Full (unsharded) model and optimizer state on CPU, keyed by parameter name; rank 0 only."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_sd = get_model_state_dict(self.model, options=options)
        optim_sd = get_optimizer_state_dict(self.model, self.optimizer, options=options)
        return model_sd, optim_sd
