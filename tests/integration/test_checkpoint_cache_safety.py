"""The local cache (``checkpoint.local_cache_dir``) never lets whoever else can write near it steer
the job's own writes, deletes or reads (issue 25, item 3), with the real CheckpointManager on a
local checkpoint root:

- a link planted at a predictable ``.partial`` name or at a file's final name is never written
  through: the file it points at is untouched, the save commits and the cache holds real files;
- an unsafe cache directory (writable by others, group-writable, owned by another user) turns
  the cache off with one warning naming the setting, the path and the fix; saves and loads go on;
- a FIFO, a link to ``/dev/zero`` or a link to a copy of the right bytes at a cached file's name
  is not read: the load reads storage and succeeds;
- a link planted where a step directory or a cached file is dropped is removed itself, never
  what it points at.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from ftrain.checkpoint.local_cache import cache_root
from ftrain.checkpoint.manager import CheckpointManager
from ftrain.checkpoint.manifest import step_dir_name
from ftrain.checkpoint.storage import StorageOptions
from ftrain.checkpointing import validate_trainer_state
from tests.integration.test_checkpoint_trust import fields

SHARD, META = "__0_0.distcp", ".metadata"
STEP4, STEP8 = step_dir_name(4), step_dir_name(8)
NOBODY = 65534


def state(value: float) -> dict[str, Any]:
    return {"model": {"w": torch.arange(100_000, dtype=torch.float32) + value, "b": torch.full((7,), value)}}


def manager(ckpt: Path, cache: Path) -> CheckpointManager:
    return CheckpointManager(
        url=str(ckpt), job="job-a", async_mode="off", options=StorageOptions(max_attempts=2), local_cache_dir=str(cache)
    )


def save(mgr: CheckpointManager, step: int) -> None:
    assert mgr.save(step, state(step), fields(step), sync=True), mgr.status.last_error


def load(mgr: CheckpointManager) -> tuple[int, dict[str, Any]]:
    target = state(-1)
    manifest = mgr.load(lambda m: target, validate=validate_trainer_state)
    assert manifest is not None
    return manifest.step, target


def victim(tmp_path: Path, name: str) -> Path:
    path = tmp_path / "victims" / name
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(b"precious: the job must never write here\n")
    return path


def test_links_planted_at_partial_and_final_names_are_never_written_through(tmp_path):
    ckpt, cache = tmp_path / "ck", tmp_path / "cache"
    root = Path(cache_root(str(cache), str(ckpt)))
    mgr = manager(ckpt, cache)
    save(mgr, 4)
    step8 = root / STEP8
    step8.mkdir(mode=0o700)  # a step directory the job will write into, planted with links
    planted = {}
    for name in (SHARD, META, SHARD + ".blocks"):
        for link in (name + ".partial", name):
            target = victim(tmp_path, link.replace("/", "_"))
            os.symlink(target, step8 / link)
            planted[target] = target.read_bytes()
    save(mgr, 8)
    for target, before in planted.items():
        assert target.read_bytes() == before, f"the job wrote through a link into {target}"
    names = sorted(os.listdir(step8))
    assert names == sorted([SHARD, META, SHARD + ".blocks"]), names
    for name in names:
        path = step8 / name
        assert not path.is_symlink() and path.is_file(), name
        assert path.read_bytes() == (ckpt / STEP8 / name).read_bytes(), name
        assert (path.stat().st_mode & 0o777) == 0o600, name
    assert (root.stat().st_mode & 0o777) == 0o700 and (step8.stat().st_mode & 0o777) == 0o700
    mgr.close()

    reader = manager(ckpt, cache)
    step, target = load(reader)
    assert step == 8 and torch.equal(target["model"]["w"], state(8)["model"]["w"])
    assert reader.load_reads[1] == reader.load_reads[0] > 400_000, reader.load_reads  # all of it from the cache


def _unsafe_group_writable(cache: Path, root: Path) -> None:
    root.mkdir(parents=True, mode=0o700)
    os.chmod(root, 0o770)


def _unsafe_world_writable_parent(cache: Path, root: Path) -> None:
    cache.mkdir(mode=0o700)
    os.chmod(cache, 0o777)  # not sticky: anyone may rename the job's directory out and put theirs in


def _unsafe_foreign_owner(cache: Path, root: Path) -> None:
    root.mkdir(parents=True, mode=0o700)
    os.chown(root, NOBODY, NOBODY)


def _unusable_file(cache: Path, root: Path) -> None:
    cache.write_text("a file where the cache directory should be")


@pytest.mark.parametrize(
    "make, problem",
    [
        (_unsafe_group_writable, "writable by group or others"),
        (_unsafe_world_writable_parent, "not sticky"),
        (_unsafe_foreign_owner, f"owned by uid {NOBODY}"),
        (_unusable_file, "cannot be used"),
    ],
    ids=["group-writable", "world-writable-parent", "foreign-owner", "a-file"],
)
def test_an_unsafe_cache_directory_turns_the_cache_off_with_one_warning(tmp_path, caplog, make, problem):
    if make is _unsafe_foreign_owner and os.geteuid() != 0:
        pytest.skip("making a directory owned by another user needs root")
    ckpt, cache = tmp_path / "ck", tmp_path / "cache"
    root = Path(cache_root(str(cache), str(ckpt)))
    make(cache, root)
    files = lambda: sorted(str(p) for p in cache.rglob("*") if not p.is_dir()) if cache.is_dir() else []  # noqa: E731
    before = files()
    with caplog.at_level(logging.WARNING, logger="ftrain.checkpoint.local_cache"):
        mgr = manager(ckpt, cache)
        save(mgr, 4)
        save(mgr, 8)
        mgr.close()
    warnings = [r.getMessage() for r in caplog.records if r.name == "ftrain.checkpoint.local_cache"]
    assert len(warnings) == 1, warnings
    (warning,) = warnings
    assert "checkpoint.local_cache_dir" in warning and "OFF" in warning and problem in warning, warning
    assert str(cache) in warning, warning
    if make is not _unusable_file:
        assert "rm -rf" in warning and "choose another checkpoint.local_cache_dir" in warning, warning
        assert files() == before, "the job wrote into an unsafe cache directory"
    reader = manager(ckpt, cache)
    step, target = load(reader)
    assert step == 8 and torch.equal(target["model"]["b"], state(8)["model"]["b"])
    assert reader.load_reads[1] == 0 < reader.load_reads[0], reader.load_reads


def _fifo(path: Path, tmp_path: Path) -> None:
    os.mkfifo(path)


def _dev_zero(path: Path, tmp_path: Path) -> None:
    os.symlink("/dev/zero", path)


def _link_to_a_good_copy(path: Path, tmp_path: Path) -> None:
    copy = tmp_path / "outside" / path.name  # the right size and bytes, but outside the cache
    copy.parent.mkdir(exist_ok=True)
    shutil.copyfile(path, copy)
    path.unlink()
    os.symlink(copy, path)


def _directory(path: Path, tmp_path: Path) -> None:
    path.mkdir()


@pytest.mark.parametrize("plant", [_fifo, _dev_zero, _link_to_a_good_copy, _directory])
def test_a_special_file_at_a_cached_name_is_not_read_and_the_load_reads_storage(tmp_path, plant):
    ckpt, cache = tmp_path / "ck", tmp_path / "cache"
    step8 = Path(cache_root(str(cache), str(ckpt))) / STEP8
    mgr = manager(ckpt, cache)
    save(mgr, 8)
    mgr.close()
    shard = step8 / SHARD
    shard_bytes = shard.stat().st_size
    if plant is not _link_to_a_good_copy:
        shard.unlink()
    plant(shard, tmp_path)
    reader = manager(ckpt, cache)
    step, target = load(reader)  # returns: a FIFO opened for reading would block here
    assert step == 8 and torch.equal(target["model"]["w"], state(8)["model"]["w"])
    total, cached = reader.load_reads
    assert total - cached >= shard_bytes, f"the shard was read from {plant.__name__} in the cache: {reader.load_reads}"


def test_a_link_where_a_step_directory_or_a_cached_file_is_dropped_is_removed_itself(tmp_path):
    ckpt, cache = tmp_path / "ck", tmp_path / "cache"
    root = Path(cache_root(str(cache), str(ckpt)))
    mgr = manager(ckpt, cache)
    save(mgr, 4)
    keep = tmp_path / "victims" / "dir"
    keep.mkdir(parents=True)
    (keep / "file").write_text("keep me")
    os.symlink(keep, root / step_dir_name(2))  # looks like a cached step that retention drops
    save(mgr, 8)  # the commit keeps only step 8 in the cache
    mgr.close()
    assert not os.path.lexists(root / step_dir_name(2)) and not (root / STEP4).exists()
    assert (keep / "file").read_text() == "keep me"

    # a damaged cached file is dropped by unlinking its name, whatever is behind it
    outside = tmp_path / "victims" / "shard"
    shutil.copyfile(root / STEP8 / SHARD, outside)
    data = bytearray(outside.read_bytes())
    data[len(data) // 2] ^= 0xFF
    outside.write_bytes(bytes(data))
    (root / STEP8 / SHARD).unlink()
    (root / STEP8 / SHARD).write_bytes(bytes(data))  # a regular file of the right size, one bit off
    reader = manager(ckpt, cache)
    step, target = load(reader)
    assert step == 8 and torch.equal(target["model"]["w"], state(8)["model"]["w"])
    assert not os.path.lexists(root / STEP8 / SHARD)
    assert outside.read_bytes() == bytes(data)
