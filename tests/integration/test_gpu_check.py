"""``make gpu-check``'s dry run (``scripts/gpu_check.py --dry``): the same checks as on a GPU host,
on the CPU at the smallest sizes. It keeps the GPU run's plumbing from rotting between the rare
runs on a device: a broken import, a renamed config key or a changed bench option fails it.

The test asserts the summary's shape and that every check ran ok or was skipped with a reason;
never how long anything took (the script reports ``wall_s`` and that is all).
"""

from __future__ import annotations

import json
import sys

import pytest

from ftrain.testbed.jobs import run

pytestmark = pytest.mark.timeout(300)

#: check names the dry run must report (the strategies at one rank are ftrain plan's, at least these)
EXPECTED = {
    "train/gpt/ddp/x1",
    "train/gpt/fsdp/x1",
    "train/llama/ddp/x1",
    "train/llama/fsdp/x1",
    "train/gpt/ddp/x2-gloo",
    "train/gpt/fsdp/x2-gloo",
    "train/llama/ddp/x2-gloo",
    "train/llama/fsdp/x2-gloo",
    "live/gpt/ddp/x2-gloo/worker_kill",
    "flight_recorder",
    "checkpoint_bench",
    "plan_vs_measured",
}
#: the dry run runs these for real (one of each kind); the rest are validated only
RUN_FOR_REAL = {
    "train/gpt/ddp/x1",
    "train/llama/fsdp/x1",
    "train/gpt/ddp/x2-gloo",
    "live/gpt/ddp/x2-gloo/worker_kill",
    "flight_recorder",
    "plan_vs_measured",
}


@pytest.fixture(scope="module")
def summary() -> dict:
    proc = run([sys.executable, "scripts/gpu_check.py", "--dry"], timeout_s=280)
    assert proc.returncode == 0, proc.stdout[-6000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_dry_run_says_it_is_dry_and_claims_no_gpu(summary):
    assert summary["gpu_check"] == "summary"
    assert summary["mode"] == "dry" and summary["cuda"] is False and summary["device"] == "cpu"
    assert summary["ok"] is True
    assert isinstance(summary["wall_s"], float) and summary["budget_s"] > 0
    for check in summary["checks"]:
        if "device" in check["figures"]:
            assert check["figures"]["device"] == "cpu", check


def test_every_check_ran_ok_or_was_skipped_with_a_reason(summary):
    checks = {c["name"]: c for c in summary["checks"]}
    assert EXPECTED <= set(checks), sorted(EXPECTED - set(checks))
    counts = {s: sum(c["status"] == s for c in summary["checks"]) for s in ("ok", "failed", "skipped")}
    assert summary["counts"] == counts and counts["failed"] == 0
    for check in checks.values():
        assert set(check) >= {"name", "status", "wall_s", "figures"}, check
        assert check["status"] in ("ok", "skipped"), check
        if check["status"] == "skipped":
            assert check["reason"], check
    for name in RUN_FOR_REAL:
        assert checks[name]["status"] == "ok", checks[name]


def test_the_figures_are_those_the_gpu_run_reports(summary):
    checks = {c["name"]: c for c in summary["checks"]}
    for name in ("train/gpt/ddp/x1", "train/llama/fsdp/x1", "train/gpt/ddp/x2-gloo"):
        figures = checks[name]["figures"]
        assert figures["steps"] > 0 and figures["peak_mem_bytes"] > 0 and figures["final_loss"] > 0, figures
    assert checks["train/gpt/ddp/x2-gloo"]["figures"]["backend"] == "gloo"
    live = checks["live/gpt/ddp/x2-gloo/worker_kill"]["figures"]
    assert live["survivor_kept_process"] and live["sources"] == ["live_peer"] and live["agent_exit"] == 0
    flight = checks["flight_recorder"]["figures"]
    assert flight["available"] and flight["recorded"] == flight["issued"] == flight["recorded_done"]
    rows = checks["plan_vs_measured"]["figures"]["rows"]
    assert rows and all(r["estimate_compared_bytes"] > 0 and r["measured_bytes"] > 0 for r in rows)
    # the bench's options as the device run passes them, parsed by the bench's own parser
    parsed = checks["checkpoint_bench"]["figures"]["args_parsed"]
    assert parsed["state_mb"] == 4096 and parsed["repeats"] == 1 and parsed["no_process"]
    # a validated-only training check still names the command it would have run
    assert "-m ftrain train" in checks["train/gpt/zero1/x1"]["figures"]["command"]
    assert set(summary["strategies"]["gpt"]["at_one_rank"]) >= {"ddp", "fsdp"}
