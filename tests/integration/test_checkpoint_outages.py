"""Storage outages during saves, on a real SeaweedFS server that is paused or killed."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from ftrain.checkpoint.catalog import list_steps
from ftrain.checkpoint.storage import Storage
from ftrain.contract.events import read_events
from ftrain.observability.metrics import read_metrics
from ftrain.testbed.jobs import TINY_CONFIG, torchrun_cmd, train_job, worker_env
from ftrain.testbed.procs import kill_tree
from ftrain.testbed.wait import wait_for

pytestmark = pytest.mark.dist


def metrics(path: Path) -> list[dict]:
    return read_metrics(path) if path.exists() else []


def events(path: Path, name: str) -> list[dict]:
    return [e for e in read_events(str(path)) if e["event"] == name] if path.exists() else []


def start_job(workdir: Path, nproc: int, *args: str, env: dict[str, str]) -> tuple[subprocess.Popen, Path, Path]:
    workdir.mkdir(parents=True, exist_ok=True)
    cfg = workdir / "config.toml"
    cfg.write_text(TINY_CONFIG)
    m, ev = workdir / "metrics.jsonl", workdir / "events.jsonl"
    cmd = torchrun_cmd(nproc, cfg, f"--logging.metrics_path={m}", f"--logging.events_path={ev}", *args)
    proc = subprocess.Popen(
        cmd,
        env=worker_env(**env),
        stdout=open(workdir / "out.log", "w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    return proc, m, ev


def test_sigkill_during_async_upload_leaves_no_manifest(seaweed, s3_prefix, tmp_path):
    """Pause S3 so the step-8 upload hangs in the background, SIGKILL every worker, bring S3 back:
    step 8 has no manifest, the resume uses step 4, and the re-save of step 8 replaces the torn one."""
    url = seaweed.url(f"{s3_prefix}/job")
    storage = Storage(url, seaweed.storage_options())
    env = {**seaweed.env(), "FTRAIN_FAULT_STEP_SLEEP_S": "0.25"}
    proc, m, ev = start_job(
        tmp_path / "crash", 2, f"--checkpoint.uri={url}", "--checkpoint.interval=4", "--train.steps=12", env=env
    )
    try:
        wait_for(
            lambda: any(r.get("ckpt_last_committed_step") == 4 for r in metrics(m)),
            120,
            "step 4 committed",
            alive=lambda: proc.poll() is None,
        )
        seaweed.pause()
        try:
            wait_for(
                lambda: events(ev, "ckpt_staged") and events(ev, "ckpt_staged")[-1]["step"] == 8,
                60,
                "step 8 staged",
                alive=lambda: proc.poll() is None,
            )
            wait_for(
                lambda: any(r["step"] >= 9 for r in metrics(m)),
                60,
                "training past step 8 while S3 hangs",
                alive=lambda: proc.poll() is None,
            )
            kill_tree(proc)  # SIGKILL: torchrun and both workers, mid-upload
        finally:
            seaweed.resume()
    finally:
        kill_tree(proc)
    steps = {s.step: s.state for s in list_steps(storage)}
    assert steps.get(4) == "committed"
    assert steps.get(8) in (None, "uncommitted")

    resumed = train_job(
        tmp_path / "resume",
        2,
        f"--checkpoint.uri={url}",
        "--checkpoint.interval=4",
        "--checkpoint.gc_grace_s=0",
        "--train.steps=12",
        save_final=False,
        env=seaweed.env(),
    )
    assert "resumed from checkpoint step 4" in resumed.output
    final = {s.step: s.state for s in list_steps(storage)}
    assert final.get(8) == "committed" and final.get(12) == "committed"
    assert "uncommitted" not in final.values()
    assert storage.clear_multipart_uploads("") == 0  # nothing orphaned is left behind


def test_s3_down_during_save_is_retried_or_fails_cleanly(seaweed, s3_prefix, tmp_path):
    """Kill the S3 server while a save uploads and restart it a few seconds later: the save is
    retried and committed (or reported failed), training never stops, and later saves commit."""
    url = seaweed.url(f"{s3_prefix}/job")
    storage = Storage(url, seaweed.storage_options())
    env = {**seaweed.env(), "FTRAIN_FAULT_STEP_SLEEP_S": "0.25"}
    proc, m, ev = start_job(
        tmp_path / "job", 2, f"--checkpoint.uri={url}", "--checkpoint.interval=4", "--train.steps=16", env=env
    )
    try:
        wait_for(lambda: any(r["step"] >= 3 for r in metrics(m)), 120, "step 3", alive=lambda: proc.poll() is None)
        stopped_at = time.time()
        seaweed.stop()
        try:
            wait_for(
                lambda: any(r["step"] >= 6 for r in metrics(m)),
                60,
                "training on while S3 is down",
                alive=lambda: proc.poll() is None,
            )
        finally:
            seaweed.restart(timeout_s=60)
        assert proc.wait(timeout=180) == 0, (tmp_path / "job" / "out.log").read_text()[-3000:]
    finally:
        kill_tree(proc)
    committed = {s.step for s in list_steps(storage) if s.state == "committed"}
    assert {12, 16} <= committed  # (retention keeps the newest 3)
    # step 4 was saved while S3 was down: it either committed after the outage (retried) or
    # was reported failed; either way its outcome came after the stop, on every rank
    outcome = [e for e in events(ev, "ckpt_committed") + events(ev, "ckpt_failed") if e["step"] == 4]
    assert len(outcome) == 2 and all(e["time"] > stopped_at for e in outcome), outcome
    if any(e["event"] == "ckpt_failed" for e in outcome):
        assert metrics(m)[-1]["ckpt_saves_failed"] >= 1
    steps_seen = [r["step"] for r in metrics(m)]
    assert steps_seen == list(range(1, 17)), "training must not stop or skip steps during the outage"
