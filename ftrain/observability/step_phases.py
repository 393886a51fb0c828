"""Where a rank's time goes, step by step: host wall time split into phases.

- ``data``: picking the batch, reading its samples, copying them to the device;
- ``forward``: the model and the loss;
- ``backward``: backward's compute, up to the moment the last gradient is ready (a hook on every
  parameter's gradient accumulation says when);
- ``comm_wait``: time blocked on communication: what backward spends after its last gradient
  (waiting for the gradient all-reduce DDP overlapped with it), the explicit reductions and
  clipping, the all-gather of the losses and the stop agreement;
- ``optimizer``: the update and zeroing the gradients;
- ``ckpt_staging``: copying state for a checkpoint or the memory tier, and waiting for a copy;
- ``other``: the rest of the interval (reporting, fault hooks, the checks).

Phases add up to the wall time between two reports (:meth:`StepPhases.take`), so what happens
after one step's report (its checkpoint's staging, the stop agreement) counts in the next.
Where gradients are not accumulated through autograd (FSDP assigns its sharded gradients), no
hook fires and backward's wait stays in ``backward``. On CUDA the times are the host's: a phase
ends when its kernels are queued, not run, except where the host waits for them.

``busy_s`` (everything but ``comm_wait``) is what a slow rank has more of and its peers do
not: they wait for it in ``comm_wait`` (the straggler signal). Wherever a slow rank loses its
time — compute, a stall reading data, a process stopped and continued — it shows there.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn

from ftrain.contract.heartbeat import STEP_PHASES as PHASES


class StepPhases:
    def __init__(self, model: nn.Module):
        self._seconds = dict.fromkeys(PHASES, 0.0)
        self._since = time.perf_counter()
        self._last_grad_at = 0.0
        for p in model.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._grad_ready)

    def _grad_ready(self, param: object) -> None:
        self._last_grad_at = time.perf_counter()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        began = time.perf_counter()
        try:
            yield
        finally:
            self._seconds[name] += time.perf_counter() - began

    @contextmanager
    def backward(self) -> Iterator[None]:
        """A backward pass: compute up to its last gradient, the rest waiting for communication."""
        began = time.perf_counter()
        self._last_grad_at = 0.0
        try:
            yield
        finally:
            ended = time.perf_counter()
            wait = ended - self._last_grad_at if self._last_grad_at >= began else 0.0
            self._seconds["backward"] += ended - began - wait
            self._seconds["comm_wait"] += wait

    def add(self, name: str, seconds: float) -> None:
        """Time measured elsewhere (a pipeline schedule's compute and waits)."""
        self._seconds[name] += seconds

    def so_far(self, name: str) -> float:
        return self._seconds[name]

    def busy_s(self) -> float:
        """The interval so far, less the time blocked on communication."""
        return time.perf_counter() - self._since - self._seconds["comm_wait"]

    def take(self) -> dict[str, float]:
        """The interval since the last call, by phase (``other``: the rest), and start a new one."""
        now = time.perf_counter()
        out = dict(self._seconds)
        out["other"] = max(0.0, now - self._since - sum(v for k, v in out.items() if k != "other"))
        self._seconds = dict.fromkeys(PHASES, 0.0)
        self._since = now
        return out
