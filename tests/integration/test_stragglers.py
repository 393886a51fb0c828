"""Stragglers against real agents, torchrun workers and real signals: a worker slowed by a
stop/continue duty cycle (what chaos's ``worker_slow`` does) is flagged by the leader; under
``agent.on_straggler = evict`` its node is left out and joins again later."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from ftrain.agents.etcd import EtcdClient
from ftrain.agents.status import format_status, job_status
from tests.agent_support import AgentJob, wait_for

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def job(tmp_path, etcd):
    j = AgentJob(tmp_path, etcd.endpoint, steps=400)
    try:
        yield j
    finally:
        j.close()


def _slow_down(pid: int, stop: threading.Event, *, stop_s: float = 0.1, run_s: float = 0.2) -> None:
    try:
        while not stop.is_set():
            os.kill(pid, signal.SIGSTOP)
            time.sleep(stop_s)  # the duty cycle is the fault itself, not a wait for a condition
            os.kill(pid, signal.SIGCONT)
            stop.wait(run_s)
    except ProcessLookupError:
        pass
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


def test_a_slowed_worker_is_flagged_by_the_leader_and_warn_lets_the_job_ride_it_out(job, etcd):
    options = ("--straggler-after-s", "2")
    job.start("a", *options)
    job.start("b", *options)
    job.wait_step(30)
    stop = threading.Event()
    slowed = threading.Thread(target=_slow_down, args=(job.worker_pids("b")[0], stop), daemon=True)
    began = job.step()
    slowed.start()
    client = EtcdClient([etcd.endpoint])
    try:
        detected = job.wait_event("straggler_detected", timeout_s=30)

        def status_with_straggler() -> str | None:
            text = format_status(job_status(client, job.job))
            return text if "STRAGGLER" in text else None

        text = wait_for(status_with_straggler, 10, "the straggler in ftrain status")
        shown = next(line for line in text.splitlines() if "STRAGGLER" in line)
    finally:
        stop.set()
        slowed.join(timeout=5)
        client.close()
    flagged_at = job.step()
    assert detected["node"] == "b" and detected["policy"] == "warn" and detected["slow_for_s"] >= 2.0, detected
    assert detected["busy_s"] > 1.25 * detected["others_s"] > 0
    assert shown.startswith("STRAGGLER b (rank ") and "per step vs" in shown, shown
    assert "device time: " in text and "goodput " in text and "cost" not in text, text  # no price set: no cost
    assert flagged_at - began < 150, f"flagged {flagged_at - began} steps after the slowdown began"
    assert job.wait_exit("a") == 0 and job.wait_exit("b") == 0, job.log_tail()
    assert [e["reason"] for e in job.events("round_formed")] == ["start"], "warn forms no round"
    # one event per episode (a node slow without a break since a time); on a loaded machine another
    # episode may follow once the slowdown ended, but none is reported twice
    episodes = sorted((e["node"], e["time"] - e["slow_for_s"]) for e in job.events("straggler_detected"))
    assert all(
        node != next_node or next_since - since > 0.5
        for (node, since), (next_node, next_since) in zip(episodes, episodes[1:], strict=False)
    ), episodes
