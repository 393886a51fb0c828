"""Replica consistency checks, non-finite steps, HMAC-signed manifests and process-based
async saves: real ranks, faults injected inside the workers (ftrain/faults.py)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from ftrain.contract.events import read_events
from ftrain.testbed.jobs import RunResult, train_job
from tests.distributed.batched_runs import batched_runs

pytestmark = pytest.mark.dist


def _events(path, name, rank=None):
    return [e for e in read_events(str(path)) if e["event"] == name and rank in (None, e["rank"])]


def test_a_corrupt_replica_among_two_halts_the_job_naming_both(tmp_path):
    """Two replicas that differ have no majority: the check cannot tell which one is corrupt and
    names both (undecided), rather than blaming one at random."""
    ev = tmp_path / "events.jsonl"
    run = train_job(
        tmp_path / "job",
        2,
        "--consistency.interval=1",
        "--consistency.on_mismatch=halt",
        f"--logging.events_path={ev}",
        env={"FTRAIN_FAULT_BITFLIP": "4:1"},
        check=False,
        save_final=False,
    )
    assert run.returncode != 0
    assert "replicas differ on ranks [0, 1]" in run.output and "no majority" in run.output
    mismatch = _events(ev, "replica_mismatch")
    assert mismatch and mismatch[0]["step"] == 4 and mismatch[0]["ranks"] == [0, 1]
    assert mismatch[0]["decided"] is False
    assert max(m["step"] for m in run.metrics) == 4


_CKPT = ("--checkpoint.interval=2", "--checkpoint.async_mode=off")
_THREE = ("--train.global_batch_size=12", *_CKPT)
#: the rollback runs: a bit of rank 2's ``target`` flips in memory after steps 3 and 6
_FLIPS = {"param", "exp_avg"}


@pytest.fixture(scope="module")
def three_ranks(tmp_path_factory) -> tuple[Path, Callable[[str], RunResult]]:
    """The 3-rank runs of this file, ONE torchrun launch for all (tests/distributed/batched_runs.py;
    blocking saves, no rank killed, each case's faults fire as in a process of its own): ``golden``
    (fault-free) and a rollback run per bit-flip target; (their directory, ``get(name)``)."""
    tmp = tmp_path_factory.mktemp("consistency3")
    cases = {"golden": (3, (*_THREE, f"--checkpoint.uri={tmp / 'golden' / 'ck'}"))}
    case_env = {}
    for target in sorted(_FLIPS):
        cases[target] = (
            3,
            (
                *_THREE,
                "--consistency.interval=1",
                "--consistency.on_mismatch=rollback",
                f"--checkpoint.uri={tmp / target / 'ck'}",
                f"--logging.events_path={tmp / target / 'events.jsonl'}",
            ),
        )
        case_env[target] = {"FTRAIN_FAULT_BITFLIP": "3:2,6:2", "FTRAIN_FAULT_BITFLIP_IN": target}
    return tmp, batched_runs(tmp_path_factory, cases, case_env=case_env)


@pytest.fixture(scope="module")
def golden_three(three_ranks):
    """The fault-free run the rollbacks must reproduce: 3 ranks, a checkpoint every 2 steps."""
    return three_ranks[1]("golden")


@pytest.mark.timeout(600)  # the first case waits for every case of the launch
@pytest.mark.parametrize("target", ["param", "exp_avg"])
def test_a_flipped_bit_is_found_on_its_rank_and_rolled_back_to_a_verified_checkpoint(three_ranks, golden_three, target):
    """Silent data corruption: one bit of rank 2's parameter (or AdamW moment) flips in memory
    after steps 3 and 6. The check after each step finds rank 2 (the other two agree: decided),
    every rank reloads the last verified step and replays: the result equals the clean run. Step
    6 is a checkpoint step: the check runs before its save, so the corrupt state is never
    committed (a rollback to it would keep the corruption)."""
    tmp, get = three_ranks
    ev = tmp / target / "events.jsonl"
    run = get(target)  # also checks that it ran on 3 ranks and the launch exited 0
    assert f"flipped a bit ({target} of the first parameter" in run.output
    # a flip in a moment shows in the state at once (the check digests the optimizer state too)
    assert [(m["step"], m["ranks"], m["decided"]) for m in _events(ev, "replica_mismatch", rank=0)] == [
        (3, [2], True),
        (6, [2], True),
    ]
    assert [r["step"] for r in _events(ev, "rolled_back", rank=0)] == [2, 4]
    for name, tensor in golden_three.final["model"].items():
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
