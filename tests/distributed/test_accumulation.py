"""Gradient accumulation keeps the global batch fixed when the world size changes.

W=1 x A=4, W=2 x A=2 and W=4 x A=1 must consume exactly the same samples, step by step and in
the same global order (checked on the ledger each rank writes), and follow the same loss
trajectory within the reordering tolerance of tests/distributed/test_strategies.py.
"""

from __future__ import annotations

import pytest

from ftrain.data import check_exactly_once, read_ledger
from ftrain.testbed.jobs import train_job

pytestmark = pytest.mark.dist

GLOBAL_BATCH, MICRO = 8, 2


def _consumed(ledger_dir):
    """step -> sample ids in global micro-batch order, merged over ranks."""
    by_step: dict[int, dict[int, list[int]]] = {}
    for e in read_ledger(ledger_dir):
        chunks = [e["sample_ids"][i : i + MICRO] for i in range(0, len(e["sample_ids"]), MICRO)]
        for idx, chunk in zip(e["micro"], chunks, strict=True):
            by_step.setdefault(e["step"], {})[idx] = chunk
    return {s: [i for m in sorted(ms) for i in ms[m]] for s, ms in by_step.items()}


def test_world_sizes_consume_same_samples_and_follow_same_losses(tmp_path):
    runs = {}
    for world, accum in ((1, 4), (2, 2), (4, 1)):
        ledger = tmp_path / f"ledger-w{world}"
        run = train_job(
            tmp_path / f"w{world}",
            world,
            f"--train.global_batch_size={GLOBAL_BATCH}",
            f"--train.micro_batch_size={MICRO}",
            f"--data.ledger_dir={ledger}",
            save_final=False,
        )
        assert run.metrics[0]["accum_steps"] == accum
        report = check_exactly_once(
            read_ledger(ledger), num_samples=1_000_000, global_batch_size=GLOBAL_BATCH, seed=5, steps=10
        )
        assert report.ok, report.summary()
        runs[world] = (_consumed(ledger), [m["loss"] for m in run.metrics])
    samples_1, losses_1 = runs[1]
    assert len(samples_1) == 10 and all(len(v) == GLOBAL_BATCH for v in samples_1.values())
    for world in (2, 4):
        samples, losses = runs[world]
        assert samples == samples_1, f"W={world} consumed different samples"
        assert max(abs(a - b) for a, b in zip(losses, losses_1, strict=True)) < 1e-4, (world, losses, losses_1)
