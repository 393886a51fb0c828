"""Bad input stops ``ftrain train`` at start: non-zero exit, a message naming the problem."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from ftrain.data import write_token_file
from ftrain.testbed.jobs import TINY_CONFIG, run, train_job


def ftrain(tmp_path, *args, config=TINY_CONFIG):
    cfg = tmp_path / "config.toml"
    cfg.write_text(config)
    return run([sys.executable, "-m", "ftrain", "train", str(cfg), *args], timeout_s=120)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--train.stesp=3"], "train.stesp: unknown key (did you mean 'steps'?)"),
        (["--train.steps=many"], "train.steps: expected int"),
        (["--train.global_batch_size=15"], "train.global_batch_size: 15 is not a multiple of train.micro_batch_size=2"),
        (["--data.source=/no/such/tokens.bin"], "data.source: token file '/no/such/tokens.bin' does not exist"),
    ],
)
def test_bad_config_exits_nonzero_naming_the_problem(tmp_path, args, message):
    proc = ftrain(tmp_path, *args)
    assert proc.returncode == 2, proc.stdout
    assert message in proc.stdout
    assert "Traceback" not in proc.stdout


def test_global_batch_not_divisible_by_world_size(tmp_path):
    """16 sequences of micro-batch 2 cannot be split over 3 ranks: named at start, every rank exits."""
    run_ = train_job(tmp_path, 3, check=False, save_final=False)
    assert run_.returncode != 0
    assert "train.global_batch_size: 16 is not divisible by train.micro_batch_size * data-parallel size" in run_.output
    assert not run_.metrics


def test_token_ids_beyond_vocab_are_named(tmp_path):
    tokens = tmp_path / "tokens.bin"
    write_token_file(tokens, np.full(4096, 100, dtype=np.uint16), "uint16")
    proc = ftrain(tmp_path, f"--data.source={tokens}", "--train.steps=1")
    assert proc.returncode == 2, proc.stdout
    assert str(tokens) in proc.stdout and "vocab_size" in proc.stdout


def test_trains_on_a_token_file(tmp_path):
    tokens = tmp_path / "tokens.bin"
    rng = np.random.default_rng(0)
    write_token_file(tokens, rng.integers(0, 64, 20_000), "uint16")
    proc = ftrain(
        tmp_path, f"--data.source={tokens}", "--train.steps=3", f"--logging.metrics_path={tmp_path / 'm.jsonl'}"
    )
    assert proc.returncode == 0, proc.stdout
    assert len((tmp_path / "m.jsonl").read_text().splitlines()) == 3


def test_user_model_factory_trains_under_fsdp(tmp_path):
    run_ = train_job(
        tmp_path,
        2,
        "--model.factory=tests.user_model:build",
        "--parallel.strategy=fsdp",
        "--train.steps=4",
        save_final=False,
    )
    assert len(run_.metrics) == 4 and run_.metrics[-1]["loss"] < run_.metrics[0]["loss"]


@pytest.mark.parametrize(
    ("factory", "message"),
    [
        ("tests.user_model:not_a_model", "returned str, not an nn.Module"),
        ("tests.no_such_module:build", "cannot import module 'tests.no_such_module'"),
        ("tests.user_model", 'expected "pkg.module:function"'),
    ],
)
def test_bad_model_factory_is_named(tmp_path, factory, message):
    proc = ftrain(tmp_path, f"--model.factory={factory}", "--train.steps=1")
    assert proc.returncode == 2, proc.stdout
    assert "model.factory" in proc.stdout and message in proc.stdout
