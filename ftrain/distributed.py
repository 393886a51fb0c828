"""Process groups and devices of a run.

``init_distributed`` joins the process group torchrun describes in the environment (or a
one-rank group when started without torchrun): NCCL on GPUs, gloo on CPU. Where a rank sits in
the parallel layout is the strategy's to say (:func:`ftrain.strategies.compute_layout`).
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from ftrain.config import ConfigError, ParallelConfig, TrainConfig

log = logging.getLogger(__name__)


def select_device(train: TrainConfig) -> torch.device:
    if train.device == "cuda" or (train.device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError("train.device", "cuda requested but no GPU is visible")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def select_dtype(train: TrainConfig, device: torch.device) -> torch.dtype:
    """bf16 by default on GPUs; fp32 on CPU, where bf16 runs ~12x slower without bf16 units."""
    if train.dtype == "bf16" or (train.dtype == "auto" and device.type == "cuda"):
        return torch.bfloat16
    return torch.float32


def init_distributed(parallel: ParallelConfig, device: torch.device) -> tuple[int, int, int]:
    """Join the process group; returns (rank, world_size, local_world_size)."""
    backend = parallel.backend
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=parallel.timeout_s)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend, timeout=timeout, device_id=device if device.type == "cuda" else None)
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        local_world = 1
    log.debug("joined %s group: rank %d of %d", backend, dist.get_rank(), dist.get_world_size())
    return dist.get_rank(), dist.get_world_size(), local_world


def shutdown_distributed() -> None:
    """Tear down after a successful run: a barrier first, so no rank destroys its groups (and
    exits) while gloo work of a peer still references them, which can abort the process at
    exit ("terminate called without an active exception")."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
