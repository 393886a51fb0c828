"""examples/own_loop/train.py as bench/session.py runs each side of its pairs:

    torchrun --standalone --nproc-per-node=2 bench/lib/own_loop_sides.py {session|plain} [EXAMPLE_ARGS]

``session``: the example as it is (its ``ftrain.Session``); ``plain``: the same loop with the session
replaced by a stand-in that only joins torchrun's process group (no checkpoints, no heartbeat).
Either way the example's own ``main`` runs, and a run that returns ends its process the way
ftrain's workers do (:func:`ftrain.distributed.exit_without_teardown`): the bench times steps, and
gloo's threads can abort an interpreter's exit on CPU (about once in 25 runs under load here),
which would fail a pair whose figures were already printed. An error still exits non-zero."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import torch.distributed as dist

import ftrain
from ftrain.distributed import exit_without_teardown

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "own_loop" / "train.py"
SIDES = ("session", "plain")


class NoSession:
    """What the loop calls on a session, doing nothing but the process group's start and end."""

    restored = None

    def __init__(self, *_args: Any, **_kwargs: Any):
        pass

    def run(self, train: Any, *, warm_up: Any = None) -> Any:  # a plain loop keeps no spares to warm up
        self.start()
        try:
            return train(self)
        finally:
            self.close()

    def start(self) -> NoSession:
        dist.init_process_group("gloo")
        return self

    def load(self, _state: Any) -> int:
        return 0

    def step(self, _step: int, _state: Any, metrics: Any = None) -> bool:
        return False

    def finish(self, _step: int, _state: Any) -> None:
        return None

    def close(self) -> None:
        dist.barrier()
        dist.destroy_process_group()


def main(argv: list[str]) -> None:
    if not argv or argv[0] not in SIDES:
        raise SystemExit(f"usage: own_loop_sides.py {{{'|'.join(SIDES)}}} [EXAMPLE_ARGS]")
    if argv[0] == "plain":
        ftrain.Session = NoSession  # type: ignore[attr-defined,misc]  # the example looks it up when it runs
    spec = importlib.util.spec_from_file_location("own_loop_train", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(argv[1:])
    exit_without_teardown(0)


if __name__ == "__main__":
    main(sys.argv[1:])
