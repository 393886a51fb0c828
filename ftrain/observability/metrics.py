"""Per-step metrics: one JSON line per optimizer step (rank 0), and peak memory per rank.

Torch-free at import (the agent reads these files; JSON lines are read as events are,
:func:`ftrain.contract.events.read_jsonl`).
"""

from __future__ import annotations

import json
import os
import resource
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ftrain.contract.events import read_jsonl
from ftrain.contract.local_files import open_append

if TYPE_CHECKING:
    import torch


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated GPU memory on CUDA; peak resident set size of the process on CPU."""
    if device.type == "cuda":
        import torch

        return int(torch.cuda.max_memory_allocated(device))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def resident_bytes(*, peak: bool = False) -> int:
    """This process's resident memory now (or its peak since it started: ``peak``), from
    /proc/self/status (VmRSS, VmHWM: counted from exec, unlike getrusage's, which a forked
    child inherits from its parent); getrusage's peak where /proc is missing."""
    field = "VmHWM:" if peak else "VmRSS:"
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class MetricsWriter:
    """Appends JSON lines; each line is flushed so a killed run keeps every completed step."""

    def __init__(self, path: str | os.PathLike):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        # a regular file of this user's, never a link planted in a shared directory (open_append)
        self._fh = os.fdopen(open_append(path), "a", buffering=1)

    def write(self, record: dict[str, Any]) -> None:
        self._fh.write(json.dumps(record, separators=(",", ":")) + "\n")

    def close(self) -> None:
        self._fh.close()


read_metrics = read_jsonl
