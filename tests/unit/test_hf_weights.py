"""Hugging Face weights in (``model.init_from``) and out (``to_hf`` + ``write_hf_dir``, what
``ftrain ckpt export --format hf`` writes), on tiny models in one process."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from ftrain.checkpoint.export import write_hf_dir  # noqa: E402
from ftrain.config import ConfigError, ModelConfig  # noqa: E402
from ftrain.model import build_model  # noqa: E402
from ftrain.models.hf_weights import HF_FACTORY, load_hf_weights, sha256_of, to_hf  # noqa: E402
from ftrain.models.layout import logits_of  # noqa: E402

SIZES = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
VOCAB, SEQ, FFN = 64, 16, 64
TOKENS = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))


def hf_model(family: str = "llama", **extra):
    cls = {"llama": "Llama", "qwen2": "Qwen2", "mistral": "Mistral"}[family]
    config = getattr(transformers, f"{cls}Config")(
        **SIZES,
        intermediate_size=FFN,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        **extra,
    )
    torch.manual_seed(1)
    return getattr(transformers, f"{cls}ForCausalLM")(config).eval()


def saved(model, path: Path, **kw) -> Path:
    model.save_pretrained(path, **kw)
    return path


def llama_cfg(init_from: Path | str = "", **kw) -> ModelConfig:
    values = {"vocab_size": VOCAB, "seq_len": SEQ, "n_layer": 2, "n_head": 4, "n_kv_heads": 2, "d_model": 32}
    return ModelConfig(arch="llama", ffn_dim=FFN, init_from=str(init_from), **{**values, **kw})


def factory_cfg(family: str, init_from: Path | str = "", **args) -> ModelConfig:
    rope = {"rope_type": "default", "rope_theta": 500000.0}
    settings = {
        "family": family,
        **SIZES,
        "intermediate_size": FFN,
        "rope_parameters": rope,
        "rms_norm_eps": 1e-5,
        **args,
    }
    return ModelConfig(factory=HF_FACTORY, vocab_size=VOCAB, seq_len=SEQ, init_from=str(init_from), args=settings)


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return logits_of(model.eval()(TOKENS))


def loaded(cfg: ModelConfig):
    model = build_model(cfg)
    digests = load_hf_weights(model, cfg)
    return model, digests


@pytest.mark.parametrize("tied", [False, True])
def test_init_from_into_the_builtin_llama_gives_hf_logits(tmp_path, tied):
    hf = hf_model(tie_word_embeddings=tied)
    path = saved(hf, tmp_path / "hf")
    with safetensors_torch.safe_open(str(path / "model.safetensors"), framework="pt") as f:
        assert ("lm_head.weight" in f.keys()) is not tied  # noqa: SIM118 - a tied head is saved once
    model, digests = loaded(llama_cfg(path, tie_embeddings=tied))
    assert digests == {"model.safetensors": sha256_of(path / "model.safetensors")}
    torch.testing.assert_close(logits(model), logits(hf), atol=1e-5, rtol=0)
    if tied:
        assert model.head.weight is model.tok_emb.weight


def test_init_from_a_sharded_directory(tmp_path):
    hf = hf_model()
    path = saved(hf, tmp_path / "hf", max_shard_size="20KB")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and not (path / "model.safetensors").exists()
    model, digests = loaded(llama_cfg(path))
    assert sorted(digests) == files
    torch.testing.assert_close(logits(model), logits(hf), atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_init_from_into_a_hugging_face_factory_model(tmp_path, family):
    hf = hf_model(family)
    path = saved(hf, tmp_path / "hf")
    model, _ = loaded(factory_cfg(family, path))
    torch.testing.assert_close(logits(model), logits(hf), atol=1e-5, rtol=0)


def test_a_config_mismatch_names_the_setting(tmp_path):
    path = saved(hf_model(), tmp_path / "hf")
    with pytest.raises(ConfigError, match=r"num_hidden_layers = 2 but the model has 3 \(model.n_layer\)"):
        loaded(llama_cfg(path, n_layer=3))
    with pytest.raises(ConfigError, match=r"num_key_value_heads = 2 but the model has 4 \(model.n_kv_heads\)"):
        loaded(llama_cfg(path, n_kv_heads=4))
    with pytest.raises(ConfigError, match=r"model.init_from: config.json's hidden_size = 32 but the model has 64"):
        loaded(factory_cfg("llama", path, hidden_size=64))


def test_a_numeric_difference_is_a_warning(tmp_path, caplog):
    path = saved(hf_model(), tmp_path / "hf")
    with caplog.at_level("WARNING", logger="ftrain.models.hf_weights"):
        loaded(llama_cfg(path, norm_eps=1e-6))
    assert "config.json's rms_norm_eps = 1e-05 but the model uses 1e-06" in caplog.text


def rewrite(path: Path, change) -> None:
    """Edit ``path``'s model.safetensors: ``change(tensors)`` in place."""
    file = path / "model.safetensors"
    tensors = dict(safetensors_torch.load_file(str(file)))
    change(tensors)
    safetensors_torch.save_file(tensors, str(file), metadata={"format": "pt"})


