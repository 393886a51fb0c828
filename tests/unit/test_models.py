"""The model protocol and its start-up checks, on real modules: the built-in models, Hugging Face
causal LMs built by the shipped factory, torchtitan-shaped models and models that declare nothing."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from ftrain.config import Config, ConfigError, ModelConfig, ParallelConfig, load_config
from ftrain.model import build_model
from ftrain.models.checks import check_model, check_pipeline_calls
from ftrain.models.hf import causal_lm
from ftrain.models.layout import ModelLayout, block_list, declare, find_blocks, layout_of, tp_plan_of
from ftrain.models.titan import causal_lm as titan_lm
from ftrain.parallel.pipeline import PipelineModule, pipeline_layout

HF_ARGS = {
    "family": "llama",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def _hf(**args) -> nn.Module:
    return causal_lm(ModelConfig(vocab_size=64, seq_len=16, factory="ftrain.models.hf:causal_lm", args=HF_ARGS | args))


def test_a_fused_qkv_module_is_refused_at_start_naming_the_module_and_the_fix():
    cfg = ModelConfig(
        vocab_size=64,
        seq_len=16,
        n_layer=2,
        d_model=32,
        factory="ftrain.models.titan:causal_lm",
        args={"builder": "tests.titan_model:build", "fused": True},
    )
    with pytest.raises(ConfigError) as e:
        check_model(titan_lm(cfg), Config(model=cfg))
    assert "'layers.0.attention.fused' (FusedQKVLinear)" in str(e.value)
    message = str(e.value)
    assert "saves wk.weight, wq.weight, wv.weight but holds wqkv.weight (and 1 more module(s) like it)" in message
    assert "fused QKV" in message


def test_a_torchtitan_shaped_model_declares_its_layout_and_its_stages_compute_the_model():
    cfg = ModelConfig(
        vocab_size=64, seq_len=16, n_layer=3, d_model=32,
        factory="ftrain.models.titan:causal_lm", args={"builder": "tests.titan_model:build"},
    )  # fmt: skip
    model = titan_lm(cfg)
    layout = pipeline_layout(model)
    assert layout.blocks == "layers" and len(block_list(model)) == 3
    check_model(model, Config(model=cfg, parallel=ParallelConfig(strategy="tp", pp_size=1)))
    check_pipeline_calls(model, layout, 16)
    plan = tp_plan_of(model)
    assert plan is not None and plan["layers.2.feed_forward.w2"] == "rowwise"


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_hugging_face_families_declare_their_decoder_layers_and_tp_plan(family):
    model = _hf(family=family)
    layout = layout_of(model)
    assert layout is not None and layout.blocks == "model.layers" and layout.splittable
    assert len(block_list(model)) == 3
    plan = tp_plan_of(model)
    assert plan is not None and plan["model.layers.1.self_attn.o_proj"] == "rowwise"
    check_model(model, Config(model=ModelConfig(vocab_size=64, seq_len=16), parallel=ParallelConfig(pp_size=2)))


def test_a_pipeline_stage_keeps_the_whole_models_parameter_names():
    model = _hf()
    whole = set(model.state_dict())
    layout = pipeline_layout(model)
    first = PipelineModule(model, layout, [0], first=True, last=False)
    last = PipelineModule(model, layout, [1, 2], first=False, last=True)
    assert set(first.state_dict()) | set(last.state_dict()) == whole
    assert "model.embed_tokens.weight" in first.state_dict() and "lm_head.weight" in last.state_dict()
    tokens = torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        assert torch.allclose(last(first(tokens)), model(tokens).logits, atol=1e-6)


def test_tied_embeddings_cannot_be_cut_by_a_pipeline():
    with pytest.raises(ConfigError, match="tie_word_embeddings = false"):
        pipeline_layout(_hf(tie_word_embeddings=True))
    with pytest.raises(ConfigError, match="model.tie_embeddings = false"):
        pipeline_layout(build_model(ModelConfig(arch="llama", size="debug", tie_embeddings=True)))


def test_hf_args_are_checked_by_name():
    with pytest.raises(
        ConfigError, match=r"model.args.hiden_size: not a setting of LlamaConfig \(did you mean 'hidden_size'"
    ):
        _hf(hiden_size=32)
    with pytest.raises(ConfigError, match="say which model"):
        causal_lm(ModelConfig(factory="ftrain.models.hf:causal_lm", args={"hidden_size": 32}))
    with pytest.raises(ConfigError, match="model.vocab_size: 64 exceeds the model's vocab_size 32"):
        _hf(vocab_size=32)
    with pytest.raises(ConfigError, match="'gpt2' is not one of"):
        _hf(family="gpt2")


def test_a_typo_in_the_factory_gets_a_suggestion():
    with pytest.raises(ConfigError, match=r"'tests.user_model' has no callable 'buidl' \(did you mean 'build'\?\)"):
        build_model(ModelConfig(factory="tests.user_model:buidl"))
    with pytest.raises(
        ConfigError, match=r"cannot import module 'tests.user_modle': .*did you mean 'tests.user_model'"
    ):
        build_model(ModelConfig(factory="tests.user_modle:build"))
    builder = ModelConfig(factory="ftrain.models.titan:causal_lm", args={"builder": "tests.titan_model:buld"})
    with pytest.raises(ConfigError, match=r"model.args.builder: .* no callable 'buld' \(did you mean 'build'\?\)"):
        titan_lm(builder)


def test_a_tp_plan_naming_a_missing_module_is_an_error():
    model = build_model(ModelConfig(arch="llama", size="debug"))
    layout = layout_of(model)
    assert layout is not None
    declare(model, ModelLayout(blocks="blocks", tp_plan={**(layout.tp_plan or {}), "blocks.*.attn.qkv": "colwise"}))
    with pytest.raises(ConfigError, match="names 'blocks.0.attn.qkv', which is not a module"):
        check_model(
            model, Config(model=ModelConfig(arch="llama", size="debug"), parallel=ParallelConfig(strategy="tp"))
        )


def test_a_layout_whose_calls_do_not_reproduce_the_model_is_refused_before_a_pipeline():
    model = build_model(ModelConfig(arch="llama", size="debug"))
    layout = layout_of(model)
    assert layout is not None and layout.call_head is not None
    wrong = ModelLayout(**{**layout.__dict__, "call_head": lambda parts, x: parts["head"](x)})  # forgets the norm
    with pytest.raises(ConfigError, match="does not give the model's own logits"):
        check_pipeline_calls(model, wrong, 16)


def test_blocks_are_found_at_any_path_and_a_model_without_any_is_warned_about(caplog):
    hf = _hf()
    del vars(hf)["ftrain_layout"]  # as a user's own HF model, built without the factory
    assert find_blocks(hf) == "model.layers"
    lone = nn.Sequential(nn.Embedding(64, 8), nn.Linear(8, 64))
    with caplog.at_level(logging.WARNING):
        check_model(lone, Config(parallel=ParallelConfig(strategy="fsdp")))
    assert "no repeated blocks that parallel.strategy = fsdp could work on" in caplog.text


def test_model_size_and_args_in_config():
    cfg = load_config(None, ["--model.arch=llama", "--model.size=70B"])
    assert (cfg.model.n_layer, cfg.model.d_model, cfg.model.kv_heads, cfg.model.swiglu_dim) == (80, 8192, 8, 28672)
    with pytest.raises(ConfigError, match="model.n_layer: is set by model.size='8B'"):
        load_config(None, ["--model.arch=llama", "--model.size=8B", "--model.n_layer=2"])
    with pytest.raises(ConfigError, match="model.size: unknown size '9B'"):
        load_config(None, ["--model.arch=llama", "--model.size=9B"])
    with pytest.raises(ConfigError, match="model.args: is read by model.factory"):
        load_config(None, ["--model.args.hidden_size=3"])
    cfg = load_config(None, ["--model.factory=a.b:c", "--model.args.family=qwen2", "--model.args.hidden_size=64"])
    assert cfg.model.args == {"family": "qwen2", "hidden_size": 64}
    with pytest.raises(ConfigError, match="model.n_kv_heads: 3 does not divide model.n_head=4"):
        load_config(None, ["--model.arch=llama", "--model.n_kv_heads=3"])


def test_sequence_parallelism_needs_tensor_parallelism_and_no_pipeline():
    with pytest.raises(ConfigError, match="parallel.sequence_parallel: needs a tensor-parallel strategy"):
        load_config(None, ["--parallel.sequence_parallel=true"])
    with pytest.raises(ConfigError, match="parallel.sequence_parallel: does not run inside a pipeline"):
        load_config(None, ["--parallel.strategy=tp", "--parallel.sequence_parallel=true", "--parallel.pp_size=2"])
    layout = layout_of(build_model(ModelConfig(arch="llama", size="debug")))
    assert layout is not None and layout.sp_plan is not None and layout.sp_plan["head"] == "exit"
