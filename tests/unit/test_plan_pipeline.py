"""ftrain plan under pipeline parallelism: per-stage parameters and activations, the bubble, the report."""

from __future__ import annotations

import dataclasses

import pytest

from ftrain.config import Config, ConfigError, ModelConfig, ParallelConfig, TrainConfig
from ftrain.parallel.pipeline_stages import stage_blocks
from ftrain.planning.memory import GiB, Target, activations, layout_for, model_stats
from ftrain.planning.plan import estimate, estimate_all
from ftrain.planning.plan_pipeline import stage_estimates
from ftrain.planning.plan_report import plan_report
from ftrain.planning.stages import p2p_buffer_bytes, stage_stats

GPU_BF16 = Target("cuda", "bf16")

# Every dim 0 a multiple of 8 (no FSDP padding); 8 blocks split into up to 8 stages.
SMALL = dict(vocab_size=256, seq_len=128, n_layer=8, n_head=8, d_model=128)


def _cfg(strategy: str = "ddp", *, train: dict | None = None, model: dict | None = None, **parallel) -> Config:
    return Config(
        train=TrainConfig(**({"global_batch_size": 64, "micro_batch_size": 4} | (train or {}))),
        model=ModelConfig(**(SMALL | (model or {}))),
        parallel=ParallelConfig(strategy=strategy, **parallel),
    )


def _stage_numel(cfg: Config, pp_rank: int) -> int:
    stats = model_stats(cfg.model, cfg.optim)
    pp = cfg.parallel.pp_size
    v = len(stage_blocks(cfg.parallel, stats.num_blocks)) // pp
    return stage_stats(stats, stage_blocks(cfg.parallel, stats.num_blocks), list(range(pp_rank, pp * v, pp))).num_params


# ---------------------------------------------------------------------------------------------
# Parameters per stage.


@pytest.mark.parametrize(
    "parallel",
    [
        dict(pp_size=2),
        dict(pp_size=4),
        dict(pp_size=2, pp_schedule="interleaved_1f1b"),
        dict(pp_size=3, pp_split="1,7"),  # uneven: 1, 6 and 1 blocks
        dict(pp_size=2, pp_schedule="gpipe"),
    ],
)
def test_stage_parameters_add_up_to_the_model(parallel):
    cfg = _cfg("ddp", **parallel)
    psi = model_stats(cfg.model).num_params
    found = stage_estimates(cfg, world_size=4 * cfg.parallel.pp_size)
    assert [e.pp_rank for e in found] == list(range(cfg.parallel.pp_size))
    assert sum(e.params_bytes for e in found) == 4 * psi  # ddp replicates: 4 bytes per stage parameter
    assert all(e.model_state_bytes == 16 * e.params_bytes // 4 for e in found)


def test_embeddings_go_with_the_first_stage_and_the_head_with_the_last():
    cfg = _cfg(pp_size=2, pp_schedule="interleaved_1f1b")  # rank 0: stages 0, 2; rank 1: stages 1, 3
    stats = model_stats(cfg.model)
    blocks = stage_blocks(cfg.parallel, 8)
    first, last = (stage_stats(stats, blocks, [r, r + 2]) for r in (0, 1))
    names = lambda s: {p.name.split(".")[0] for p in s.params}  # noqa: E731
    assert names(first) == {"tok_emb", "pos_emb", "blocks"} and names(last) == {"blocks", "ln_f", "head"}
    assert {p.name.split(".")[1] for p in first.params if p.unit >= 0} == {"0", "1", "4", "5"}
    assert sorted({p.unit for p in first.params if p.unit >= 0}) == [0, 1, 2, 3]  # FSDP units renumbered
    assert first.num_blocks == last.num_blocks == 4


def test_fsdp_shards_a_stage_over_its_data_parallel_ranks():
    cfg = _cfg("fsdp", pp_size=2)
    found = stage_estimates(cfg, world_size=8)  # 4 ranks per stage
    assert [e.dp_size for e in found] == [4, 4]
    for e in found:
        assert e.params_bytes == 4 * _stage_numel(cfg, e.pp_rank) // 4
        assert any("unsharded" in n for n in e.notes)  # torch's stage keeps FSDP2 units gathered
        # ... bf16, and their fp32 gradients, from the first backward on; beside the P2P buffers.
        buffers = p2p_buffer_bytes(cfg, "mp", [e.pp_rank], 2, 4)  # m = 64 / (4 x 4)
        assert e.transient_bytes >= (2 + 4) * _stage_numel(cfg, e.pp_rank) + buffers


def test_start_up_holds_the_stage_and_its_largest_parameter_made_whole_on_a_gpu_and_a_cpu():
    cfg = _cfg(pp_size=2)
    stats = model_stats(cfg.model)
    largest = max(p.numel for p in stats.params)  # the embedding in stage 0, the head (same shape) in stage 1
    gpu = stage_estimates(cfg, world_size=4)
    assert [e.init_bytes for e in gpu] == [4 * _stage_numel(cfg, r) + 4 * largest for r in range(2)]
    cpu = stage_estimates(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, device="cpu")), world_size=4)
    assert [e.init_bytes for e in cpu] == [e.init_bytes for e in gpu]
    assert all(e.init_bytes < 4 * stats.num_params for e in cpu)  # no rank builds the whole model


