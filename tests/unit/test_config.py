"""Config: precedence, types, and errors that name the key."""

from __future__ import annotations

import pytest

from ftrain.cli.config import load_job_config as load_config
from ftrain.cli.config import reference_markdown
from ftrain.contract.config import ConfigError


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
    cfg = load_config(
        None, ["--optim.lr=1e-3", "--parallel.deterministic=true", "--data.source=synthetic", "--optim.warmup_steps=0"]
    )
    assert cfg.optim.lr == 1e-3 and cfg.parallel.deterministic is True
    assert cfg.parallel.strategy == "ddp" and cfg.optim.warmup_steps == 0


@pytest.mark.parametrize(
    ("text", "overrides", "key", "words"),
    [
        ("[train]\nstpes = 3\n", [], "train.stpes", "did you mean 'steps'"),
        ("[trian]\nsteps = 3\n", [], "trian", "unknown section"),
        ('[train]\nsteps = "ten"\n', [], "train.steps", "expected int"),
        ("", ["--train.steps=1.5"], "train.steps", "expected int"),
        ("", ["--parallel.deterministic=maybe"], "parallel.deterministic", "expected bool"),
        ("[train]\nglobal_batch_size = 10\nmicro_batch_size = 4\n", [], "train.global_batch_size", "multiple"),
        ('[data]\nsource = "/nonexistent/tokens.bin"\n', [], "data.source", "/nonexistent/tokens.bin"),
        ('[parallel]\nstrategy = "zero4"\n', [], "parallel.strategy", "not one of"),
        ('[parallel]\nstrategy = "fsdp"\ndeterministic = true\n', [], "parallel.deterministic", "ddp only"),
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
    for key in (
        "train.steps",
        "model.factory",
        "data.source",
        "optim.lr_scaling",
        "parallel.deterministic",
        "logging.metrics_path",
    ):
        assert f"`{key}`" in ref


# -- numeric keys: finite and in range (issue #8) --------------------------------------------
def _float_keys() -> list[str]:
    import dataclasses

    from ftrain.cli.config import schema as sections

    return [
        f"{name}.{f.name}" for name, cls in sections().items() for f in dataclasses.fields(cls) if f.type == "float"
    ]


@pytest.mark.parametrize("key", _float_keys())
@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_every_float_key_refuses_nan_and_inf(key, value):
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"--{key}={value}"])
    assert err.value.key == key and "finite" in str(err.value)


def test_nan_from_a_file_or_built_in_code_is_refused_too(tmp_path):
    from ftrain.config import CheckpointConfig, TrainConfig

    with pytest.raises(ConfigError, match="train.grad_clip: must be a finite number"):
        load_config(write(tmp_path, "[train]\ngrad_clip = nan\n"))
    with pytest.raises(ConfigError, match="train.grad_clip"):
        TrainConfig(grad_clip=float("nan"))
    with pytest.raises(ConfigError, match="checkpoint.gc_grace_s"):
        CheckpointConfig(gc_grace_s=float("nan"))


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("--checkpoint.gc_grace_s=-1", "checkpoint.gc_grace_s"),
        ("--checkpoint.load_step=-2", "checkpoint.load_step"),
        ("--checkpoint.max_failed_commits=-1", "checkpoint.max_failed_commits"),
        ("--checkpoint.on_no_loadable_step=ignore", "checkpoint.on_no_loadable_step"),
        ("--train.grad_clip=-0.5", "train.grad_clip"),
        ("--optim.weight_decay=-0.1", "optim.weight_decay"),
        ("--optim.beta1=1.0", "optim.beta1"),
        ("--optim.beta2=-0.1", "optim.beta2"),
        ("--optim.eps=0", "optim.eps"),
        ("--data.seed=-1", "data.seed"),
        ("--agent.settle_s=-1", "agent.settle_s"),
        ("--agent.hang_timeout_s=0", "agent.hang_timeout_s"),
        ("--agent.start_timeout_s=-5", "agent.start_timeout_s"),
        ("--agent.restart_window_s=0", "agent.restart_window_s"),
        ("--agent.max_restarts=-1", "agent.max_restarts"),
        ("--agent.backoff_initial_s=-1", "agent.backoff_initial_s"),
        ("--agent.backoff_max_s=0.5", "agent.backoff_max_s"),
        ("--agent.metrics_port=70000", "agent.metrics_port"),
    ],
)
def test_numeric_ranges_name_the_key(override, key):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert err.value.key == key


