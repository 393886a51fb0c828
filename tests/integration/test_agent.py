"""The node agent against real etcd, real torchrun workers and real signals.

Every test runs a small job (TINY_CONFIG, ddp, one worker per node unless said otherwise, steps
slowed to ~30 ms so faults land mid-run) and checks what the agents and workers recorded in the
shared event log, the metrics and the checkpoint directory.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from ftrain.agent_link.fence import EtcdRoundFence
from ftrain.agent_link.heartbeat import process_gone
from ftrain.agents.job_keys import JobKeys
from ftrain.checkpoint.errors import StaleRoundError
from ftrain.contract import exits
from ftrain.contract.heartbeat import STEP_PHASES
from ftrain.testbed.jobs import TINY_CONFIG, run, torchrun_cmd, worker_env
from ftrain.testbed.procs import REPO
from tests.agent_support import AgentJob, wait_for

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def job(tmp_path, etcd):
    j = AgentJob(tmp_path, etcd.endpoint)
    try:
        yield j
    finally:
        j.close()


def _rounds(job: AgentJob) -> list[dict]:
    return sorted(job.events("round_formed"), key=lambda e: e["new_round"])


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        return reply.read().decode()


def _metric(text: str, name: str, **labels: str) -> float | None:
    for line in text.splitlines():
        if line.startswith((name + "{", name + " ")) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return None


def _ftrain_status(job) -> subprocess.CompletedProcess:
    """``ftrain status`` of ``job``, as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "ftrain", "status", "--etcd", job.etcd, "--job", job.job],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=REPO,
        env=worker_env(),
    )


def test_a_killed_worker_then_a_hung_one_restart_from_the_last_checkpoint_past_garbage_records(job, client):
    """Restart recovery of two worker faults in one job, with garbage in etcd all along.

    At step 20 records no agent wrote land in the job's keys (not JSON, a wrong type, a newer
    version's extra field, a malformed round key): they are skipped, each logged once (not every
    tick), and ``ftrain status`` warns about them. At step 50 node b's worker is SIGKILLed: both
    nodes restart (round 2, ``worker_exit``) from the newest commit, and node a's metrics show
    the round, the restart and its own rank's step breakdown. Then node b's worker of round 2
    is frozen (SIGSTOP): it is taken for a hang, every worker's stack is dumped (the stopped
    one's too, continued just long enough to dump), and the job restarts again (round 3,
    ``hang``) and finishes. (Was three tests: a worker kill, a hang, garbage records.)"""
    keys = JobKeys(job.job)
    job.start("a", "--metrics-port", "0")
    job.start("b")
    port = job.wait_event("agent_metrics", node="a")["port"]
    job.wait_step(20)
    client.put(keys.status("x"), "not json")
    client.put(keys.node("ghost"), '{"node_id": "ghost", "pid": "1"}')  # wrong type: not a live member
    client.put(keys.status("a"), json.dumps({"round": 1, "state": "running", "from_v9": True}))  # a newer version's
    client.put(keys.prefix + "rounds/1x", "{")
    job.wait_step(50)
    wait_for(lambda: (_metric(_scrape(port), "ftrain_step") or 0) >= 50, 10, "step 50 in the metrics")
    text = _scrape(port)
    assert _metric(text, "ftrain_round") == 1
    assert _metric(text, "ftrain_restarts_total", cause="worker_exit") in (None, 0.0)
    assert _metric(text, "ftrain_last_committed_step") >= 40 and _metric(text, "ftrain_checkpoint_duration_seconds") > 0
    # each local rank's step breakdown, labelled by global rank: node a's rank only
    mine = job.events("worker_started", node="a")[0]["rank"]
    assert (_metric(text, "ftrain_step_phase_seconds", rank=str(mine), phase="forward") or 0) > 0
    assert _metric(text, "ftrain_step_phase_seconds", rank=str(1 - mine), phase="forward") is None
    line = job.metrics()[-1]
    assert set(line["phases_s"]) == set(STEP_PHASES) and len(line["rank_busy_s"]) == len(line["rank_comm_wait_s"]) == 2
    committed = job.committed_steps()
    os.kill(job.worker_pids("b")[0], signal.SIGKILL)

    resumed = [job.wait_event("resumed", round=2, rank=r) for r in (0, 1)]

    def round_2_scraped() -> str | None:
        text = _scrape(port)
        return text if _metric(text, "ftrain_round") == 2 else None

    text = wait_for(round_2_scraped, 30, "round 2 in the metrics")
    assert _metric(text, "ftrain_restarts_total", cause="worker_exit") == 1.0
    assert _metric(text, "ftrain_productive_seconds") > 0
    assert len({e["step"] for e in resumed}) == 1
    assert resumed[0]["step"] >= max(committed), "resumed from an older step than the last committed one"
    assert resumed[0]["step"] in job.committed_steps()

    job.wait_step(resumed[0]["step"] + 5)  # round 2 trains: a step past its resume
    stopped = job.worker_pids("b", 2)[0]
    os.kill(stopped, signal.SIGSTOP)
    assert job.wait_exit("a") == 0 and job.wait_exit("b") == 0, job.log_tail()
    assert [r["reason"] for r in _rounds(job)] == ["start", "worker_exit", "hang"]
    # whichever agent noticed first, every worker's stack was dumped before the restart,
    # the stopped one's included (continued just long enough to dump)
    stacks = {int(pid): text for e in job.events("hang") for pid, text in e["stacks"].items()}
    assert stopped in stacks and "was stopped" in stacks[stopped], stacks
    assert all('File "' in text and "ftrain/train.py" in text for text in stacks.values()), stacks
    assert job.step() == 120
    assert job.events("job_final")[0]["status"] == "succeeded"

    # the garbage: skipped by every agent, logged once by the one that reads statuses (the leader)
    leader = job.events("leader_elected")[0]["node"]
    bad = {e["key"] for e in job.events("bad_record", node=leader)}
    assert bad == {keys.status("x"), keys.node("ghost"), keys.prefix + "rounds/1x"}, bad
    assert {e["key"] for e in job.events("bad_record")} == bad, "a record of a newer version was refused"
    assert len(job.events("bad_record", node=leader, key=keys.status("x"))) == 1, "logged once, not every tick"
    status = _ftrain_status(job)
    assert status.returncode == 0, status.stderr
    assert "SUCCEEDED" in status.stdout and f"warning: unreadable job record {keys.status('x')}" in status.stdout


