"""The memory tier's node directory (checkpoint.memory_dir): what a worker writes there, what a
restarted worker finds, and what is never trusted or left behind."""

from __future__ import annotations

import os

from checkpoint.digest import digest_bytes
from checkpoint.manifest import FileEntry, Manifest
from ftrain.tier_store import MANIFEST_FILE, DirFiles, Snapshot, TierStore

JOB = "job-a"
KEY = b"tier-key"


def _snapshot(
    step: int, files: dict[str, bytes], *, job: str = JOB, listed: dict[str, bytes] | None = None
) -> Snapshot:
    entries = {n: FileEntry(len(b), digest_bytes(b, "xxh3_128")) for n, b in (listed or files).items()}
    manifest = Manifest(
        step=step,
        round=1,
        world_size=2,
        layout={"strategy": "fsdp"},
        config_hash="c",
        config={},
        trainer={"cursor": {"step": step}},
        digest_algorithm="xxh3_128",
        files=entries,
        created_time=1.0,
        job=job,
    )
    data = manifest.to_json(KEY)
    return Snapshot(step, Manifest.from_json(data, KEY), data, files)


SHARDS = {".metadata": b"meta", "__0_0.distcp": b"rank0-shard", "__1_0.distcp": b"rank1-shard"}


def test_a_persisted_snapshot_is_read_from_the_directory_and_found_by_a_restarted_worker(tmp_path):
    store = TierStore(str(tmp_path), JOB, "node-a", 0)
    kept = store.persist(
        _snapshot(40, {".metadata": SHARDS[".metadata"], "__0_0.distcp": SHARDS["__0_0.distcp"]}, listed=SHARDS)
    )
    assert isinstance(kept.files, DirFiles) and kept.files["__0_0.distcp"] == b"rank0-shard"
    assert sorted(kept.files) == [".metadata", "__0_0.distcp"]  # what it holds, not what the manifest lists
    assert not list(store.own_dir.glob(".tmp-*"))

    # its neighbour on the node (local rank 1) kept the other shard of the same snapshot
    other = TierStore(str(tmp_path), JOB, "node-a", 1)
    other.persist(_snapshot(40, {"__1_0.distcp": SHARDS["__1_0.distcp"]}, listed=SHARDS))

    found = TierStore(str(tmp_path), JOB, "node-a", 0).discover(KEY, JOB)
    assert [s.step for s in found] == [40] and found[0].key == kept.key
    assert sorted(found[0].files) == sorted(SHARDS)  # both workers' files, one snapshot
    assert found[0].files["__1_0.distcp"] == b"rank1-shard"
    # another node's directory is not this node's
    assert TierStore(str(tmp_path), JOB, "node-b", 0).discover(KEY, JOB) == []


def test_nothing_untrusted_is_offered(tmp_path):
    store = TierStore(str(tmp_path), JOB, "n", 0)
    store.persist(_snapshot(10, dict(SHARDS)))
    store.persist(_snapshot(20, dict(SHARDS), job="job-b"))  # another job's, same directory
    forged = store.own_dir / "step-000000030-forged"
    forged.mkdir()
    (forged / MANIFEST_FILE).write_bytes(b'{"format": 2, "step": 30}')
    unsigned = _snapshot(50, dict(SHARDS))
    unsigned_dir = store.own_dir / "step-000000050-unsigned"
    unsigned_dir.mkdir()
    (unsigned_dir / MANIFEST_FILE).write_bytes(unsigned.manifest.to_json(b"another key"))
    extra = store.persist(_snapshot(60, dict(SHARDS)))
    (store.own_dir / f"step-000000060-{extra.key}" / "unlisted.bin").write_bytes(b"x")
    (store.own_dir / ".tmp-step-000000070-dead-12345").mkdir()  # a worker died writing it

    found = TierStore(str(tmp_path), JOB, "n", 0).discover(KEY, JOB)
    assert [s.step for s in found] == [10, 60]
    assert "unlisted.bin" not in found[1].files
    assert not list(store.own_dir.glob(".tmp-*")), "an unfinished directory was left"


def test_superseded_snapshots_are_deleted_and_a_finished_job_leaves_nothing(tmp_path):
    store = TierStore(str(tmp_path), JOB, "n", 0)
    a = store.persist(_snapshot(10, dict(SHARDS)))
    b = store.persist(_snapshot(20, dict(SHARDS)))
    store.keep([b])
    assert [p.name.split("-")[1] for p in store.own_dir.iterdir()] == ["000000020"]
    assert a.key not in {s.key for s in store.discover(KEY, JOB)}

    restarted = TierStore(str(tmp_path), JOB, "n", 0)
    assert [s.step for s in restarted.discover(KEY, JOB)] == [20]
    c = restarted.persist(_snapshot(30, dict(SHARDS)))
    restarted.keep([c])  # the snapshot found from before the restart is superseded too
    assert [s.step for s in restarted.discover(KEY, JOB)] == [30]

    neighbour = TierStore(str(tmp_path), JOB, "n", 1)
    neighbour.persist(_snapshot(30, dict(SHARDS)))
    restarted.discard()
    assert not restarted.own_dir.exists() and neighbour.own_dir.exists()  # only its own
    neighbour.discard()
    assert os.listdir(tmp_path) == []


def test_a_name_that_is_not_a_plain_file_name_is_not_written(tmp_path):
    store = TierStore(str(tmp_path), JOB, "n", 0)
    bad = _snapshot(10, {".metadata": b"m", "sub/shard.distcp": b"x"})  # a manifest may name subdirectories
    try:
        store.persist(bad)
    except Exception as e:  # noqa: BLE001 - the type is checked below
        assert "not a file of the manifest" in str(e)
    else:
        raise AssertionError("a path-like name was written")
    assert not list(store.own_dir.iterdir())
