"""The checkpoint check: ``bench/checkpoint.py`` (a real SeaweedFS, a two-rank FSDP2 job, async
saves, verified loads) and the figures of its final JSON line: ``blocked_ratio`` (the training
thread's time in an async save over a blocking save's), ``save_vs_raw`` and ``load_vs_raw``
(against raw PUT/GET of the same bytes).

What was asked on the device: >= 4 GB of state on CUDA, staged through pinned host memory. What
the bench can do is read off the bench itself, not assumed (:mod:`.bench_args` parses the GPU
run's options with the bench's own parser): whether it offers ``--device`` (only then is its
state on CUDA) and whether it accepts ``--state-mb 4096``. What it cannot do is listed in
``limitations`` and fails the check on the device; the part that works still runs and is
reported (the largest state it takes up to :data:`FALLBACK_STATE_MB`, on the CPU).

The dry run parses those options (a renamed option fails it) and says what the device run would
be limited by; it does not run the bench (``bench/checkpoint.py --smoke`` is the test suite's).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from gpu_check_lib.core import Check, CheckFailed, Deadline, Mode, Skip

BENCH = Path(__file__).resolve().parents[2] / "bench" / "checkpoint.py"
BENCH_ARGS = Path(__file__).resolve().parent / "bench_args.py"
ASKED_STATE_MB = 4096
FALLBACK_STATE_MB = 1024  #: state on the CPU (no --device): 1 GB keeps the bench inside the budget
FIGURES = ("blocked_ratio", "save_vs_raw", "load_vs_raw", "step_slowdown", "bytes", "state_mb_requested", "wall_s")
#: what the bench's driver needs beyond its job's limit: SeaweedFS start and stop, the report
DRIVER_SLACK_S = 40.0


def bench_args(state_mb: int, job_limit_s: float, device: bool) -> list[str]:
    args = ["--state-mb", str(state_mb), "--repeats", "1", "--no-process", "--timeout-s", f"{job_limit_s:.0f}"]
    return args + (["--device", "cuda"] if device else [])


def _parse(args: list[str], mode: Mode, deadline: Deadline) -> dict[str, Any]:
    from bench.strategies import output_failure
    from ftrain.testbed.jobs import run_within

    proc = run_within(
        [sys.executable, str(BENCH_ARGS), str(BENCH), *args], timeout_s=deadline.remaining(), env=mode.env()
    )
    out = proc.stdout or ""
    if proc.returncode != 0:
        raise CheckFailed(f"bench/checkpoint.py refused {' '.join(args)}: {output_failure(out, proc.returncode)}", out)
    return dict(json.loads(out.strip().splitlines()[-1]))


def limitations_of(parsed: dict[str, Any]) -> list[str]:
    out = []
    if not parsed["takes_device"]:
        out.append(
            "state on the CPU: bench/checkpoint.py takes no --device (its ranks train on the CPU over gloo and "
            "save with device_type='cpu'): no CUDA state, no pinned staging measured"
        )
    if "state_mb_refused" in parsed:
        out.append(f"--state-mb {ASKED_STATE_MB} refused: {parsed['state_mb_refused']}")
    return out


def check(mode: Mode, timeout_s: float) -> Check:
    def run(deadline: Deadline) -> dict[str, Any]:
        from bench.strategies import output_failure
        from ftrain.testbed.jobs import run_within

        probe = _parse(bench_args(ASKED_STATE_MB, 60, False), mode, deadline)
        device = probe["takes_device"]
        if device:
            probe = _parse(bench_args(ASKED_STATE_MB, 60, True), mode, deadline)
        limitations = limitations_of(probe)
        if mode.dry:
            figures = {"args_parsed": probe["args"], "limitations_on_the_device": limitations}
            raise Skip(
                "dry mode: the device run's options parsed by the bench's own parser; the bench not run", figures
            )
        # the asked size only where it lands on the device: 4 GB through the CPU path would not fit the budget
        state_mb = ASKED_STATE_MB if device and "state_mb_refused" not in probe else FALLBACK_STATE_MB
        args = bench_args(state_mb, max(10.0, deadline.remaining() - DRIVER_SLACK_S), device)
        proc = run_within([sys.executable, str(BENCH), *args], timeout_s=deadline.remaining(), env=mode.env())
        out = proc.stdout or ""
        last = out.strip().splitlines()[-1] if out.strip() else ""
        if proc.returncode != 0 or not last.startswith("{"):
            failure = output_failure(out, proc.returncode)
            raise CheckFailed(f"bench/checkpoint.py failed: {failure}", out, {"limitations": limitations})
        summary = json.loads(last)
        figures = {k: summary.get(k) for k in FIGURES}
        figures.update(
            state_mb_asked=ASKED_STATE_MB,
            state_mb_run=state_mb,
            state_device="cuda" if device else "cpu",
            # False on the CPU; on CUDA only what the bench itself reports (None: it does not say)
            pinned_staging=summary.get("pinned_staging") if device else False,
            limitations=limitations,
        )
        missing = [k for k in ("blocked_ratio", "save_vs_raw", "load_vs_raw") if summary.get(k) is None]
        if missing:
            raise CheckFailed(f"the bench's JSON line has no {', '.join(missing)}", out, figures)
        if limitations:
            raise CheckFailed(
                "bench/checkpoint.py cannot run this check as asked: " + "; ".join(limitations), "", figures
            )
        return figures

    return Check("checkpoint_bench", run, timeout_s)
