"""Corrupted checkpoints on real S3: ``ftrain ckpt verify`` names the bad file, training
falls back to the previous good step, and a malicious ``.metadata`` pickle never runs."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from ftrain.chaos.s3proxy import FaultRates, S3FaultProxy
from ftrain.checkpoint.digest import digest_bytes
from ftrain.checkpoint.storage import Storage
from ftrain.contract.events import read_events
from ftrain.testbed.jobs import RunResult, max_abs_diff, run, train_job, worker_env
from tests.distributed.batched_runs import batched_runs

pytestmark = pytest.mark.dist

STEP8 = "step-000000008"


@pytest.fixture(scope="module")
def pristine(seaweed, tmp_path_factory):
    """One real run's committed steps 4 and 8, copied afresh for every corruption case."""
    url = seaweed.url("corruption-source")
    train_job(
        tmp_path_factory.mktemp("src"),
        2,
        "--train.steps=8",
        f"--checkpoint.uri={url}",
        "--checkpoint.interval=4",
        save_final=False,
        env=seaweed.env(),
    )
    return url


def _copy(seaweed, src_url: str, prefix: str) -> Storage:
    src = Storage(src_url, seaweed.storage_options())
    dst = Storage(seaweed.url(prefix), seaweed.storage_options())
    for dirname in [d for d in src.listdir("") if d.startswith("step-")]:
        for name in src.listdir(dirname):
            dst.write_bytes(f"{dirname}/{name}", src.read_bytes(f"{dirname}/{name}"))
    return dst


