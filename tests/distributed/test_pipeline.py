"""Pipeline parallelism trains the same model to the same place as single-process training,
under every schedule and combined with ddp, fsdp and tensor parallelism inside the stages.

Tolerance: tests/distributed/test_strategies.py's. A pipeline changes only where gradients are
summed (per stage, then across data-parallel ranks) and the norm (a sum of per-stage squares):
reordering noise. A stage that drops, doubles or mis-scales a micro-batch's gradient, a loss
taken from the wrong ranks, or a norm of one stage only moves the trajectory far past it.
"""

from __future__ import annotations

import pytest

from ftrain.testbed.jobs import max_abs_diff, optimizer_tensors

pytestmark = pytest.mark.dist

PARAM_ATOL = 2e-4
LOSS_ATOL = 1e-4
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
    assert len(run.metrics) == len(reference.metrics) == 10
    for a, b in zip(run.metrics, reference.metrics, strict=True):
        assert abs(a["loss"] - b["loss"]) < LOSS_ATOL, f"step {a['step']}: loss {a['loss']} vs {b['loss']}"
        assert abs(a["grad_norm"] - b["grad_norm"]) < 1e-3 * b["grad_norm"], "the norm is the whole model's"
        assert a["pp_size"] == 2 and len(a["rank_pp_bubble"]) == nproc
        assert all(0.0 <= x < 1.0 for x in a["rank_pp_bubble"])
    diff = max_abs_diff(run.final["model"], reference.final["model"])
    assert diff < PARAM_ATOL, f"parameters differ by {diff}"
    odiff = max_abs_diff(optimizer_tensors(run.final["optim"]), optimizer_tensors(reference.final["optim"]))
    assert odiff < PARAM_ATOL, f"optimizer state differs by {odiff}"
