"""A deferred build (:mod:`ftrain.models.deferred_init`) gives every model kind the weights of a
normal build, leaves the random stream where a normal build leaves it, keeps tied weights one
parameter, and falls back to a normal build for what it cannot replay."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ftrain.config import ModelConfig
from ftrain.model import build_model
from ftrain.models.deferred_init import build_deferred, is_deferred, materialize, own_name

HF_ARGS = {
    "family": "llama",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
MODELS = {
    "gpt": ModelConfig(vocab_size=64, seq_len=16),
    "llama": ModelConfig(arch="llama", size="debug"),
    "llama-tied": ModelConfig(arch="llama", size="debug", tie_embeddings=True),
    "hf-llama": ModelConfig(vocab_size=64, seq_len=16, factory="ftrain.models.hf:causal_lm", args=HF_ARGS),
    "hf-qwen2": ModelConfig(
        vocab_size=64, seq_len=16, factory="ftrain.models.hf:causal_lm", args=HF_ARGS | {"family": "qwen2"}
    ),
    "titan": ModelConfig(
        vocab_size=64, seq_len=16, factory="ftrain.models.titan:causal_lm", args={"builder": "tests.titan_model:build"}
    ),
    "user": ModelConfig(factory="tests.user_model:build"),
}


def _built(build, seed: int = 3) -> tuple[nn.Module, torch.Tensor]:
    """``build()`` after seeding, and the next draws of the generator after it."""
    torch.manual_seed(seed)
    model = build()
    return model, torch.rand(8)


def _assert_same(model: nn.Module, reference: nn.Module) -> None:
    got, want = model.state_dict(), reference.state_dict()
    assert got.keys() == want.keys()
    different = [k for k in got if not torch.equal(got[k], want[k])]
    assert not different, different


@pytest.mark.parametrize("name", list(MODELS))
def test_a_deferred_build_materializes_to_the_weights_of_a_normal_build(name):
    cfg = MODELS[name]
    reference, after_reference = _built(lambda: build_model(cfg))
    model, after = _built(lambda: build_deferred(lambda: build_model(cfg)))
    assert is_deferred(model) and all(p.is_meta for p in model.parameters())
    assert torch.equal(after, after_reference), "the deferred build left the generator elsewhere"
    materialize(model, torch.device("cpu"))
    assert not is_deferred(model)
    _assert_same(model, reference)
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in reference.named_parameters()], "a tie broke"


def test_trunc_normal_and_created_values_replay_exactly():
    """In-place ops after a random fill (trunc_normal_: uniform_, erfinv_, mul_, add_, clamp_), a
    parameter made with its value (torch.ones, torch.randn) and never written again, and a
    generator passed explicitly."""

    def build() -> nn.Module:
        m = nn.Module()
        m.a = nn.Parameter(torch.empty(33, 7))
        nn.init.trunc_normal_(m.a, std=0.5, a=-0.4, b=0.4)
        m.b = nn.Parameter(torch.randn(5, 3))
        m.c = nn.Parameter(torch.ones(4))
        g = torch.Generator().manual_seed(11)
        m.d = nn.Parameter(torch.empty(9))
        m.d.data.normal_(generator=g)
        return m

    reference, after_reference = _built(build)
    model, after = _built(lambda: build_deferred(build))
    assert is_deferred(model) and torch.equal(after, after_reference)
    _assert_same(materialize(model, torch.device("cpu")), reference)


def test_a_build_that_writes_part_of_a_parameter_is_built_whole_from_the_same_random_state(caplog):
    def build() -> nn.Module:
        m = nn.Embedding(10, 4, padding_idx=0)  # reset_parameters zeroes row 0: part of the weight
        m.extra = nn.Linear(4, 4)
        return m

    reference, after_reference = _built(build)
    with caplog.at_level("INFO", logger="ftrain.models.deferred_init"):
        model, after = _built(lambda: build_deferred(build))
    assert not is_deferred(model), "a partial write was deferred"
    assert "cannot be deferred" in caplog.text and "part of a parameter" in caplog.text, caplog.text
    assert torch.equal(after, after_reference)
    _assert_same(model, reference)


def test_only_the_wrappers_parts_leave_a_parameters_name():
    assert own_name("blocks.0._checkpoint_wrapped_module.attn.q.weight") == "blocks.0.attn.q.weight"
    assert own_name("_orig_mod.head.weight") == "head.weight"
    assert own_name("submodule.weight") == "submodule.weight" and own_name("module.x.weight") == "module.x.weight"
