"""Parallel layouts and the LR schedule: pure functions."""

from __future__ import annotations

import math

import pytest

from ftrain.config import ConfigError, OptimConfig, ParallelConfig
from ftrain.optim import lr_at, peak_lr
from ftrain.parallel.strategies import compute_layout


def layout(strategy, world, rank=0, local=None, n_head=4, **kw):
    return compute_layout(
        ParallelConfig(strategy=strategy, **kw),
        world_size=world,
        rank=rank,
        local_world_size=local or world,
        n_head=n_head,
    )


def test_fsdp_tp_grid_assigns_data_ranks_by_row():
    ranks = [layout("fsdp+tp", 8, rank=r, tp_size=2) for r in range(8)]
    assert [(lo.dp_rank, lo.tp_rank) for lo in ranks] == [(r // 2, r % 2) for r in range(8)]
    assert ranks[0].dp_size == 4 and ranks[0].mesh_shape == ((4, 2), ("dp", "tp"))


def test_hsdp_shards_within_a_node_and_replicates_across():
    lo = layout("hsdp", 8, local=4)
    assert lo.mesh_shape == ((2, 4), ("replicate", "shard")) and lo.dp_size == 8


def test_tp_uses_every_rank_and_reads_one_data_stream():
    lo = layout("tp", 4)
    assert lo.dp_size == 1 and lo.tp_size == 4


@pytest.mark.parametrize(
    ("strategy", "world", "kw", "key"),
    [
        ("hsdp", 6, {"shard_size": 4}, "parallel.shard_size"),
        ("tp", 4, {"tp_size": 2}, "parallel.tp_size"),
        ("fsdp+tp", 6, {"tp_size": 4}, "parallel.tp_size"),
    ],
)
def test_impossible_layouts_name_the_key(strategy, world, kw, key):
    with pytest.raises(ConfigError) as err:
        layout(strategy, world, **kw)
    assert err.value.key == key


def test_tp_needs_heads_divisible():
    with pytest.raises(ConfigError, match="n_head"):
        layout("tp", 3, n_head=4)


def test_schedule_warms_up_then_decays_to_the_floor():
    kw = dict(peak=1.0, warmup_steps=10, total_steps=110, min_lr_ratio=0.1)
    assert lr_at(0, **kw) == pytest.approx(0.1)
    assert lr_at(9, **kw) == pytest.approx(1.0)
    assert lr_at(60, **kw) == pytest.approx(0.55)
    assert lr_at(110, **kw) == pytest.approx(0.1)
    assert all(lr_at(s, **kw) >= lr_at(s + 1, **kw) for s in range(10, 120))


def test_lr_scaling_by_data_parallel_size():
    assert peak_lr(OptimConfig(lr=1.0, lr_scaling="linear", base_world_size=2), 8) == 4.0
    assert peak_lr(OptimConfig(lr=1.0, lr_scaling="sqrt"), 16) == 4.0
    assert peak_lr(OptimConfig(lr=1.0), 16) == 1.0
    assert math.isfinite(peak_lr(OptimConfig(lr=1.0, lr_scaling="sqrt"), 1))