# ---------------------------------------------------------------------------------------------
# Activations and buffers.


def _acts(cfg: Config, n_layer: int):
    """The whole-model activation model of an ``n_layer``-block GPT of these sizes, under bf16 autocast."""
    model = dataclasses.replace(cfg.model, n_layer=n_layer)
    kw = dict(mode="autocast", tp=1, device="cuda", checkpointing=False)
    return activations(model, micro_batch=cfg.train.micro_batch_size, **kw)


def test_1f1b_first_stage_holds_more_activations_than_the_last():
    cfg = _cfg(pp_size=4)  # 2 blocks a stage; m = 64 / (4 x 2) = 8 micro-batches per step
    found = stage_estimates(cfg, world_size=8)
    assert [e.in_flight for e in found] == [4, 3, 2, 1]
    assert found[0].activation_bytes > found[-1].activation_bytes
    boundary = 4 * 128 * 128 * 4  # micro 4 x seq x d_model, the fp32 residual stream under autocast
    assert found[0].activation_bytes == 4 * (2 * _acts(cfg, 1).layers + boundary)  # 4 in flight
    # The last stage: one micro-batch in flight, with the final norm and the loss, as the whole
    # model's count for a 2-block model.
    assert found[-1].activation_bytes == _acts(cfg, 2).at_loss_backward


def test_gpipe_holds_every_micro_batch_on_every_stage():
    found = stage_estimates(_cfg(pp_size=2, pp_schedule="gpipe"), world_size=4)  # m = 8
    assert [e.in_flight for e in found] == [8, 8]
    onef = stage_estimates(_cfg(pp_size=2), world_size=4)
    assert all(g.activation_bytes > o.activation_bytes for g, o in zip(found, onef, strict=True))


def test_p2p_buffers_per_stage():
    cfg = _cfg(pp_size=4)
    boundary = 4 * 128 * 128 * 4
    # first: output-gradient buffers; middle: input buffers, their gradients, output gradients; last: inputs
    assert [p2p_buffer_bytes(cfg, "autocast", [s], 4, 8) for s in range(4)] == [
        8 * boundary,
        3 * 8 * boundary,
        3 * 8 * boundary,
        2 * 8 * boundary,
    ]
    assert p2p_buffer_bytes(cfg, "mp", [0, 2], 4, 8) == (1 + 3) * 8 * boundary // 2  # bf16 residual stream


def test_bubble_rides_on_every_stage_estimate():
    assert [e.bubble_fraction for e in stage_estimates(_cfg(pp_size=4), world_size=8)] == pytest.approx([3 / 11] * 4)
    interleaved = stage_estimates(_cfg(pp_size=4, pp_schedule="interleaved_1f1b"), world_size=8)
    assert interleaved[0].bubble_fraction == pytest.approx(3 / 19)


