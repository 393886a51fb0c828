"""Fault-injection points inside a worker, armed only through ``FTRAIN_FAULT_*`` variables.

The chaos suite and tests use them to create faults that cannot be made from outside the
process; unset, every hook is a no-op.

- ``FTRAIN_FAULT_PERTURB="STEP:RANK"``: after step STEP, rank RANK adds 1e-3 to its first
  parameter, silently diverging from its replicas.
"""

from __future__ import annotations

import logging
import os

import torch
from torch import nn
from torch.distributed.tensor import DTensor

log = logging.getLogger(__name__)


def _armed(name: str) -> tuple[int, int] | None:
    raw = os.environ.get(name, "")
    if not raw:
        return None
    step, _, rank = raw.partition(":")
    return int(step), int(rank or 0)


def maybe_perturb_replica(step: int, rank: int, model: nn.Module) -> None:
    target = _armed("FTRAIN_FAULT_PERTURB")
    if target is None or target != (step, rank):
        return
    p = next(model.parameters())
    with torch.no_grad():
        (p.to_local() if isinstance(p, DTensor) else p).add_(1e-3)
    log.warning("fault injected: perturbed a parameter on rank %d after step %d", rank, step)
