"""Corrupted checkpoints on real S3: ``ftrain ckpt verify`` names the bad file, training
falls back to the previous good step, and a malicious ``.metadata`` pickle never runs."""

from __future__ import annotations

import json
import os
import pickle
import sys
from pathlib import Path

import pytest

from ftrain.chaos.s3proxy import FaultRates, S3FaultProxy
from ftrain.checkpoint.digest import digest_bytes
from ftrain.checkpoint.storage import Storage
from ftrain.contract.events import read_events
from ftrain.testbed.jobs import max_abs_diff, run, train_job, worker_env

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


@pytest.mark.parametrize("case", sorted(CASES))
def test_corruption_is_named_and_training_falls_back(case, seaweed, pristine, s3_prefix, tmp_path):
    storage = _copy(seaweed, pristine, s3_prefix)
    sentinel = tmp_path / "PWNED"
    bad_file = CASES[case](storage, sentinel)
    env = worker_env(**seaweed.env())

    verify = run([sys.executable, "-m", "ftrain", "ckpt", "verify", storage.url], timeout_s=120, env=env)
    assert verify.returncode == 1, verify.stdout
    assert bad_file in verify.stdout and STEP8 in verify.stdout
    assert "step-000000004: OK" in verify.stdout

    events = tmp_path / "events.jsonl"
    resumed = train_job(
        tmp_path / "resume",
        1,
        "--train.steps=9",
        "--train.on_schedule_change=rescale",  # one step past the saved run's end
        f"--checkpoint.uri={storage.url}",
        "--checkpoint.interval=0",
        "--checkpoint.final_save=false",
        f"--logging.events_path={events}",
        save_final=False,
        env=seaweed.env(),
    )
    assert "resumed from checkpoint step 4" in resumed.output
    assert resumed.metrics[0]["step"] == 5
    corrupt = [e for e in read_events(str(events)) if e["event"] == "ckpt_corrupt"]
    assert corrupt and corrupt[0]["step"] == 8
    assert storage.exists(f"{STEP8}/corrupt.json")  # marked, nothing deleted
    assert storage.exists(f"{STEP8}/manifest.json")
    assert not sentinel.exists(), "the malicious pickle ran"
    assert not os.path.exists(sentinel)


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
