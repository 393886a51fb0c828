"""A tensor-parallel degree that does not divide a model's attention heads or key/value heads is
refused at start naming ``parallel.tp_size`` (it used to crash in the first forward on a reshape),
and ``ftrain plan`` skips it, for every model kind: built-in GPT and Llama, Hugging Face, torchtitan."""

from __future__ import annotations

import pytest

from ftrain.config import Config, ConfigError, ModelConfig, ParallelConfig
from ftrain.model import build_model
from ftrain.models.checks import check_model
from ftrain.models.hf import causal_lm
from ftrain.models.layout import layout_of, tp_head_problem
from ftrain.models.titan import causal_lm as titan_lm
from ftrain.planning.memory import Target, model_stats
from ftrain.planning.plan import attention_heads, estimate_all
from ftrain.planning.plan_report import plan_report

GPU_BF16 = Target("cuda", "bf16")
HF = "ftrain.models.hf:causal_lm"
#: Llama-3-8B's heads (32 query, 8 key/value) on a model small enough to build
HF_GQA = {
    "family": "llama",
    "hidden_size": 256,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
}


def _refused(model, model_cfg: ModelConfig, **parallel) -> str:
    with pytest.raises(ConfigError) as e:
        check_model(model, Config(model=model_cfg, parallel=ParallelConfig(**parallel)))
    assert e.value.key == "parallel.tp_size"
    return str(e.value)


def test_the_built_in_gpt_refuses_a_tp_size_that_does_not_divide_its_heads():
    cfg = ModelConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=6, d_model=48)
    model = build_model(cfg)
    layout = layout_of(model)
    assert layout is not None and (layout.heads, layout.kv_heads) == (6, 6)
    message = _refused(model, cfg, strategy="tp", tp_size=4)
    assert message == (
        "parallel.tp_size: 4 does not divide the model's attention heads (n_head=6, n_kv_heads=6): each "
        "tensor-parallel rank runs an equal share of them; a degree of 1, 2, 3 or 6 would"
    )
    check_model(model, Config(model=cfg, parallel=ParallelConfig(strategy="tp", tp_size=3)))


def test_the_built_in_llama_refuses_a_tp_size_that_does_not_divide_its_kv_heads():
    cfg = ModelConfig(arch="llama", vocab_size=64, seq_len=16, n_layer=2, n_head=8, n_kv_heads=2, d_model=64)
    model = build_model(cfg)
    layout = layout_of(model)
    assert layout is not None and (layout.heads, layout.kv_heads) == (8, 2)
    message = _refused(model, cfg, strategy="tp", tp_size=4)
    assert "(n_head=8, n_kv_heads=2)" in message and message.endswith("a degree of 1 or 2 would")
    check_model(model, Config(model=cfg, parallel=ParallelConfig(strategy="fsdp+tp", tp_size=2)))
    one_kv = ModelConfig(arch="llama", vocab_size=64, seq_len=16, n_layer=2, n_head=4, n_kv_heads=1, d_model=32)
    # fsdp+tp's default degree (2) is checked too; the caller's resolved degree wins over the config's 0
    assert "a degree of 1 would" in _refused(build_model(one_kv), one_kv, strategy="fsdp+tp")
    with pytest.raises(ConfigError, match="parallel.tp_size: 2 does not divide"):
        check_model(build_model(one_kv), Config(model=one_kv, parallel=ParallelConfig(strategy="tp")), tp_size=2)


def test_a_hugging_face_model_refuses_a_tp_size_that_does_not_divide_its_kv_heads():
    args = {"family": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2}
    cfg = ModelConfig(
        vocab_size=64, seq_len=16, factory=HF, args=args | {"num_attention_heads": 4, "num_key_value_heads": 2}
    )
    model = causal_lm(cfg)
    layout = layout_of(model)
    assert layout is not None and (layout.heads, layout.kv_heads) == (4, 2)
    message = _refused(model, cfg, strategy="tp", tp_size=4)
    assert "4 does not divide the model's attention heads (n_head=4, n_kv_heads=2)" in message
    check_model(model, Config(model=cfg, parallel=ParallelConfig(strategy="tp", tp_size=2)))
    # num_key_value_heads left out: one per query head, as transformers defaults it
    mha = causal_lm(ModelConfig(vocab_size=64, seq_len=16, factory=HF, args=args | {"num_attention_heads": 4}))
    mha_layout = layout_of(mha)
    assert mha_layout is not None and (mha_layout.heads, mha_layout.kv_heads) == (4, 4)


def test_a_torchtitan_model_refuses_a_tp_size_that_does_not_divide_its_heads():
    cfg = ModelConfig(
        vocab_size=64, seq_len=16, n_layer=2, n_head=4, d_model=32,
        factory="ftrain.models.titan:causal_lm", args={"builder": "tests.titan_model:build"},
    )  # fmt: skip
    model = titan_lm(cfg)
    layout = layout_of(model)
    assert layout is not None and (layout.heads, layout.kv_heads) == (4, 4)  # wq/wk widths over head_dim
    assert "(n_head=4, n_kv_heads=4)" in _refused(model, cfg, strategy="fsdp+tp", tp_size=8)


def test_unknown_heads_pass_and_the_fix_lists_the_common_divisors():
    assert tp_head_problem(64, None, None) is None
    assert tp_head_problem(1, 3, 3) is None
    assert tp_head_problem(16, 32, None) is None
    problem = tp_head_problem(16, 32, 8)
    assert problem is not None and problem.endswith("a degree of 1, 2, 4 or 8 would")


def test_the_plan_skips_tp_degrees_beyond_a_hugging_face_models_kv_heads():
    model_cfg = ModelConfig(vocab_size=256, seq_len=32, factory=HF, args=HF_GQA)
    assert attention_heads(model_cfg) == (32, 8)
    stats = model_stats(model_cfg)
    for tp, world in ((16, 64), (64, 64), (16, 16)):
        cfg = Config(model=model_cfg, parallel=ParallelConfig(tp_size=tp))
        estimates, skipped = estimate_all(stats, cfg, world_size=world, gpus_per_node=8, target=GPU_BF16)
        assert not [e for e in estimates if e.tp_size > 1], (tp, world)
        reasons = {s.strategy: s.reason for s in skipped}
        assert (
            f"parallel.tp_size: {tp} does not divide the model's attention heads (n_head=32, n_kv_heads=8)"
            in (reasons["fsdp+tp" if world > tp else "tp"])
        )
    cfg = Config(model=model_cfg, parallel=ParallelConfig(tp_size=8))
    estimates, _ = estimate_all(stats, cfg, world_size=64, gpus_per_node=8, target=GPU_BF16)
    assert [e.tp_size for e in estimates if e.strategy == "fsdp+tp"] == [8]
    report = plan_report(Config(model=model_cfg), world_size=64, gpus_per_node=8)
    assert "skipped tp: parallel.tp_size: 64 does not divide" in report
    assert "| tp " not in report and "| fsdp+tp  | dp=32 tp=2 |" in report
