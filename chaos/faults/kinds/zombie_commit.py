"""``zombie_commit``: a worker of the round before the current one (round 0, never current, while
the job is in round 1) resumes and tries to save into the job's checkpoints; every attempt must
fail with ``StaleRoundError`` (the commit fence), which the record's ``refused`` says."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from ftrain.agents.job_keys import JobKeys
from ftrain.chaos.faults.registry import FAULTS, Fault, Outcome
from ftrain.chaos.faults.spec import Context, FaultSpec
from ftrain.chaos.faults.targets import current_round
from ftrain.contract.events import Event, read_jsonl
from ftrain.contract.worker_env import WorkerEnv
from ftrain.testbed.procs import quiet_env
from ftrain.testbed.wait import WaitTimeout, wait_for


def _act(ctx: Context, spec: FaultSpec) -> dict[str, Any]:
    # The zombie claims the round before the current one. In round 1 that is round 0, a round that
    # was never current: refused all the same. (Waiting for a second round instead deadlocked a
    # soak whose first random fault was this one: faults fire one at a time, so nothing restarted.)
    g = wait_for(lambda: current_round(ctx), 120, "the first round")
    zombie_events = ctx.cluster.workdir / "zombie-events.jsonl"
    args = [
        a
        for a in ctx.cluster.worker_args
        if not a.startswith(("--logging.", "--data.ledger_dir", "--train.save_final_path"))
    ]
    old_round = WorkerEnv(
        job=ctx.cluster.job,
        round=g - 1,
        etcd=tuple(ctx.cluster.etcd_endpoints),
        fence_key=JobKeys(ctx.cluster.job).round,
    )
    env = quiet_env(**ctx.cluster.env, **old_round.to_env(), FTRAIN_LOG_LEVEL="WARNING")
    out = _run_zombie(args, zombie_events, env)
    return ctx.emit(spec.kind, round=g - 1, current_round=g, **out)


def _run_zombie(args: list[str], events_path: Path, env: dict[str, str]) -> dict[str, Any]:
    """One old-round worker that resumes and tries to save once; then it is stopped."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ftrain",
            "train",
            *args,
            f"--logging.events_path={events_path}",
            "--checkpoint.interval=1",
            "--checkpoint.async_mode=off",
            "--train.steps=100000",
            "--train.on_schedule_change=keep",  # another train.steps than the job's: resume all the same
            "--logging.progress=off",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
        start_new_session=True,
    )
    try:

        def attempted() -> list[dict[str, Any]]:
            if not os.path.exists(events_path):
                return []
            return [e for e in read_jsonl(events_path) if e["event"] in (Event.CKPT_FAILED, Event.CKPT_COMMITTED)]

        try:
            attempts = wait_for(attempted, 90, "the zombie's first save")
        except WaitTimeout:
            attempts = []
    finally:
        proc.kill()
        proc.wait()
    committed = [e["step"] for e in attempts if e["event"] == Event.CKPT_COMMITTED]
    refused = bool(attempts) and not committed and all("StaleRoundError" in e.get("error", "") for e in attempts)
    return {"refused": refused, "attempts": len(attempts), "committed": committed}


FAULT = FAULTS.register(Fault(kind="zombie_commit", act=_act, outcome=Outcome.REFUSED))