def test_a_joining_node_enters_at_the_next_checkpoint_and_losing_the_leader_shrinks_within_ttl_plus_settle(job):
    """Node a trains alone; node b joins at step 15 and enters at the next committed checkpoint
    (round 2, ``scale_up``, resharded from world size 1 to 2). Then node a, the leader and node
    rank 0, is lost with its workers: both roles migrate, and node b goes on alone (round 3, world
    size 1) within the lease TTL plus settle, resharded from world size 2, to the last step.
    (Was two tests: a node joining, a node lost.)"""
    job.start("a")
    job.wait_step(15)
    job.start("b")
    joined_at = job.wait_event("agent_registered", node="b")["time"]
    resumed = wait_for(
        lambda: len(job.events("resumed", round=2)) == 2 and job.events("resumed", round=2), 90, "round 2"
    )
    rounds = _rounds(job)
    assert [r["reason"] for r in rounds] == ["start", "scale_up"]
    assert rounds[1]["members"] == ["a", "b"]
    first_commit_after_join = min(e["time"] for e in job.events("ckpt_committed") if e["time"] > joined_at)
    assert rounds[1]["time"] >= first_commit_after_join, "grew before a checkpoint was committed"
    assert {e["world_size"] for e in resumed} == {2} and {e["from_world_size"] for e in resumed} == {1}

    # a step committed by the round of two, so the round after the loss reshards from world size 2
    wait_for(lambda: job.events("ckpt_committed", round=2), 90, "a commit in round 2")
    lost = job.events("leader_elected")[0]["node"]  # lose the leader, which is also node rank 0: both roles migrate
    assert lost == "a" == rounds[1]["members"][0], (lost, rounds[1])
    survivor = "b"
    killed_at = time.time()
    job.kill_agent(lost)
    for pid in job.worker_pids(lost):  # the whole host goes: its workers too
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert job.wait_exit(survivor) == 0, job.log_tail()
    rounds = _rounds(job)
    assert len(rounds) == 3, rounds
    assert rounds[2]["members"] == [survivor] and rounds[2]["world_size"] == 1
    assert rounds[2]["time"] - killed_at < 2 + 1 + 2.5, "smaller round took longer than TTL + settle (+ slack)"
    resumed = job.events("resumed", round=3)
    assert len(resumed) == 1 and resumed[0]["from_world_size"] == 2 and resumed[0]["world_size"] == 1
    assert job.step() == 120


