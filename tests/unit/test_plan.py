"""ftrain plan: memory formulas per strategy, parameter count, activations, recommendation, report."""

from __future__ import annotations

import dataclasses
import math
import sys
import textwrap

import pytest
import torch

from ftrain.config import Config, ConfigError, ModelConfig, ParallelConfig, TrainConfig
from ftrain.model import build_model, count_parameters
from ftrain.parallel.strategies.zero1 import zero1_partition
from ftrain.planning.memory import (
    GiB,
    Target,
    activation_bytes,
    activations,
    layout_for,
    model_stats,
    textbook_model_state_bytes,
)
from ftrain.planning.plan import PREFERENCE, estimate, estimate_all, recommend
from ftrain.planning.plan_report import plan_report
from tests.unit.saved_activations import saved_bytes

GPU_BF16 = Target("cuda", "bf16")
CPU_FP32 = Target("cpu", "fp32")

# Every dim 0 (vocab 256, seq 128, d_model 128, 4*d_model) is a multiple of 8: no FSDP padding.
SMALL = dict(vocab_size=256, seq_len=128, n_layer=4, n_head=8, d_model=128)


def _cfg(strategy: str = "ddp", *, train: dict | None = None, parallel: dict | None = None, **model) -> Config:
    return Config(
        train=TrainConfig(**(train or {})),
        model=ModelConfig(**(SMALL | model)),
        parallel=ParallelConfig(strategy=strategy, **(parallel or {})),
    )


def _est(cfg: Config, strategy: str, world: int, target: Target = GPU_BF16, gpus_per_node: int = 8):
    stats = model_stats(cfg.model, cfg.optim)
    layout = layout_for(cfg, strategy, world_size=world, gpus_per_node=gpus_per_node)
    return stats, estimate(stats, cfg, layout, target)


# ---------------------------------------------------------------------------------------------
# Parameter count and model states.


@pytest.mark.parametrize(
    "model", [SMALL, dict(vocab_size=1000, seq_len=33, n_layer=3, n_head=3, d_model=48, mlp_ratio=2)]
)
def test_param_count_on_meta_equals_the_real_model(model):
    cfg = ModelConfig(**model)
    assert model_stats(cfg).num_params == count_parameters(build_model(cfg))


