"""Each rank's own entries of a session's state (:mod:`ftrain.session_per_rank`) across a change
of world size, on real gloo ranks: saved by two ranks, loaded by three. Ranks 0 and 1 get their
own RNG state and object back (each draws what it drew after the save: not one rank's state for
all); rank 2, which did not exist at the save, keeps what its loop built."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from ftrain.testbed.jobs import run, worker_env

pytestmark = pytest.mark.dist


def _launch(tmp_path, mode: str, nproc: int) -> list[dict]:
    out = tmp_path / f"{mode}.json"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
        "tests/distributed/session_per_rank_worker.py", mode, str(tmp_path / "ckpt"),
    ]  # fmt: skip
    proc = run(cmd, timeout_s=180, env=worker_env(OUT=str(out)))
    assert proc.returncode == 0, proc.stdout[-4000:]
    return [r for rank in json.loads(out.read_text()) for r in rank]


def test_each_rank_gets_its_own_entries_back_at_another_world_size(tmp_path):
    saved = {r["rank"]: r for r in _launch(tmp_path, "save", 2)}
    loaded = {r["rank"]: r for r in _launch(tmp_path, "load", 3)}
    assert saved[0]["draw"] != saved[1]["draw"]
    for rank in (0, 1):
        assert loaded[rank]["step"] == 1 and loaded[rank]["mine"] == rank * 10
        assert loaded[rank]["draw"] == saved[rank]["draw"], rank  # its own generator, as saved
    torch.manual_seed(202)
    assert loaded[2]["mine"] == -1 and loaded[2]["draw"] == torch.rand(3).tolist()  # the loop's own
