"""One rank of tests/distributed/test_live_restore.py (run under torchrun, 3 ranks, gloo).

Trains 2 steps, then makes up what each rank holds after a failure (the scenario) and runs
:func:`ftrain.recovery.live.restore` in a new trainer, as a live worker does in its next round. Writes
what it got to ``<out>/rank<r>.json``.
"""

from __future__ import annotations

import dataclasses
import json
import sys

import torch

from ftrain import state_codec
from ftrain.config import load_config
from ftrain.distributed import exit_without_teardown, init_distributed, select_device, shutdown_distributed
from ftrain.recovery.live import hold, restore
from ftrain.recovery.peer_state import HeldState
from ftrain.train import CURSOR, SCHEDULE, Trainer

#: 3 ranks: a global batch they divide
OVERRIDES = ["--parallel.deterministic=true", "--train.global_batch_size=12"]


def _ahead(held: HeldState, by: float) -> HeldState:
    """``held`` one step further: the cursor past one more batch, every parameter moved by ``by``."""
    assert held.model is not None and held.cursor is not None
    cursor = held.entry(CURSOR)
    cursor = dict(cursor, step=cursor["step"] + 1, next_index=cursor["next_index"] + cursor["global_batch_size"])
    model = {k: v + by for k, v in held.model.items()}
    return HeldState(held.step + 1, held.committed_step, model, held.optim, _with(held, CURSOR, cursor))


def _with(held: HeldState, name: str, value: object) -> dict[str, str]:
    """``held``'s entries with ``name`` set to ``value``."""
    assert held.cursor is not None
    return {**held.cursor, name: state_codec.encode(value)}


def main(config: str, scenario: str, out: str) -> None:
    cfg = load_config(config, ["--train.steps=2", *OVERRIDES])
    device = select_device(cfg.train)
    rank, world, local = init_distributed(cfg.parallel, device)
    first = Trainer(cfg, device, torch.float32, rank, world, local)
    first.run(resume=False)
    held: HeldState | None = hold(first)
    if scenario == "mixed":  # ranks 0 and 2 finished step 3, rank 1 did not
        held = _ahead(held, 0.5) if rank != 1 else held
    elif scenario == "replicas_differ":  # ranks 0 and 2 say step 3, with different parameters
        held = _ahead(held, 0.5 if rank == 0 else 0.25) if rank != 1 else held
    elif scenario == "joiner":  # rank 2 is a new process: it holds nothing
        held = None if rank == 2 else held
        if held is not None:  # the others trained on what a resume under on_schedule_change=keep kept
            held.cursor = _with(held, SCHEDULE, dataclasses.replace(first.lr_schedule(), total_steps=7).to_dict())
    checkpointed = [f"--checkpoint.uri={out}/ckpt"] if scenario == "joiner" else []
    second = Trainer(
        load_config(config, ["--train.steps=3", *OVERRIDES, *checkpointed]),
        device,
        torch.float32,
        rank,
        world,
        local,
    )
    restored = restore(second, held)
    params = {k: v.detach().clone() for k, v in second.par.model.state_dict().items()}
    digest = hold(second).digest()
    with open(f"{out}/rank{rank}.json", "w") as fh:
        json.dump(
            {
                "source": restored.source,
                "step": restored.step,
                "from_rank": restored.from_rank,
                "cursor_step": second.cursor.step,
                "digest": digest,
                "param_sum": float(sum(float(v.double().sum()) for v in params.values())),
                "schedule_steps": second.lr_schedule().total_steps,
            },
            fh,
        )
    shutdown_distributed()


if __name__ == "__main__":
    main(*sys.argv[1:4])
    exit_without_teardown(0)  # a clean end: no C++ teardown that can abort (ftrain.distributed)
