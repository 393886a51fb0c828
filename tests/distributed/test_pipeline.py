"""Pipeline parallelism trains the same model to the same place as single-process training,
under every schedule and combined with ddp, fsdp and tensor parallelism inside the stages.

Tolerance: tests/distributed/parity.py's. A pipeline changes only where gradients are
summed (per stage, then across data-parallel ranks) and the norm (a sum of per-stage squares):
reordering noise. A stage that drops, doubles or mis-scales a micro-batch's gradient, a loss
taken from the wrong ranks, or a norm of one stage only moves the trajectory far past it.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from ftrain.testbed.jobs import RunResult
from tests.distributed.batched_runs import batched_runs
from tests.distributed.parity import assert_trains_alike

pytestmark = pytest.mark.dist

FOUR_BLOCKS = "--model.n_layer=4"  # two stages per rank need four blocks at pp=2


@pytest.fixture
def reference(golden):
    """Single process, the whole global batch accumulated on one rank."""
    return golden(1, FOUR_BLOCKS)


#: name -> (ranks, overrides); the cases of one world size share a launch (tests/distributed/batched_runs.py)
PIPELINES: dict[str, tuple[int, tuple[str, ...]]] = {
    "1f1b": (2, ("--parallel.pp_size=2",)),  # the default schedule
    "gpipe-split": (2, ("--parallel.pp_size=2", "--parallel.pp_schedule=gpipe", "--parallel.pp_split=1")),
    "interleaved": (
        2,
        ("--parallel.pp_size=2", "--parallel.pp_schedule=interleaved_1f1b", "--parallel.pp_virtual_stages=2"),
    ),
    "pp2xdp2": (4, ("--parallel.pp_size=2",)),  # pp=2 x dp=2 (ddp)
    "pp2xfsdp2-ac": (
        4,
        ("--parallel.pp_size=2", "--parallel.strategy=fsdp", "--parallel.activation_checkpointing=true"),
    ),
    "pp2xtp2": (4, ("--parallel.pp_size=2", "--parallel.strategy=fsdp+tp", "--parallel.tp_size=2")),  # pp=2 x tp=2
}


@pytest.fixture(scope="module")
def pipeline_run(tmp_path_factory) -> Callable[[str], RunResult]:
    return batched_runs(tmp_path_factory, {n: (nproc, (FOUR_BLOCKS, *o)) for n, (nproc, o) in PIPELINES.items()})


@pytest.mark.timeout(900)  # the first case of a world size waits for all of that size's cases
@pytest.mark.parametrize("name", list(PIPELINES))
def test_pipeline_matches_single_process(name, pipeline_run, reference):
    nproc, overrides = PIPELINES[name]
    run = pipeline_run(name)  # also checks that it ran on its ranks and exited 0
    assert reference.metrics[-1]["loss"] < reference.metrics[0]["loss"] - 0.3  # the loss moves
    assert run.final["layout"]["pp_size"] == 2
    assert run.final["model"].keys() == reference.final["model"].keys()  # every stage's part, global names
    assert_trains_alike(run, reference, " ".join(overrides))
    for a, b in zip(run.metrics, reference.metrics, strict=True):
        assert abs(a["grad_norm"] - b["grad_norm"]) < 1e-3 * b["grad_norm"], "the norm is the whole model's"
        assert a["pp_size"] == 2 and len(a["rank_pp_bubble"]) == nproc
        assert all(0.0 <= x < 1.0 for x in a["rank_pp_bubble"])
