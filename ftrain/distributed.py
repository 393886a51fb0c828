"""Process groups, devices and the parallel layout of a run.

``compute_layout`` is a pure function of the strategy and the world: which ranks shard, which
replicate, which form tensor-parallel groups, and so which data-parallel rank reads which
micro-batches. ``init_distributed`` joins the process group torchrun describes in the
environment (or a one-rank group when started without torchrun): NCCL on GPUs, gloo on CPU.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ftrain.config import ConfigError, ParallelConfig, TrainConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Layout:
    """Where this rank sits: world, data-parallel and tensor-parallel coordinates."""

    strategy: str
    world_size: int
    rank: int
    dp_size: int
    dp_rank: int
    tp_size: int = 1
    shard_size: int = 0  # HSDP: ranks per shard group
    deterministic: bool = False

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def mesh_shape(self) -> tuple[tuple[int, ...], tuple[str, ...]] | None:
        if self.strategy == "hsdp":
            return (self.world_size // self.shard_size, self.shard_size), ("replicate", "shard")
        if self.strategy == "fsdp+tp":
            return (self.dp_size, self.tp_size), ("dp", "tp")
        if self.strategy == "tp":
            return (self.tp_size,), ("tp",)
        if self.strategy in ("zero2", "fsdp"):
            return (self.world_size,), ("dp",)
        return None

    def describe(self) -> dict:
        return {
            "strategy": self.strategy,
            "world_size": self.world_size,
            "dp_size": self.dp_size,
            "tp_size": self.tp_size,
            "shard_size": self.shard_size,
            "deterministic": self.deterministic,
        }


def compute_layout(
    parallel: ParallelConfig, *, world_size: int, rank: int, local_world_size: int, n_head: int | None
) -> Layout:
    """Derive the layout, or raise ConfigError naming the key that cannot work at this size."""
    s = parallel.strategy
    if s == "hsdp":
        shard = parallel.shard_size or (local_world_size if local_world_size < world_size else 2)
        if world_size % shard or shard > world_size:
            raise ConfigError(
                "parallel.shard_size",
                f"HSDP shard groups of {shard} ranks do not tile a world of {world_size}; "
                "choose a divisor of the world size",
            )
        return Layout(s, world_size, rank, world_size, rank, shard_size=shard)
    if s in ("tp", "fsdp+tp"):
        tp = parallel.tp_size or (world_size if s == "tp" else 2)
        if s == "tp" and tp != world_size:
            raise ConfigError(
                "parallel.tp_size",
                f"strategy tp uses every rank for tensor parallelism (tp_size={tp}, world={world_size}); "
                "use fsdp+tp to combine it with data parallelism",
            )
        if world_size % tp:
            raise ConfigError("parallel.tp_size", f"{tp} does not divide the world size {world_size}")
        if n_head is not None and n_head % tp:
            raise ConfigError("parallel.tp_size", f"{tp} does not divide model.n_head={n_head}")
        return Layout(s, world_size, rank, world_size // tp, rank // tp, tp_size=tp)
    return Layout(s, world_size, rank, world_size, rank, deterministic=parallel.deterministic)


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
