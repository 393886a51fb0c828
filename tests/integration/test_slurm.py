"""The shipped Slurm recipe (``examples/slurm/ftrain.sbatch`` + ``agent.sh``, unedited) on a real
Slurm: slurmctld and three slurmd, each node in namespaces of its own (:mod:`tests.slurm_cluster`),
etcd and S3 on the bridge's address (``ftrain local up --host``'s stack). Submitted with
``sbatch`` as a user would; the job's settings come only from the environment and the job's TOML
(whose ``[agent]`` section makes failures found fast on one machine).

- a node crash (its link down, every process on it SIGKILLed): Slurm marks the node down, the job
  step lives on (``srun --no-kill``), the agents on the other nodes shrink the job and it completes;
- ``scancel`` drains (workers finish the step and save within KillWait); the job resubmitted under
  the same name resumes from the drained step; ``scontrol requeue`` (what a preemption does)
  drains it again and the requeued job resumes and completes.

Needs root and Debian's ``slurm-wlm`` + ``munge`` (``.ci/run`` installs them as root); skipped with
the reason otherwise."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from ftrain.agents.job_keys import JobKeys
from ftrain.chaos.cluster import JsonlTail
from ftrain.contract.exits import DRAINED
from ftrain.testbed.jobs import TINY_CONFIG
from ftrain.testbed.procs import REPO
from ftrain.testbed.stack import LocalStack
from ftrain.testbed.wait import wait_for
from tests.slurm_cluster import SlurmCluster, unavailable_reason

pytestmark = [
    pytest.mark.timeout(420),
    pytest.mark.skipif(unavailable_reason() is not None, reason=f"Slurm: {unavailable_reason()}"),
]

SBATCH = REPO / "examples" / "slurm" / "ftrain.sbatch"
#: an agent's settings for one machine (the job's [agent] section: the recipe itself is unedited)
FAST_AGENT = "[agent]\nlease_ttl_s = 2\nsettle_s = 1.0\nstart_timeout_s = 90.0\nbackoff_initial_s = 0.2\n"


class SlurmJob:
    """The cluster, the stack and the files of one test's jobs."""

    def __init__(self, slurm: SlurmCluster, stack: LocalStack, base: Path, steps: int, step_sleep_s: float):
        self.slurm, self.stack, self.base = slurm, stack, base
        self.events_path = base / "events.jsonl"
        self.exits_seen = 0  #: agent_exit events already looked at
        self.metrics_path = base / "metrics.jsonl"
        self._events, self._metrics = JsonlTail(self.events_path), JsonlTail(self.metrics_path)
        config = base / "job.toml"
        paths = f'[logging]\nevents_path = "{self.events_path}"\nmetrics_path = "{self.metrics_path}"\n'
        assert "[logging]\n" in TINY_CONFIG and "[checkpoint]" not in TINY_CONFIG
        config.write_text(
            TINY_CONFIG.replace("steps = 10", f"steps = {steps}")
            .replace("global_batch_size = 16", "global_batch_size = 12")  # divides at 1, 2 and 3 nodes
            .replace("[logging]\n", paths)
            + FAST_AGENT
            + "\n[checkpoint]\ninterval = 10\n"
        )
        self.env = {
            **stack.env(),
            "FTRAIN_ETCD": stack.etcd_url,
            "FTRAIN_CONFIG": str(config),
            "FTRAIN_CHECKPOINT_URI": stack.s3_server().url("slurm"),
            "FTRAIN_NPROC_PER_NODE": "1",
            "FTRAIN_RUN_DIR": str(base / "run"),
            "FTRAIN_FAULT_STEP_SLEEP_S": str(step_sleep_s),
            "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
        }

    def submit(self, name: str, *args: str) -> int:
        return self.slurm.sbatch(
            f"--job-name={name}", f"--output={self.base}/slurm-%j.out", *args, str(SBATCH), env=self.env, cwd=REPO
        )

    def events(self, name: str, **match: Any) -> list[dict[str, Any]]:
        return [e for e in self._events.records() if e.get("event") == name and _matches(e, match)]

    def step(self) -> int:
        return max((m["step"] for m in self._metrics.records()), default=0)

    def wait(self, job_id: int, predicate: Any, timeout_s: float, what: str) -> Any:
        """Wait for ``predicate`` while the Slurm job runs (its end fails the wait at once)."""
        return wait_for(
            predicate,
            timeout_s,
            what,
            poll_s=0.2,
            alive=lambda: self.slurm.job_state(job_id) in ("PENDING", "CONFIGURING", "RUNNING", "REQUEUED"),
            context=lambda: self.context(job_id),
        )

    def wait_drained(self, agents: int, timeout_s: float = 60) -> None:
        """Wait until ``agents`` more agents than last time exited, and assert that they drained."""
        seen = self.exits_seen
        exits = wait_for(
            lambda: len(e := self.events("agent_exit")) >= seen + agents and e, timeout_s, f"{agents} agents exit"
        )
        self.exits_seen = len(exits)
        assert [e["exit_code"] for e in exits[seen:]] == [DRAINED] * (len(exits) - seen), exits

    def wait_state(self, job_id: int, states: set[str], timeout_s: float) -> str:
        return wait_for(
            lambda: (s := self.slurm.job_state(job_id)) in states and s,
            timeout_s,
            f"job {job_id} {' or '.join(sorted(states))}",
            poll_s=0.2,
            context=lambda: self.context(job_id),
        )

    def context(self, job_id: int) -> str:
        out = "\n".join(p.read_text()[-3000:] for p in sorted(self.base.glob("slurm-*.out")))
        return f"job {json.dumps(self.slurm.job(job_id))}\n{out}\n{self.slurm.log_tail(1500)}"


