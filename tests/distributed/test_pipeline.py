"""Pipeline parallelism trains the same model to the same place as single-process training,
under every schedule and combined with ddp, fsdp and tensor parallelism inside the stages.

Tolerance: tests/distributed/parity.py's. A pipeline changes only where gradients are
summed (per stage, then across data-parallel ranks) and the norm (a sum of per-stage squares):
reordering noise. A stage that drops, doubles or mis-scales a micro-batch's gradient, a loss
taken from the wrong ranks, or a norm of one stage only moves the trajectory far past it.
"""

from __future__ import annotations

import pytest

from tests.distributed.parity import assert_trains_alike

pytestmark = pytest.mark.dist

FOUR_BLOCKS = "--model.n_layer=4"  # two stages per rank need four blocks at pp=2


@pytest.fixture
def reference(golden):
    """Single process, the whole global batch accumulated on one rank."""
    return golden(1, FOUR_BLOCKS)


@pytest.mark.parametrize(
    ("nproc", "overrides"),
    [
        (2, ["--parallel.pp_size=2"]),  # 1f1b, the default schedule
        (2, ["--parallel.pp_size=2", "--parallel.pp_schedule=gpipe", "--parallel.pp_split=1"]),
        (2, ["--parallel.pp_size=2", "--parallel.pp_schedule=interleaved_1f1b", "--parallel.pp_virtual_stages=2"]),
        (4, ["--parallel.pp_size=2"]),  # pp=2 x dp=2 (ddp)
        (4, ["--parallel.pp_size=2", "--parallel.strategy=fsdp", "--parallel.activation_checkpointing=true"]),
        (4, ["--parallel.pp_size=2", "--parallel.strategy=fsdp+tp", "--parallel.tp_size=2"]),  # pp=2 x tp=2
    ],
    ids=["1f1b", "gpipe-split", "interleaved", "pp2xdp2", "pp2xfsdp2-ac", "pp2xtp2"],
)
def test_pipeline_matches_single_process(nproc, overrides, golden, reference):
    run = golden(nproc, FOUR_BLOCKS, *overrides)
    assert reference.metrics[-1]["loss"] < reference.metrics[0]["loss"] - 0.3  # the loss moves
    assert run.final["layout"]["pp_size"] == 2
    assert run.final["model"].keys() == reference.final["model"].keys()  # every stage's part, global names
    assert_trains_alike(run, reference, " ".join(overrides))
    for a, b in zip(run.metrics, reference.metrics, strict=True):
        assert abs(a["grad_norm"] - b["grad_norm"]) < 1e-3 * b["grad_norm"], "the norm is the whole model's"
        assert a["pp_size"] == 2 and len(a["rank_pp_bubble"]) == nproc
        assert all(0.0 <= x < 1.0 for x in a["rank_pp_bubble"])
