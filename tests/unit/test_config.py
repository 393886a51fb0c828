"""Config: precedence, types, and errors that name the key."""

from __future__ import annotations

import pytest

from ftrain.config import ConfigError, load_config, reference_markdown


def write(tmp_path, text):
    path = tmp_path / "c.toml"
    path.write_text(text)
    return path


def test_precedence_cli_over_file_over_defaults(tmp_path):
    path = write(tmp_path, "[train]\nsteps = 7\nmicro_batch_size = 4\n")
    cfg = load_config(path, ["--train.steps=9"])
    assert cfg.train.steps == 9  # CLI
    assert cfg.train.micro_batch_size == 4  # file
    assert cfg.train.global_batch_size == 32  # default


def test_override_values_are_typed(tmp_path):
    cfg = load_config(None, ["--optim.lr=1e-3", "--parallel.deterministic=true", "--data.source=synthetic",
                             "--optim.warmup_steps=0"])
    assert cfg.optim.lr == 1e-3 and cfg.parallel.deterministic is True
    assert cfg.parallel.strategy == "ddp" and cfg.optim.warmup_steps == 0


@pytest.mark.parametrize(
    ("text", "overrides", "key", "words"),
    [
        ("[train]\nstpes = 3\n", [], "train.stpes", "did you mean 'steps'"),
        ("[trian]\nsteps = 3\n", [], "trian", "unknown section"),
        ("[train]\nsteps = \"ten\"\n", [], "train.steps", "expected int"),
        ("", ["--train.steps=1.5"], "train.steps", "expected int"),
        ("", ["--parallel.deterministic=maybe"], "parallel.deterministic", "expected bool"),
        ("[train]\nglobal_batch_size = 10\nmicro_batch_size = 4\n", [], "train.global_batch_size", "multiple"),
        ("[data]\nsource = \"/nonexistent/tokens.bin\"\n", [], "data.source", "/nonexistent/tokens.bin"),
        ("[parallel]\nstrategy = \"zero4\"\n", [], "parallel.strategy", "not one of"),
        ("[parallel]\nstrategy = \"fsdp\"\ndeterministic = true\n", [], "parallel.deterministic", "ddp only"),
        ("[model]\nd_model = 30\nn_head = 4\n", [], "model.d_model", "multiple"),
        ("", ["--train.steps"], "", "--section.key=value"),
    ],
)
def test_bad_config_names_the_key(tmp_path, text, overrides, key, words):
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, text), overrides)
    assert err.value.key == key
    assert words in str(err.value)


def test_missing_config_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="nope.toml"):
        load_config(tmp_path / "nope.toml")


def test_digest_changes_with_any_value():
    assert load_config(None).digest() == load_config(None).digest()
    assert load_config(None).digest() != load_config(None, ["--optim.lr=0.5"]).digest()


def test_reference_lists_every_key():
    ref = reference_markdown()
    for key in ("train.steps", "model.factory", "data.source", "optim.lr_scaling", "parallel.deterministic",
                "logging.metrics_path"):
        assert f"`{key}`" in ref