def test_param_count_works_for_a_user_factory(tmp_path, monkeypatch):
    (tmp_path / "plan_factory_mod.py").write_text(
        textwrap.dedent("""
        from torch import nn
        def make(cfg):
            return nn.Sequential(nn.Embedding(cfg.vocab_size, cfg.d_model), nn.Linear(cfg.d_model, cfg.vocab_size))
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = ModelConfig(factory="plan_factory_mod:make", vocab_size=100, d_model=16)
    assert model_stats(cfg).num_params == 100 * 16 + 16 * 100 + 100
    sys.modules.pop("plan_factory_mod", None)


def test_ddp_holds_16_bytes_per_parameter():
    stats, e = _est(_cfg(), "ddp", 8)
    assert e.params_bytes == 4 * stats.num_params
    assert e.grads_bytes == 4 * stats.num_params
    assert e.optimizer_bytes == 8 * stats.num_params
    assert e.model_state_bytes == 16 * stats.num_params == e.textbook_model_state_bytes


def test_zero3_at_8_ranks_is_an_eighth_of_ddp():
    cfg = _cfg()
    _, ddp = _est(cfg, "ddp", 8)
    _, fsdp = _est(cfg, "fsdp", 8)
    assert fsdp.model_state_bytes * 8 == ddp.model_state_bytes
    assert fsdp.model_state_bytes == fsdp.textbook_model_state_bytes


def test_fsdp_pads_dim0_to_the_shard_count():
    # vocab 250 is not a multiple of 8: the embedding and head shards are ceil(250/8) = 32 rows.
    stats, e = _est(_cfg(vocab_size=250), "fsdp", 8)
    assert e.model_state_bytes > 16 * stats.num_params / 8
    padded = sum(math.ceil(p.shape[0] / 8) * math.prod(p.shape[1:]) for p in stats.params)
    assert e.params_bytes == 4 * padded


def test_zero1_textbook_formula_and_ours():
    stats, e = _est(_cfg(), "zero1", 8)
    psi = stats.num_params
    assert textbook_model_state_bytes("zero1", psi, shard=8) == 4 * psi + 12 * psi // 8
    assert e.textbook_model_state_bytes == 4 * psi + 12 * psi // 8
    # Ours: DDP keeps fp32 params and grads; ZeroRedundancyOptimizer shards m and v by whole parameters.
    share = max(zero1_partition(stats, 8))
    assert sum(zero1_partition(stats, 8)) == psi and share >= psi / 8
    assert e.model_state_bytes == 8 * psi + 8 * share


def test_zero1_partition_is_zero_redundancy_optimizers():
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from ftrain.optim import param_groups

    cfg = _cfg()
    with torch.device("meta"):
        model = build_model(cfg.model)
    zero = object.__new__(ZeroRedundancyOptimizer)  # no process group: only the partitioner runs
    zero.param_groups = param_groups(model, cfg.optim)
    zero.world_size = 3
    zero._partition_parameters_cache = []
    theirs = [sum(p.numel() for g in groups for p in g["params"]) for groups in zero._partition_parameters()]
    assert zero1_partition(model_stats(cfg.model, cfg.optim), 3) == theirs


def test_zero2_hsdp_tp_and_2d_model_states():
    cfg = _cfg()
    stats = model_stats(cfg.model)
    psi = stats.num_params
    assert _est(cfg, "zero2", 8)[1].model_state_bytes == 16 * psi // 8
    hsdp = _est(cfg, "hsdp", 8, gpus_per_node=4)[1]
    assert (hsdp.shard_size, hsdp.model_state_bytes) == (4, 16 * psi // 4)
    split = sum(p.numel for p in stats.params if p.tp_dim is not None)
    # q, k, v, fc (weights and biases) and out, proj weights; the rowwise biases stay replicated.
    d, L = cfg.model.d_model, cfg.model.n_layer
    assert split == L * (3 * (d * d + d) + (d * 4 * d + 4 * d) + d * d + 4 * d * d)
    tp = _est(cfg, "tp", 4)[1]
    assert tp.model_state_bytes == 16 * (split // 4 + psi - split) == tp.textbook_model_state_bytes
    two_d = _est(cfg, "fsdp+tp", 8)[1]
    assert (two_d.dp_size, two_d.tp_size) == (4, 2)
    assert two_d.model_state_bytes == 16 * (split // 2 + psi - split) // 4


def test_bf16_ddp_keeps_autocast_copies_of_linear_weights():
    stats, e = _est(_cfg(), "ddp", 8, GPU_BF16)
    assert e.transient_bytes == 2 * sum(p.numel for p in stats.params if p.autocast_copy)
    assert e.grads_in_backward_bytes == e.grads_bytes  # DDP's buckets persist
    _, fp32 = _est(_cfg(), "ddp", 8, CPU_FP32)
    assert fp32.transient_bytes == 0


def test_fsdp_gradient_accumulation_holds_unsharded_fp32_gradients():
    cfg = _cfg(train={"global_batch_size": 64, "micro_batch_size": 2})  # 4 micro-batches per rank at 8
    stats, e = _est(cfg, "fsdp", 8)
    _, single = _est(_cfg(train={"global_batch_size": 16, "micro_batch_size": 2}), "fsdp", 8)
    assert e.grads_in_backward_bytes == 0
    assert e.transient_bytes - single.transient_bytes == 4 * stats.num_params
    assert any("unsharded fp32 gradients" in n for n in e.notes)


def test_start_up_holds_the_full_model_for_ddp_and_the_shard_plus_the_largest_parameter_for_fsdp():
    # At 64 ranks the sharded states are small: a full fp32 build at start-up would set the peak.
    cfg = _cfg(vocab_size=32768, n_layer=8, n_head=8, d_model=1024, train={"micro_batch_size": 1})
    stats, e = _est(cfg, "fsdp", 64)
    largest = max(p.numel for p in stats.params)
    assert e.init_bytes == 4 * largest + e.params_bytes
    assert e.init_bytes < stats.num_params and e.phase != "init"
    _, d = _est(cfg, "ddp", 64)
    assert d.init_bytes >= 4 * stats.num_params


# ---------------------------------------------------------------------------------------------
# Activations, checked against the tensors autograd really saves (CPU).


@pytest.mark.parametrize("mode,dropout", [("fp32", 0.0), ("autocast", 0.0), ("fp32", 0.1)])
def test_activation_formula_matches_saved_tensors(mode, dropout):
    model = ModelConfig(vocab_size=64, seq_len=32, n_layer=2, n_head=4, d_model=64, dropout=dropout)
    predicted = activations(model, micro_batch=3, mode=mode, tp=1, device="cpu", checkpointing=False).saved_bytes
    measured = saved_bytes(model, 3, mode)
    assert predicted == pytest.approx(measured, rel=0.01)


def test_activation_checkpointing_and_tp_shrink_activations():
    model = ModelConfig(**SMALL)
    kw = dict(micro_batch=8, mode="mp", device="cuda")
    full = activation_bytes(model, tp=1, checkpointing=False, **kw)
    assert activation_bytes(model, tp=1, checkpointing=True, **kw) < full / 2
    assert activation_bytes(model, tp=4, checkpointing=False, **kw) < full
    # The logits: b*s*V in bf16 plus three fp32 copies' worth.
    acts = activations(model, tp=1, checkpointing=False, **kw)
    assert acts.loss_peak == 8 * 128 * 256 * 14
    assert acts.at_loss_backward == full


# ---------------------------------------------------------------------------------------------
# Recommendation and report.


def test_small_model_gets_ddp():
    cfg = _cfg()
    estimates, _ = estimate_all(model_stats(cfg.model), cfg, world_size=8, gpus_per_node=8, target=GPU_BF16)
    assert recommend(estimates, 80 * GiB).strategy == "ddp"


def test_large_model_on_small_memory_gets_a_sharded_strategy():
    # ~1.3B parameters: DDP needs ~21 GB of model states; 16 GiB forces sharding.
    cfg = _cfg(vocab_size=32768, seq_len=512, n_layer=24, n_head=16, d_model=2048, train={"micro_batch_size": 1})
    estimates, _ = estimate_all(model_stats(cfg.model), cfg, world_size=8, gpus_per_node=8, target=GPU_BF16)
    best = recommend(estimates, 16 * GiB)
    assert best is not None and best.strategy in ("zero2", "hsdp", "fsdp", "fsdp+tp")
    by_name = {e.strategy: e for e in estimates}
    assert not by_name["ddp"].fits(16 * GiB)
    # Preference order: nothing earlier in PREFERENCE fits.
    for s in PREFERENCE[: PREFERENCE.index(best.strategy)]:
        assert s not in by_name or not by_name[s].fits(16 * GiB)


def test_report_has_every_strategy_row_and_a_recommendation():
    report = plan_report(_cfg(), world_size=4, device_memory_bytes=80 * GiB, gpus_per_node=2)
    rows = [line.split("|")[1].strip() for line in report.splitlines() if line.startswith("| ")]
    assert rows[0] == "strategy"
    assert rows[1:] == ["ddp", "zero1", "zero2", "fsdp", "hsdp", "tp", "fsdp+tp"]
    assert "recommended: ddp" in report


def test_report_states_the_memory_tiers_host_memory_for_strategies_without_a_replica():
    cfg = _cfg()
    report = plan_report(cfg, world_size=4, device_memory_bytes=80 * GiB, gpus_per_node=2)
    tier = {line.split(":")[0].strip(" -"): line for line in report.splitlines() if "memory tier" in line}
    assert set(tier) == {"zero2", "fsdp", "hsdp", "tp", "fsdp+tp"}  # ddp and zero1 heal from a replica
    _, fsdp = _est(cfg, "fsdp", 4, gpus_per_node=2)
    state = fsdp.params_bytes + fsdp.optimizer_bytes
    assert (
        f"{2 * state / GiB:.1f} GiB per rank" in tier["fsdp"] or f"{2 * state / 2**20:.1f} MiB per rank" in tier["fsdp"]
    )
    off = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, memory_interval=0))
    assert "memory tier" not in plan_report(off, world_size=4, device_memory_bytes=80 * GiB, gpus_per_node=2)
    kept = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, memory_dir="/dev/shm"))
    report = plan_report(kept, world_size=4, device_memory_bytes=80 * GiB, gpus_per_node=2)
    assert "snapshots in /dev/shm (tmpfs: host memory), kept across restarts" in report


def test_report_skips_what_cannot_run_with_the_reason():
    report = plan_report(_cfg(n_head=6, d_model=96), world_size=4, device_memory_bytes=80 * GiB, gpus_per_node=4)
    assert "skipped tp: parallel.tp_size: 4 does not divide model.n_head=6" in report
    report = plan_report(_cfg(), world_size=1, device_memory_bytes=80 * GiB)
    assert "skipped hsdp" in report and "skipped fsdp+tp" in report


def test_report_says_when_nothing_fits_and_what_would():
    cfg = _cfg(vocab_size=32768, seq_len=2048, n_layer=24, n_head=16, d_model=2048, train={"micro_batch_size": 8})
    report = plan_report(cfg, world_size=8, device_memory_bytes=16 * GiB, gpus_per_node=8)
    assert "recommended: none" in report
    assert "--parallel.activation_checkpointing=true" in report or "--train.micro_batch_size=" in report
    # A model whose fp32 copy alone (157 GiB) is ten times the device is helped by more ranks: no
    # rank builds it whole at start-up (ftrain.models.deferred_init)
    huge = _cfg(
        vocab_size=32768,
        seq_len=512,
        n_layer=48,
        n_head=32,
        d_model=8192,
        train={"micro_batch_size": 1},
        parallel={"activation_checkpointing": True},
    )
    report = plan_report(huge, world_size=8, device_memory_bytes=16 * GiB)
    assert "recommended: none" in report and "64 ranks: fsdp+tp fits" in report, report


def test_cpu_plan_counts_the_process_baseline():
    cfg = _cfg(train={"device": "cpu"})
    report = plan_report(cfg, world_size=2, device_memory_bytes=8 * GiB)
    assert "target: cpu fp32" in report
    _, e = _est(cfg, "ddp", 2, CPU_FP32)
    assert e.overhead_bytes > 200 * 10**6


def test_bad_world_size_is_a_config_error():
    with pytest.raises(ConfigError):
        plan_report(_cfg(), world_size=0, device_memory_bytes=GiB)
