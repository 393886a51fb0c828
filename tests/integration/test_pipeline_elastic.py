"""A pipeline job loses a node and goes on in the next layout that fits: real etcd, agents,
worker processes and SIGKILL.

Two agents with two workers each train the tiny config at pp=2 x dp=2 (stage 0 on node rank 0's
two workers, stage 1 on the other's). Node b goes (agent and workers SIGKILLed): the leader
forms a round of node a alone, 2 ranks, which the layout runs as pp=2 x dp=1 (stage 0 and 1 on
a's two workers), resumed from the last commit by a resharding load. With one worker per node and
``parallel.pp_fallback = "1"`` the survivor's single rank runs the model without a pipeline. The
job finishes, and the ledger shows every sample of every step consumed exactly once by the
attempt that counted. Live recovery runs the built-in Llama, restart recovery the tiny GPT.
"""

from __future__ import annotations

import os
import signal

import pytest

from ftrain.agent_link.heartbeat import process_gone
from ftrain.chaos.cluster import Cluster
from ftrain.config import load_config
from ftrain.data import check_exactly_once, read_ledger
from ftrain.testbed.jobs import TINY_CONFIG
from ftrain.testbed.wait import wait_for

pytestmark = pytest.mark.timeout(300)

STEPS = 120


@pytest.mark.parametrize(
    ("recovery", "nproc", "fallback", "after"),
    [
        # live recovery runs the built-in Llama (RoPE, GQA, SwiGLU), restart recovery the tiny GPT:
        # each model's pipeline split is covered, and each recovery (was a live run per model)
        ("live", 2, ["--model.arch=llama", "--model.n_kv_heads=2"], (2, 2, 1)),
        ("restart", 2, [], (2, 2, 1)),
        ("restart", 1, ["--parallel.pp_fallback=1"], (1, 1, 1)),
    ],
    ids=["live-llama", "restart", "fallback-to-pp1"],
)
def test_a_node_lost_from_a_pipeline_goes_on_in_the_next_layout_and_consumes_every_sample_once(
    tmp_path, etcd, recovery, nproc, fallback, after
):
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
        overrides=["--parallel.pp_size=2", *fallback, f"--data.ledger_dir={ledger}"],
    )
    try:
        for node in ("a", "b"):
            job.start(node, "--recovery", recovery, nnodes="1:2", nproc=nproc)
        world = 2 * nproc
        wait_for(lambda: [m for m in job.metrics() if m["world_size"] == world and m["step"] >= 30], 120, "step 30")
        first = min(job.events("round_formed"), key=lambda e: e["new_round"])
        survivor, lost = first["members"]
        job.kill_agent(lost)
        for pid in job.worker_pids(lost):
            if not process_gone(pid):
                os.kill(pid, signal.SIGKILL)
        assert job.wait_exit(survivor, timeout_s=180) == 0, job.log_tail()
        rounds = sorted(job.events("round_formed"), key=lambda e: e["new_round"])
        assert rounds[-1]["members"] == [survivor] and rounds[-1]["world_size"] == nproc
        metrics = job.metrics()
        assert all(m["pp_size"] == 2 for m in metrics if m["world_size"] == world)
        smaller = [m for m in metrics if m["world_size"] == nproc]
        assert smaller and {(m["world_size"], m.get("pp_size", 1), m["dp_size"]) for m in smaller} == {after}
        assert max(m["step"] for m in metrics) == STEPS
        cfg = load_config(config)
        report = check_exactly_once(
            read_ledger(ledger),
            num_samples=cfg.data.num_samples,
            global_batch_size=cfg.train.global_batch_size,
            seed=cfg.data.seed,
            steps=STEPS,
        )
        assert report.ok, report.summary()
        assert report.superseded_entries > 0 or recovery == "live", "the steps after the commit were replayed"
    finally:
        job.close()
