"""Hangs under live recovery (``ftrain agent --recovery live``), with real agents, worker
processes, gloo and signals, two agents of one worker each (the issue's layout):

- ranks that wait in mismatched collectives while their heartbeat threads keep saying "alive"
  are found hung from the age of their oldest collective in flight (not from a silence), the
  round formed for it frees them in-process (no healthy process killed) and the job consumes
  every sample once;
- a SIGSTOPped worker's hang gets the other node's evidence: its agent takes its worker's
  flight record while that worker still waits (the finder holds the kill until then), so the
  merged verdict names the frozen rank's node and host, the collective's number and op, and
  the rank waiting in it.

Each test asserts what the code decided (the events, the verdict, the rounds), never how fast;
the times it prints are measurements, not limits.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from ftrain.agents.etcd import EtcdClient
from ftrain.agents.flight_verdict import CULPRIT, DESYNC, from_events
from ftrain.agents.job_keys import JobKeys
from ftrain.agents.records import JobState
from ftrain.agents.status import format_status, job_status
from ftrain.chaos.cluster import Cluster
from ftrain.config import load_config
from ftrain.data import check_exactly_once, read_ledger
from ftrain.testbed.jobs import TINY_CONFIG
from ftrain.testbed.procs import REPO, quiet_env
from ftrain.testbed.wait import wait_for

pytestmark = pytest.mark.timeout(480)

STEPS = 80
LIVE = ("--recovery", "live", "--spares", "1")
HANG_TIMEOUT_S = 5.0  #: ftrain.chaos.cluster.FAST_AGENT_SETTINGS


def _job(tmp_path, etcd, *, env: dict[str, str]) -> tuple[Cluster, object]:
    config = tmp_path / "config.toml"
    config.write_text(TINY_CONFIG)
    ledger = tmp_path / "ledger"
    job = Cluster(
        tmp_path,
        etcd.endpoint,
        config,
        steps=STEPS,
        ckpt_interval=20,
        step_sleep_s=0.03,
        env=env,
        overrides=["--parallel.deterministic=true", f"--data.ledger_dir={ledger}"],
    )
    return job, (config, ledger)


def _exactly_once(config, ledger) -> None:
    cfg = load_config(config)
    report = check_exactly_once(
        read_ledger(ledger),
        num_samples=cfg.data.num_samples,
        global_batch_size=cfg.train.global_batch_size,
        seed=cfg.data.seed,
        steps=STEPS,
    )
    assert report.ok, report.summary()


def _serving(job: Cluster, node: str, worker_round: int) -> list[int]:
    return [e["pid"] for e in job.events("worker_started", node=node, round=worker_round)]


def _analyze(path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ftrain", "analyze", str(path)],
        cwd=REPO,
        env=quiet_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )


def _found_at(etcd, job: Cluster) -> float:
    """When the first node reported the hang of round 1 (its report's time)."""
    client = EtcdClient([etcd.endpoint])
    try:
        keys = JobKeys(job.job)
        listing = client.list_prefix(keys.prefix)
    finally:
        client.close()
    reports = JobState.parse(keys, listing.kvs, listing.revision).reports[1]
    return min(r.time for r in reports.values() if r.reason == "hang")


def _recovery_times(job: Cluster, found_at: float) -> str:
    restored_at = max(e["time"] for e in job.events("live_restored", round=2))
    first_step = min(m["time"] for m in job.metrics() if m["time"] > restored_at)
    formed_at = next(e["time"] for e in job.events("round_formed") if e["new_round"] == 2)
    return (
        f"hang found -> round 2 formed {formed_at - found_at:.2f}s, -> restored {restored_at - found_at:.2f}s, "
        f"-> first step {first_step - found_at:.2f}s (hang_timeout_s {HANG_TIMEOUT_S:g})"
    )


def test_ranks_in_mismatched_collectives_are_found_hung_from_their_in_flight_age_and_recover_in_process(tmp_path, etcd):
    """Rank 1 skips the losses' all-gather of step 30: its next collective (the stop flags'
    all-reduce) gets the number its peer's all-gather has, and each waits in its own for ever
    while both keep saying "alive"."""
    job, (config, ledger) = _job(tmp_path, etcd, env={"FTRAIN_FAULT_SKIP_COLLECTIVE": "30:1:1"})
    try:
        job.start("a", *LIVE, nnodes="2:2", nproc=1)
        job.start("b", *LIVE, nnodes="2:2", nproc=1)
        job.wait_step(10, 240)  # start-up first: it takes as long as the machine's load makes it
        wait_for(lambda: len(job.events("live_restored", round=2)) == 2, 120, "round 2 restored")
        assert job.wait_exit("a") == 0 and job.wait_exit("b") == 0, job.log_tail()
        round1 = {n: _serving(job, n, 1) for n in ("a", "b")}
        assert {n: _serving(job, n, 2) for n in ("a", "b")} == round1, "a healthy worker process was replaced"
        rounds = sorted(job.events("round_formed"), key=lambda e: e["new_round"])
        assert [e["reason"] for e in rounds] == ["start", "hang"]
        hangs = job.events("hang", worker_round=1)
        found = [h for h in hangs if "inside one collective past hang_timeout_s" in h["why"]]
        assert found, [h["why"] for h in hangs]  # decided from the in-flight age, not from a silence
        assert all(h["frozen"] == [] for h in hangs) and not job.events("workers_exited", worker_round=1)
        assert {h["node"] for h in hangs} == {"a", "b"}  # each node's records are in
        [evidence] = [e for e in from_events(job.events()) if e.round == 1]
        verdict = evidence.verdict()
        assert verdict.kind == DESYNC and f"#{verdict.seq} " in verdict.line, verdict
        assert "gloo:all_gather" in verdict.line and "gloo:all_reduce" in verdict.line, verdict.line
        # the finder's own verdict saw the other node's rank from its status
        assert any("across the round: desync" in h["verdict"] for h in found), [h["verdict"] for h in found]
        print(_recovery_times(job, _found_at(etcd, job)))
        print(f"found by: {found[0]['why']}")
        _exactly_once(config, ledger)
    finally:
        job.close()


def test_a_stopped_workers_hang_is_named_with_its_node_host_collective_and_the_rank_waiting_in_it(tmp_path, etcd):
    """Rank 1 stops itself (SIGSTOP) inside the losses' all-gather of step 30; rank 0 waits in it."""
    job, (config, ledger) = _job(tmp_path, etcd, env={"FTRAIN_FAULT_SIGSTOP_IN_COLLECTIVE": "30:1:1"})
    try:
        job.start("a", *LIVE, nnodes="2:2", nproc=1)
        job.start("b", *LIVE, nnodes="2:2", nproc=1)
        job.wait_step(10, 240)  # start-up first: it takes as long as the machine's load makes it
        wait_for(lambda: job.events("round_formed", new_round=2), 120, "the hang's round")
        client = EtcdClient([etcd.endpoint])
        try:  # while round 2 runs, the finder's status carries its verdict
            shown = wait_for(
                lambda: next(
                    (
                        line
                        for line in format_status(job_status(client, job.job)).splitlines()
                        if line.startswith("last hang seen by")
                    ),
                    None,
                ),
                30,
                "the hang's verdict in ftrain status",
            )
        finally:
            client.close()
        assert job.wait_exit("a") == 0 and job.wait_exit("b") == 0, job.log_tail()
        rounds = sorted(job.events("round_formed"), key=lambda e: e["new_round"])
        assert [e["reason"] for e in rounds] == ["start", "hang"]
        stopped_node = next(e["node"] for e in job.events("worker_started", round=1) if e["rank"] == 1)
        other = "a" if stopped_node == "b" else "b"
        mine = job.events("hang", worker_round=1, node=stopped_node)
        theirs = job.events("hang", worker_round=1, node=other)
        assert mine and mine[0]["frozen"] == [1] and "stopped" in mine[0]["missing"]["1"], mine
        assert theirs and set(theirs[0]["flight"]) == {"0"}, theirs  # the waiting rank's record, from its node
        [evidence] = [e for e in from_events(job.events()) if e.round == 1]
        verdict = evidence.verdict()
        assert (verdict.kind, verdict.ranks, verdict.waiting) == (CULPRIT, [1], [0]), verdict
        place = f"rank 1 (node {stopped_node}, host 127.0.0.1"
        assert verdict.line.startswith(place) and "frozen" in verdict.line, verdict.line
        # the collective rank 0 waits in (the all-gather rank 1 stopped in, or the next one, if
        # rank 1's side of it was sent before it stopped), by its number and op, as rank 0's record has it
        [waited] = [e for e in evidence.records[0].entries if e.group == verdict.group and not e.done]
        assert f"collective #{verdict.seq} {waited.op} " in verdict.line and waited.seq == verdict.seq, verdict.line
        assert waited.op.startswith("gloo:") and "in which rank 0 waits" in verdict.line
        out = _analyze(job.workdir)
        assert out.returncode == 0 and f"round 1: {verdict.line}" in out.stdout, out
        assert f"rank 1 (node {stopped_node}, host 127.0.0.1" in shown and "frozen" in shown, shown
        print(f"ftrain status: {shown}")
        print(f"ftrain analyze: {verdict.line}")
        print(_recovery_times(job, _found_at(etcd, job)))
        _exactly_once(config, ledger)
    finally:
        job.close()
