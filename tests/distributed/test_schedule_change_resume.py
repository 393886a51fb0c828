"""Resuming with another ``train.steps`` is a decision (``train.on_schedule_change``), end to end:
``ftrain train`` saves to a local checkpoint root, then resumes it under each policy; the learning
rates it used are read back from the metrics, the decision from the events and the exit code."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from ftrain.contract import exits
from ftrain.contract.events import read_jsonl
from ftrain.optim import Schedule
from ftrain.testbed.jobs import TINY_CONFIG, run

pytestmark = pytest.mark.dist

SAVED_STEPS, NEW_STEPS = 8, 16
#: TINY_CONFIG's schedule (lr 1e-2, warmup 2, floor 0.1) at SAVED_STEPS
SAVED = Schedule(
    total_steps=SAVED_STEPS, warmup_steps=2, lr=1e-2, min_lr_ratio=0.1, lr_scaling="none", base_world_size=1
)


def train(workdir: Path, root: Path, *args: str) -> tuple[int, str, list[dict], list[dict]]:
    """``ftrain train`` (one process) on ``root``: exit code, output, metrics and events."""
    workdir.mkdir(parents=True, exist_ok=True)
    cfg = workdir / "config.toml"
    cfg.write_text(TINY_CONFIG)
    metrics, events = workdir / "metrics.jsonl", workdir / "events.jsonl"
    proc = run(
        [
            sys.executable,
            "-m",
            "ftrain",
            "train",
            str(cfg),
            f"--checkpoint.uri={root}",
            "--checkpoint.interval=4",
            f"--logging.metrics_path={metrics}",
            f"--logging.events_path={events}",
            *args,
        ],
        timeout_s=120,
    )
    read = [read_jsonl(p) if p.exists() else [] for p in (metrics, events)]
    return proc.returncode, proc.stdout, *read


def lrs(metrics: list[dict]) -> dict[int, float]:
    return {m["step"]: m["lr"] for m in metrics}


def expected(schedule: Schedule, first: int, last: int) -> dict[int, float]:
    """What the metrics say for steps ``first..last`` (1-based: step s ran at 0-based s - 1)."""
    return {s: pytest.approx(schedule.lr_at(s - 1, 1), rel=1e-12) for s in range(first, last + 1)}


def resumed_event(events: list[dict]) -> dict:
    (event,) = [e for e in events if e["event"] == "resumed"]
    return event


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A root whose newest step, SAVED_STEPS, was trained with train.steps=SAVED_STEPS."""
    work = tmp_path_factory.mktemp("saved")
    rc, out, metrics, _ = train(work, work / "ckpt", f"--train.steps={SAVED_STEPS}")
    assert rc == 0, out[-3000:]
    assert lrs(metrics) == expected(SAVED, 1, SAVED_STEPS)
    return work / "ckpt"


def copy_of(root: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(root, tmp_path / "ckpt"))


def test_fail_refuses_naming_the_change_and_the_options(saved, tmp_path):
    rc, out, metrics, events = train(tmp_path, copy_of(saved, tmp_path), f"--train.steps={NEW_STEPS}")
    assert rc == exits.USAGE, out[-3000:]
    assert f"ftrain: config error: train.on_schedule_change: checkpoint step {SAVED_STEPS}" in out
    assert f"train.steps {SAVED_STEPS} -> {NEW_STEPS}" in out
    assert "--train.on_schedule_change=keep" in out and "--train.on_schedule_change=rescale" in out
    assert "Traceback" not in out
    assert not metrics  # not one step trained
    (failed,) = [e for e in events if e["event"] == "resume_failed"]
    assert f"train.steps {SAVED_STEPS} -> {NEW_STEPS}" in failed["refused"][0]


def test_keep_goes_on_with_the_saved_schedule_and_records_it(saved, tmp_path):
    root = copy_of(saved, tmp_path)
    rc, out, metrics, events = train(
        tmp_path / "keep", root, f"--train.steps={NEW_STEPS}", "--train.on_schedule_change=keep"
    )
    assert rc == 0, out[-3000:]
    assert "train.on_schedule_change=keep: the saved schedule goes on" in out
    floor = SAVED.lr * SAVED.min_lr_ratio
    assert lrs(metrics) == {s: pytest.approx(floor, rel=1e-12) for s in range(SAVED_STEPS + 1, NEW_STEPS + 1)}
    event = resumed_event(events)
    assert event["schedule_outcome"] == "kept" and event["schedule"] == SAVED.to_dict()
    assert event["schedule_changes"] == [f"train.steps {SAVED_STEPS} -> {NEW_STEPS}"]
    # its checkpoints record the schedule it used, not the configured one: a second resume under
    # fail names the saved schedule's train.steps (the config of those steps said NEW_STEPS)
    manifest = json.loads((root / f"step-{NEW_STEPS:09d}" / "manifest.json").read_text())
    assert manifest["trainer"]["schedule"] == SAVED.to_dict()
    assert manifest["config"]["train"]["steps"] == NEW_STEPS
    rc, out, _, _ = train(tmp_path / "again", root, "--train.steps=20")
    assert rc == exits.USAGE and f"train.steps {SAVED_STEPS} -> 20" in out, out[-3000:]


def test_rescale_applies_the_configured_schedule_from_the_resumed_step(saved, tmp_path):
    rc, out, metrics, events = train(
        tmp_path, copy_of(saved, tmp_path), f"--train.steps={NEW_STEPS}", "--train.on_schedule_change=rescale"
    )
    assert rc == 0, out[-3000:]
    assert (
        f"the LR schedule changes (train.steps {SAVED_STEPS} -> {NEW_STEPS}); train.on_schedule_change=rescale" in out
    )
    configured = Schedule(**{**SAVED.to_dict(), "total_steps": NEW_STEPS})
    assert lrs(metrics) == expected(configured, SAVED_STEPS + 1, NEW_STEPS)
    assert resumed_event(events)["schedule_outcome"] == "rescaled"


def test_a_checkpoint_of_an_older_ftrain_resumes_with_the_configured_schedule(saved, tmp_path):
    root = copy_of(saved, tmp_path)
    path = root / f"step-{SAVED_STEPS:09d}" / "manifest.json"
    manifest = json.loads(path.read_text())
    del manifest["trainer"]["schedule"]  # what an older ftrain wrote (no HMAC key here: nothing to re-sign)
    path.write_text(json.dumps(manifest))
    rc, out, metrics, events = train(tmp_path, root, f"--train.steps={NEW_STEPS}")
    assert rc == 0, out[-3000:]
    assert "the checkpoint records no LR schedule" in out
    configured = Schedule(**{**SAVED.to_dict(), "total_steps": NEW_STEPS})
    assert lrs(metrics) == expected(configured, SAVED_STEPS + 1, NEW_STEPS)
    assert resumed_event(events)["schedule_outcome"] == "unrecorded"
