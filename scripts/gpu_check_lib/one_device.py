"""``ftrain train`` with every local rank on one CUDA device: the torchrun entry of the checks that
run two processes on a host with one GPU (gloo carries CUDA tensors between them).

    torchrun --standalone --nproc-per-node=2 scripts/gpu_check_lib/one_device.py train CONFIG [overrides]

Why it exists: ``ftrain.distributed.select_device`` gives local rank N the device ``cuda:N``, so
rank 1 asks for ``cuda:1``, which a one-GPU host does not have. This entry wraps that function
(local rank modulo the devices there are) before the train loop binds it, then runs ftrain's own
command line; nothing else differs from ``-m ftrain``. On the CPU it changes nothing.
"""

from __future__ import annotations

import sys

import torch

import ftrain.distributed
from ftrain.config import TrainConfig

if "ftrain.train" in sys.modules:  # it would already hold the unwrapped function
    raise RuntimeError("one_device: ftrain.train was imported before select_device was wrapped")

_select_device = ftrain.distributed.select_device


def _one_device(train: TrainConfig) -> torch.device:
    device = _select_device(train)
    if device.type == "cuda" and device.index is not None and torch.cuda.device_count() > 0:
        return torch.device("cuda", device.index % torch.cuda.device_count())
    return device


ftrain.distributed.select_device = _one_device

if __name__ == "__main__":
    from ftrain.cli import main

    sys.exit(main())
