"""The round watchdog (:mod:`ftrain.recovery.round_watchdog`) on 3 real gloo ranks: a rank blocked in a
collective with a stopped peer is freed soon after its agent assigns a newer round, and ranks
that leave a round in time are left alone."""

from __future__ import annotations

import json
import re
import sys

import pytest

from ftrain.contract import exits
from ftrain.recovery.round_watchdog import MIN_GRACE_S
from ftrain.testbed.jobs import run, worker_env

pytestmark = pytest.mark.dist


@pytest.mark.parametrize(
    ("kind", "why"), [("grace", "had not reached a step boundary"), ("interrupt", "lost a member")]
)
def test_a_rank_stuck_with_a_stopped_peer_is_freed_and_a_prompt_one_is_left_alone(tmp_path, kind, why):
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=3",
        "tests/distributed/round_watchdog_worker.py", str(tmp_path), kind,
    ]  # fmt: skip
    proc = run(cmd, timeout_s=120, env=worker_env())
    assert proc.returncode == 0, proc.stdout[-4000:]
    fired = []
    for rank in (0, 1):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got["prompt_fired"] == "", got
        assert "closed" in got["error"].lower() or "reset" in got["error"].lower(), got
        # freed soon, not at the process-group timeout (torchrun's default: 30 minutes)
        assert got["freed_s"] < 60, got
        if not got["stuck_fired"]:
            continue  # freed first by the other rank's watchdog shutting their connection down
        assert "shut down" in got["stuck_fired"] and why in got["stuck_fired"], got
        # the watchdog waited the grace after it saw the newer round (none for an interrupting
        # round): its own measure, which a busy machine does not stretch the way it stretches the
        # time to the collective's error
        waited = re.search(r"assigned (\d+\.\d+)s ago", got["stuck_fired"])
        assert waited is not None, got
        waited_s = float(waited.group(1))
        assert waited_s >= MIN_GRACE_S if kind == "grace" else waited_s < MIN_GRACE_S, got
        fired.append(rank)
    assert fired, "neither stuck rank's watchdog fired"


STUCK_WORKER = """
import sys, time
from ftrain.contract.control import Assignment, ControlFile
from ftrain.recovery.round_watchdog import RoundWatchdog

control = ControlFile(sys.argv[1])
def assign(round_):
    control.write(Assignment(round=round_, rank=0, world_size=1, local_rank=0, local_world_size=1, node_rank=0,
                             nnodes=1, master_addr="127.0.0.1", master_port=29500, interrupt=True))
assign(1)
with RoundWatchdog(control.path, 1, lambda: 0.01, set(), give_up_s=0.5):
    assign(2)
    time.sleep(60)  # blocked where no socket shutdown reaches
print("left the round")
"""


def test_a_rank_that_cannot_be_freed_ends_itself_with_its_stacks(tmp_path):
    """What no shutdown reaches (here: a sleep; in a job, a rendezvous retrying a dead peer) is
    ended by the process's exit, so that its agent replaces it instead of waiting for a timeout."""
    proc = run([sys.executable, "-c", STUCK_WORKER, str(tmp_path / "control")], timeout_s=30, env=worker_env())
    assert proc.returncode == exits.STUCK, proc.stdout[-4000:]
    assert "left the round" not in proc.stdout
    assert "ending this worker" in proc.stdout
    blocked_line = next(n for n, line in enumerate(STUCK_WORKER.splitlines(), 1) if "time.sleep(60)" in line)
    assert f'File "<string>", line {blocked_line}' in proc.stdout, proc.stdout[-4000:]  # the main thread's stack
