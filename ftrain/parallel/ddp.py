"""Replicated data parallelism: DDP, and ZeRO-1 (optimizer state sharded over DDP)."""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

from ftrain.parallel.base import Parallel

#: DDP times backward's compute and communication every this many steps (torch's own timers)
DDP_TIMING_EVERY = 10


def wrap_ddp(model: torch.nn.Module, device: torch.device, *, bucket_cap_mb: float, static_graph: bool) -> DDP:
    ddp = DDP(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        bucket_cap_mb=bucket_cap_mb,
        static_graph=static_graph,
        gradient_as_bucket_view=True,
    )
    try:
        ddp._set_ddp_runtime_logging_sample_rate(DDP_TIMING_EVERY)  # noqa: SLF001 - torch's timers, sampled
    except (AttributeError, RuntimeError):  # another torch: no overlap figure
        pass
    return ddp


def ddp_overlap(model: torch.nn.Module) -> float | None:
    """torch DDP's running average over its sampled steps: time its gradient all-reduce
    overlapped backward's compute / the all-reduce's time (None before its first sample)."""
    try:
        data = model._get_ddp_logging_data()  # type: ignore[operator]  # noqa: SLF001 - no public reader
    except (AttributeError, RuntimeError, TypeError):
        return None
    comm = float(data.get("avg_backward_comm_time", 0) or 0)
    overlap = float(data.get("avg_backward_compute_comm_overlap_time", 0) or 0)
    return round(min(1.0, overlap / comm), 4) if comm > 0 else None


class DDPParallel(Parallel):
    """DistributedDataParallel; accumulation skips the all-reduce with ``no_sync``."""

    def grad_sync(self, is_last: bool) -> AbstractContextManager:
        model = cast(DDP, self.model)  # nn.Module's __getattr__ hides the type
        return contextlib.nullcontext() if is_last else model.no_sync()

    def comm_overlap(self) -> float | None:
        return ddp_overlap(self.model)


class Zero1Parallel(DDPParallel):
    """ZeRO-1: DDP gradients, AdamW state sharded across ranks by ZeroRedundancyOptimizer."""

    def full_state_dict(self) -> tuple[dict[str, Any], dict[str, Any]]:
        # ZeroRedundancyOptimizer keeps state by parameter index: gather it on rank 0 and key it
        # by parameter name, like the other strategies.
        cast(ZeroRedundancyOptimizer, self.optimizer).consolidate_state_dict(to=0)
        model_sd = {k.removeprefix("module."): v.detach().cpu() for k, v in self.model.state_dict().items()}
        if dist.get_rank() != 0:
            return model_sd, {}
        full = self.optimizer.state_dict()
        names = [n.removeprefix("module.") for n, _ in self.model.named_parameters()]
        by_param = {id(p): n for n, p in zip(names, self.model.parameters(), strict=True)}
        index_to_name = {}
        i = 0
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                index_to_name[i] = by_param[id(p)]
                i += 1
        state = {
            index_to_name[i]: {k: (v.cpu() if torch.is_tensor(v) else v) for k, v in s.items()}
            for i, s in full["state"].items()
        }
        return model_sd, {"state": state}


def make_zero1_optimizer(groups: list[dict[str, Any]], **adamw_kwargs: Any) -> ZeroRedundancyOptimizer:
    return ZeroRedundancyOptimizer(groups, optimizer_class=torch.optim.AdamW, **adamw_kwargs)
