"""The memory tier's node directory (checkpoint.memory_dir): what a worker writes there, what a
restarted worker finds, and what is never trusted or left behind."""

from __future__ import annotations

import os
import stat

import pytest

from ftrain.checkpoint.digest import digest_bytes
from ftrain.checkpoint.manifest import FileEntry, Manifest
from ftrain.contract.local_files import UnsafeLocalDirError
from ftrain.recovery.tier_binding import Binding
from ftrain.recovery.tier_store import MANIFEST_FILE, DirFiles, Snapshot, TierStore

JOB = "job-a"
KEY = b"tier-key"
CONFIG = {"train": {"seed": 3}, "checkpoint": {"uri": "s3://b/job-a"}}
RUN = Binding("run-1", "c", "s3://b/job-a", CONFIG)


def _snapshot(
    step: int,
    files: dict[str, bytes],
    *,
    job: str = JOB,
    listed: dict[str, bytes] | None = None,
    run_id: str = "run-1",
    config_hash: str = "c",
    config: dict | None = None,
) -> Snapshot:
    entries = {n: FileEntry(len(b), digest_bytes(b, "xxh3_128")) for n, b in (listed or files).items()}
    manifest = Manifest(
        step=step,
        round=1,
        world_size=2,
        layout={"strategy": "fsdp"},
        config_hash=config_hash,
        config=CONFIG if config is None else config,
        trainer={"cursor": {"step": step}},
        digest_algorithm="xxh3_128",
        files=entries,
        created_time=1.0,
        job=job,
        run_id=run_id,
    )
    data = manifest.to_json(KEY)
    return Snapshot(step, Manifest.from_json(data, KEY), data, files)


def _store(tmp_path, node: str = "n", local_rank: int = 0) -> TierStore:
    store = TierStore(str(tmp_path), JOB, node, local_rank)
    store.open()
    return store


def _found(tmp_path, node: str = "n", binding: Binding = RUN) -> list[Snapshot]:
    return _store(tmp_path, node).discover(KEY, JOB, binding)[0]


SHARDS = {".metadata": b"meta", "__0_0.distcp": b"rank0-shard", "__1_0.distcp": b"rank1-shard"}


def test_a_persisted_snapshot_is_read_from_the_directory_and_found_by_a_restarted_worker(tmp_path):
    store = _store(tmp_path, "node-a", 0)
    kept = store.persist(
        _snapshot(40, {".metadata": SHARDS[".metadata"], "__0_0.distcp": SHARDS["__0_0.distcp"]}, listed=SHARDS)
    )
    assert isinstance(kept.files, DirFiles) and kept.files["__0_0.distcp"] == b"rank0-shard"
    assert sorted(kept.files) == [".metadata", "__0_0.distcp"]  # what it holds, not what the manifest lists
    assert not list(store.own_dir.glob(".tmp-*"))

    # its neighbour on the node (local rank 1) kept the other shard of the same snapshot
    other = _store(tmp_path, "node-a", 1)
    other.persist(_snapshot(40, {"__1_0.distcp": SHARDS["__1_0.distcp"]}, listed=SHARDS))

    found = _found(tmp_path, "node-a")
    assert [s.step for s in found] == [40] and found[0].key == kept.key
    assert sorted(found[0].files) == sorted(SHARDS)  # both workers' files, one snapshot
    assert found[0].files["__1_0.distcp"] == b"rank1-shard"
    # another node's directory is not this node's
    assert _found(tmp_path, "node-b") == []


def test_the_directories_are_private_and_the_files_unreadable_by_others(tmp_path):
    os.chmod(tmp_path, 0o1777)  # as /dev/shm: world-writable, sticky
    store = _store(tmp_path)
    store.persist(_snapshot(10, dict(SHARDS)))
    for path in (store.tier_dir, store.node_dir, store.own_dir, *store.own_dir.iterdir()):
        assert stat.S_IMODE(path.stat().st_mode) == 0o700, path
    files = [p for p in store.own_dir.rglob("*") if p.is_file()]
    assert files and all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in files)


