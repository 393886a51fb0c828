"""One rank of tests/distributed/test_tier_schedule.py (torchrun, 2 ranks, gloo, fsdp).

``spare``: the two ranks train a first round of 4 steps with the measured interval
(``checkpoint.memory_interval = -1``); then rank 0 is kept, its tier as it measured — set to 5
here, as a slower machine would have measured it, so that the test does not depend on this one's
speed — and rank 1 comes back as a new process (a spare: a fresh tier). A second round, restored
through :func:`ftrain.recovery.live.restore` as a live worker does (the step and source it restored go to
``<events>.rank<r>.json``), trains to step 12.

``failures``: one round of 60 steps of at least 0.1 s each with a snapshot every 2 steps; rank
1's snapshot of step 3 cannot copy its state, and its snapshot of step 7 raises in the middle of
the exchange (its peer is left waiting in it until the tier's timeout, half of
``parallel.timeout_s``: 3 s, shorter than the job however fast the machine, and gloo closes the
pairs of the tier's group).

Each rank's ``memory_snapshot`` events (in ``logging.events_path``) say which snapshots it took.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch

from ftrain.config import load_config
from ftrain.distributed import exit_without_teardown, init_distributed, select_device, shutdown_distributed
from ftrain.recovery import memory_tier
from ftrain.recovery.live import hold, restore
from ftrain.recovery.memory_tier import MemoryTier
from ftrain.train import Trainer

COMMON = ["--parallel.strategy=fsdp", "--optim.min_lr_ratio=1.0", "--parallel.timeout_s=20"]


def _failing_once(call: Any, fail_at_call: int, what: str) -> Any:
    calls = [0]

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == fail_at_call:
            raise RuntimeError(f"injected by the test: {what}")
        return call(*args, **kwargs)

    return wrapper


def _stagers_failing_once(new_stager: Any, fail_at_call: int) -> Any:
    """``new_stager`` whose stagers' ``stage`` calls, counted together, fail once (the tier makes a
    stager per snapshot)."""
    stage = _failing_once(lambda real, *args, **kwargs: real(*args, **kwargs), fail_at_call, "staging")

    def made(*args: Any, **kwargs: Any) -> Any:
        stager = new_stager(*args, **kwargs)
        real = stager.stage
        stager.stage = lambda *a, **k: stage(real, *a, **k)
        return stager

    return made


def spare(config: str, events: str) -> None:
    overrides = [*COMMON, "--checkpoint.memory_interval=-1", f"--logging.events_path={events}"]
    cfg = load_config(config, ["--train.steps=4", *overrides])
    device = select_device(cfg.train)
    rank, world, _ = init_distributed(cfg.parallel, device)
    tier = MemoryTier(cfg)
    first = Trainer(cfg, device, torch.float32, rank, world, 2, tier=tier)
    first.run(resume=False)
    held = hold(first)
    first.close()
    if rank == 0:
        tier.interval = 5  # kept: the interval it measured in the round before
    else:
        held, tier = None, MemoryTier(cfg)  # a spare: a new process
    second = Trainer(
        load_config(config, ["--train.steps=12", "--train.on_schedule_change=rescale", *overrides]),
        device,
        torch.float32,
        rank,
        world,
        2,
        tier=tier,
    )
    restored = restore(second, held)
    with open(f"{events}.rank{rank}.json", "w") as fh:
        json.dump({"source": restored.source, "step": restored.step}, fh)
    second.run(resume=False)
    second.close()


def failures(config: str, events: str) -> None:
    overrides = [*COMMON, "--parallel.timeout_s=6", "--checkpoint.memory_interval=2", f"--logging.events_path={events}"]
    cfg = load_config(config, ["--train.steps=60", *overrides])
    os.environ["FTRAIN_FAULT_STEP_SLEEP_S"] = "0.1"  # the job outlasts the tier's timeout
    device = select_device(cfg.train)
    rank, world, _ = init_distributed(cfg.parallel, device)
    tier = MemoryTier(cfg)
    trainer = Trainer(cfg, device, torch.float32, rank, world, 2, tier=tier)
    if rank == 1:  # snapshots at steps 1, 3, 5, 7, ...: the 2nd cannot stage, the 4th breaks off
        memory_tier.new_stager = _stagers_failing_once(memory_tier.new_stager, 2)
        tier._swap_with_buddy = _failing_once(tier._swap_with_buddy, 3, "the exchange")  # type: ignore[method-assign]  # noqa: SLF001
    trainer.run(resume=False)
    trainer.close()


if __name__ == "__main__":
    {"spare": spare, "failures": failures}[sys.argv[1]](sys.argv[2], sys.argv[3])
    shutdown_distributed()
    exit_without_teardown(0)  # a clean end: no C++ teardown that can abort (ftrain.distributed)
