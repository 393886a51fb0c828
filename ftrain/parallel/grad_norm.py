"""Global gradient-norm clipping that works for plain tensors and DTensors on several meshes.

``torch.nn.utils.clip_grad_norm_`` refuses mixed tensors and DTensors (tensor parallelism
leaves embeddings and norms replicated) and DTensors on different meshes (2-D FSDP+TP). So
gradients are grouped by mesh, each group's norm is reduced to a full value, and the squares
are combined before scaling.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def total_grad_norm(params: Iterable[torch.nn.Parameter]) -> torch.Tensor:
    groups: dict[object, list[torch.Tensor]] = defaultdict(list)
    for p in params:
        if p.grad is not None:
            key = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
            groups[key].append(p.grad)
    squares = []
    for grads in groups.values():
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        squares.append(norm.float() ** 2)
    if not squares:
        return torch.zeros(())
    return torch.stack(squares).sum().sqrt()


def clip_grad_norm(
    params: Iterable[torch.nn.Parameter], max_norm: float, *, across: dist.ProcessGroup | None = None
) -> float:
    """Scale gradients so their global L2 norm is at most ``max_norm``; returns the norm before.
    ``across``: the group whose ranks hold the model's other parameters (pipeline stages): the
    norm is over all of theirs."""
    params = list(params)
    norm = total_grad_norm(params)
    if across is not None:
        square = (norm.float() ** 2).reshape(1)
        dist.all_reduce(square, group=across)
        norm = square.sqrt()[0]
    total = float(norm)
    if max_norm > 0 and total > max_norm:
        scale = max_norm / (total + 1e-6)
        for p in params:
            if p.grad is not None:
                p.grad.mul_(scale)
    return total
