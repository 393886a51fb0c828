"""A torchrun worker for the rendezvous tests: gloo, all_reduce, a result file, a loop of collectives.

``rdzv_worker.py OUT_DIR [--seconds S]``. After the first all_reduce (whose sum must equal the
world size) it writes ``OUT_DIR/started-<pid>.json``; it then runs one all_reduce every 50 ms
until ``S`` seconds have passed on rank 0 or ``OUT_DIR/stop`` exists on any rank (the decision
is itself all-reduced, so every rank stops after the same step), and writes
``OUT_DIR/done-<pid>.json``. A collective that loses its peer raises: the worker exits non-zero
and its agent restarts it.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist


def write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    tmp.rename(path)  # readers never see half a file


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--seconds", type=float, default=2.0)
    args = parser.parse_args()

    # a short timeout: a collective whose peer vanished without a reset fails instead of hanging
    dist.init_process_group("gloo", timeout=timedelta(seconds=15))
    rank, world = dist.get_rank(), dist.get_world_size()
    info = {
        "pid": os.getpid(),
        "rank": rank,
        "world_size": world,
        "restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        "group_rank": int(os.environ["GROUP_RANK"]),
    }

    ones = torch.ones(4)
    dist.all_reduce(ones)
    if not torch.equal(ones, torch.full((4,), float(world))):
        raise SystemExit(f"all_reduce gave {ones.tolist()}, expected {world}")
    write_json(args.out / f"started-{os.getpid()}.json", {**info, "time": time.time()})

    deadline = time.monotonic() + args.seconds
    steps = 0
    while True:
        stop = (args.out / "stop").exists() or (rank == 0 and time.monotonic() >= deadline)
        flags = torch.tensor([1.0, float(stop)])
        dist.all_reduce(flags)
        if flags[0].item() != world:
            raise SystemExit(f"step {steps}: all_reduce gave {flags[0].item()}, expected {world}")
        steps += 1
        if flags[1].item() > 0:
            break
        time.sleep(0.05)  # the workload's pace, not synchronisation

    write_json(args.out / f"done-{os.getpid()}.json", {**info, "steps": steps, "time": time.time()})
    dist.barrier()  # before destroying: a rank that destroys its group early can abort its peer
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
