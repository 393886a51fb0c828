"""Every benchmark's ``--smoke`` run keeps working and ends with its JSON line: a benchmark that
nothing runs rots."""

from __future__ import annotations

import json
import sys

import pytest

from testbed.jobs import run

pytestmark = pytest.mark.timeout(400)


def test_the_recovery_bench_smoke_run_times_live_and_restart_recovery():
    proc = run([sys.executable, "bench/recovery.py", "--smoke"], timeout_s=380)
    assert proc.returncode == 0, proc.stdout[-4000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    live = summary["results"]["worker_kill"]["ftrain_live"]
    restart = summary["results"]["worker_kill"]["ftrain_restart"]
    assert live["recovered"] == restart["recovered"] == 1
    assert live["load_start_by"] == ["live_restored (live_peer)"]  # the replacement healed from its peer
    assert summary["live_worker_kill_s"] == live["total_s"] and summary["live_speedup_vs_restart"] > 1


def test_the_steady_state_bench_smoke_run_compares_the_agent_with_torchrun():
    proc = run([sys.executable, "bench/steady_state.py", "--smoke"], timeout_s=300)
    assert proc.returncode == 0, proc.stdout[-4000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["bench"] == "steady_state" and len(summary["ratios"]) == 1
    assert summary["agent_step_s"] > 0 and summary["torchrun_step_s"] > 0
    ratio = summary["agent_step_s"] / summary["torchrun_step_s"]
    assert summary["steady_state_vs_torchrun"] == pytest.approx(ratio, abs=1e-3)
    assert isinstance(summary["target_met"], bool)
