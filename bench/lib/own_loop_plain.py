"""examples/own_loop/train.py without ftrain: the same loop with ``ftrain.Session`` replaced by a
stand-in that only joins torchrun's process group (bench/session.py's baseline). Run it as the
example is run: ``torchrun --standalone --nproc-per-node=2 bench/lib/own_loop_plain.py [ARGS]``."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import torch.distributed as dist

import ftrain

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "own_loop" / "train.py"


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

    def step(self, _step: int, _state: Any) -> bool:
        return False

    def finish(self, _step: int, _state: Any) -> None:
        return None

    def close(self) -> None:
        dist.barrier()
        dist.destroy_process_group()


def main(argv: list[str]) -> None:
    ftrain.Session = NoSession  # type: ignore[attr-defined,misc]  # the example looks it up when it runs
    spec = importlib.util.spec_from_file_location("own_loop_train", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
