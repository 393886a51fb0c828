"""A drain is never lost: SIGTERM to a node's agent, in every state the agent and its live workers
can be in when it arrives, ends with the agent's exit 75 (``exits.DRAINED``) well before its drain
timeout, never by the timeout's kill ("drain timed out"). The states: registered and waiting for a
round that cannot form yet; a scale-up round just formed (the kept workers leave their round, join
the new one and restore: where a SIGTERM was lost, 3 of 3 tries on a real Slurm); healing (another
node's worker just died); a checkpoint save in flight. Live recovery (the default), real agents,
etcd and worker processes."""

from __future__ import annotations

import os
import signal
import time

import pytest

from ftrain.chaos.cluster import FAST_AGENT_OPTIONS, Cluster
from ftrain.contract.exits import DRAINED
from ftrain.testbed.jobs import TINY_CONFIG
from ftrain.testbed.wait import wait_for

pytestmark = pytest.mark.timeout(300)

#: far above any drain here: one that ends by this timeout was lost
DRAIN_TIMEOUT_S = 120


def _drain(job: Cluster, node: str) -> float:
    """SIGTERM ``node``'s agent; the seconds until it exited, asserting that it drained."""
    began = time.monotonic()
    job.kill_agent(node, signal.SIGTERM)
    code = job.wait_exit(node, timeout_s=DRAIN_TIMEOUT_S + 30)
    log = (job.workdir / f"agent-{node}.log").read_text(errors="replace")
    assert code == DRAINED, f"{node} exited {code}\n{job.log_tail()}"
    assert "drain timed out" not in log, (
        f"{node}'s drain was lost: its workers were killed at the timeout\n{log[-3000:]}"
    )
    return time.monotonic() - began


def test_a_sigterm_drains_the_node_in_every_state_it_can_arrive_in(tmp_path, etcd):
    config = tmp_path / "config.toml"
    config.write_text(TINY_CONFIG)
    options = [*FAST_AGENT_OPTIONS, "--drain-timeout-s", str(DRAIN_TIMEOUT_S)]
    job = Cluster(
        tmp_path,
        etcd.endpoint,
        config,
        steps=2000,
        ckpt_interval=20,
        step_sleep_s=0.03,
        agent_options=options,
        overrides=["--train.global_batch_size=12"],  # runs on 1, 2 and 3 nodes
    )
    took: dict[str, float] = {}
    try:
        # registered, no round: a second node is needed (its spare warms meanwhile)
        job.start("w", nnodes="2:3")
        wait_for(
            lambda: "registered node w" in (tmp_path / "agent-w.log").read_text(errors="replace"), 60, "w registered"
        )
        took["waiting for a round"] = _drain(job, "w")

        for node in ("a", "b"):
            job.start(node, nnodes="1:3")
        job.wait_step(10, timeout_s=120)
        # a scale-up: c joins; a's kept worker leaves round 1 for round 2 and restores in it
        first = max(e["new_round"] for e in job.events("round_formed"))
        job.start("c", nnodes="1:3")
        job.wait_event("round_formed", new_round=first + 1, timeout_s=60)
        took["scale-up round formed"] = _drain(job, "a")

        # healing: b's worker killed, and c asked to drain while the round heals. First the round
        # after a's drain, node_left even when the SIGTERM came as a's agent (the leader) formed
        # the scale-up round and never started workers in it: it reports stopped for that round
        # (tests/integration/test_drain_as_a_round_forms.py)
        after = job.wait_event("round_formed", timeout_s=60, new_round=first + 2)
        assert after["reason"] == "node_left", f"a's drain told as {after['reason']}\n{job.log_tail()}"
        step = job.wait_step(job.step() + 5, timeout_s=60)
        for pid in job.worker_pids("b"):
            os.kill(pid, signal.SIGKILL)
        took["healing"] = _drain(job, "c")

        # a save in flight: b alone, asked to drain as its workers stage a checkpoint
        saved = max(job.committed_steps(), default=-1)
        job.wait_event("ckpt_staged", timeout_s=120, step=((max(saved, step) // 20) + 1) * 20)
        took["saving"] = _drain(job, "b")
        assert not job.events("job_final"), "a drain is not the job's end"
    finally:
        job.close()
    print(f"\ndrain times: {', '.join(f'{k} {v:.1f}s' for k, v in took.items())}")