def test_without_a_pipeline_one_estimate_as_before():
    cfg = _cfg("fsdp")
    stats = model_stats(cfg.model, cfg.optim)
    assert stage_estimates(cfg, world_size=8) == [
        estimate(stats, cfg, layout_for(cfg, "fsdp", world_size=8, gpus_per_node=8), GPU_BF16)
    ]


def test_a_micro_batch_count_torch_refuses_is_a_config_error():
    cfg = _cfg(pp_size=4, train={"global_batch_size": 16})  # 16 / (4 x 2) = 2 micro-batches < 4 stages
    with pytest.raises(ConfigError) as e:
        stage_estimates(cfg, world_size=8)
    assert e.value.key == "train.micro_batch_size"
    with pytest.raises(ConfigError):
        plan_report(cfg, world_size=8, device_memory_bytes=80 * GiB)


# ---------------------------------------------------------------------------------------------
# Recommendation and report.

# ~168M parameters: 4 bytes each (672 MB) on every rank at start-up without a pipeline.
WIDE = dict(vocab_size=32768, seq_len=256, n_layer=8, n_head=8, d_model=1024)


def test_a_pipeline_is_recommended_when_nothing_fits_without_one():
    # holding the accumulated gradients unsharded (with every_micro_batch, fsdp fits at 2 GiB)
    cfg = _cfg(model=WIDE, train={"micro_batch_size": 1}, gradient_reduce="last_micro_batch")
    memory = 2 * GiB
    estimates, _ = estimate_all(model_stats(cfg.model), cfg, world_size=8, gpus_per_node=8, target=GPU_BF16)
    assert not any(e.fits(memory) for e in estimates)
    report = plan_report(cfg, world_size=8, device_memory_bytes=memory)
    assert "recommended: none" in report
    line = next(line for line in report.splitlines() if "set parallel.pp_size=" in line)
    assert "set parallel.pp_size=2 (a 1f1b pipeline): fsdp fits on every stage" in line
    piped = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, pp_size=2, strategy="fsdp"))
    assert all(e.fits(memory) for e in stage_estimates(piped, world_size=8))


def test_no_pipeline_is_suggested_when_something_fits():
    report = plan_report(_cfg(model=WIDE, train={"micro_batch_size": 1}), world_size=8, device_memory_bytes=80 * GiB)
    assert "pp_size" not in report


def test_report_has_a_row_per_pipeline_rank_and_the_bubble():
    report = plan_report(_cfg("fsdp", pp_size=4), world_size=8, device_memory_bytes=80 * GiB)
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in report.splitlines() if line.startswith("| ")]
    assert rows[0][:4] == ["pp rank", "stages", "layout", "in flight"]
    assert [r[0] for r in rows[1:]] == ["0", "1", "2", "3"]
    assert rows[1][1] == "0: blocks 0-1 + embeddings" and rows[4][1] == "3: blocks 6-7 + head"
    assert [r[2] for r in rows[1:]] == ["dp=2"] * 4 and [r[3] for r in rows[1:]] == ["4", "3", "2", "1"]
    assert "bubble: 27.3% of every rank's step idle (1f1b, p=4 ranks, m=8 micro-batch(es)" in report
    assert "the textbook (p-1)/(m+p-1) agrees" in report
    assert "recommended: fsdp in a 4-stage pipeline fits on every stage" in report


def test_report_gives_the_simulated_bubble_where_the_textbook_one_is_too_low():
    cfg = _cfg(pp_size=4, pp_schedule="interleaved_1f1b", train={"global_batch_size": 16})  # m = 2 < 4 ranks
    line = next(line for line in plan_report(cfg, world_size=8).splitlines() if line.startswith("bubble:"))
    assert line.startswith("bubble: 55.6% of every rank's step idle")  # simulate("interleaved_1f1b", 4, 2, 2)
    assert "the textbook (p-1)/(v*m+p-1) says 42.9%" in line


def test_report_says_when_a_stage_does_not_fit():
    cfg = _cfg("ddp", pp_size=2, model=WIDE, train={"micro_batch_size": 1})
    report = plan_report(cfg, world_size=8, device_memory_bytes=2 * GiB)
    assert "recommended: none: pipeline rank" in report
    assert "--parallel.strategy=fsdp fits on every stage" in report
