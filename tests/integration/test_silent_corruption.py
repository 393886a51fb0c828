"""Silent data corruption under the agents: a bit flips in one rank's memory, the consistency
check finds that rank and its node, every rank rolls back to a verified checkpoint, and the
node whose rank was found corrupt twice drains itself (its hardware is suspect); the job goes
on without it and ends bitwise equal to a fault-free run."""

from __future__ import annotations

import pytest
import torch

from ftrain.chaos.cluster import Cluster
from ftrain.contract.exits import DRAINED
from ftrain.testbed.jobs import TINY_CONFIG, max_abs_diff, optimizer_tensors, train_job

pytestmark = pytest.mark.timeout(300)

STEPS = 60
#: three replicas (a majority can name the corrupt one), the fixed-order reduction (bitwise
#: equal at any world size), a check after every step and a rollback on a mismatch
SETTINGS = (
    "--train.global_batch_size=12",
    "--parallel.deterministic=true",
    "--consistency.interval=1",
    "--consistency.on_mismatch=rollback",
)
FLIPS = (25, 35)


@pytest.fixture
def golden(tmp_path):
    return train_job(tmp_path / "golden", 3, f"--train.steps={STEPS}", *SETTINGS[:2]).final


def test_a_rank_found_corrupt_twice_drains_its_node_and_the_job_finishes_without_it(tmp_path, etcd, golden):
    config = tmp_path / "config.toml"
    config.write_text(TINY_CONFIG)
    job = Cluster(
        tmp_path / "job",
        etcd.endpoint,
        config,
        steps=STEPS,
        ckpt_interval=10,
        step_sleep_s=0.03,
        env={"FTRAIN_FAULT_BITFLIP": ",".join(f"{s}:2:1" for s in FLIPS)},  # rank 2 of round 1
        overrides=[f"--train.save_final_path={tmp_path / 'final.pt'}", *SETTINGS],
    )
    try:
        for node in ("a", "b", "c"):
            job.start(node, nnodes="2:3")
        corrupt = job.wait_event("worker_started", round=1, rank=2, timeout_s=120)["node"]
        healthy = sorted({"a", "b", "c"} - {corrupt})

        suspect = job.wait_event("node_suspect", timeout_s=180)
        assert suspect["node"] == corrupt and suspect["corruptions"] == 2 and suspect["limit"] == 2
        assert job.wait_exit(corrupt) == DRAINED, job.log_tail()  # drained, not failed
        # its workers stopped (exit 0), the others' yielded: a node_left round, no failure
        exits = [(e["node"], e["outcome"]) for e in job.events("workers_exited")]
        assert (corrupt, "stopped") in exits and all(outcome != "failed" for _, outcome in exits), exits
        for node in healthy:
            assert job.wait_exit(node, timeout_s=180) == 0, job.log_tail()

        found = {
            (e["step"], tuple(e["ranks"]), tuple(e["nodes"]), e["decided"]) for e in job.events("replica_mismatch")
        }
        assert found == {(s, (2,), (corrupt,), True) for s in FLIPS}
        assert sorted({e["step"] for e in job.events("rolled_back")}) == [20, 30]
        after = [r for r in job.events("round_formed") if r["new_round"] > 1]
        assert after and sorted(after[-1]["members"]) == healthy and after[-1]["world_size"] == 2
        assert after[-1]["reason"] == "node_left", after
        assert job.step() == STEPS and job.events("job_final")[0]["status"] == "succeeded"

        final = torch.load(tmp_path / "final.pt", weights_only=False)
        assert max_abs_diff(final["model"], golden["model"]) == 0.0
        assert max_abs_diff(optimizer_tensors(final["optim"]), optimizer_tensors(golden["optim"])) == 0.0
    finally:
        job.close()
