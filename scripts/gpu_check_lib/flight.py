"""The flight recorder check: a one-rank NCCL group (gloo in dry mode), a few all_reduces, and the
recorder's snapshot must hold every one of them, completed (:mod:`.flight_worker` runs the rank)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from gpu_check_lib.core import Check, CheckFailed, Deadline, Mode

WORKER = Path(__file__).resolve().parent / "flight_worker.py"
COUNT = 32  #: all_reduces issued


def check(mode: Mode, timeout_s: float) -> Check:
    def run(deadline: Deadline) -> dict[str, Any]:
        from ftrain.testbed.jobs import run_within

        cmd = [sys.executable, str(WORKER), "--backend", mode.collective_backend, "--device", mode.device]
        proc = run_within([*cmd, "--count", str(COUNT)], timeout_s=deadline.remaining(), env=mode.env())
        lines = [ln for ln in (proc.stdout or "").splitlines() if ln.startswith("{")]
        if proc.returncode != 0 or not lines:
            raise CheckFailed(f"the flight worker failed (exit {proc.returncode})", proc.stdout or "")
        figures = json.loads(lines[-1])
        problems = []
        if not figures["available"]:
            problems.append(f"the recorder read no buffer ({figures['buffer_env']})")
        if figures["recorded"] < COUNT:
            problems.append(f"{figures['recorded']} of {COUNT} {mode.collective_backend}:all_reduce recorded")
        if figures["recorded_done"] < figures["recorded"]:
            problems.append(f"{figures['recorded'] - figures['recorded_done']} recorded as not completed after a sync")
        if figures["in_flight_after_sync"]:
            problems.append(f"still in flight after a sync: {figures['in_flight_after_sync']}")
        if not figures["result_ok"]:
            problems.append("the all_reduce result is wrong")
        if problems:
            raise CheckFailed("; ".join(problems), proc.stdout or "", figures)
        return figures

    return Check("flight_recorder", run, timeout_s)
