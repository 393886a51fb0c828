"""examples/hf_trainer/train.py with a callback that writes (rank 0) the optimizer state, the
scheduler state and the step that training starts from (``begin.pt``) and that each save holds
(``step-N.pt``), for tests/integration/test_hf_trainer.py:

    torchrun ... tests/integration/hf_trainer_probe.py OUT_DIR EVERY -- <the example's arguments>
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "hf_trainer" / "train.py"


class Dump(TrainerCallback):
    def __init__(self, out: Path, every: int):
        self.out, self.every = out, every

    def _write(self, name: str, state: Any, optimizer: Any, lr_scheduler: Any) -> None:
        if state.is_world_process_zero:
            got = {"step": state.global_step, "optim": optimizer.state_dict(), "sched": lr_scheduler.state_dict()}
            torch.save(got, self.out / f"{name}.tmp")
            os.replace(self.out / f"{name}.tmp", self.out / name)

    def on_train_begin(self, args, state, control, optimizer=None, lr_scheduler=None, **kwargs):
        self._write("begin.pt", state, optimizer, lr_scheduler)

    def on_step_end(self, args, state, control, optimizer=None, lr_scheduler=None, **kwargs):
        if state.global_step % self.every == 0:
            self._write(f"step-{state.global_step}.pt", state, optimizer, lr_scheduler)


if __name__ == "__main__":
    out, every, sep, *rest = sys.argv[1:]
    assert sep == "--", sys.argv
    Path(out).mkdir(parents=True, exist_ok=True)
    spec = importlib.util.spec_from_file_location("hf_trainer_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    example.main(rest, callbacks=[Dump(Path(out), int(every))])
