"""One rank of tests/distributed/test_memory_tier.py (torchrun, 4 ranks, gloo, fsdp).

The ranks stand for 2 nodes of 2 (local world size 2: each rank's buddy is on the other "node").
They train 4 steps with a memory-tier snapshot after every step, then the scenario says which
ranks lose their memory (a new process) or damage what they keep, and a second trainer restores
through :func:`ftrain.recovery.live.restore`, as a live worker does in its next round, and trains to step 6
(saving the final state). Writes what each rank got to ``<out>/rank<r>.json``.
"""

from __future__ import annotations

import json
import os
import sys

import torch

from ftrain.config import load_config
from ftrain.distributed import exit_without_teardown, init_distributed, select_device, shutdown_distributed
from ftrain.recovery.live import hold, restore
from ftrain.recovery.memory_tier import MemoryTier
from ftrain.train import Trainer

#: a constant LR after the warm-up: the schedule does not depend on train.steps (4, then 6)
OVERRIDES = ["--parallel.strategy=fsdp", "--checkpoint.memory_interval=1", "--optim.min_lr_ratio=1.0"]
#: scenario -> (ranks that come back as new processes, the rank that damages its buddy copies)
SCENARIOS = {"replaced": ({3}, None), "damaged": ({0}, 2), "pair_lost": ({0, 2}, None)}


def main(config: str, scenario: str, out: str, final: str) -> None:
    fresh, damaging = SCENARIOS[scenario]
    cfg = load_config(config, ["--train.steps=4", *OVERRIDES])
    device = select_device(cfg.train)
    rank, world, _ = init_distributed(cfg.parallel, device)
    if damaging is not None and rank == damaging:
        os.environ["FTRAIN_FAULT_DAMAGE_MEMORY_COPY"] = str(rank)
    tier = MemoryTier(cfg)
    first = Trainer(cfg, device, torch.float32, rank, world, 2, tier=tier)
    first.run(resume=False)
    held = hold(first)
    first.close()  # waits for the last snapshot's exchange
    snapshots = [s.step for s in tier.snapshots]
    if rank in fresh:  # a new process: nothing in memory
        held, tier = None, MemoryTier(cfg)
    longer = ["--train.steps=6", "--train.on_schedule_change=rescale"]  # a storage fallback resumes step 4
    second_cfg = load_config(config, [*longer, *OVERRIDES, f"--train.save_final_path={final}"])
    second = Trainer(second_cfg, device, torch.float32, rank, world, 2, tier=tier)
    restored = restore(second, held)
    cursor_step = second.cursor.step
    second.run(resume=False)
    second.close()
    with open(f"{out}/rank{rank}.json", "w") as fh:
        json.dump(
            {"source": restored.source, "step": restored.step, "cursor_step": cursor_step, "snapshots": snapshots},
            fh,
        )
    shutdown_distributed()


if __name__ == "__main__":
    main(*sys.argv[1:5])
    exit_without_teardown(0)  # a clean end: no C++ teardown that can abort (ftrain.distributed)
