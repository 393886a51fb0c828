"""Every parallel strategy trains the same model to the same place as single-process training
(the tolerance: tests/distributed/parity.py)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from ftrain.testbed.jobs import RunResult
from tests.distributed.batched_runs import batched_runs
from tests.distributed.parity import assert_trains_alike

pytestmark = pytest.mark.dist


@pytest.fixture
def reference(golden):
    """Single process, the whole global batch accumulated on one rank (A = 8)."""
    return golden(1)


@pytest.fixture
def ddp(golden):
    return golden(2)


def test_ddp_two_ranks_matches_single_process(ddp, reference):
    assert ddp.metrics[0]["world_size"] == 2 and ddp.metrics[0]["accum_steps"] == 4
    assert reference.metrics[0]["accum_steps"] == 8
    # the loss must actually move, or matching trajectories would prove nothing
    assert reference.metrics[-1]["loss"] < reference.metrics[0]["loss"] - 0.3
    assert_trains_alike(ddp, reference, "ddp x2")


#: name -> (ranks, overrides): the runs of this file no other test shares (fsdp on 2 ranks is
#: test_checkpoint_resume's golden run too: it stays one); the cases of one world size share a
#: torchrun launch (tests/distributed/batched_runs.py)
RUNS: dict[str, tuple[int, tuple[str, ...]]] = {
    "zero1": (2, ("--parallel.strategy=zero1",)),
    "zero2": (2, ("--parallel.strategy=zero2",)),
    "tp": (2, ("--parallel.strategy=tp",)),
    "fsdp+ac+bf16": (
        2,
        ("--parallel.strategy=fsdp", "--parallel.activation_checkpointing=true", "--train.dtype=bf16"),
    ),
    "hsdp": (4, ("--parallel.strategy=hsdp",)),
    "fsdp+tp": (4, ("--parallel.strategy=fsdp+tp",)),
}


@pytest.fixture(scope="module")
def batched(tmp_path_factory) -> Callable[[str], RunResult]:
    return batched_runs(tmp_path_factory, RUNS)


@pytest.mark.timeout(900)  # the first case of a world size waits for all of that size's cases
@pytest.mark.parametrize(
    ("strategy", "nproc"),
    [("zero1", 2), ("zero2", 2), ("fsdp", 2), ("hsdp", 4), ("tp", 2), ("fsdp+tp", 4)],
)
def test_strategy_matches_ddp(strategy, nproc, ddp, golden, batched):
    run = golden(nproc, f"--parallel.strategy={strategy}") if strategy not in RUNS else batched(strategy)
    assert run.final["layout"]["strategy"] == strategy
    assert_trains_alike(run, ddp, strategy)


@pytest.mark.timeout(900)
def test_activation_checkpointing_and_bf16_train(ddp, batched):
    """bf16 compute (fp32 reduce) and recomputed activations still follow the fp32 trajectory."""
    run = batched("fsdp+ac+bf16")
    losses = [m["loss"] for m in run.metrics]
    ref = [m["loss"] for m in ddp.metrics]
    # bf16 has 8 bits of mantissa: loss agrees to ~1e-2, not bitwise
    assert max(abs(a - b) for a, b in zip(losses, ref, strict=True)) < 5e-2
    assert losses[-1] < losses[0] - 0.3
