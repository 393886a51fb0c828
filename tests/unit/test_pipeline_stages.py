"""Pipeline layouts without processes: which blocks make each stage, which rank runs it, where a
rank sits in the pp x dp x tp grid, and the config errors that name the key to fix."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ftrain.checkpointing import load_target
from ftrain.config import ConfigError, ParallelConfig, load_config
from ftrain.parallel.pipeline_stages import at_world, local_stages, pipeline_degree, stage_blocks
from ftrain.parallel.strategies import compute_layout, fixed_tp_size, full_replica


def blocks(n_layer: int, **kw) -> list[list[int]]:
    return [list(r) for r in stage_blocks(ParallelConfig(**kw), n_layer)]


def test_blocks_spread_evenly_the_first_stages_taking_one_more():
    assert blocks(4, pp_size=2) == [[0, 1], [2, 3]]
    assert blocks(7, pp_size=3) == [[0, 1, 2], [3, 4], [5, 6]]
    assert blocks(8, pp_size=2, pp_schedule="interleaved_1f1b") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert blocks(6, pp_size=3, pp_split="1,5") == [[0], [1, 2, 3, 4], [5]]


def test_a_rank_runs_every_pp_size_th_stage():
    assert local_stages(0, 2, 2) == [0, 2] and local_stages(1, 2, 2) == [1, 3]
    assert local_stages(3, 4, 1) == [3]


@pytest.mark.parametrize(
    ("settings", "n_layer", "key", "says"),
    [
        ({"pp_size": 0}, 4, "parallel.pp_size", ">= 1"),
        ({"pp_size": 4}, 3, "parallel.pp_size", "model.n_layer=3"),
        ({"pp_size": 2, "pp_split": "2,3"}, 4, "parallel.pp_split", "give 1"),
        ({"pp_size": 2, "pp_split": "x"}, 4, "parallel.pp_split", "block indices"),
        ({"pp_size": 2, "pp_split": "4"}, 4, "parallel.pp_split", "does not exist"),
        ({"pp_size": 3, "pp_split": "2,1"}, 4, "parallel.pp_split", "increasing"),
        ({"pp_split": "2"}, 4, "parallel.pp_split", "without a pipeline"),
        (
            {"pp_size": 2, "pp_schedule": "interleaved_1f1b", "pp_virtual_stages": 1},
            4,
            "parallel.pp_virtual_stages",
            "at least 2",
        ),
        ({"pp_size": 2, "pp_virtual_stages": 2}, 4, "parallel.pp_virtual_stages", "one chunk"),
        ({"pp_size": 2, "strategy": "zero1"}, 4, "parallel.strategy", "use one of ddp, fsdp"),
        ({"pp_size": 2, "deterministic": True}, 4, "parallel.deterministic", "pp_size = 1"),
    ],
)
def test_pipeline_settings_that_cannot_work_name_their_key(settings, n_layer, key, says):
    overrides = [f"--parallel.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in settings.items()]
    with pytest.raises(ConfigError, match=says) as e:
        load_config(None, [*overrides, f"--model.n_layer={n_layer}"])
    assert e.value.key == key


def test_the_grid_puts_the_pipeline_outermost_and_the_strategy_inside_each_stage():
    parallel = ParallelConfig(strategy="fsdp+tp", tp_size=2, pp_size=2)
    grid = [compute_layout(parallel, world_size=8, rank=r, local_world_size=4, n_head=4) for r in range(8)]
    assert [(lo.pp_rank, lo.dp_rank, lo.tp_rank) for lo in grid] == [(r // 4, (r % 4) // 2, r % 2) for r in range(8)]
    assert {(lo.world_size, lo.dp_size, lo.tp_size, lo.pp_size) for lo in grid} == {(8, 2, 2, 2)}
    assert grid[0].mesh_shape == ((2, 2), ("dp", "tp"))  # one stage's mesh: the job's adds pp
    assert [lo.reads_data for lo in grid] == [True, False, True, False, False, False, False, False]
    assert grid[0].loss_ranks() == [(4, 0), (6, 1)]  # the last stage's first tensor-parallel ranks
    assert fixed_tp_size(parallel) == 2 and pipeline_degree(parallel, 8) == 2 and pipeline_degree(parallel, 6) is None
    with pytest.raises(ConfigError, match="multiple of 2 ranks") as e:
        compute_layout(ParallelConfig(pp_size=2), world_size=3, rank=0, local_world_size=3, n_head=4)
    assert e.value.key == "parallel.pp_size"


def test_a_stage_is_no_full_replica_and_replicas_are_per_stage():
    ddp = compute_layout(ParallelConfig(), world_size=2, rank=1, local_world_size=2, n_head=4)
    piped = compute_layout(ParallelConfig(pp_size=2), world_size=4, rank=3, local_world_size=2, n_head=4)
    assert full_replica(ddp) and not full_replica(piped)
    assert fixed_tp_size(ParallelConfig()) == 1 and fixed_tp_size(ParallelConfig(strategy="fsdp+tp")) == 2


def test_a_world_the_pipeline_does_not_tile_runs_at_the_first_fallback_that_does():
    parallel = ParallelConfig(pp_size=4, pp_fallback="2,1")
    assert [pipeline_degree(parallel, n) for n in (8, 4, 6, 2, 3, 1)] == [4, 4, 2, 2, 1, 1]
    assert at_world(parallel, 6).pp_size == 2 and at_world(parallel, 6).pp_fallback == ""
    assert at_world(ParallelConfig(pp_size=2), 3) == ParallelConfig(pp_size=2)  # no fallbacks: as it is
    with pytest.raises(ConfigError, match="tiles a world of 3 ranks") as e:
        at_world(ParallelConfig(pp_size=4, pp_fallback="2"), 3)
    assert e.value.key == "parallel.pp_size"
    for bad, says in (("x", "degrees like"), ("4", "other than"), ("0", ">= 1"), ("2,2", "distinct")):
        with pytest.raises(ConfigError, match=says) as e:
            load_config(None, ["--parallel.pp_size=4", f"--parallel.pp_fallback={bad}"])
        assert e.value.key == "parallel.pp_fallback"
    with pytest.raises(ConfigError, match="fits one stage count") as e:
        load_config(None, ["--parallel.pp_size=2", "--parallel.pp_fallback=1", "--parallel.pp_split=1"])
    with pytest.raises(ConfigError, match="model.n_layer=4") as e:  # every fallback must split the blocks
        load_config(None, ["--parallel.pp_size=2", "--parallel.pp_fallback=8", "--model.n_layer=4"])


def test_a_step_saved_before_flat_optimizer_state_is_refused_at_pp_with_the_fix():
    piped = compute_layout(ParallelConfig(pp_size=2), world_size=2, rank=0, local_world_size=2, n_head=4)
    manifest = SimpleNamespace(step=40, world_size=2, layout={"strategy": "ddp"})  # no optimizer_state key
    with pytest.raises(ConfigError, match="resume it once with parallel.pp_size=1") as e:
        load_target(SimpleNamespace(layout=piped), 0, manifest)  # type: ignore[arg-type]
    assert e.value.key == "parallel.pp_size"
