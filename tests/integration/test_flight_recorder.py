"""The flight recorder against real agents, torchrun workers, gloo and real signals: a hang or a
desync is pinned on the right rank and collective, in the ``hang`` event, ``ftrain status``
and ``ftrain analyze``.

Both jobs run three workers on one node (the agent tests' tiny job); the fault fires in round
1 only, so the restarted round finishes the job.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from ftrain.agents.etcd import EtcdClient
from ftrain.agents.flight_verdict import CULPRIT, DESYNC, NONE, SLOWEST, from_events
from ftrain.agents.status import format_status, job_status, request_dump
from ftrain.testbed.procs import REPO, quiet_env
from tests.agent_support import AgentJob, wait_for

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def job(tmp_path, etcd):
    j = AgentJob(tmp_path, etcd.endpoint, steps=60, overrides=["--train.global_batch_size=18"])
    try:
        yield j
    finally:
        j.close()


def _analyze(path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ftrain", "analyze", str(path), *args],
        cwd=REPO,
        env=quiet_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )


def _timeless(verdict: str) -> str:
    """A verdict without its wait times (the agent measures them when it collects, the merged
    analysis when the newest record was taken)."""
    return re.sub(r"for \d+\.\d s", "for _ s", verdict)


def _in_flight(record, group: str) -> list[int]:
    return [e.seq for e in record.entries if e.group == group and not e.done]


def test_a_worker_stopped_inside_a_collective_is_named_with_the_collective_its_peers_wait_in(job, etcd):
    job.start("a", nnodes="1:1", nproc=3, env={"FTRAIN_FAULT_SIGSTOP_IN_COLLECTIVE": "30:1:1"})
    job.wait_step(10, 240)  # start-up first: it takes as long as the machine's load makes it
    job.wait_event("hang")
    client = EtcdClient([etcd.endpoint])
    try:  # while round 2 runs, the agent's status carries the verdict
        shown = wait_for(
            lambda: next(
                (
                    line
                    for line in format_status(job_status(client, job.job)).splitlines()
                    if line.startswith("last hang")
                ),
                None,
            ),
            30,
            "the hang's verdict in ftrain status",
        )
    finally:
        client.close()
    assert job.wait_exit("a") == 0, job.log_tail()
    hang = job.events("hang")[0]
    assert hang["worker_round"] == 1 and hang["frozen"] == [1], hang["frozen"]
    assert "stopped" in hang["missing"]["1"] and set(hang["flight"]) == {"0", "2"}
    [evidence] = [e for e in from_events(job.events()) if e.round == 1]
    verdict = evidence.verdict()
    assert verdict.kind == CULPRIT and verdict.ranks == [1] and verdict.waiting == [0, 2], verdict
    for rank in (0, 2):  # each waiter's own record has that collective in flight, and no earlier one
        assert _in_flight(evidence.records[rank], verdict.group) == [verdict.seq], evidence.records[rank]
    assert _timeless(hang["verdict"]) == _timeless(verdict.line) and f"#{verdict.seq} " in verdict.line
    assert "rank 1" in verdict.line
    assert "frozen" in verdict.line and "ranks 0,2 wait" in verdict.line, verdict.line
    assert _timeless(shown) == _timeless(f"last hang seen by a, round 1: {verdict.line}")  # waits measured apart
    out = _analyze(job.workdir)
    assert out.returncode == 0 and f"round 1: {verdict.line}" in out.stdout, out
    at = "(node a, host 127.0.0.1)"  # where each rank ran, in the verdict and beside each rank
    assert f"rank 1 {at} is frozen" in verdict.line, verdict.line
    assert f"rank 1 {at}: no record (stopped" in out.stdout and f"rank 0 {at}: #" in out.stdout, out.stdout
    assert job.events("round_formed")[1]["reason"] == "hang" and job.step() == 60


def test_a_rank_that_skips_a_collective_is_named_as_a_desync_at_that_sequence_number(job, etcd):
    job.start("a", nnodes="1:1", nproc=3, env={"FTRAIN_FAULT_SKIP_COLLECTIVE": "45:1:1"})
    job.wait_step(3, 240)
    client = EtcdClient([etcd.endpoint])
    try:  # first, while it runs healthy: ftrain status --dump
        s = request_dump(client, job.job, timeout_s=20)
    finally:
        client.close()
    [node] = s["nodes"]
    assert node["dump_nonce"] == s["dump"] and node["dump_verdict"].startswith("round 1: "), node
    assert f"dump by a, {node['dump_verdict']}" in format_status(s)
    dumped = job.events("dumped")[0]
    assert sorted(dumped["flight"]) == ["0", "1", "2"] and dumped["missing"] == {} and not job.events("hang")
    [healthy] = from_events([dumped])
    assert not healthy.hung and healthy.verdict().kind in (SLOWEST, NONE), healthy.verdict()
    assert job.wait_exit("a") == 0, job.log_tail()
    [evidence] = [e for e in from_events(job.events()) if e.round == 1]
    assert evidence.hung
    verdict = evidence.verdict()
    assert verdict.kind == DESYNC and verdict.ranks == [1], verdict
    records = evidence.records
    seq, group = verdict.seq, verdict.group

    def at(rank: int, n: int):
        return next(e for e in records[rank].entries if e.group == group and e.seq == n)

    # up to the skipped collective every rank ran the same ones; at it, rank 1 ran its next one
    assert at(0, seq - 1).signature() == at(1, seq - 1).signature() == at(2, seq - 1).signature()
    assert at(0, seq).signature() == at(2, seq).signature() != at(1, seq).signature()
    assert at(0, seq).op == "gloo:all_gather" and at(1, seq).op == "gloo:all_reduce", records  # losses / stop flags
    hang = job.events("hang")[0]
    assert (
        hang["worker_round"] == 1
        and _timeless(hang["verdict"]) == _timeless(verdict.line)
        and f"#{seq} " in verdict.line
    )
    out = json.loads(_analyze(job.events_path, "--json").stdout.splitlines()[0])
    assert out["kind"] == DESYNC and out["seq"] == seq and out["ranks"] == [1], out
    wait_for(lambda: job.step() == 60, 10, "the job to finish its steps")
