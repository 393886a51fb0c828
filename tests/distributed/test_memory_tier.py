"""The memory tier on 4 real gloo ranks under fsdp (2 "nodes" of 2): a rank that comes back as a
new process heals from its buddy's copy, bitwise as if nothing happened; a damaged copy, or a
rank lost together with its buddy, makes every rank fall back to storage (here: none, so fresh)."""

from __future__ import annotations

import json
import sys

import pytest

from ftrain.testbed.jobs import TINY_CONFIG, max_abs_diff, optimizer_tensors, run, train_job, worker_env

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def golden(tmp_path_factory):
    job = ("--train.steps=6", "--parallel.strategy=fsdp", "--optim.min_lr_ratio=1.0")  # as the worker trains
    return train_job(tmp_path_factory.mktemp("golden"), 4, *job).final


def _run(tmp_path, scenario: str) -> tuple[list[dict], str]:
    config = tmp_path / "config.toml"
    config.write_text(TINY_CONFIG)
    out = tmp_path / scenario
    out.mkdir()
    final = tmp_path / "final.pt"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
        "tests/distributed/memory_tier_worker.py", str(config), scenario, str(out), str(final),
    ]  # fmt: skip
    proc = run(cmd, timeout_s=240, env=worker_env())
    assert proc.returncode == 0, proc.stdout[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)], str(final)


def test_a_rank_that_comes_back_empty_heals_from_its_buddys_copy_bitwise(tmp_path, golden):
    import torch

    ranks, final = _run(tmp_path, "replaced")
    assert all(r["snapshots"][-1] == 4 for r in ranks), ranks  # every rank finished the step-4 snapshot
    assert [r["source"] for r in ranks] == ["memory_tier"] * 4 and {r["step"] for r in ranks} == {4}
    assert {r["cursor_step"] for r in ranks} == {4}
    state = torch.load(final, weights_only=False)
    assert max_abs_diff(state["model"], golden["model"]) == 0.0
    assert max_abs_diff(optimizer_tensors(state["optim"]), optimizer_tensors(golden["optim"])) == 0.0


def test_a_damaged_copy_is_refused_and_every_rank_falls_back_to_storage(tmp_path):
    ranks, _ = _run(tmp_path, "damaged")
    assert [r["source"] for r in ranks] == ["fresh"] * 4  # no checkpoint.uri: storage holds nothing
    assert {r["cursor_step"] for r in ranks} == {0}


def test_a_rank_lost_with_its_buddy_takes_its_shards_with_it(tmp_path):
    ranks, _ = _run(tmp_path, "pair_lost")
    assert [r["source"] for r in ranks] == ["fresh"] * 4