def test_new_checkpoint_keys_defaults_and_reference():
    cfg = load_config(None)
    assert cfg.checkpoint.on_no_loadable_step == "fail" and cfg.checkpoint.max_failed_commits == 3
    assert load_config(None, ["--checkpoint.on_no_loadable_step=fresh"]).checkpoint.on_no_loadable_step == "fresh"
    ref = reference_markdown()
    assert "`checkpoint.on_no_loadable_step`" in ref
    assert "Consecutive failed checkpoint commits after which training stops instead of running unprotected." in ref
    assert "directly under it" in ref  # checkpoint.uri is the job's own root


def test_checkpoint_defaults_equal_the_checkpoint_service_defaults():
    """One source of truth: ftrain.checkpoint.retention.Retention; CheckpointManager, ``ftrain ckpt gc``
    and the config agree."""
    import dataclasses

    from ftrain.checkpoint.manager import CheckpointManager
    from ftrain.checkpoint.retention import Retention
    from ftrain.config import CheckpointConfig

    cfg = CheckpointConfig()
    manager = {f.name: f.default for f in dataclasses.fields(CheckpointManager)}
    assert (cfg.keep_last, cfg.keep_every, cfg.gc_grace_s) == (
        Retention.keep_last,
        Retention.keep_every,
        Retention.grace_s,
    )
    assert (manager["keep_last"], manager["keep_every"], manager["gc_grace_s"]) == (
        cfg.keep_last,
        cfg.keep_every,
        cfg.gc_grace_s,
    )
    assert (manager["digest"], manager["async_mode"], manager["when_busy"], manager["on_no_loadable_step"]) == (
        cfg.digest,
        cfg.async_mode,
        cfg.when_busy,
        cfg.on_no_loadable_step,
    )


# -- the worker's job id ---------------------------------------------------------------------
def test_worker_job_id_comes_from_the_agent_then_the_config(monkeypatch):
    from ftrain.config import worker_job_id

    monkeypatch.setenv("FTRAIN_TEST_KEY", "k")
    cfg = load_config(None, ["--agent.job=from-config", "--checkpoint.uri=/tmp/x"])
    assert worker_job_id(cfg, {"FTRAIN_JOB": "from-agent"}) == "from-agent"
    assert worker_job_id(cfg, {}) == "from-config"
    assert worker_job_id(load_config(None), {}) == ""  # unsigned: a job id is optional
    with pytest.raises(ConfigError, match="FTRAIN_JOB: job id"):
        worker_job_id(cfg, {"FTRAIN_JOB": "bad\nid"})


def test_signed_manifests_without_a_job_id_are_a_config_error(monkeypatch):
    from ftrain.config import worker_job_id

    monkeypatch.setenv("FTRAIN_TEST_KEY", "k")
    cfg = load_config(None, ["--checkpoint.uri=/tmp/x", "--checkpoint.hmac_key_env=FTRAIN_TEST_KEY"])
    with pytest.raises(ConfigError) as err:
        worker_job_id(cfg, {})
    assert err.value.key == "checkpoint.hmac_key_env" and "agent.job=" in str(err.value)
    assert worker_job_id(cfg, {"FTRAIN_JOB": "j"}) == "j"


def test_empty_hmac_key_variable_is_refused(monkeypatch):
    monkeypatch.setenv("FTRAIN_TEST_KEY", "")
    with pytest.raises(ConfigError, match="FTRAIN_TEST_KEY is not set"):
        load_config(None, ["--checkpoint.hmac_key_env=FTRAIN_TEST_KEY"])