@pytest.mark.parametrize("cfg_of", [llama_cfg, lambda p: factory_cfg("llama", p)], ids=["builtin", "factory"])
def test_shape_and_key_mismatches_name_the_key(tmp_path, cfg_of):
    key = "model.layers.1.mlp.up_proj.weight"
    path = saved(hf_model(), tmp_path / "hf")
    rewrite(path, lambda t: t.__setitem__(key, torch.zeros(FFN + 1, 32)))
    with pytest.raises(
        ConfigError, match=rf"model.init_from: '{key}' has shape \[65, 32\] in the checkpoint but \[64, 32\]"
    ):
        loaded(cfg_of(path))
    rewrite(path, lambda t: t.pop(key))
    with pytest.raises(ConfigError, match=rf"model.init_from: '{key}' .*is not in the checkpoint"):
        loaded(cfg_of(path))
    rewrite(path, lambda t: t.update({key: torch.zeros(FFN, 32), "model.layers.1.mlp.extra.weight": torch.zeros(2)}))
    with pytest.raises(ConfigError, match=r"'model.layers.1.mlp.extra.weight' is in the checkpoint but not a tensor"):
        loaded(cfg_of(path))
    # rotary inv_freq buffers older checkpoints carry are computed by the model: ignored
    rewrite(
        path,
        lambda t: (
            t.pop("model.layers.1.mlp.extra.weight"),
            t.update({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(4)}),
        ),
    )
    loaded(cfg_of(path))


def test_an_untied_model_needs_the_head(tmp_path):
    path = saved(hf_model(tie_word_embeddings=True), tmp_path / "hf")
    (path / "config.json").write_text(
        json.dumps({**json.loads((path / "config.json").read_text()), "tie_word_embeddings": False})
    )
    with pytest.raises(ConfigError, match=r"'lm_head.weight' \(the model's 'head.weight'\) is not in the checkpoint"):
        loaded(llama_cfg(path))


def test_the_reference_gpt_and_missing_files_are_errors(tmp_path):
    path = saved(hf_model(), tmp_path / "hf")
    with pytest.raises(ConfigError, match="model.arch: the reference GPT has no Hugging Face equivalent"):
        loaded(ModelConfig(init_from=str(path)))
    (path / "model.safetensors").rename(path / "pytorch_model.bin")
    with pytest.raises(ConfigError, match=r"neither model.safetensors nor .*pytorch_model.bin: only safetensors"):
        loaded(llama_cfg(path))
    (path / "model.safetensors.index.json").write_text('{"weight_map": {"lm_head.weight": "../elsewhere.safetensors"}}')
    with pytest.raises(ConfigError, match=r"must map tensors to file names in .*'../elsewhere.safetensors'"):
        loaded(llama_cfg(path))  # an index read from disk names no file outside the directory


def test_without_safetensors_the_error_names_the_extra(tmp_path, monkeypatch):
    path = saved(hf_model(), tmp_path / "hf")
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    with pytest.raises(ConfigError, match=r"pip install 'ftrain\[hf\]'"):
        loaded(llama_cfg(path))


# -- out ---------------------------------------------------------------------------------------
def export(model, cfg: ModelConfig, out: Path, **kw) -> list[str]:
    tensors, config = to_hf(model.state_dict(), dataclasses.asdict(cfg))
    return write_hf_dir(out, tensors, config, **kw)


@pytest.mark.parametrize("tied", [False, True])
def test_the_builtin_llama_exports_to_from_pretrained(tmp_path, tied):
    cfg = llama_cfg(tie_embeddings=tied, size="")
    torch.manual_seed(2)
    model = build_model(cfg)
    written = export(model, cfg, tmp_path / "out")
    assert written == ["config.json", "model.safetensors"]
    with safetensors_torch.safe_open(str(tmp_path / "out" / "model.safetensors"), framework="pt") as f:
        assert ("lm_head.weight" in f.keys()) is not tied  # noqa: SIM118
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert type(hf).__name__ == "LlamaForCausalLM"
    torch.testing.assert_close(logits(hf), logits(model), atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", ["qwen2", "mistral"])
def test_a_factory_model_exports_sharded_to_from_pretrained(tmp_path, family):
    cfg = factory_cfg(family)
    torch.manual_seed(2)
    model = build_model(cfg)
    written = export(model, cfg, tmp_path / "out", max_shard_bytes=20_000)
    assert written[-1] == "model.safetensors.index.json" and len(written) > 3
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert type(hf).__name__ == {"qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}[family]
    torch.testing.assert_close(logits(hf), logits(model), atol=1e-5, rtol=0)
    # and back in: the export is an init_from directory
    again, _ = loaded(dataclasses.replace(cfg, init_from=str(tmp_path / "out")))
    torch.testing.assert_close(logits(again), logits(model), atol=0, rtol=0)


def test_the_reference_gpt_does_not_export():
    cfg = ModelConfig()
    with pytest.raises(ConfigError, match="no Hugging Face equivalent"):
        to_hf(build_model(cfg).state_dict(), dataclasses.asdict(cfg))
