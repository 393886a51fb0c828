"""``ftrain chaos run`` against a user's own script (``[job] script``): a tiny loop of its own
(tests/chaos/own_script/train.py: ftrain.Session + ftrain.ResumableSampler, DDP on gloo) on two
``ftrain agent --script`` nodes, against real etcd, SeaweedFS, processes and signals. Killed once,
it keeps every invariant that applies to a script job (the others are reported skipped, with why:
the session logs its loads and rounds into the job's event log, as ``ftrain train`` does);
with a data pipeline that loses one sample, the exactly-once check fails and names that sample.
Both runs share the fault-free reference run (the session's golden cache)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ftrain.chaos.runner import print_summary, run_scenario
from ftrain.chaos.scenario import load_scenario

SCRIPT = Path(__file__).resolve().parent / "own_script" / "train.py"
DROPPED = 13  #: the sample id the failing run's pipeline loses

JOB = f"""
name = "own-script"
[job]
script = "{SCRIPT}"
script_args = ["--ckpt", "{{checkpoint}}", "--steps", "{{steps}}", "--save-every", "5", "--step-sleep-s", "0.05"]
nodes = 2
nnodes = "2:2"
steps = 24
timeout_s = 150
"""
FAULT = """
[[faults]]
kind = "worker_kill"
at_step = 8
"""
APPLY = {
    "job_finished",
    "state_matches_fault_free_run",
    "committed_checkpoints_verify",
    "loads_were_committed_and_intact",  # the session logs ckpt_loaded into the job's event log
    "resumed_from_the_newest_commit",
    "samples_consumed_exactly_once",
    "faults_handled",
    "one_round_trains_at_a_time",
    "no_commit_from_a_stale_round",
}


def _scenario(tmp_path: Path, text: str):
    path = tmp_path / "own-script.toml"
    path.write_text(text)
    return load_scenario(path)


@pytest.mark.timeout(300)
def test_a_killed_worker_of_a_users_script_keeps_every_invariant_that_applies(tmp_path, golden_cache):
    scenario = _scenario(tmp_path, JOB + FAULT)
    result = run_scenario(scenario, seed=1, out_dir=tmp_path / "run", cache_dir=golden_cache)
    print_summary(result)
    assert result.ok, f"invariants failed: {result.failed}; report {result.out_dir / 'report.html'}"
    checks = {c.name: c for c in result.checks}
    assert {n for n, c in checks.items() if not c.skipped} >= APPLY
    assert "bitwise equal" in checks["state_matches_fault_free_run"].detail
    assert re.match(r"\d+ load\(s\)", checks["loads_were_committed_and_intact"].detail)
    assert checks["resumed_from_the_newest_commit"].detail.startswith("2 round(s)")  # the kill made a round
    [kill] = result.report["faults"]
    assert kill["kind"] == "worker_kill" and kill["new_round"] is not None, kill
    assert kill["recovery_s"] is not None and kill["resumed_step"] is not None, kill  # read from the ledger live


@pytest.mark.timeout(300)
def test_a_script_that_loses_a_sample_fails_exactly_once_naming_it(tmp_path, golden_cache, monkeypatch):
    monkeypatch.setenv("OWN_SCRIPT_DROP_SAMPLE", str(DROPPED))  # the agents' workers inherit it
    scenario = _scenario(tmp_path, JOB)  # no fault needed: the loss is the script's own
    result = run_scenario(scenario, seed=1, out_dir=tmp_path / "run", cache_dir=golden_cache)
    print_summary(result)
    assert "samples_consumed_exactly_once" in result.failed
    detail = next(c.detail for c in result.checks if c.name == "samples_consumed_exactly_once")
    assert re.search(rf"step \d+: 1 missing ids \[{DROPPED}\]", detail), detail
