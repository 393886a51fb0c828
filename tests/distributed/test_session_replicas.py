"""The replica check in a user's loop (:mod:`ftrain.session_replicas`) on real gloo ranks: one
rank's parameter silently corrupted after an update is found at that step, named (the two
other replicas agree), and ``rollback`` trains on from the newest commit to the same final
weights as a run without the corruption, bit for bit; ``halt`` ends the job naming the rank."""

from __future__ import annotations

import json
import sys

import pytest

from ftrain.testbed.jobs import run, worker_env

pytestmark = pytest.mark.dist

WORKER = "tests/distributed/session_replicas_worker.py"


def _torchrun(tmp_path, mode: str):
    out, events = tmp_path / f"{mode}.json", tmp_path / f"events-{mode}.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=3"]
    env = worker_env(OUT=str(out), FTRAIN_EVENTS=str(events))
    proc = run([*cmd, WORKER, mode, str(tmp_path / f"ckpt-{mode}")], timeout_s=240, env=env)
    lines = events.read_text().splitlines() if events.exists() else []
    return proc, (json.loads(out.read_text()) if out.exists() else None), [json.loads(line) for line in lines]


def test_a_corrupt_replica_is_found_named_and_rolled_back_or_halted(tmp_path):
    straight, reference, _ = _torchrun(tmp_path, "straight")
    assert straight.returncode == 0, straight.stdout[-4000:]
    assert reference["runs"] == 1

    proc, result, events = _torchrun(tmp_path, "rollback")
    assert proc.returncode == 0, proc.stdout[-4000:]
    mismatches = [e for e in events if e["event"] == "replica_mismatch"]
    assert mismatches and {e["step"] for e in mismatches} == {5}, mismatches
    assert all(e["ranks"] == [2] and e["decided"] and e["policy"] == "rollback" for e in mismatches), mismatches
    rolled = [e for e in events if e["event"] == "rolled_back"]
    assert rolled and {e["step"] for e in rolled} == {4}, rolled  # the newest commit before the corruption
    assert result["runs"] == 2  # train ran again, in the same processes
    assert result["final"] == reference["final"]  # bitwise: the corruption left nothing behind

    halted, _, events = _torchrun(tmp_path, "halt")
    assert halted.returncode != 0
    assert "replicas differ on ranks [2]" in halted.stdout, halted.stdout[-4000:]
    assert [e["step"] for e in events if e["event"] == "replica_mismatch"][:1] == [5]
