"""Both ``parallel.gradient_reduce`` modes train fsdp under accumulation to the same place (two
gloo ranks, the tiny config: global batch 16 = micro batch 2 x 2 ranks x 4 micro-batches; the
tolerance: tests/distributed/parity.py). The setting's checks and the plan:
tests/unit/test_gradient_reduce.py."""

from __future__ import annotations

import pytest

from tests.distributed.batched_runs import batched_runs
from tests.distributed.parity import assert_trains_alike

pytestmark = pytest.mark.dist


@pytest.mark.timeout(600)
def test_every_micro_batch_trains_like_last_micro_batch_and_ddp(golden, tmp_path_factory):
    ddp = golden(2)  # shared with other tests
    # both fsdp runs in one torchrun launch (tests/distributed/batched_runs.py)
    runs = batched_runs(
        tmp_path_factory,
        {
            mode: (2, ("--parallel.strategy=fsdp", f"--parallel.gradient_reduce={mode}"))
            for mode in ("last_micro_batch", "every_micro_batch")
        },
    )
    last, every = runs("last_micro_batch"), runs("every_micro_batch")
    assert every.metrics[0]["accum_steps"] == last.metrics[0]["accum_steps"] == 4
    assert_trains_alike(every, last, "fsdp every_micro_batch vs last_micro_batch")
    assert_trains_alike(every, ddp, "fsdp every_micro_batch vs ddp")
