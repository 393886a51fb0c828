"""The one parity check of the strategy, pipeline and model tests: two runs of the tiny config
followed the same trajectory.

Tolerance: fp32 on CPU. Strategies differ only in the order of floating-point sums (ring
all-reduce vs reduce-scatter vs tensor-parallel partial sums, per-stage sums of a pipeline), which
perturbs each gradient by a few ulps (~1e-7 relative). Over 10 AdamW steps at lr 1e-2 those
perturbations stay at the 1e-6 level; 2e-4 on parameters is 50x below the size of a single AdamW
update (lr = 1e-2), so a strategy that skips, doubles or mis-scales any gradient contribution
fails it, while reordering noise passes.
"""

from __future__ import annotations

from ftrain.testbed.jobs import RunResult, max_abs_diff, optimizer_tensors

PARAM_ATOL = 2e-4
LOSS_ATOL = 1e-4


def assert_trains_alike(run: RunResult, ref: RunResult, what: str) -> float:
    """Same losses step by step, same final parameters and optimizer state (within the tolerance);
    returns the largest parameter difference."""
    assert run.final is not None and ref.final is not None
    assert len(run.metrics) == len(ref.metrics) == 10
    for a, b in zip(run.metrics, ref.metrics, strict=True):
        assert abs(a["loss"] - b["loss"]) < LOSS_ATOL, f"{what}: step {a['step']} loss {a['loss']} vs {b['loss']}"
    diff = max_abs_diff(run.final["model"], ref.final["model"])
    assert diff < PARAM_ATOL, f"{what}: parameters differ by {diff}"
    odiff = max_abs_diff(optimizer_tensors(run.final["optim"]), optimizer_tensors(ref.final["optim"]))
    assert odiff < PARAM_ATOL, f"{what}: optimizer state differs by {odiff}"
    return diff
