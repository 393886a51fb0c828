"""A user's own FSDP2 loop (tests/integration/users_loop/train.py: plain torch modules, two
parameter groups, gradient accumulation and clipping, a cosine schedule, a buffer and a Stateful of
its own; not the shipped example) under two ``ftrain agent --script --recovery live`` nodes: a
SIGKILLed worker and then a lost node are healed from the memory tier (every process, the spare
that replaces the killed worker too, ran the loop's warm-up before its round) — the shards the ranks and
their buddies keep in memory, no checkpoint read back from storage — while the surviving process
serves every round, and the run ends bitwise equal to the straight one, weights, buffer, optimizer
path and the loop's own statistics alike."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import pytest

from ftrain.testbed.procs import kill_tree
from ftrain.testbed.wait import wait_for
from tests.script_agents import (
    assert_agents_exit,
    assert_ends_as,
    committed_steps,
    rounds_formed,
    served_by,
    snapshots_complete,
    start_agent,
    stop_agents,
    torchrun_script,
)

pytestmark = pytest.mark.timeout(400)

LOOP = Path(__file__).resolve().parent / "users_loop" / "train.py"
STATS = re.compile(r"^final stats .*$", re.M)


def test_a_users_fsdp_loop_heals_a_worker_kill_and_a_node_loss_from_memory_bitwise(tmp_path, etcd):
    straight = tmp_path / "straight"
    straight.mkdir()
    out = torchrun_script(LOOP, straight, 2, "--ckpt", "ck", "--final-weights", "final.pt")
    live, script_args = ("--recovery", "live"), ("--ckpt", "ck", "--step-sleep-s", "0.05")
    agents = {n: start_agent(tmp_path, etcd.endpoint, n, LOOP, *live, script_args=script_args) for n in "ab"}
    try:
        # a snapshot newer than the newest commit on both ranks: what the heal goes on from
        wait_for(lambda: snapshots_complete(tmp_path, 10), 180, "a snapshot of step 10 or later on both ranks")
        (_, [victim]), *_ = served_by(tmp_path, "b")[-1:]
        os.kill(victim, signal.SIGKILL)  # a worker: node b's agent hands its rank to a spare
        wait_for(lambda: len(rounds_formed(tmp_path)) >= 2, 60, "the round after the worker's death")
        wait_for(lambda: snapshots_complete(tmp_path, 0, since_round=2), 120, "snapshots of round 2 on both ranks")
        kill_tree(agents.pop("b"))  # node b is lost; --nnodes 2:2: a's process waits for a replacement host
        agents["c"] = start_agent(tmp_path, etcd.endpoint, "c", LOOP, *live, script_args=script_args)
        assert_agents_exit(tmp_path, agents)
        reasons = rounds_formed(tmp_path)
        assert reasons[:2] == ["start", "worker_exit"] and len(reasons) >= 3, reasons
        served = served_by(tmp_path, "a")
        assert len(served) >= 3 and len({pid for _, (pid,) in served}) == 1, served  # one process, every round
        worker_logs = "".join(p.read_text() for p in tmp_path.glob("*/workers.log"))
        assert worker_logs.count("from memory_tier") >= 2, worker_logs[-4000:]  # both new processes
        assert "from storage" not in worker_logs and "Traceback" not in worker_logs, worker_logs[-4000:]
        serving = {pid for node in "abc" for _, pids in served_by(tmp_path, node) for pid in pids}
        assert all(f"warmed up (pid {pid})" in worker_logs for pid in serving), (
            serving
        )  # the loop's warm-up, spares too
        assert committed_steps(tmp_path / "ck")[-1] == 60
        assert_ends_as(tmp_path, straight / "final.pt")
        assert STATS.findall(worker_logs) == STATS.findall(out), (STATS.findall(worker_logs), STATS.findall(out))
    finally:
        stop_agents(agents)
