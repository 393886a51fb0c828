"""A torchtitan-shaped model (``tests/titan_model.py``) through ``ftrain.models.titan:causal_lm``:
trained under tp and a two-stage pipeline to the same place as one process, with no wrapper of
the user's; and its fused-QKV build refused before the first step with the module named."""

from __future__ import annotations

import pytest

from ftrain.testbed.jobs import train_job
from tests.distributed.batched_runs import batched_runs
from tests.distributed.parity import assert_trains_alike

pytestmark = pytest.mark.dist

TITAN = (
    "--model.factory=ftrain.models.titan:causal_lm",
    "--model.args.builder=tests.titan_model:build",
    "--model.n_layer=4",
)


@pytest.mark.timeout(600)
def test_a_torchtitan_shaped_model_trains_under_tp_and_a_pipeline_like_one_process(golden, tmp_path_factory):
    ref = golden(1, *TITAN)
    assert ref.metrics[-1]["loss"] < ref.metrics[0]["loss"] - 0.3
    assert "layers.3.attention.wq.weight" in ref.final["model"]
    layouts = {"tp": ("--parallel.strategy=tp",), "pp2": ("--parallel.pp_size=2",)}
    # both two-rank runs in one torchrun launch (tests/distributed/batched_runs.py)
    runs = batched_runs(tmp_path_factory, {name: (2, (*TITAN, *o)) for name, o in layouts.items()})
    for name, overrides in layouts.items():
        assert_trains_alike(runs(name), ref, " ".join(overrides))


def test_its_fused_qkv_build_is_refused_at_start_with_the_module_and_the_fix(tmp_path):
    run = train_job(tmp_path, 1, *TITAN, "--model.args.fused=true", check=False, save_final=False)
    assert run.returncode != 0 and not run.metrics
    assert "module 'layers.0.attention.fused' (FusedQKVLinear)" in run.output, run.output[-3000:]
    assert "separate wq/wk/wv" in run.output
