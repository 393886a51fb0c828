"""Live recovery (``ftrain agent --recovery live``) against real etcd, worker processes and signals.

Two agents with two workers each train the tiny config (steps slowed to ~30 ms so faults land
mid-run). A fault must leave the healthy workers' processes running (same PIDs before and after)
and end bitwise equal to a fault-free torchrun run of the same job.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from agents.workers import descendants
from chaos.cluster import Cluster
from testbed.jobs import TINY_CONFIG, max_abs_diff, optimizer_tensors, train_job
from testbed.wait import wait_for

pytestmark = pytest.mark.timeout(300)

STEPS = 120
LIVE = ("--recovery", "live", "--spares", "1")
#: the fixed-order reduction: bitwise equal at any world size, and whatever DDP's bucket layout
DETERMINISTIC = ("--parallel.deterministic=true",)


@pytest.fixture(scope="module")
def golden(tmp_path_factory):
    """The same job without faults: 4 ranks under plain torchrun."""
    return train_job(tmp_path_factory.mktemp("golden"), 4, f"--train.steps={STEPS}", *DETERMINISTIC).final


def _cluster(tmp_path, etcd, *overrides: str) -> Cluster:
    config = tmp_path / "config.toml"
    config.write_text(TINY_CONFIG)
    return Cluster(
        tmp_path,
        etcd.endpoint,
        config,
        steps=STEPS,
        ckpt_interval=20,
        step_sleep_s=0.03,
        overrides=[f"--train.save_final_path={tmp_path / 'final.pt'}", *DETERMINISTIC, *overrides],
    )


def _serving(job: Cluster, node: str, worker_round: int) -> dict[int, int]:
    """local rank -> PID of the process that served ``node`` in ``worker_round``."""
    return {e["local_rank"]: e["pid"] for e in job.events("worker_started", node=node, round=worker_round)}


def _assert_bitwise_golden(final_path, golden) -> None:
    final = torch.load(final_path, weights_only=False)
    assert max_abs_diff(final["model"], golden["model"]) == 0.0
    assert max_abs_diff(optimizer_tensors(final["optim"]), optimizer_tensors(golden["optim"])) == 0.0


def test_a_killed_worker_is_replaced_by_a_spare_and_the_survivors_keep_their_processes(tmp_path, etcd, golden):
    job = _cluster(tmp_path, etcd)
    try:
        job.start("a", *LIVE, nnodes="2:2", nproc=2)
        job.start("b", *LIVE, nnodes="2:2", nproc=2)
        job.wait_step(40)
        round1 = {n: _serving(job, n, 1) for n in ("a", "b")}
        assert all(len(r) == 2 for r in round1.values()), round1
        before = set(descendants(job.agents["b"].pid))  # serving workers and the warm spare
        spares = before - set(round1["b"].values())
        assert spares, f"no spare process under agent b: {before}"
        killed_at = time.time()
        os.kill(round1["b"][1], signal.SIGKILL)

        restored = wait_for(
            lambda: len(job.events("live_restored", round=2)) == 4 and job.events("live_restored", round=2),
            60,
            "4 ranks restored in round 2",
        )
        assert job.wait_exit("a") == 0 and job.wait_exit("b") == 0, job.log_tail()
        round2 = {n: _serving(job, n, 2) for n in ("a", "b")}
        assert round2["a"] == round1["a"], "a's workers were restarted"
        assert round2["b"][0] == round1["b"][0], "b's surviving worker was restarted"
        assert round2["b"][1] in spares, "the replacement was not a spare started before the fault"
        assert sorted(e["reason"] for e in job.events("round_formed")) == ["start", "worker_exit"]
        sources = {e["rank"]: e["source"] for e in restored}
        assert sources[3] == "live_peer" and all(sources[r] == "live_peer" for r in range(4)), sources
        assert not job.events("resume_started", round=2), "the recovery read from storage"
        first_step = min(m["time"] for m in job.metrics() if m["time"] > killed_at)
        print(f"worker kill -> first completed step of round 2: {first_step - killed_at:.2f}s")
        _assert_bitwise_golden(tmp_path / "final.pt", golden)
    finally:
        job.close()
