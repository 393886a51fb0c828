"""Run under torchrun (gloo): each rank's own entries of a session's state (its RNG state, a
:class:`ftrain.PerRank` object) saved at one world size and loaded at another.

``save ROOT``: each rank seeds its generator with 100 + rank, keeps ``rank * 10`` in its own
object, saves step 1, then draws. ``load ROOT``: each rank seeds 200 + rank, keeps -1, loads, then
draws. One JSON list per rank on rank 0 ($OUT): {"rank", "step", "draw", "mine"}.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist

import ftrain
from ftrain.distributed import exit_without_teardown
from tests.distributed.deferred_init_worker import write_gathered


class Mine:
    def __init__(self, value: int):
        self.value = value

    def state_dict(self) -> Any:
        return {"value": self.value}

    def load_state_dict(self, sd: Any) -> None:
        self.value = sd["value"]


def main() -> None:
    mode, root = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    mine = Mine(rank * 10 if mode == "save" else -1)
    state = {"model": model, "rng": ftrain.RNGState(), "mine": ftrain.PerRank(mine)}
    with ftrain.Session(root, verbose=False) as session:
        if mode == "save":
            torch.manual_seed(100 + rank)
            session.save(1, state, sync=True)
            step = 1
        else:
            torch.manual_seed(200 + rank)
            step = session.load(state)
        draw = torch.rand(3).tolist()
    write_gathered([{"rank": rank, "step": step, "draw": draw, "mine": mine.value}])


if __name__ == "__main__":
    main()
    exit_without_teardown(0)  # a clean end: no C++ teardown that can abort (ftrain.distributed)