@pytest.mark.parametrize("plant", ["group_writable", "other_owner", "symlink", "parent_of_another_user"])
def test_a_tier_directory_someone_else_could_plant_in_is_refused(tmp_path, plant):
    os.chmod(tmp_path, 0o1777)
    tier_dir = tmp_path / f"ftrain-tier-{JOB}"
    if plant == "parent_of_another_user":  # sticky, but its owner may rename what is in it
        os.chown(tmp_path, 12345, 12345)
    elif plant == "symlink":
        (tmp_path / "elsewhere").mkdir(mode=0o700)
        tier_dir.symlink_to(tmp_path / "elsewhere")
    else:
        tier_dir.mkdir(mode=0o700)
        if plant == "group_writable":
            os.chmod(tier_dir, 0o770)
        else:
            os.chown(tier_dir, 12345, 12345)  # the tests run as root: as if another user made it
    with pytest.raises(UnsafeLocalDirError) as err:
        TierStore(str(tmp_path), JOB, "n", 0).open()
    assert "checkpoint.memory_dir" in str(err.value) and str(tier_dir) in str(err.value)


def test_nothing_untrusted_is_offered(tmp_path):
    store = _store(tmp_path)
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
    linked = store.node_dir / "local7"
    linked.symlink_to(store.own_dir)  # a link to a directory is never followed

    found, skipped = _store(tmp_path).discover(KEY, JOB, RUN)
    assert [s.step for s in found] == [10, 60]
    assert "unlisted.bin" not in found[1].files
    assert not list(store.own_dir.glob(".tmp-*")), "an unfinished directory was left"
    assert {os.path.basename(s.path).split("-")[1] for s in skipped} == {"000000020", "000000030", "000000050"}
    assert all("local7" not in s.path for s in skipped)


@pytest.mark.parametrize(
    ("theirs", "named"),
    [
        ({"run_id": "run-0"}, "another run (run id 'run-0', this run 'run-1')"),
        ({"config_hash": "d", "config": {**CONFIG, "train": {"seed": 4}}}, "train.seed: 4 -> 3"),
        ({"config": {"train": {"seed": 3}, "checkpoint": {"uri": "s3://b/old"}}}, "checkpoint.uri 's3://b/old'"),
    ],
)
def test_a_snapshot_of_another_run_is_skipped_and_says_what_differs(tmp_path, theirs, named):
    store = _store(tmp_path)
    old = store.persist(_snapshot(12, dict(SHARDS), **theirs))
    found, skipped = _store(tmp_path).discover(KEY, JOB, RUN)
    assert found == []
    assert len(skipped) == 1 and skipped[0].path.endswith(old.key) and named in skipped[0].why, skipped
    assert (store.own_dir / f"step-000000012-{old.key}").is_dir(), "another run's snapshot is reported, not deleted"


def _defect(path, kind: str) -> None:
    path.unlink()
    if kind == "symlink_to_dev_zero":
        path.symlink_to("/dev/zero")
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    elif kind == "longer":
        path.write_bytes(b"rank0-shard" + b"\0" * 4096)


DEFECTS = ["symlink_to_dev_zero", "fifo", "directory", "longer"]


@pytest.mark.parametrize("kind", DEFECTS)
def test_a_file_that_is_not_what_the_manifest_lists_is_not_offered(tmp_path, kind):
    store = _store(tmp_path)
    kept = store.persist(_snapshot(10, dict(SHARDS)))
    _defect(store.own_dir / f"step-000000010-{kept.key}" / "__0_0.distcp", kind)
    found, skipped = _store(tmp_path).discover(KEY, JOB, RUN)
    assert sorted(found[0].files) == [".metadata", "__1_0.distcp"]  # not held: the restore sees it missing
    assert [os.path.basename(s.path) for s in skipped] == ["__0_0.distcp"], skipped


@pytest.mark.parametrize("kind", [*DEFECTS, "vanished", "edited"])
def test_a_file_changed_after_discovery_is_an_oserror_naming_it_never_a_hang_or_an_unbounded_read(tmp_path, kind):
    store = _store(tmp_path)
    kept = store.persist(_snapshot(10, dict(SHARDS)))
    found = _found(tmp_path)[0]
    path = store.own_dir / f"step-000000010-{kept.key}" / "__0_0.distcp"
    if kind == "vanished":
        path.unlink()
    elif kind == "edited":
        path.write_bytes(b"rank0-shaRd")  # same size
    else:
        _defect(path, kind)
    assert isinstance(found.files, DirFiles)
    with pytest.raises(OSError) as err:
        found.files.read("__0_0.distcp")
    assert str(path) in str(err.value)
    assert found.files.read("__1_0.distcp") == b"rank1-shard"


