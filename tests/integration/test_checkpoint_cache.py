"""The local disk cache tier (``checkpoint.local_cache_dir``, :mod:`ftrain.checkpoint.local_cache`) with
the real CheckpointManager on a real S3 server (SeaweedFS): saves write the cache as they
upload, a load reads the cache first and trusts none of it, and only the newest step stays."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from ftrain.checkpoint.local_cache import cache_root
from ftrain.checkpoint.manager import CheckpointManager
from ftrain.checkpoint.manifest import CORRUPT_NAME, step_dir_name
from ftrain.checkpoint.storage import Storage
from ftrain.checkpointing import validate_trainer_state
from tests.integration.test_checkpoint_trust import fields

SHARD = "__0_0.distcp"


def state(value: float) -> dict[str, Any]:
    # over one 64 KiB block: the shard gets a block listing, which is cached too
    return {"model": {"w": torch.arange(100_000, dtype=torch.float32) + value, "b": torch.full((7,), value)}}


def manager(seaweed, url: str, cache: Path) -> CheckpointManager:
    return CheckpointManager(
        url=url, job="job-a", async_mode="thread", options=seaweed.storage_options(), local_cache_dir=str(cache)
    )


def save(mgr: CheckpointManager, step: int) -> None:
    assert mgr.save(step, state(step), fields(step))
    assert mgr.wait().last_committed_step == step, mgr.status.last_error


def load(mgr: CheckpointManager, caplog) -> tuple[int, dict[str, Any], str]:
    target = state(-1)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="ftrain.checkpoint.loading"):
        manifest = mgr.load(lambda m: target, validate=validate_trainer_state)
    assert manifest is not None
    fetched = [r.getMessage() for r in caplog.records if "for this rank's load" in r.getMessage()]
    return manifest.step, target, fetched[-1]


def test_a_save_fills_the_cache_and_a_load_reads_it_first_trusting_none_of_it(seaweed, s3_prefix, tmp_path, caplog):
    url = seaweed.url(f"{s3_prefix}/job")
    storage, cache = Storage(url, seaweed.storage_options()), tmp_path / "cache"
    root = Path(cache_root(str(cache), url))
    mgr = manager(seaweed, url, cache)
    try:
        save(mgr, 4)
        save(mgr, 8)
    finally:
        mgr.close()
    # what the cache holds of step 8 is what storage holds, byte for byte; step 4 was dropped
    assert sorted(p.name for p in root.iterdir()) == ["source.txt", step_dir_name(8)]
    step8 = root / step_dir_name(8)
    names = sorted(p.name for p in step8.iterdir())
    assert SHARD in names and SHARD + ".blocks" in names and ".metadata" in names
    assert not [n for n in names if n.endswith(".partial")]
    for name in names:
        assert (step8 / name).read_bytes() == storage.read_bytes(f"{step_dir_name(8)}/{name}"), name

    # a new manager (a restarted job) reads step 8 from the cache: all of it
    step, target, fetched = load(manager(seaweed, url, cache), caplog)
    assert step == 8 and torch.equal(target["model"]["w"], state(8)["model"]["w"])
    read_mb = float(fetched.split("fetched ")[1].split(" MB")[0])
    cached_mb = float(fetched.split(", ")[-1].split(" MB")[0])
    assert read_mb > 0.3 and cached_mb == read_mb, fetched

    # a damaged cached shard is found by its block digest, dropped, and read from storage
    data = bytearray((step8 / SHARD).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (step8 / SHARD).write_bytes(bytes(data))
    step, target, fetched = load(manager(seaweed, url, cache), caplog)
    assert step == 8 and torch.equal(target["model"]["w"], state(8)["model"]["w"]), fetched
    assert not (step8 / SHARD).exists()
    assert not storage.exists(f"{step_dir_name(8)}/{CORRUPT_NAME}")  # the cache's fault, not the step's

    # a cached file of the wrong size is not read at all
    (step8 / SHARD).write_bytes(b"short")
    step, target, fetched = load(manager(seaweed, url, cache), caplog)
    assert step == 8 and torch.equal(target["model"]["w"], state(8)["model"]["w"])
    assert float(fetched.split(", ")[-1].split(" MB")[0]) < 0.01, fetched  # .metadata and the listing only


def test_an_unusable_cache_directory_never_fails_a_save(seaweed, s3_prefix, tmp_path, caplog):
    url = seaweed.url(f"{s3_prefix}/job")
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the cache directory should be")
    mgr = manager(seaweed, url, blocker)
    try:
        save(mgr, 2)
    finally:
        mgr.close()
    step, target, fetched = load(manager(seaweed, url, blocker), caplog)
    assert step == 2 and torch.equal(target["model"]["b"], state(2)["model"]["b"])
    assert fetched.endswith("0.0 MB of it from the local cache"), fetched
