"""The round watchdog (:mod:`ftrain.round_watchdog`) on 3 real gloo ranks: a rank blocked in a
collective with a stopped peer is freed soon after its agent assigns a newer round, and ranks
that leave a round in time are left alone."""

from __future__ import annotations

import json
import sys

import pytest

from ftrain.round_watchdog import MIN_GRACE_S
from testbed.jobs import run, worker_env

pytestmark = pytest.mark.dist


@pytest.mark.parametrize(
    ("kind", "freed_within_s"), [("grace", (MIN_GRACE_S, MIN_GRACE_S + 2.0)), ("interrupt", (0.0, 1.0))]
)
def test_a_rank_stuck_with_a_stopped_peer_is_freed_and_a_prompt_one_is_left_alone(tmp_path, kind, freed_within_s):
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=3",
        "tests/distributed/round_watchdog_worker.py", str(tmp_path), kind,
    ]  # fmt: skip
    proc = run(cmd, timeout_s=120, env=worker_env())
    assert proc.returncode == 0, proc.stdout[-4000:]
    for rank in (0, 1):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got["prompt_fired"] == "", got
        assert "shut down" in got["stuck_fired"], got
        assert "closed" in got["error"].lower() or "reset" in got["error"].lower(), got
        # freed after the grace (at once for an interrupting round), not at the process-group
        # timeout (torchrun's default: 30 minutes)
        assert freed_within_s[0] <= got["freed_s"] < freed_within_s[1], got