def _matches(record: dict[str, Any], match: dict[str, Any]) -> bool:
    return all(record.get(k) == v for k, v in match.items())


@pytest.fixture
def cluster(tmp_path):
    with SlurmCluster(tmp_path / "slurm") as slurm:
        assert slurm.net is not None
        with LocalStack(tmp_path / "stack", host=slurm.net.root_address) as stack:
            yield slurm, stack


def test_a_node_crash_and_the_job_completes_on_the_other_nodes(cluster, tmp_path):
    slurm, stack = cluster
    job = SlurmJob(slurm, stack, tmp_path, steps=60, step_sleep_s=0.1)
    began = time.monotonic()
    job_id = job.submit("crash", "--nodes=3")
    job.wait(
        job_id, lambda: len({e["node"] for e in job.events("worker_started", world_size=3)}) == 3, 120, "3 workers"
    )
    trained_s = time.monotonic() - began
    job.wait(job_id, lambda: job.step() >= 15, 120, "step 15")
    crashed_at, step_at_crash = time.monotonic(), job.step()
    # the leader's node, unless it is the batch node (n1: the batch script and srun run there, and
    # Slurm ends a job whose batch host fails, --no-kill or not)
    record = stack.etcd.client().get(JobKeys("crash").leader)
    leader = record.value.decode() if record is not None else ""
    victim = leader if leader in ("n2", "n3") else "n3"
    slurm.crash(victim)
    shrunk = job.wait(job_id, lambda: next(iter(job.events("live_restored", world_size=2)), None), 120, "2 nodes")
    shrunk_s = time.monotonic() - crashed_at
    wait_for(lambda: slurm.node_states().get(victim, "").startswith("down"), 90, f"Slurm marks {victim} down")
    down_s = time.monotonic() - crashed_at
    state = job.wait_state(job_id, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}, 240)
    assert state == "COMPLETED", job.context(job_id)
    assert job.step() == 60
    final = job.events("job_final")
    assert final and all(f["status"] == "succeeded" for f in final), final
    role = "the leader" if victim == leader else "not the leader"
    print(
        f"\nslurm crash: 3 workers training {trained_s:.1f}s after sbatch; {victim} ({role}) crashed at step "
        f"{step_at_crash}; a round of 2 trained on from step {shrunk['step']} {shrunk_s:.1f}s later; Slurm marked "
        f"it down after {down_s:.1f}s; job {state} {time.monotonic() - began:.1f}s after sbatch"
    )


def test_scancel_drains_a_resubmission_resumes_and_a_requeue_resumes_again(cluster, tmp_path):
    slurm, stack = cluster
    job = SlurmJob(slurm, stack, tmp_path, steps=90, step_sleep_s=0.1)
    began = time.monotonic()
    first = job.submit("resume", "--nodes=2")
    job.wait(first, lambda: job.step() >= 13, 180, "step 13")
    cancelled_at = time.monotonic()
    slurm.run(["scancel", str(first)])
    job.wait_drained(2)
    job.wait_state(first, {"CANCELLED", "COMPLETED", "FAILED"}, 60)
    drained = max(e["step"] for e in job.events("ckpt_committed"))
    assert drained > 10, f"the drain saved no step after the interval's step 10: {job.events('ckpt_committed')}"
    drain_s = time.monotonic() - cancelled_at
    assert not job.events("job_final"), "a drain is not the job's end"

    second = job.submit("resume", "--nodes=2")
    job.wait(second, lambda: job.events("resumed", step=drained), 180, f"resumed from step {drained}")
    job.wait(second, lambda: job.step() >= drained + 5, 120, "training after the resume")
    requeued_at = time.monotonic()
    slurm.run(["scontrol", "requeue", str(second)])  # what PreemptMode=REQUEUE does to a preempted job
    job.wait_drained(2)
    wait_for(lambda: slurm.job(second).get("Reason") == "BeginTime", 60, "the job requeued, pending")
    requeue_s = time.monotonic() - requeued_at
    requeued = max(e["step"] for e in job.events("ckpt_committed"))
    assert requeued >= drained + 5, f"the requeue's drain saved no newer step than {drained}"
    # Slurm holds a requeued job ~120 s (its BeginTime); a test need not wait that out
    slurm.run(["scontrol", "update", f"JobId={second}", "StartTime=now"])
    job.wait(second, lambda: job.events("resumed", step=requeued), 180, f"requeued job resumed from step {requeued}")
    state = job.wait_state(second, {"COMPLETED", "FAILED", "CANCELLED"}, 240)
    assert state == "COMPLETED", job.context(second)
    assert job.step() == 90
    print(
        f"\nslurm drain: scancel drained at step {drained} in {drain_s:.1f}s; resubmitted job resumed there; "
        f"requeue drained at step {requeued} in {requeue_s:.1f}s and the requeued job resumed there; "
        f"{time.monotonic() - began:.1f}s in all"
    )
