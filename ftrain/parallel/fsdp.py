"""Sharded data parallelism with FSDP2 ``fully_shard``: ZeRO-2, ZeRO-3 (fsdp) and HSDP.

Each transformer block is its own FSDP unit, then the root. ZeRO-2 keeps parameters unsharded
between forward and backward (``reshard_after_forward=False``); fsdp re-shards them (ZeRO-3);
HSDP shards within groups of ``shard_size`` ranks and replicates across groups (a 2-D mesh).
bf16 runs as a MixedPrecisionPolicy: bf16 parameters for compute, fp32 gradient reduction.

Under gradient accumulation :class:`FSDPParallel` reduces as ``parallel.gradient_reduce`` says
(:mod:`ftrain.parallel.strategies.fsdp`): on the last micro-batch only, or after every one. All
ranks of a job must reduce alike (a reduce-scatter one rank skips hangs the others), so ``auto``
is decided from the same inputs on every rank and, where it reads the device, agreed by an
all-reduce.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from ftrain.models.layout import block_list
from ftrain.parallel.base import Parallel
from ftrain.parallel.strategies._gradient_reduce import EVERY_MICRO_BATCH, LAST_MICRO_BATCH, choose_gradient_reduce

if TYPE_CHECKING:
    from ftrain.parallel.strategies import Layout

log = logging.getLogger(__name__)

#: ``auto`` judges the peak with accumulated gradients against this share of the device's memory;
#: the rest is for what torch's allocator does not count (CUDA context, NCCL buffers), the loss's
#: backward buffers and fragmentation.
AUTO_MEMORY_FRACTION = 0.9

#: (bytes allocated now, bytes the device has) on this rank's device
MemoryProbe = Callable[[], tuple[int, int]]


def shard_model(
    model: nn.Module, mesh: DeviceMesh, *, reshard_after_forward: bool, compute_dtype: torch.dtype
) -> nn.Module:
    mp = (
        MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
        if compute_dtype != torch.float32
        else MixedPrecisionPolicy()
    )
    for block in block_list(model):
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp)
    return model


def cuda_memory_probe(device: torch.device) -> MemoryProbe:
    """What ``auto`` reads on a CUDA device: torch's allocated bytes and the device's total."""
    total = int(torch.cuda.get_device_properties(device).total_memory)
    return lambda: (int(torch.cuda.memory_allocated(device)), total)


class FSDPParallel(Parallel):
    """FSDP2 units driven through accumulation in ``gradient_reduce`` mode (``auto``, ``every_micro_batch``
    or ``last_micro_batch``; ``accum_steps``: this rank's micro-batches per step).

    ``auto`` is ``last_micro_batch`` when a step has one micro-batch or the device is a CPU (no
    ``memory_probe``: its memory is treated as fitting). Otherwise it is decided once, at the end of
    the first forward (before that micro-batch's backward reduces): ``last_micro_batch`` if the
    memory allocated then (parameter shards, the activations backward will use, the optimizer state
    if loaded), plus the AdamW state a first step will create and the unsharded fp32 gradients the
    micro-batches accumulate, fit in :data:`AUTO_MEMORY_FRACTION` of the device on every rank;
    ``every_micro_batch`` otherwise. ``ftrain plan`` applies the same rule
    (:func:`~ftrain.parallel.strategies._gradient_reduce.choose_gradient_reduce`) to its estimates."""

    uses_autocast = False  # the MixedPrecisionPolicy casts

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        layout: Layout,
        device: torch.device,
        compute_dtype: torch.dtype,
        *,
        gradient_reduce: str = LAST_MICRO_BATCH,
        accum_steps: int = 1,
        shard_count: int = 1,
        memory_probe: MemoryProbe | None = None,
    ):
        super().__init__(model, optimizer, layout, device, compute_dtype)
        self.accum_steps = accum_steps
        self.shard_count = shard_count
        self._is_last = True
        self._hooks: list[Any] = []
        if memory_probe is None and device.type == "cuda" and gradient_reduce == "auto" and accum_steps > 1:
            memory_probe = cuda_memory_probe(device)
        self._probe = memory_probe
        #: the mode in force; "auto" until the first forward decides it
        self.gradient_reduce = gradient_reduce
        if gradient_reduce == "auto" and (memory_probe is None or accum_steps <= 1):
            self._resolved(choose_gradient_reduce("auto", accum_steps=accum_steps, last_bytes=None, memory_bytes=None))
        elif gradient_reduce == "auto":
            self._hooks.append(model.register_forward_hook(self._decide_after_forward))
        elif accum_steps > 1 and layout.rank == 0:
            log.info("parallel.gradient_reduce=%s over %d micro-batches per step", gradient_reduce, accum_steps)

    def _resolved(self, mode: str, why: str = "") -> None:
        self.gradient_reduce = mode
        if self.accum_steps > 1 and self.layout.rank == 0:
            log.info("parallel.gradient_reduce=auto: %s over %d micro-batches per step%s", mode, self.accum_steps, why)

    def accumulated_gradient_bytes(self) -> int:
        """The unsharded fp32 gradients ``last_micro_batch`` holds between micro-batches, beyond
        the shards: every local shard times the shard count (FSDP2's dim-0 padding included)."""
        local = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in self.model.parameters())
        return 4 * local * max(self.shard_count - 1, 0)

    def _decide_after_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        assert self._probe is not None
        in_use, total = self._probe()
        local = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in self.model.parameters())
        optimizer_to_come = 0 if self.optimizer.state else 8 * local  # AdamW's m and v come at the first step
        # ... and backward brings this micro-batch's gradient shards and the accumulated unsharded rest
        need = torch.tensor(
            [
                in_use + optimizer_to_come + 4 * local + self.accumulated_gradient_bytes(),
                -int(AUTO_MEMORY_FRACTION * total),
            ],
            dtype=torch.int64,
            device=self.device,
        )
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(need, op=dist.ReduceOp.MAX)  # every rank decides on the largest need, the least memory
        last_bytes, memory_bytes = int(need[0]), -int(need[1])
        mode = choose_gradient_reduce(
            "auto", accum_steps=self.accum_steps, last_bytes=last_bytes, memory_bytes=memory_bytes
        )
        self._resolved(
            mode,
            f" (peak with the accumulated gradients {last_bytes / 2**30:.2f} GiB, budget "
            f"{AUTO_MEMORY_FRACTION:.0%} of the device: {memory_bytes / 2**30:.2f} GiB)",
        )
        self._apply()

    def _apply(self) -> None:
        sync = self._is_last or self.gradient_reduce == EVERY_MICRO_BATCH
        cast(FSDPModule, self.model).set_requires_gradient_sync(sync)

    def grad_sync(self, is_last: bool) -> AbstractContextManager:
        """Reduce-scatter this micro-batch's gradients on the last micro-batch only
        (``last_micro_batch``; undecided ``auto`` too, until the first forward decides) or on every one."""
        self._is_last = is_last
        self._apply()
        return contextlib.nullcontext()