def test_the_job_survives_etcd_outages_longer_than_the_lease_a_pause_then_a_restart(job, etcd):
    """etcd frozen (SIGSTOP) at step 30, then, once the agents have re-registered, stopped and
    started again: each time both agents notice the lost lease, re-register when etcd is back, and
    the job goes on to its last step and succeeds. (Was two tests, one per outage, a job each.)"""
    job.start("a")
    job.start("b")
    job.wait_step(30)
    for outage in ("pause", "restart"):
        assert not job.events("job_final"), f"the job ended before the {outage} outage"
        began = time.time()

        def after_outage(name: str, began: float = began) -> list[dict]:
            return [e for e in job.events(name) if e["time"] >= began]

        if outage == "pause":
            etcd.pause()
            try:
                wait_for(lambda: len(after_outage("lease_lost")) >= 2, 20, "both agents to notice the lost lease")
            finally:
                etcd.resume()
        else:
            etcd.stop()
            try:
                wait_for(lambda: len(after_outage("lease_lost")) >= 2, 20, "both agents to notice the lost lease")
            finally:
                etcd.restart(timeout_s=20)
        wait_for(
            lambda: len(after_outage("agent_registered")) >= 2,
            30,
            f"the agents to re-register after the {outage} outage",
            context=job.log_tail,
        )
    assert job.wait_exit("a") == 0 and job.wait_exit("b") == 0, job.log_tail()
    assert job.step() == 120
    registrations = job.events("agent_registered")
    assert len(registrations) >= 6, "agents did not re-register after losing their lease"
    assert job.events("job_final")[0]["status"] == "succeeded"


