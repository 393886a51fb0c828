"""Replica consistency checks, non-finite steps, HMAC-signed manifests and process-based
async saves: real ranks, faults injected inside the workers (ftrain/faults.py)."""

from __future__ import annotations

import json

import pytest
import torch

from ftrain.contract.events import read_events
from ftrain.testbed.jobs import train_job

pytestmark = pytest.mark.dist


def _events(path, name):
    return [e for e in read_events(str(path)) if e["event"] == name]


def test_perturbed_replica_halts_the_job(tmp_path):
    ev = tmp_path / "events.jsonl"
    run = train_job(
        tmp_path / "job",
        3,
        "--consistency.interval=1",
        "--consistency.on_mismatch=halt",
        "--train.global_batch_size=12",
        f"--logging.events_path={ev}",
        env={"FTRAIN_FAULT_PERTURB": "4:2"},
        check=False,
        save_final=False,
    )
    assert run.returncode != 0
    assert "replicas differ on ranks [2]" in run.output
    mismatch = _events(ev, "replica_mismatch")
    assert mismatch and mismatch[0]["step"] == 4 and mismatch[0]["ranks"] == [2]
    assert max(m["step"] for m in run.metrics) == 4


def test_perturbed_replica_rolls_back_to_a_verified_checkpoint(tmp_path):
    """Rollback reloads step 2 on every rank and replays: the result equals a clean run."""
    ck = ["--checkpoint.interval=2", "--checkpoint.async_mode=off"]
    golden = train_job(tmp_path / "golden", 2, f"--checkpoint.uri={tmp_path / 'ck0'}", *ck)
    ev = tmp_path / "events.jsonl"
    run = train_job(
        tmp_path / "job",
        2,
        "--consistency.interval=1",
        "--consistency.on_mismatch=rollback",
        f"--checkpoint.uri={tmp_path / 'ck1'}",
        *ck,
        f"--logging.events_path={ev}",
        env={"FTRAIN_FAULT_PERTURB": "3:1"},
    )
    rolled = _events(ev, "rolled_back")
    assert rolled and rolled[0]["step"] == 2
    assert _events(ev, "replica_mismatch")[0]["ranks"] == [1]
    for name, tensor in golden.final["model"].items():
        assert torch.equal(run.final["model"][name], tensor), name


def test_nan_loss_skips_the_step(tmp_path):
    ev = tmp_path / "events.jsonl"
    run = train_job(
        tmp_path / "job",
        2,
        "--train.on_nonfinite=skip",
        f"--logging.events_path={ev}",
        env={"FTRAIN_FAULT_NAN": "3:0"},
        save_final=False,
    )
    assert [m["step"] for m in run.metrics] == list(range(1, 11))
    assert run.metrics[-1]["skipped_steps"] == 1
    assert _events(ev, "nonfinite")[0]["policy"] == "skip"
    assert all(m["loss"] == m["loss"] for m in run.metrics if m["step"] != 3)  # finite elsewhere


def test_nan_loss_halts_when_asked(tmp_path):
    run = train_job(
        tmp_path / "job", 1, "--train.on_nonfinite=halt", env={"FTRAIN_FAULT_NAN": "2:0"}, check=False, save_final=False
    )
    assert run.returncode != 0 and "train.on_nonfinite=halt" in run.output


def test_hmac_signed_manifests_and_process_async_saves(tmp_path):
    """Manifests carry an HMAC bound to the job when a key is configured; a reader with another
    key, or of another job, refuses them."""
    from ftrain.checkpoint.catalog import list_steps
    from ftrain.checkpoint.storage import Storage

    key_env = {"FTRAIN_TEST_HMAC": "s3cret"}
    uri = tmp_path / "ck"
    run = train_job(
        tmp_path / "job",
        2,
        f"--checkpoint.uri={uri}",
        "--checkpoint.interval=5",
        "--checkpoint.async_mode=process",
        "--checkpoint.hmac_key_env=FTRAIN_TEST_HMAC",
        "--agent.job=hmac-job",
        save_final=False,
        env=key_env,
    )
    assert run.metrics[-1]["ckpt_saves_failed"] == 0
    manifest = json.loads((uri / "step-000000005" / "manifest.json").read_text())
    assert len(manifest["hmac"]) == 64 and manifest["job"] == "hmac-job"
    states = {s.step: s.state for s in list_steps(Storage(str(uri)), b"s3cret", job="hmac-job")}
    assert states == {5: "committed", 10: "committed"}
    forged = {s.step: s.state for s in list_steps(Storage(str(uri)), b"other-key", job="hmac-job")}
    assert set(forged.values()) == {"corrupt"}
    other_job = {s.step: s.state for s in list_steps(Storage(str(uri)), b"s3cret", job="another-job")}
    assert set(other_job.values()) == {"corrupt"}
