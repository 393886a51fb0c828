"""The fence window, closed: a worker frozen between its fence check and its manifest PUT while
a newer round forms can store its manifest later, but cannot commit (real agents, etcd, worker
processes and signals).

Rank 0 stops itself (SIGSTOP, ``FTRAIN_FAULT_PAUSE_AFTER_FENCE``) in the commit of step 40,
right after its fence check passed; the test freezes its agent too, so that nothing on that
node kills it (a frozen host). The other node's agent sees the lease expire and forms round 2
alone; its worker goes on live. Then the frozen worker is continued: it stores its manifest of
step 40, and the commit record (one etcd transaction with the round check) is refused. Its agent
is continued last, finds itself out of the job, and its node rejoins without a human.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch

from agents.records import JobKeys
from chaos.cluster import Cluster
from chaos.faults.targets import continue_process, is_stopped
from checkpoint.catalog import list_steps
from checkpoint.storage import Storage
from ftrain.fence import EtcdRoundFence
from testbed.jobs import TINY_CONFIG, max_abs_diff, optimizer_tensors, train_job
from testbed.wait import wait_for

pytestmark = pytest.mark.timeout(300)

STEPS, PAUSED_STEP = 120, 40
DETERMINISTIC = "--parallel.deterministic=true"


def test_a_worker_frozen_between_its_fence_check_and_its_put_cannot_commit(tmp_path, etcd):
    golden = train_job(tmp_path / "golden", 2, f"--train.steps={STEPS}", DETERMINISTIC).final
    config = tmp_path / "config.toml"
    config.write_text(TINY_CONFIG)
    job = Cluster(
        tmp_path,
        etcd.endpoint,
        config,
        steps=STEPS,
        ckpt_interval=20,
        step_sleep_s=0.05,
        overrides=[f"--train.save_final_path={tmp_path / 'final.pt'}", DETERMINISTIC],
    )
    pause = {"FTRAIN_FAULT_PAUSE_AFTER_FENCE": f"{PAUSED_STEP}:0:1"}
    frozen: list[int] = []
    try:
        job.start("a", nnodes="1:2", env=pause)
        job.start("b", nnodes="1:2", env=pause)
        wait_for(lambda: len(job.events("worker_started", round=1)) == 2, 90, "round 1")
        zombie = next(e for e in job.events("worker_started", round=1) if e["rank"] == 0)
        wait_for(lambda: is_stopped(zombie["pid"]), 90, f"rank 0 to stop in the commit of step {PAUSED_STEP}")
        agent = job.agents[zombie["node"]].pid
        os.kill(agent, signal.SIGSTOP)  # the frozen host: nothing there kills the worker
        frozen += [zombie["pid"], agent]
        survivor = "a" if zombie["node"] == "b" else "b"

        round2 = wait_for(lambda: job.events("round_formed", new_round=2), 30, "round 2 without the frozen node")[0]
        assert round2["members"] == [survivor], round2
        wait_for(lambda: job.events("live_restored", round=2), 30, "round 2's worker to go on")
        continue_process(zombie["pid"])  # the zombie wakes up, past its fence check, and stores its manifest
        # its fence refuses the commit record (said in its log: its training thread, blocked on
        # the dead round's group, may never report the failed save)
        log = tmp_path / zombie["node"] / "workers.log"
        refused = f"round 1 is no longer current ({JobKeys(job.job).round} moved on)"
        wait_for(lambda: refused in log.read_text(errors="replace"), 30, "the zombie's commit record to be refused")
        keys = JobKeys(job.job)
        recorded = EtcdRoundFence([etcd.endpoint], keys.round, commits_key=keys.commits).recorded() or {}
        info = next(s for s in list_steps(Storage(str(tmp_path / "ckpt")), job=job.job) if s.step == PAUSED_STEP)
        assert info.state == "committed" and info.manifest is not None and info.manifest.round == 1, info
        # what a reader without the records would load: the zombie's step; with them, nothing
        assert PAUSED_STEP not in recorded, recorded
        judged = list_steps(Storage(str(tmp_path / "ckpt")), job=job.job, recorded=recorded)
        assert next(s for s in judged if s.step == PAUSED_STEP).state == "uncommitted"
        continue_process(agent)
        frozen.clear()

        assert job.wait_exit(survivor, timeout_s=180) == 0, job.log_tail()
        assert job.wait_exit(zombie["node"], timeout_s=60) == 0, job.log_tail()
        committed = job.events("ckpt_committed")
        assert not [e for e in committed if e["round"] == 1 and e["step"] >= PAUSED_STEP], committed
        assert all(e["ckpt_round"] >= 2 or e["step"] < PAUSED_STEP for e in job.events("ckpt_loaded"))
        joined = [e for e in job.events("round_formed") if e["new_round"] > 2]
        assert joined and sorted(joined[-1]["members"]) == ["a", "b"], "the frozen node did not rejoin"
        final = torch.load(tmp_path / "final.pt", weights_only=False)
        assert max_abs_diff(final["model"], golden["model"]) == 0.0
        assert max_abs_diff(optimizer_tensors(final["optim"]), optimizer_tensors(golden["optim"])) == 0.0
    finally:
        for pid in frozen:
            continue_process(pid)
        job.close()
