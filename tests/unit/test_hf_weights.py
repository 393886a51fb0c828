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
from ftrain.models.hf_weights import (  # noqa: E402
    HF_FACTORY,
    WeightsConfigError,
    load_hf_weights,
    model_record,
    sha256_of,
    to_hf,
)
from ftrain.models.layout import logits_of  # noqa: E402

SIZES = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
VOCAB, SEQ, FFN = 64, 16, 64
TOKENS = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))


def hf_model(family: str = "llama", seed: int = 1, **extra):
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
    torch.manual_seed(seed)
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


def test_a_numeric_difference_is_an_error_unless_overridden(tmp_path, caplog):
    """rms_norm_eps / rope_theta change what the same tensors compute: an error naming the key and
    the override; with the override, the model's value is trained (and logged)."""
    path = saved(hf_model(), tmp_path / "hf")
    with pytest.raises(WeightsConfigError, match=r"its config.json has rms_norm_eps = 1e-05 but the model has 1e-06"):
        loaded(llama_cfg(path, norm_eps=1e-6))
    with pytest.raises(ConfigError, match=r"rope_theta = 500000.0 but the model has 10000.0 \(model.rope_theta\)"):
        loaded(llama_cfg(path, rope_theta=10000.0))
    with pytest.raises(ConfigError, match=r"rope_theta = 500000.0 but .* 10000.0 \(model.args.rope_theta\)"):
        loaded(factory_cfg("llama", path, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}))
    with caplog.at_level("WARNING", logger="ftrain.models.hf_weights"):
        model, _ = loaded(llama_cfg(path, rope_theta=10000.0, override_weights_config="rope_theta"))
    assert "rope_theta = 500000.0 there; the model keeps 10000.0 (model.override_weights_config)" in caplog.text
    assert model.rope.inv_freq[1].item() == pytest.approx(1 / 10000.0 ** (2 / 8))


def test_the_override_names_only_known_settings():
    with pytest.raises(ConfigError, match=r"model.override_weights_config: 'rope_thta' .*did you mean 'rope_theta'"):
        ModelConfig(override_weights_config="rope_thta")
    assert ModelConfig(override_weights_config=" rope_theta, rms_norm_eps ").override_weights_config


