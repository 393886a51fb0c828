"""One rank of tests/distributed/test_tier_files.py (torchrun, 2 ranks on one node, gloo, fsdp,
``checkpoint.memory_dir``).

The ranks train 4 steps, a snapshot after every step kept in ``memory_dir``, and end without
cleaning up (as a killed job). Then, for each defect named on the command line, rank 0 puts it in
place of every copy of ``__0_0.distcp`` of the newest snapshot (the node's two workers each hold
one: rank 0 its own shard, rank 1 its buddy copy), and the ranks start again as restarted workers
do — a new tier and trainer (which find what the node holds), the resume (memory tier first),
then training to step 4. ``vanished`` deletes the copies after the new tier found them, before the
restore reads them. Writes, per defect, the step each rank resumed at and where its events begin
and end in the event log to ``<out>/rank<r>.json``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from ftrain.config import load_config
from ftrain.distributed import exit_without_teardown, init_distributed, select_device, shutdown_distributed
from ftrain.recovery.memory_tier import MemoryTier
from ftrain.train import Trainer

SHARD = "__0_0.distcp"


def _copies(memory_dir: str) -> list[Path]:
    """Every copy of SHARD in the newest snapshot directories of the node."""
    dirs = sorted(Path(memory_dir).glob("ftrain-tier-*/*/local*/step-*"))
    newest = max(d.name.split("-")[1] for d in dirs)
    return [d / SHARD for d in dirs if d.name.split("-")[1] == newest and (d / SHARD).exists()]


def _plant(path: Path, defect: str) -> None:
    size = path.stat().st_size
    path.unlink()
    if defect == "symlink_to_dev_zero":
        path.symlink_to("/dev/zero")
    elif defect == "fifo":
        os.mkfifo(path)
    elif defect == "directory":
        path.mkdir()
    elif defect == "longer":
        path.write_bytes(b"\0" * (size + 4096))
    else:
        raise ValueError(defect)


def _start(cfg, memory_dir: str, device, rank: int, world: int) -> tuple[MemoryTier, Trainer]:
    tier = MemoryTier(cfg, memory_dir)
    return tier, Trainer(cfg, device, torch.float32, rank, world, 2, tier=tier)


def main(config: str, memory_dir: str, events: str, out: str, defects: str) -> None:
    cfg = load_config(
        config,
        [
            "--train.steps=4",
            "--parallel.strategy=fsdp",
            "--checkpoint.memory_interval=1",
            f"--checkpoint.memory_dir={memory_dir}",
            f"--logging.events_path={events}",
        ],
    )
    device = select_device(cfg.train)
    rank, world, _ = init_distributed(cfg.parallel, device)
    tier, trainer = _start(cfg, memory_dir, device, rank, world)
    trainer.run(resume=False)
    trainer.close()
    tier.close()  # not job_done: the snapshots stay, as a killed job's do
    results = []
    for defect in [*defects.split(","), "none"]:
        dist.barrier()
        if rank == 0 and defect not in ("none", "vanished"):
            for path in _copies(memory_dir):
                _plant(path, defect)
        dist.barrier()
        begin = os.path.getsize(events)
        tier, trainer = _start(cfg, memory_dir, device, rank, world)  # finds what the node holds
        dist.barrier()
        if rank == 0 and defect == "vanished":
            for path in _copies(memory_dir):
                path.unlink()
        dist.barrier()
        trainer._resume()  # noqa: SLF001 - what Trainer.run does first: the memory tier, then storage
        resumed_at = trainer.cursor.step
        trainer.run(resume=False)  # trains on, to step 4
        trainer.close()
        tier.close()
        dist.barrier()
        results.append({"defect": defect, "resumed_at": resumed_at, "begin": begin, "end": os.path.getsize(events)})
    with open(f"{out}/rank{rank}.json", "w") as fh:
        json.dump(results, fh)
    shutdown_distributed()


if __name__ == "__main__":
    main(*sys.argv[1:6])
    exit_without_teardown(0)  # a clean end: no C++ teardown that can abort (ftrain.distributed)