def test_a_good_copy_beside_a_bad_one_is_used(tmp_path):
    a, b = _store(tmp_path, "n", 0), _store(tmp_path, "n", 1)
    snap = _snapshot(10, dict(SHARDS))
    kept = a.persist(snap)
    b.persist(snap)
    (a.own_dir / f"step-000000010-{kept.key}" / "__0_0.distcp").write_bytes(b"rank0-shaRd")
    found = _found(tmp_path)[0]
    assert found.files["__0_0.distcp"] == b"rank0-shard"  # local1's copy


def test_superseded_snapshots_are_deleted_and_a_finished_job_leaves_nothing(tmp_path):
    store = _store(tmp_path)
    a = store.persist(_snapshot(10, dict(SHARDS)))
    b = store.persist(_snapshot(20, dict(SHARDS)))
    store.keep([b])
    assert [p.name.split("-")[1] for p in store.own_dir.iterdir()] == ["000000020"]
    assert a.key not in {s.key for s in store.discover(KEY, JOB, RUN)[0]}

    restarted = _store(tmp_path)
    assert [s.step for s in restarted.discover(KEY, JOB, RUN)[0]] == [20]
    c = restarted.persist(_snapshot(30, dict(SHARDS)))
    restarted.keep([c])  # the snapshot found from before the restart is superseded too
    assert [s.step for s in restarted.discover(KEY, JOB, RUN)[0]] == [30]

    neighbour = _store(tmp_path, "n", 1)
    neighbour.persist(_snapshot(30, dict(SHARDS)))
    restarted.discard()
    assert not restarted.own_dir.exists() and neighbour.own_dir.exists()  # only its own
    neighbour.discard()
    assert os.listdir(tmp_path) == []


def test_a_name_that_is_not_a_plain_file_name_is_not_written(tmp_path):
    store = _store(tmp_path)
    bad = _snapshot(10, {".metadata": b"m", "sub/shard.distcp": b"x"})  # a manifest may name subdirectories
    with pytest.raises(Exception, match="not a file of the manifest"):
        store.persist(bad)
    assert not list(store.own_dir.iterdir())


def test_a_worker_killed_while_it_deletes_a_superseded_snapshot_leaves_nothing_a_restart_reports(tmp_path, monkeypatch):
    """CI: all workers SIGKILLed in the middle of ``keep`` left a step directory whose manifest
    was already gone; the restarted workers resumed, but reported it as not a usable snapshot."""
    store = _store(tmp_path)
    old = store.persist(_snapshot(10, dict(SHARDS)))
    new = store.persist(_snapshot(20, dict(SHARDS)))
    real_unlink = os.unlink

    def killed_after_the_manifest(path, *args, **kwargs):
        real_unlink(path, *args, **kwargs)
        if str(path).endswith(MANIFEST_FILE):
            raise KeyboardInterrupt("killed mid-delete")

    monkeypatch.setattr(os, "unlink", killed_after_the_manifest)
    with pytest.raises(KeyboardInterrupt):
        store.keep([new])
    monkeypatch.undo()

    restarted = _store(tmp_path)
    found, skipped = restarted.discover(KEY, JOB, RUN)
    assert skipped == [] and [s.key for s in found] == [new.key] and old.key != new.key
    assert sorted(p.name for p in restarted.own_dir.iterdir()) == [f"step-000000020-{new.key}"]


def test_a_snapshot_announcing_more_than_the_host_holds_is_refused_before_any_buffer_is_allocated():
    """The sizes of a restore's receive buffers come from a snapshot's manifest (a node-local
    file): more than the host's available memory is a problem every rank learns, not a
    RuntimeError on one rank that leaves its peers blocked in the exchange."""
    from ftrain.recovery.tier_host import too_big_to_receive

    assert too_big_to_receive(1 << 20, 3) == ""
    why = too_big_to_receive(1 << 62, 3)
    assert why.startswith("rank 3 would receive 4611686018427387904 bytes"), why
