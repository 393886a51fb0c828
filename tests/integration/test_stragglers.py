"""Stragglers against real agents, torchrun workers and real signals: a worker slowed by a
stop/continue duty cycle (what chaos's ``worker_slow`` does) is flagged by the leader; under
``agent.on_straggler = evict`` its node is left out and joins again later."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from ftrain.agents.etcd import EtcdClient
from ftrain.agents.status import format_status, job_status
from ftrain.testbed.procs import REPO, kill_tree, quiet_env
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


def test_a_slowed_worker_of_a_users_loop_is_flagged_too_and_once_frozen_named_by_the_flight_records(tmp_path, etcd):
    """The same slowdown in a user's own loop (examples/own_loop under DDP, two ``--recovery
    live`` agents): the session's beats split each step into the wait for peers (backward's last
    gradient to the optimizer's update, the boundary's agreement) and the rest, so the leader
    sees which rank the others wait for. Then that worker is frozen (SIGSTOP): the agents give a
    script's workers torch's flight recorder as ``ftrain train``'s, so the hang's verdict (and
    ``ftrain analyze``) names the frozen rank and the collective its peer waits in."""
    from ftrain.agents.flight_verdict import CULPRIT, from_events
    from tests.script_agents import events, served_by, start_agent

    example = REPO / "examples" / "own_loop" / "train.py"
    options = ("--recovery", "live", "--straggler-after-s", "2", "--hang-timeout-s", "10")
    script_args = ("--parallel", "ddp", "--steps", "100000", "--save-every", "0")
    agents = {n: start_agent(tmp_path, etcd.endpoint, n, example, *options, script_args=script_args) for n in "ab"}
    stop = threading.Event()
    slowed = None
    try:
        (_, [worker]), *_ = wait_for(lambda: served_by(tmp_path, "b"), 120, "node b's worker in round 1")
        slowed = threading.Thread(target=_slow_down, args=(worker, stop), daemon=True)
        slowed.start()

        def flagged() -> dict | None:
            return next((e for e in events(tmp_path) if e["event"] == "straggler_detected"), None)

        detected = wait_for(flagged, 90, "a straggler_detected event")
        stop.set()
        slowed.join(timeout=5)
        os.kill(worker, signal.SIGSTOP)

        def hang_seen_by() -> set[str]:
            return {e["node"] for e in events(tmp_path) if e["event"] == "hang" and e["worker_round"] == 1}

        wait_for(lambda: hang_seen_by() == {"a", "b"}, 90, "the frozen worker's hang, as each node saw it")
        [evidence] = [r for r in from_events(events(tmp_path)) if r.round == 1]
        verdict = evidence.verdict()
        analyzed = subprocess.run(
            [sys.executable, "-m", "ftrain", "analyze", str(tmp_path / "events.jsonl")],
            env=quiet_env(), capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    finally:
        stop.set()
        if slowed is not None:
            slowed.join(timeout=5)
        for agent in agents.values():
            kill_tree(agent)
    assert detected["node"] == "b" and detected["policy"] == "warn" and detected["slow_for_s"] >= 2.0, detected
    assert detected["busy_s"] > 1.25 * detected["others_s"] > 0, detected
    assert verdict.kind == CULPRIT and verdict.ranks == [detected["busy_rank"]], verdict
    [waiter] = verdict.waiting  # its record says where it waits: a collective, by number and op
    [waited] = [e for e in evidence.records[waiter].entries if e.group == verdict.group and not e.done]
    assert f"collective #{verdict.seq} {waited.op} " in verdict.line and "frozen" in verdict.line, verdict.line
    assert analyzed.returncode == 0 and f"round 1: {verdict.line}" in analyzed.stdout, analyzed
