"""``parallel.deterministic = true``: bitwise identical training at any world size.

Global batch 12 of micro-batches of 1 gives A = 12, 6, 3 at 1, 2, 4 ranks, so the ranks'
blocks are not all aligned subtrees of the reduction tree (6 and 3 are not powers of two): the
segment-tree cover is exercised, not only the easy case. At 5 ranks, which do not divide 12, the
blocks are uneven (2, 2, 3, 2, 3 micro-batches): a job that shrinks to such a size stays exact.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from ftrain.testbed.jobs import RunResult, optimizer_tensors
from tests.distributed.batched_runs import batched_runs

pytestmark = pytest.mark.dist


DETERMINISTIC = (
    "--parallel.deterministic=true",
    "--train.global_batch_size=12",
    "--train.micro_batch_size=1",
    "--train.steps=6",
)


#: the control's overrides: DETERMINISTIC without the fixed order
PLAIN = DETERMINISTIC[1:]


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory) -> Callable[[str], RunResult]:
    """The two 1-rank runs of this file (no other test shares them), ``deterministic`` and
    ``plain``, in ONE torchrun launch (tests/distributed/batched_runs.py): starting a rank and
    importing torch is most of such a run's time here. The runs of 2, 4 and 5 ranks stay the
    session's golden runs (4 ranks deterministic is test_checkpoint_resume's too)."""
    return batched_runs(tmp_path_factory, {"deterministic": (1, DETERMINISTIC), "plain": (1, PLAIN)})


@pytest.mark.timeout(600)  # the first 1-rank case waits for both
def test_one_two_four_and_five_ranks_are_bitwise_identical(golden, one_rank):
    finals = {}
    for world in (1, 2, 4, 5):
        run = one_rank("deterministic") if world == 1 else golden(world, *DETERMINISTIC)
        assert run.metrics[0]["accum_steps"] == 12 // world
        finals[world] = run
    ref = finals[1]
    for world in (2, 4, 5):
        run = finals[world]
        assert [m["loss"] for m in run.metrics] == [m["loss"] for m in ref.metrics], world
        for name, tensor in ref.final["model"].items():
            assert torch.equal(run.final["model"][name], tensor), f"W={world}: parameter {name} differs"
        ref_opt, opt = optimizer_tensors(ref.final["optim"]), optimizer_tensors(run.final["optim"])
        assert opt.keys() == ref_opt.keys() and opt
        for name, tensor in ref_opt.items():
            assert torch.equal(opt[name], tensor), f"W={world}: optimizer state {name} differs"


@pytest.mark.timeout(600)
def test_plain_ddp_is_not_bitwise_across_world_sizes(golden, one_rank):
    """The control: without the fixed order, 1 and 4 ranks differ in the last bits — so the
    test above proves something."""
    plain = PLAIN
    a = one_rank("plain")
    b = golden(4, *plain)
    assert any(not torch.equal(a.final["model"][k], b.final["model"][k]) for k in a.final["model"])
