"""The CI chaos matrix: the scenarios under chaos/scenarios/ (soak aside) cover every fault kind,
each run against real etcd, SeaweedFS, agents and torchrun workers, and every invariant must hold."""

from __future__ import annotations

from pathlib import Path

import pytest

from ftrain.chaos.faults import KINDS
from ftrain.chaos.netns import unavailable_reason
from ftrain.chaos.runner import print_summary, run_scenario
from ftrain.chaos.scenario import load_scenario

SCENARIOS = Path(__file__).resolve().parents[2] / "chaos" / "scenarios"
MATRIX = ("processes.toml", "storage.toml", "partitions.toml")


def test_the_matrix_covers_every_fault_kind():
    covered = {f.kind for name in MATRIX for f in load_scenario(SCENARIOS / name).faults}
    assert covered == set(KINDS)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", MATRIX)
def test_scenario_keeps_every_invariant(name, tmp_path, golden_cache):
    scenario = load_scenario(SCENARIOS / name)
    if scenario.job.network == "netns" and unavailable_reason() is not None:
        pytest.skip(f"network namespaces: {unavailable_reason()}")
    result = run_scenario(scenario, seed=1, out_dir=tmp_path / "run", cache_dir=golden_cache)
    print_summary(result)
    assert result.ok, f"invariants failed: {result.failed}; report {result.out_dir / 'report.html'}"
    assert {c.name for c in result.checks} >= {
        "job_finished",
        "final_state_matches_golden",
        "committed_checkpoints_verify",
        "loads_were_committed_and_intact",
        "samples_consumed_exactly_once",
        "faults_handled",
        "one_round_trains_at_a_time",
        "no_commit_from_a_stale_round",
        "cut_off_nodes_rejoined",
        "evicted_nodes_rejoined",
    }
    kinds = [f["kind"] for f in result.report["faults"]]
    assert sorted(set(kinds)) == sorted({f.kind for f in scenario.faults})
    restarts = [f for f in result.report["faults"] if f["new_round"] is not None]
    assert all(f["recovery_s"] is not None and f["detection_s"] is not None for f in restarts), restarts
