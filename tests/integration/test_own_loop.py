"""examples/own_loop/train.py, a plain PyTorch loop (a Hugging Face Llama under FSDP2) with
ftrain.Session, run as a user runs it: ``torchrun --standalone`` with its defaults, from a
directory of its own. Run straight, and stopped then run again, it ends with the same weights
bit for bit; run again with more steps on another number of processes, it goes on from its
newest step."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

from ftrain.testbed.jobs import max_abs_diff, run, worker_env
from ftrain.testbed.procs import REPO

pytestmark = pytest.mark.timeout(400)

EXAMPLE = REPO / "examples" / "own_loop" / "train.py"


def _torchrun(cwd: Path, nproc: int, *args: str) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", str(EXAMPLE)]
    out = run([*cmd, *args], timeout_s=180, cwd=cwd, env=worker_env())
    assert out.returncode == 0, out.stdout[-4000:]
    return out.stdout


def _committed(cwd: Path) -> list[int]:
    return sorted(int(p.parent.name.split("-")[1]) for p in (cwd / "runs/own_loop/ckpt").glob("step-*/manifest.json"))


def test_the_example_resumes_where_it_stopped_bitwise_and_at_another_world_size(tmp_path):
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    straight.mkdir()
    stopped.mkdir()
    out = _torchrun(straight, 2, "--final-weights", "final.pt")  # its defaults: 60 steps, a save every 20
    assert "training steps 1..60 on 2 process(es)" in out and "step 60 loss" in out, out
    assert _committed(straight) == [20, 40, 60]
    losses = [float(x) for x in re.findall(r"step \d+ loss ([0-9.]+)", out)]
    assert losses[-1] < losses[0] / 4, losses  # it learns the counting pattern

    _torchrun(stopped, 2, "--steps", "30")
    assert _committed(stopped) == [20, 30]
    out = _torchrun(stopped, 2, "--final-weights", "final.pt")
    assert "resumed after step 30; training steps 31..60" in out, out
    a, b = (torch.load(d / "final.pt", weights_only=True) for d in (straight, stopped))
    assert max_abs_diff(a, b) == 0.0

    out = _torchrun(stopped, 1, "--steps", "70")  # one process now: DCP reshards the FSDP state
    assert "resumed after step 60; training steps 61..70 on 1 process(es)" in out and "step 70 loss" in out, out
    assert _committed(stopped)[-1] == 70
