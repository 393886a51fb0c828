"""Chaos against a user's script, the parts without a cluster: the scenario keys of a script job
and their errors, and the ledger ftrain.ResumableSampler writes where FTRAIN_LEDGER_DIR names one
(the format and check of ftrain train's, one definition of the variable)."""

from __future__ import annotations

import pytest

import ftrain
from ftrain.chaos.scenario import ScenarioError, load_scenario
from ftrain.contract.worker_env import LEDGER_DIR, ROUND
from ftrain.data.ledger import check_exactly_once, read_ledger


def _scenario(tmp_path, job: str):
    (tmp_path / "train.py").write_text("")
    path = tmp_path / "s.toml"
    path.write_text("[job]\n" + job)
    return load_scenario(path)


def test_a_script_job_fills_in_where_it_saves_and_its_steps(tmp_path):
    s = _scenario(tmp_path, 'script = "train.py"\nsteps = 7\nscript_args = ["--ckpt", "{checkpoint}", "--n={steps}"]\n')
    assert s.script_path == tmp_path / "train.py"
    assert s.script_command_args("s3://b/p") == ["--ckpt", "s3://b/p", "--n=7"]


@pytest.mark.parametrize(
    "job,error",
    [
        ('script = "nope.py"\nscript_args = ["{checkpoint}"]\n', r"s\.toml: job\.script: .*nope\.py does not exist"),
        ('script = "train.py"\nscript_args = ["--ckpt", "x"]\n', r"s\.toml: job\.script_args: .*add its option"),
        ('script = "train.py"\nscript_args = "--ckpt {checkpoint}"\n', r"job\.script_args: .*list of strings"),
        ('script_args = ["{checkpoint}"]\n', r"job\.script_args: given without job\.script"),
        ('script = "train.py"\nscript_args = ["{checkpoint}"]\nconfig = "t.toml"\n', r"job\.config: does not apply"),
        ('script = "train.py"\nscript_args = ["{checkpoint}"]\nmemory_tier = true\n', r"job\.memory_tier: does not"),
        ('script = "train.py"\nscript_args = ["{checkpoint}"]\nnetwork = "netns"\n', r"job\.network: .*loopback"),
    ],
)
def test_a_bad_script_job_names_the_key_the_file_and_the_fix(tmp_path, job, error):
    with pytest.raises(ScenarioError, match=error):
        _scenario(tmp_path, job)


def test_the_sampler_writes_the_ledger_check_exactly_once_reads(tmp_path, monkeypatch):
    monkeypatch.setenv(LEDGER_DIR, str(tmp_path))
    monkeypatch.setenv(ROUND, "1")
    ranks = [ftrain.ResumableSampler(20, global_batch_size=4, seed=3) for _ in range(2)]
    for _ in range(3):
        for rank, sampler in enumerate(ranks):
            sampler.advance(rank, 2)
    saved = [s.state_dict() for s in ranks]
    for rank, sampler in enumerate(ranks):  # a step that is undone: back to the saved state, in the round
        sampler.advance(rank, 2)
        sampler.load_state_dict(saved[rank])
    for _ in range(3):
        for rank, sampler in enumerate(ranks):
            sampler.advance(rank, 2)
    report = check_exactly_once(read_ledger(tmp_path), num_samples=20, global_batch_size=4, seed=3, steps=6)
    assert report.ok and report.superseded_entries == 2, report.summary()
    assert (tmp_path / "sampler.json").exists()


def test_without_the_variable_the_sampler_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv(LEDGER_DIR, raising=False)
    monkeypatch.chdir(tmp_path)
    ftrain.ResumableSampler(20, global_batch_size=4).advance(0, 1)
    assert list(tmp_path.iterdir()) == []