def test_a_second_agent_with_a_live_node_id_is_refused(job):
    job.start("a", nnodes="1:1")
    job.wait_event("agent_registered", node="a")
    dup = subprocess.run(
        [
            sys.executable,
            "-m",
            "ftrain",
            "agent",
            "--etcd",
            job.etcd,
            "--job",
            job.job,
            "--nnodes",
            "1:1",
            "--nproc-per-node",
            "1",
            "--node-id",
            "a",
            "--",
            *job.worker_args,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        env=worker_env(),
    )
    assert dup.returncode == 2
    assert "node id 'a' is already registered" in dup.stderr
    assert job.agents["a"].poll() is None, "the first agent must be unaffected"


def test_the_fence_moves_on_from_a_member_that_holds_requests_and_asks_the_answering_one_first(etcd, client):
    """A member cut off from the quorum takes requests and never answers: the fence gives it the
    short failover timeout, not the full one, and the next check goes to the member that answered."""
    keys = JobKeys("failover")
    client.put(keys.round, "4")
    asked: list[str] = []

    class CountingFence(EtcdRoundFence):
        def _post(self, endpoint, path, body, token, timeout_s):
            asked.append(endpoint)
            return super()._post(endpoint, path, body, token, timeout_s)

    with socket.create_server(("127.0.0.1", 0)) as silent:  # listens, never accepts: requests hang
        holding = f"http://127.0.0.1:{silent.getsockname()[1]}"
        fence = CountingFence([holding, etcd.endpoint], keys.round, timeout_s=30.0)
        started = time.monotonic()
        fence.check(4)
        assert time.monotonic() - started < 30.0, "the first pass must not wait the full timeout"
        assert asked == [holding, etcd.endpoint]
        fence.check(4)
        assert asked[2:] == [etcd.endpoint]


@pytest.mark.parametrize("stale_round", ["1", "0"])  # 0: a round that was never current (chaos's zombie in round 1)
def test_a_worker_of_an_old_round_cannot_commit(tmp_path, etcd, client, stale_round):
    keys = JobKeys("fenced")
    client.put(keys.round, "2")
    with pytest.raises(StaleRoundError, match="no longer current"):
        EtcdRoundFence([etcd.endpoint], keys.round).check(1)
    EtcdRoundFence([etcd.endpoint], keys.round).check(2)  # the current round may commit

    cfg = tmp_path / "config.toml"
    cfg.write_text(TINY_CONFIG)
    events = tmp_path / "events.jsonl"
    out = run(
        torchrun_cmd(
            1,
            cfg,
            f"--checkpoint.uri={tmp_path / 'ckpt'}",
            "--checkpoint.interval=5",
            f"--logging.events_path={events}",
        ),
        timeout_s=180,
        env=worker_env(FTRAIN_ETCD=etcd.endpoint, FTRAIN_FENCE_KEY=keys.round, FTRAIN_ROUND=stale_round),
    )
    assert out.returncode == 0, out.stdout
    failures = [json.loads(line) for line in events.read_text().splitlines() if '"ckpt_failed"' in line]
    assert failures and all("StaleRoundError" in f["error"] for f in failures)
    assert not list((tmp_path / "ckpt").glob("*/manifest.json")), "a stale round committed a checkpoint"
    assert not list((tmp_path / "ckpt").rglob("*.distcp")), "a stale round wrote checkpoint files"


def test_workers_do_not_outlive_a_sigkilled_agent(job):
    job.start("a", nnodes="1:1", nproc=2)
    job.wait_step(20)
    pids = job.worker_pids("a")
    assert len(pids) == 2
    job.kill_agent("a")
    job.wait_exit("a")
    wait_for(lambda: all(process_gone(p) for p in pids), 10, f"workers {pids} to exit after their agent died")


def test_a_crash_loop_stops_at_the_restart_budget(job):
    job.start("a", "--max-restarts", "2", nnodes="1:1", env={"FTRAIN_FAULT_SIGKILL": "3:0"})
    assert job.wait_exit("a", timeout_s=180) == 1, job.log_tail()
    final = job.events("job_final")[0]
    assert final["status"] == "failed" and "restart budget" in final["reason"]
    assert len(_rounds(job)) == 3  # the first round and two restarts
    status = _ftrain_status(job)
    assert status.returncode == 0 and "FAILED" in status.stdout and "restart budget" in status.stdout, status.stdout
    as_json = json.loads(
        subprocess.run(
            [sys.executable, "-m", "ftrain", "status", "--etcd", job.etcd, "--job", job.job, "--json"],
            capture_output=True,
            text=True,
            timeout=30,
            cwd=REPO,
            env=worker_env(),
        ).stdout
    )
    assert as_json["final"]["status"] == "failed" and as_json["restarts_by_cause"] == {"worker_exit": 2}


def test_sigterm_drains_the_node(job):
    job.start("a", nnodes="1:1")
    job.wait_step(30)
    job.kill_agent("a", signal.SIGTERM)
    assert job.wait_exit("a") == exits.DRAINED  # not the job's end: start it again to go on
    stop = job.events("graceful_stop")
    assert stop, job.log_tail()
    assert stop[0]["step"] in job.committed_steps(), "the drained step was not saved"
    assert not job.events("job_final"), "a drained node does not end the job"


def test_a_job_whose_commits_keep_failing_stops_with_the_error(job, tmp_path):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("a file where the checkpoint directory should be")
    job.worker_args[1] = f"--checkpoint.uri={blocker / 'ckpt'}"  # every save fails; nothing to resume from
    job.worker_args.append("--checkpoint.resume=false")
    job.start("a", "--metrics-port", "0", nnodes="1:1")
    port = job.wait_event("agent_metrics", node="a")["port"]
    failing = job.wait_event("checkpoint_failing", node="a", failures=2)
    assert "Not a directory" in failing["error"], failing
    text = _scrape(port)
    assert _metric(text, "ftrain_checkpoint_failures_total") >= 2
    assert job.wait_exit("a", timeout_s=300) == 1, job.log_tail()
    final = job.events("job_final")[0]
    # not fatal (an outage may pass, so the agents restart), but a cause that stays fails the
    # same way at the same step: the deterministic-failure rule ends the job with the error
    assert final["status"] == "failed" and "deterministic failure" in final["reason"], final
    assert "CheckpointFailuresError" in final["reason"] and "checkpoint.max_failed_commits=3" in final["reason"]
    assert "Not a directory" in final["reason"], "the final status must name the last error"
    assert len(_rounds(job)) == 3, "stopped after 3 identical failures, not at the restart budget"
    status = _ftrain_status(job)
    assert "FAILED" in status.stdout and "CheckpointFailuresError" in status.stdout, status.stdout


def test_a_deterministic_failure_stops_the_job_before_the_budget(job, tmp_path):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("a file where the checkpoint directory should be")
    job.worker_args[1] = f"--checkpoint.uri={blocker / 'ckpt'}"  # every start fails the same way
    job.start("a", nnodes="1:1")
    assert job.wait_exit("a", timeout_s=180) == 1, job.log_tail()
    final = job.events("job_final")[0]
    assert final["status"] == "failed" and "deterministic failure" in final["reason"], final
    assert "Not a directory" in final["reason"] and "at step 0" in final["reason"]
    assert len(_rounds(job)) == 3, "stopped after 3 identical failures, not at the budget of 10"