class _Payload:
    """Unpickling this runs ``open(path, "w")``: the file's existence proves code ran."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _flip_byte(s: Storage) -> str:
    data = bytearray(s.read_bytes(f"{STEP8}/__1_0.distcp"))
    data[len(data) // 2] ^= 0x01
    s.write_bytes(f"{STEP8}/__1_0.distcp", bytes(data))
    return "__1_0.distcp"


def _truncate(s: Storage) -> str:
    data = s.read_bytes(f"{STEP8}/__0_0.distcp")
    s.write_bytes(f"{STEP8}/__0_0.distcp", data[: len(data) // 3])
    return "__0_0.distcp"


def _delete(s: Storage) -> str:
    s.remove(f"{STEP8}/__1_0.distcp")
    return "__1_0.distcp"


def _edit_manifest(s: Storage) -> str:
    manifest = json.loads(s.read_bytes(f"{STEP8}/manifest.json"))
    manifest["files"]["__0_0.distcp"]["size_bytes"] += 1
    s.write_bytes(f"{STEP8}/manifest.json", json.dumps(manifest).encode())
    return "__0_0.distcp"


def _evil_metadata(s: Storage, sentinel: Path, *, forge_manifest: bool) -> str:
    evil = pickle.dumps(_Payload(str(sentinel)))
    s.write_bytes(f"{STEP8}/.metadata", evil)
    if forge_manifest:  # the attacker also rewrites the digest: only the unpickler stands in the way
        manifest = json.loads(s.read_bytes(f"{STEP8}/manifest.json"))
        manifest["files"][".metadata"] = {
            "size_bytes": len(evil),
            "digest": digest_bytes(evil, manifest["digest_algorithm"]),
        }
        s.write_bytes(f"{STEP8}/manifest.json", json.dumps(manifest).encode())
    return ".metadata"


CASES = {
    "flipped-byte": lambda s, p: _flip_byte(s),
    "truncated": lambda s, p: _truncate(s),
    "deleted": lambda s, p: _delete(s),
    "edited-manifest": lambda s, p: _edit_manifest(s),
    "pickle": lambda s, p: _evil_metadata(s, p, forge_manifest=False),
    "pickle-forged-digest": lambda s, p: _evil_metadata(s, p, forge_manifest=True),
}


@dataclass
class Corrupted:
    """One case of CASES: its damaged copy, what ``ftrain ckpt verify`` said, and its resume."""

    storage: Storage
    bad_file: str
    sentinel: Path
    verify: subprocess.CompletedProcess
    events: Path


@pytest.fixture(scope="module")
def corrupted(seaweed, pristine, tmp_path_factory) -> tuple[dict[str, Corrupted], Callable[[str], RunResult]]:
    """Every case of CASES damaged in a copy of its own and verified, then resumed: the resumes
    (one rank each, from the damaged copy) share one torchrun launch (tests/distributed/batched_runs.py)."""
    if not seaweed.running:  # as s3_prefix does: a test that left the server dead does not cascade
        seaweed.restart(timeout_s=60)
    env = worker_env(**seaweed.env())
    cases: dict[str, Corrupted] = {}
    for case in sorted(CASES):
        tmp = tmp_path_factory.mktemp(case)
        storage = _copy(seaweed, pristine, f"t-{uuid.uuid4().hex[:12]}")
        sentinel = tmp / "PWNED"
        bad_file = CASES[case](storage, sentinel)
        verify = run([sys.executable, "-m", "ftrain", "ckpt", "verify", storage.url], timeout_s=120, env=env)
        cases[case] = Corrupted(storage, bad_file, sentinel, verify, tmp / "events.jsonl")
    resumes = {
        case: (
            1,
            (
                "--train.steps=9",
                "--train.on_schedule_change=rescale",  # one step past the saved run's end
                f"--checkpoint.uri={c.storage.url}",
                "--checkpoint.interval=0",
                "--checkpoint.final_save=false",
                f"--logging.events_path={c.events}",
            ),
        )
        for case, c in cases.items()
    }
    return cases, batched_runs(tmp_path_factory, resumes, env=seaweed.env())


@pytest.mark.timeout(900)  # the first case waits for every case's verify and resume
@pytest.mark.parametrize("case", sorted(CASES))
def test_corruption_is_named_and_training_falls_back(case, corrupted):
    cases, resume = corrupted
    c = cases[case]
    assert c.verify.returncode == 1, c.verify.stdout
    assert c.bad_file in c.verify.stdout and STEP8 in c.verify.stdout
    assert "step-000000004: OK" in c.verify.stdout

    resumed = resume(case)  # also checks that it exited 0
    assert "resumed from checkpoint step 4" in resumed.output
    assert resumed.metrics[0]["step"] == 5
    corrupt = [e for e in read_events(str(c.events)) if e["event"] == "ckpt_corrupt"]
    assert corrupt and corrupt[0]["step"] == 8
    assert c.storage.exists(f"{STEP8}/corrupt.json")  # marked, nothing deleted
    assert c.storage.exists(f"{STEP8}/manifest.json")
    assert not c.sentinel.exists(), "the malicious pickle ran"
    assert not os.path.exists(c.sentinel)


# -- damage in flight: the S3 fault proxy flips a bit of a shard's bytes on their way ---------
def _resume(seaweed, storage: Storage, workdir: Path, endpoint_url: str, *, check: bool = True):
    return train_job(
        workdir,
        1,
        "--train.steps=9",
        "--train.on_schedule_change=rescale",  # one step past the saved run's end
        f"--checkpoint.uri={storage.url}",
        f"--checkpoint.endpoint_url={endpoint_url}",
        "--checkpoint.interval=0",
        "--checkpoint.final_save=false",
        f"--logging.events_path={workdir / 'events.jsonl'}",
        env=seaweed.env(),
        check=check,
    )


def test_a_shard_damaged_in_flight_is_read_again_and_loaded_intact(seaweed, pristine, s3_prefix, tmp_path):
    storage = _copy(seaweed, pristine, s3_prefix)
    clean = _resume(seaweed, storage, tmp_path / "clean", seaweed.endpoint_url)
    with S3FaultProxy(seaweed.endpoint_url) as proxy:
        proxy.set_faults(FaultRates(flip_first=True, flip_keys=".distcp"))
        damaged = _resume(seaweed, storage, tmp_path / "damaged", proxy.endpoint_url)
    assert proxy.injected["flip"] >= 2, "the proxy damaged fewer than the step's two shards"
    assert "resumed from checkpoint step 8" in damaged.output
    assert not [e for e in read_events(str(tmp_path / "damaged" / "events.jsonl")) if e["event"] == "ckpt_corrupt"]
    assert not storage.exists(f"{STEP8}/corrupt.json")
    assert clean.final is not None and damaged.final is not None
    assert max_abs_diff(damaged.final["model"], clean.final["model"]) == 0.0


def test_shards_damaged_on_every_read_are_refused_and_never_loaded(seaweed, pristine, s3_prefix, tmp_path):
    storage = _copy(seaweed, pristine, s3_prefix)
    with S3FaultProxy(seaweed.endpoint_url) as proxy:
        proxy.set_faults(FaultRates(flip=1.0, flip_keys=".distcp"))
        result = _resume(seaweed, storage, tmp_path / "job", proxy.endpoint_url, check=False)
    assert result.returncode != 0 and "resumed from" not in result.output
    refused = [e["step"] for e in read_events(str(tmp_path / "job" / "events.jsonl")) if e["event"] == "ckpt_corrupt"]
    assert refused == [8, 4], refused
    assert "cannot resume" in result.output and "digest" in result.output
