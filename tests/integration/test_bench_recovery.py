"""``bench/recovery.py --smoke`` keeps running: a worker kill under live and restart recovery,
timed phase by phase, ending with one JSON line."""

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
