"""Optimizer parameter groups and the learning-rate schedule.

The schedule is a pure function of the step, so resuming needs no scheduler state: warmup
linearly to the peak, then cosine-decay to ``min_lr_ratio`` of the peak at ``train.steps``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from torch import nn

if TYPE_CHECKING:
    from ftrain.config import OptimConfig


def param_groups(model: nn.Module, optim: OptimConfig) -> list[dict[str, Any]]:
    """Weight decay on matrices only; biases, norms and embeddings are not decayed."""
    embeddings = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 and id(p) not in embeddings else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": optim.weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def adamw_kwargs(optim: OptimConfig) -> dict[str, Any]:
    return {"lr": optim.lr, "betas": (optim.beta1, optim.beta2), "eps": optim.eps}


def peak_lr(optim: OptimConfig, dp_size: int) -> float:
    ratio = dp_size / optim.base_world_size
    if optim.lr_scaling == "linear":
        return optim.lr * ratio
    if optim.lr_scaling == "sqrt":
        return optim.lr * math.sqrt(ratio)
    return optim.lr


def lr_at(step: int, *, peak: float, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """Learning rate for optimizer step ``step`` (0-based)."""
    if warmup_steps and step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    floor = peak * min_lr_ratio
    return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def set_lr(param_groups_: Iterable[dict[str, Any]], lr: float) -> None:
    for group in param_groups_:
        group["lr"] = lr