def test_the_builtin_llama_refuses_scaled_rotary_embeddings(tmp_path):
    """A Llama 3.1-style config.json (rope_type llama3, transformers 4's rope_scaling) computes
    other rotary embeddings than the built-in llama's: refused, naming the factory that has them."""
    path = saved(hf_model(), tmp_path / "hf")
    config = json.loads((path / "config.json").read_text())
    config.pop("rope_parameters", None)
    config |= {"rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"rope_parameters = \{.*'llama3'.*ftrain.models.hf:causal_lm"):
        loaded(llama_cfg(path))


def test_rope_theta_in_the_args_goes_into_rope_parameters():
    from ftrain.models.hf import hf_model_config

    cfg = factory_cfg("llama")
    args = {k: v for k, v in cfg.args.items() if k != "rope_parameters"}
    config = hf_model_config(dataclasses.replace(cfg, args={**args, "rope_theta": 10000.0}))
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": 10000.0}
    with pytest.raises(ConfigError, match="model.args.rope_theta: and model.args.rope_parameters are both given"):
        hf_model_config(dataclasses.replace(cfg, args={**cfg.args, "rope_theta": 10000.0}))
    with pytest.raises(ConfigError, match=r"model.args.rope_thta: not a setting .*transformers 5 keeps the rotary"):
        hf_model_config(dataclasses.replace(cfg, args={**args, "rope_thta": 10000.0}))
    with pytest.raises(ConfigError, match=r"model.args: LlamaConfig refuses these settings: .*hidden_size"):
        hf_model_config(dataclasses.replace(cfg, args={**args, "hidden_size": "wide"}))


def test_rope_theta_in_a_transformers_4_config_file_is_read(tmp_path):
    from ftrain.models.hf import hf_model_config

    file = tmp_path / "config.json"
    file.write_text(json.dumps({"model_type": "llama", **SIZES, "intermediate_size": FFN, "rope_theta": 10000.0}))
    config = hf_model_config(ModelConfig(factory=HF_FACTORY, vocab_size=VOCAB, seq_len=SEQ, args={"config": str(file)}))
    assert config.rope_parameters["rope_theta"] == 10000.0
    over = ModelConfig(factory=HF_FACTORY, vocab_size=VOCAB, seq_len=SEQ, args={"config": str(file), "rope_theta": 5.0})
    assert hf_model_config(over).rope_parameters["rope_theta"] == 5.0  # the args win over the file


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


def test_init_from_reads_safetensors_without_the_safetensors_package(tmp_path, monkeypatch):
    hf = hf_model()
    path = saved(hf, tmp_path / "hf")
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    monkeypatch.setitem(sys.modules, "safetensors", None)
    model, _ = loaded(llama_cfg(path))
    torch.testing.assert_close(logits(model), logits(hf), atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.int8, torch.bool])
def test_an_integer_or_bool_tensor_is_refused_naming_it_and_its_file(tmp_path, dtype):
    key = "model.layers.0.mlp.up_proj.weight"
    path = saved(hf_model(), tmp_path / "hf")
    rewrite(path, lambda t: t.__setitem__(key, torch.ones(FFN, 32, dtype=dtype)))
    name = {torch.int8: "I8", torch.bool: "BOOL"}[dtype]
    with pytest.raises(ConfigError, match=rf"'{key}' in model.safetensors is {name}, which cannot be the model's"):
        loaded(llama_cfg(path))


@pytest.mark.parametrize(
    "damage, words",
    [
        (lambda b: b[: len(b) // 2], "outside the .* bytes of data"),
        (lambda b: b[:5], "shorter than the 8-byte header length"),
        (lambda b: (16).to_bytes(8, "little") + b"{not json at all" + b[24:], "its header is not JSON"),
    ],
    ids=["truncated", "tiny", "garbage-header"],
)
def test_a_damaged_file_is_named_with_the_fix(tmp_path, damage, words):
    path = saved(hf_model(), tmp_path / "hf")
    file = path / "model.safetensors"
    file.write_bytes(damage(file.read_bytes()))
    with pytest.raises(
        ConfigError,
        match=rf"model.init_from: .*model.safetensors' is not a valid safetensors file: "
        rf".*({words}).*Download or copy the file again",
    ):
        loaded(llama_cfg(path))


def test_the_digest_is_of_the_bytes_that_were_loaded(tmp_path, monkeypatch):
    """Another model's weights replace the file just before ftrain's first read of it from
    Python: whatever is loaded, the digest returned must be of those bytes."""
    path = saved(hf_model(), tmp_path / "hf")
    other = saved(hf_model(seed=7), tmp_path / "other")
    file = path / "model.safetensors"
    real_open = Path.open
    swapped = []

    def open_swapping(self, *args, **kwargs):
        if self == file and not swapped:
            swapped.append(True)
            (other / "model.safetensors").replace(file)
        return real_open(self, *args, **kwargs)

    monkeypatch.setattr(Path, "open", open_swapping)
    model, digests = loaded(llama_cfg(path))
    monkeypatch.setattr(Path, "open", real_open)
    now = safetensors_torch.load_file(str(file))
    assert digests == {"model.safetensors": sha256_of(file)}
    assert torch.equal(model.blocks[0].attn.q.weight, now["model.layers.0.self_attn.q_proj.weight"])


def test_a_missing_directory_is_named_where_it_is_needed(tmp_path):
    cfg = llama_cfg(tmp_path / "gone")  # accepted at config time: a resume does not read it
    with pytest.raises(
        ConfigError, match=r"model.init_from: '.*gone' does not exist: it is read because no checkpoint"
    ):
        loaded(cfg)


# -- out ---------------------------------------------------------------------------------------
def export(model, cfg: ModelConfig, out: Path, **kw) -> list[str]:
    recorded = {**dataclasses.asdict(cfg), **model_record(model, cfg)}  # what a manifest's config["model"] holds
    tensors, files = to_hf(model.state_dict(), recorded)
    return write_hf_dir(out, tensors, files, **kw)


@pytest.mark.parametrize("tied", [False, True])
def test_the_builtin_llama_exports_to_from_pretrained(tmp_path, tied):
    cfg = llama_cfg(tie_embeddings=tied, size="")
    torch.manual_seed(2)
    model = build_model(cfg)
    written = export(model, cfg, tmp_path / "out")
    assert written == ["config.json", "generation_config.json", "model.safetensors"]
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


def test_the_exported_json_files_are_what_save_pretrained_writes(tmp_path, caplog):
    """config.json without id2label/label2id or other defaults the model does not use, and a
    generation_config.json: transformers loads the directory without a warning."""
    cfg = factory_cfg("llama")
    torch.manual_seed(2)
    model = build_model(cfg)
    export(model, cfg, tmp_path / "out")
    config = model.config.__class__.from_dict(model.config.to_dict())
    config.use_cache = True  # an exported model is for inference
    type(model)(config).save_pretrained(tmp_path / "theirs")
    for name in ("config.json", "generation_config.json"):
        ours, theirs = (json.loads((tmp_path / d / name).read_text()) for d in ("out", "theirs"))
        assert ours == theirs, name
    assert "id2label" not in json.loads((tmp_path / "out" / "config.json").read_text())
    with caplog.at_level("WARNING"):
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == []
    assert hf.generation_config.eos_token_id == hf.config.eos_token_id


def test_an_export_uses_the_config_the_model_was_built_from(tmp_path, caplog):
    """model.args.config edited after training (rope_theta 10000 -> 500000): the export still
    describes the trained model, from what the checkpoint recorded; a step saved without the
    record falls back on the file, with a warning."""
    file = tmp_path / "config.json"
    settings = {"model_type": "llama", **SIZES, "intermediate_size": FFN, "rope_theta": 10000.0}
    file.write_text(json.dumps(settings))
    cfg = ModelConfig(factory=HF_FACTORY, vocab_size=VOCAB, seq_len=SEQ, args={"config": str(file)})
    torch.manual_seed(2)
    model = build_model(cfg)
    recorded = {**dataclasses.asdict(cfg), **model_record(model, cfg)}
    file.write_text(json.dumps({**settings, "rope_theta": 500000.0}))
    tensors, files = to_hf(model.state_dict(), recorded)
    assert files["config.json"]["rope_parameters"]["rope_theta"] == 10000.0
    write_hf_dir(tmp_path / "out", tensors, files)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    torch.testing.assert_close(logits(hf), logits(model), atol=1e-5, rtol=0)
    with caplog.at_level("WARNING", logger="ftrain.models.hf_weights"):
        _, old = to_hf(model.state_dict(), dataclasses.asdict(cfg))
    assert old["config.json"]["rope_parameters"]["rope_theta"] == 500000.0
    assert "records no model config (saved by an older ftrain)" in caplog.text
    tampered = {**recorded, "hf_config": {**recorded["hf_config"], "rms_norm_eps": 0.1}}
    with pytest.raises(ConfigError, match="does not match its hf_config_sha256"):
        to_hf(model.state_dict(), tampered)


def test_each_save_records_the_model_config():
    from types import SimpleNamespace

    from ftrain.checkpointing import manifest_fields
    from ftrain.config import Config
    from ftrain.data import DataCursor

    cfg = factory_cfg("qwen2")
    record = model_record(build_model(cfg), cfg)
    assert record["hf_config"]["model_type"] == "qwen2" and len(record["hf_config_sha256"]) == 64
    par = SimpleNamespace(layout=SimpleNamespace(world_size=1, describe=lambda: {"strategy": "ddp"}))
    whole = Config(model=cfg)
    fields = manifest_fields(whole, par, DataCursor(64, 4, 0), 0, model_record=record)  # type: ignore[arg-type]
    assert fields["config"]["model"]["hf_config"] == record["hf_config"]
    assert fields["config_hash"] == whole.digest()  # what is trained is still the config's digest
    assert model_record(build_model(llama_cfg()), llama_cfg()) == {}  # its settings are all in [model]


def test_a_resume_refuses_a_model_that_computes_otherwise(caplog):
    """The checkpoint's recorded config against the model a resume builds: a changed rope_theta
    (a config file edited between runs, or [model] changed) is an error unless overridden."""
    from ftrain.models.hf_weights import check_resumed_model

    cfg = factory_cfg("llama")
    recorded = {**dataclasses.asdict(cfg), **model_record(build_model(cfg), cfg)}
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    changed = dataclasses.replace(cfg, args={**cfg.args, "rope_parameters": rope})
    now = model_record(build_model(changed), changed)
    check_resumed_model(recorded, cfg, model_record(build_model(cfg), cfg), 8)
    with pytest.raises(WeightsConfigError, match=r"checkpoint step 8 was trained with rope_theta = 500000.0 but"):
        check_resumed_model(recorded, changed, now, 8)
    check_resumed_model(recorded, dataclasses.replace(changed, override_weights_config="rope_theta"), now, 8)
    llama = dataclasses.asdict(llama_cfg())
    with pytest.raises(WeightsConfigError, match=r"rms_norm_eps = 1e-05 but the model has 1e-06 \(model.norm_eps\)"):
        check_resumed_model(llama, llama_cfg(norm_eps=1e-6), {}, 8)


@pytest.mark.parametrize(
    "recorded", ["a string", {"arch": "llama", "n_layer": "four"}], ids=["not-a-table", "bad-type"]
)
def test_a_malformed_recorded_model_section_is_named(recorded):
    with pytest.raises(ConfigError, match=r"^model: the checkpoint"):
        to_hf({}, recorded)
