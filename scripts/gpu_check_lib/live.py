"""The live recovery check: one ``ftrain agent --recovery live --spares 1`` node with two workers
sharing the device over gloo (ddp, the GPT), a throwaway etcd (``ftrain.testbed.etcd``) and a
local checkpoint directory (``ftrain.chaos.cluster.Cluster``'s default), as
tests/integration/test_live_recovery.py runs them. Rank 1 is SIGKILLed mid-run: the survivor
must keep its process, the spare must take rank 1's place with the state of its live peer, and
the job must finish every step.

Live workers choose their device per round, from the local rank the round assigns them
(``ftrain.recovery.live.serve``); on a one-GPU host local rank 1 shares ``cuda:0``
(``ftrain.distributed.select_device``).
"""

from __future__ import annotations

import os
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

from gpu_check_lib.core import Check, CheckFailed, Deadline, Mode
from gpu_check_lib.training import SIZES, config_text

LIVE = ("--recovery", "live", "--spares", "1")
STEPS = {"gpu": 60, "dry": 30}
KILL_AFTER_STEP = 10
STEP_SLEEP_S = 0.05  #: slows each step so that the kill lands mid-run (FTRAIN_FAULT_STEP_SLEEP_S)


def check(mode: Mode, root: Path, timeout_s: float) -> Check:
    def run(deadline: Deadline) -> dict[str, Any]:
        from ftrain.chaos.cluster import Cluster
        from ftrain.testbed.etcd import EtcdServer
        from ftrain.testbed.wait import wait_for

        kind = "dry" if mode.dry else "gpu"
        steps = STEPS[kind]
        workdir = Path(tempfile.mkdtemp(prefix="live-", dir=root))
        config = workdir / "config.toml"
        config.write_text(config_text(SIZES[kind]["gpt"], steps=steps, global_batch=8, micro_batch=4))
        hide = {"CUDA_VISIBLE_DEVICES": ""} if mode.dry else {}
        with EtcdServer() as etcd:
            job = Cluster(
                workdir,
                etcd.endpoint,
                config,
                steps=steps,
                ckpt_interval=20,
                step_sleep_s=STEP_SLEEP_S,
                env=hide,
                overrides=[*mode.train_overrides(), "--parallel.strategy=ddp", "--parallel.backend=gloo"],
            )
            try:
                agent = job.start("a", *LIVE, nnodes="1:1", nproc=2)
                alive = lambda: agent.poll() is None  # noqa: E731
                wait_for(
                    lambda: job.step() >= KILL_AFTER_STEP,
                    deadline.remaining(),
                    f"training step {KILL_AFTER_STEP}",
                    alive=alive,
                    context=job.log_tail,
                )
                round1 = {e["rank"]: e["pid"] for e in job.events("worker_started", round=1)}
                killed_at = time.time()
                os.kill(round1[1], signal.SIGKILL)
                restored = wait_for(
                    lambda: len(job.events("live_restored", round=2)) == 2 and job.events("live_restored", round=2),
                    deadline.remaining(),
                    "both ranks restored in round 2",
                    alive=alive,
                    context=job.log_tail,
                )
                code = job.wait_exit("a", deadline.remaining())
                round2 = {e["rank"]: e["pid"] for e in job.events("worker_started", round=2)}
                after = [m["time"] for m in job.metrics() if m["time"] > killed_at]
                figures = {
                    "world_size": 2,
                    "device": mode.device,
                    "dtype": mode.dtype,
                    "backend": "gloo",
                    "killed_rank": 1,
                    "survivor_kept_process": round2.get(0) == round1[0],
                    "sources": sorted({e["source"] for e in restored}),
                    "restored_step": max(e["step"] for e in restored),
                    "kill_to_next_step_s": round(min(after) - killed_at, 2) if after else None,
                    "steps": job.step(),
                    "round_reasons": [e["reason"] for e in job.events("round_formed")],
                    "agent_exit": code,
                }
                problems = []
                if code != 0:
                    problems.append(f"the agent exited {code}")
                if not figures["survivor_kept_process"]:
                    problems.append("the surviving rank 0 was restarted")
                if figures["sources"] != ["live_peer"]:
                    problems.append(f"state came from {figures['sources']}, not the live peer")
                if figures["steps"] != steps:
                    problems.append(f"the job ended at step {figures['steps']} of {steps}")
                if problems:
                    raise CheckFailed("; ".join(problems), job.log_tail(), figures)
                return figures
            finally:
                job.close()

    return Check("live/gpt/ddp/x2-gloo/worker_kill", run, timeout_s)
