"""Issue #8 on real DCP files, single process: the restricted loader for DCP bytes items, the
checks on where ``.metadata`` points, ``check_pickled_items``, storage errors that are not
corruption, reads of files the manifest does not list, and durable local uploads."""

from __future__ import annotations

import io
import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from ftrain.checkpoint.dcp_read import METADATA_NAME, VerifiedReader, load_metadata
from ftrain.checkpoint.dcp_write import DigestingWriter
from ftrain.checkpoint.digest import digest_bytes
from ftrain.checkpoint.errors import (
    ChecksumMismatchError,
    FatalStorageError,
    TransientStorageError,
    UnsafeMetadataError,
    UnsafePickleError,
)
from ftrain.checkpoint.manifest import MANIFEST_NAME, FileEntry, Manifest, step_dir_name
from ftrain.checkpoint.safe_pickle import SafeLoadPlanner, load_bytes_item, metadata_problems, reference_problem
from ftrain.checkpoint.storage import Storage, StorageOptions
from ftrain.checkpoint.verify import CORRUPTION_KINDS, check_metadata_safe, check_pickled_items, verify_step

DIRNAME = step_dir_name(1)
OPTIM_VALUES = {
    "lr": 0.001,
    "betas": (0.9, 0.999),
    "eps": 1e-8,
    "amsgrad": False,
    "foreach": None,
    "params": ["0.weight", "0.bias"],
    "step_t": torch.tensor(3.0),
    "nested": {"a": [1, 2.5]},
}


class _Reduce:
    """Unpickling this calls ``fn(*args)``."""

    def __init__(self, fn: Any, *args: Any):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return (self.fn, self.args)


def _torch_saved(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


class _Publisher:
    def prepare(self) -> None:
        pass

    def commit(self, files: dict[str, FileEntry]) -> None:
        self.files = files


def _write_manifest(storage: Storage, files: dict[str, FileEntry]) -> Manifest:
    manifest = Manifest(
        step=1,
        round=0,
        world_size=1,
        layout={},
        config_hash="h",
        config={},
        trainer={},
        digest_algorithm="xxh3_128",
        files=files,
        created_time=1.7e9,
    )
    storage.write_bytes(f"{DIRNAME}/{MANIFEST_NAME}", manifest.to_json())
    return manifest


@pytest.fixture
def step(tmp_path) -> tuple[Storage, Manifest]:
    """A real DCP step (tensors plus optimizer-like bytes items) with its manifest."""
    storage = Storage(f"file://{tmp_path}/ckpt")
    publisher = _Publisher()
    state = {"w": torch.arange(1024, dtype=torch.float32), "optim": dict(OPTIM_VALUES)}
    writer = DigestingWriter(
        storage.child_url(DIRNAME), options=StorageOptions(), algorithm="xxh3_128", publisher=publisher
    )
    dcp.save(state, storage_writer=writer, no_dist=True)
    return storage, _write_manifest(storage, publisher.files)


def _target() -> dict[str, Any]:
    optim = {
        k: torch.zeros(()) if torch.is_tensor(v) else {kk: None for kk in v} if isinstance(v, dict) else None
        for k, v in OPTIM_VALUES.items()
    }
    return {"w": torch.zeros(1024), "optim": optim}


def _reader(storage: Storage, files: dict[str, FileEntry]) -> VerifiedReader:
    return VerifiedReader(storage.child_url(DIRNAME), options=StorageOptions(), files=files, algorithm="xxh3_128")


def _rewrite_metadata(storage: Storage, manifest: Manifest, edit) -> Manifest:
    """Apply ``edit(metadata)``, re-pickle ``.metadata`` and forge the manifest to match."""
    metadata = load_metadata(storage.read_bytes(f"{DIRNAME}/{METADATA_NAME}"))
    edit(metadata)
    data = pickle.dumps(metadata)
    storage.write_bytes(f"{DIRNAME}/{METADATA_NAME}", data)
    files = dict(manifest.files)
    files[METADATA_NAME] = FileEntry(len(data), digest_bytes(data, "xxh3_128"))
    return _write_manifest(storage, files)


def _set_all_paths(path: str):
    def edit(metadata: Metadata) -> None:
        for info in metadata.storage_data.values():
            info.relative_path = path

    return edit


# -- the restricted loader ------------------------------------------------------------------
@pytest.mark.parametrize("payload", ["os.system", "builtins.exec", "builtins.open"])
def test_load_bytes_item_refuses_code(payload, tmp_path):
    sentinel = tmp_path / "PWNED"
    obj = {
        "os.system": _Reduce(os.system, f"touch {sentinel}"),
        "builtins.exec": _Reduce(exec, f"open({str(sentinel)!r}, 'w')"),
        "builtins.open": _Reduce(open, str(sentinel), "w"),
    }[payload]
    for data in (_torch_saved(obj), _torch_saved({"lr": [obj]})):
        with pytest.raises(UnsafePickleError) as err:
            load_bytes_item(data, fqn="optim.param_groups.0.lr", file="__0_0.distcp")
        assert "optim.param_groups.0.lr" in str(err.value) and "__0_0.distcp" in str(err.value)
        assert "asks for the global" in str(err.value)
    assert not sentinel.exists()


@pytest.mark.parametrize("data", [b"", b"garbage" * 9, b"PK\x03\x04 truncated archive"])
def test_load_bytes_item_refuses_what_dcp_never_writes(data, tmp_path):
    with pytest.raises(UnsafePickleError, match="item 'x' "):
        load_bytes_item(data, fqn="x", file="f.distcp")


def test_load_bytes_item_refuses_a_plain_pickle(tmp_path):
    """torch.load would run a plain (legacy-format) pickle's first object before any check."""
    sentinel = tmp_path / "PWNED"
    with pytest.raises(UnsafePickleError, match="not a torch.save archive"):
        load_bytes_item(pickle.dumps(_Reduce(open, str(sentinel), "w"), protocol=2), fqn="x", file="f")
    assert not sentinel.exists()


def test_load_bytes_item_loads_optimizer_values():
    for name, value in OPTIM_VALUES.items():
        got = load_bytes_item(_torch_saved(value), fqn=name, file="f")
        assert torch.equal(got, value) if torch.is_tensor(value) else got == value, name


# -- where .metadata points -----------------------------------------------------------------
FILES = {"__0_0.distcp": FileEntry(100, "0" * 32), METADATA_NAME: FileEntry(10, "0" * 32)}


@pytest.mark.parametrize(
    "info,why",
    [
        (_StorageInfo("__0_0.distcp", 0, 100), None),
        (_StorageInfo("__0_0.distcp", 40, 0), None),
        (_StorageInfo("../step-000000002/__0_0.distcp", 0, 10), "not a data file listed"),
        (_StorageInfo("/etc/passwd", 0, 10), "not a data file listed"),
        (_StorageInfo(METADATA_NAME, 0, 10), "not a data file listed"),
        (_StorageInfo("__1_0.distcp", 0, 10), "not a data file listed"),
        (_StorageInfo("__0_0.distcp", -1, 10), "non-negative"),
        (_StorageInfo("__0_0.distcp", 0, -5), "non-negative"),
        (_StorageInfo("__0_0.distcp", True, 5), "non-negative"),
        (_StorageInfo("__0_0.distcp", 0, 1 << 62), "which has 100 bytes"),
        (_StorageInfo("__0_0.distcp", 99, 2), "which has 100 bytes"),
        (_StorageInfo("__0_0.distcp", 0, 10, ["zstd/1"]), "stream transforms"),
        ("__0_0.distcp", "not DCP storage info"),
    ],
)
def test_reference_problem(info, why):
    got = reference_problem(MetadataIndex("a.b"), info, FILES)
    assert got is None if why is None else (why in got and "'a.b'" in got), got


def test_metadata_problems_bound_what_export_would_allocate():
    huge = TensorStorageMetadata(
        TensorProperties(dtype=torch.float32),
        torch.Size([1 << 20, 1 << 20]),
        [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([1 << 20, 1 << 20]))],
    )
    md = Metadata(state_dict_metadata={"w": huge, "lr": BytesStorageMetadata()}, storage_data={})
    problems = metadata_problems(md, FILES)
    assert any("tensors declare 4398046511104 bytes" in p for p in problems)
    assert any("bytes item 'lr' has no storage entry" in p for p in problems)


# -- check_pickled_items on a real step -----------------------------------------------------
@pytest.mark.parametrize("span_limit_bytes", [64 << 20, 0])
def test_clean_step_has_no_pickle_problems(step, span_limit_bytes):
    storage, manifest = step
    assert check_pickled_items(storage, DIRNAME, manifest, span_limit_bytes=span_limit_bytes) == []
    assert verify_step(storage, DIRNAME).ok


def test_metadata_pointing_outside_the_step_is_refused(step, tmp_path):
    """A ``relative_path`` of ``../other-step/shard`` whose bytes are identical to the listed
    shard passes every digest; it must still be refused by verify and by the reader."""
    storage, manifest = step
    shutil.copytree(tmp_path / "ckpt" / DIRNAME, tmp_path / "ckpt" / "elsewhere")
    manifest = _rewrite_metadata(storage, manifest, _set_all_paths("../elsewhere/__0_0.distcp"))
    problems = check_pickled_items(storage, DIRNAME, manifest)
    assert problems and all((p.file, p.kind) == (METADATA_NAME, "unsafe") for p in problems)
    assert "'../elsewhere/__0_0.distcp', which is not a data file listed in the manifest" in problems[0].detail
    assert not verify_step(storage, DIRNAME).ok
    with pytest.raises(BaseException) as err:  # CheckpointException (a BaseException) wraps it
        dcp.load(_target(), storage_reader=_reader(storage, manifest.files), planner=SafeLoadPlanner(), no_dist=True)
    assert "UnsafeMetadataError" in repr(err.value) or isinstance(err.value, UnsafeMetadataError)


def test_offsets_past_the_file_are_refused(step):
    storage, manifest = step

    def stretch(metadata: Metadata) -> None:
        info = next(iter(metadata.storage_data.values()))
        info.length = 1 << 40

    manifest = _rewrite_metadata(storage, manifest, stretch)
    problems = check_pickled_items(storage, DIRNAME, manifest)
    assert [p.kind for p in problems] == ["unsafe"] and "which has" in problems[0].detail
    with pytest.raises(BaseException) as err:
        dcp.load(_target(), storage_reader=_reader(storage, manifest.files), planner=SafeLoadPlanner(), no_dist=True)
    assert "UnsafeMetadataError" in repr(err.value)


# -- storage errors are not corruption -------------------------------------------------------
class FailingStorage(Storage):
    """Whole-file reads (``.metadata``: ``read_bytes``, ``iter_chunks``) or ranged reads (the
    shards' pickled items: ``read_range``) raise ``error``; everything else works."""

    def __init__(self, url: str, error: BaseException, *, fail_ranges_only: bool = False):
        super().__init__(url, sleep=self.no_sleep)  # retries of a transient error: no real waiting
        self.retries = 0
        self.error = error
        self.fail_ranges_only = fail_ranges_only

    def read_bytes(self, rel: str) -> bytes:
        if self.fail_ranges_only:
            return super().read_bytes(rel)
        raise self.error

    def iter_chunks(self, rel: str, chunk_bytes: int = 8 << 20):
        if not self.fail_ranges_only and rel.endswith(METADATA_NAME):
            raise self.error
        return super().iter_chunks(rel, chunk_bytes)

    def read_range(self, rel: str, offset: int, length: int) -> bytes:
        raise self.error

    def no_sleep(self, seconds: float) -> None:
        self.retries += 1


@pytest.mark.parametrize("fail_ranges_only", [False, True])
@pytest.mark.parametrize("error", [TransientStorageError("ECONNRESET"), OSError(5, "Input/output error")])
def test_a_failed_read_propagates(step, error, fail_ranges_only):
    """A read that failed says nothing about the bytes: it is raised, never a corruption kind."""
    storage, manifest = step
    failing = FailingStorage(storage.url, error, fail_ranges_only=fail_ranges_only)
    with pytest.raises(type(error)) as err:
        check_pickled_items(failing, DIRNAME, manifest)
    assert err.value is error
    with pytest.raises(type(error)):
        verify_step(failing, DIRNAME)
    if not fail_ranges_only:
        with pytest.raises(type(error)):
            check_metadata_safe(failing, DIRNAME)


@pytest.mark.parametrize("fail_ranges_only", [False, True])
def test_a_fatal_storage_error_is_unreadable_not_corrupt(step, fail_ranges_only):
    storage, manifest = step
    failing = FailingStorage(storage.url, FatalStorageError("AccessDenied"), fail_ranges_only=fail_ranges_only)
    problems = check_pickled_items(failing, DIRNAME, manifest)
    assert [p.kind for p in problems] == ["unreadable"] and "AccessDenied" in problems[0].detail
    assert not CORRUPTION_KINDS & {p.kind for p in problems}
    if not fail_ranges_only:
        assert [p.kind for p in check_metadata_safe(failing, DIRNAME)] == ["unreadable"]


def test_metadata_changed_since_the_digest_pass_is_a_digest_problem(step):
    """check_pickled_items parses the very bytes it digests: a .metadata swapped after the
    verification pass is reported as such, not parsed."""
    storage, manifest = step
    storage.write_bytes(f"{DIRNAME}/{METADATA_NAME}", pickle.dumps(Metadata(state_dict_metadata={})))
    assert [(p.file, p.kind) for p in check_pickled_items(storage, DIRNAME, manifest)] in (
        [(METADATA_NAME, "size")],
        [(METADATA_NAME, "digest")],
    )


# -- the reader: only listed files, only safe bytes items ------------------------------------
def test_reader_refuses_a_file_the_manifest_does_not_list(step, tmp_path):
    """The reader's filesystem opens only listed names under the step root: an extra file in the
    directory, a sibling step's file, or an absolute path are refused before a byte is read."""
    storage, manifest = step
    (tmp_path / "ckpt" / DIRNAME / "extra.distcp").write_bytes(b"never listed")
    fs = _reader(storage, manifest.files).fs
    root = storage.child_url(DIRNAME)
    for path in (
        f"{root}/extra.distcp",
        f"{root}/../{DIRNAME}/__0_0.distcp",
        str(tmp_path / "ckpt" / DIRNAME / "__0_0.distcp"),
    ):
        with pytest.raises(ChecksumMismatchError, match="not listed in the manifest"):
            with fs.create_stream(path, "rb"):
                pass
    with pytest.raises(ChecksumMismatchError, match="read-only"):
        with fs.create_stream(f"{root}/__0_0.distcp", "wb"):
            pass
    with fs.create_stream(f"{root}/__0_0.distcp", "rb") as stream:  # a listed file still reads, verified
        assert stream.read() == storage.read_bytes(f"{DIRNAME}/__0_0.distcp")

    files = {n: e for n, e in manifest.files.items() if not n.endswith(".distcp")}
    with pytest.raises(BaseException) as err:  # and a load whose shard is unlisted fails, naming it
        dcp.load(_target(), storage_reader=_reader(storage, files), planner=SafeLoadPlanner(), no_dist=True)
    assert "listed in the manifest" in str(err.value) and "__0_0.distcp" in str(err.value)


def test_reader_loads_bytes_items_safely_with_dcps_default_planner(step):
    """Without SafeLoadPlanner (DCP's default planner) the reader still loads bytes items
    through the allow-list loader, and loads them right."""
    storage, manifest = step
    target = _target()
    dcp.load(target, storage_reader=_reader(storage, manifest.files), no_dist=True)  # DefaultLoadPlanner
    assert torch.equal(target["w"], torch.arange(1024, dtype=torch.float32))
    for name, value in OPTIM_VALUES.items():
        got = target["optim"][name]
        assert torch.equal(got, value) if torch.is_tensor(value) else got == value, name


# -- durable local uploads -------------------------------------------------------------------
class _FsyncLog:
    def __init__(self):
        self.events: list[tuple[str, str]] = []

    def fsync(self, real):
        def fsync(fd: int) -> None:
            self.events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
            real(fd)

        return fsync

    def rename(self, real):
        def rename(src, dst, *args, **kwargs):
            self.events.append(("rename", os.fspath(dst)))
            return real(src, dst, *args, **kwargs)

        return rename


class _CommitRecorder(_Publisher):
    def __init__(self, log: _FsyncLog):
        self.log = log
        self.seen_at_commit = -1

    def commit(self, files: dict[str, FileEntry]) -> None:
        self.seen_at_commit = len(self.log.events)
        self.files = files


def test_local_uploads_are_fsynced_before_the_commit(tmp_path, monkeypatch):
    log = _FsyncLog()
    monkeypatch.setattr(os, "fsync", log.fsync(os.fsync))
    monkeypatch.setattr(os, "rename", log.rename(os.rename))
    monkeypatch.setattr(os, "replace", log.rename(os.replace))
    step_dir = tmp_path / DIRNAME
    publisher = _CommitRecorder(log)
    writer = DigestingWriter(f"file://{step_dir}", options=StorageOptions(), algorithm="xxh3_128", publisher=publisher)
    dcp.save({"w": torch.ones(64), "opt": {"lr": 0.1}}, storage_writer=writer, no_dist=True)
    before = log.events[: publisher.seen_at_commit]
    synced = [p for kind, p in before if kind == "fsync"]
    for name in publisher.files:  # every shard and .metadata: its temp file fsynced, then renamed in
        assert any(Path(p).name.startswith(name + ".") or Path(p).name.startswith(name + ".tmp") for p in synced), (
            name,
            synced,
        )
    last_metadata_rename = max(
        i for i, (kind, p) in enumerate(before) if kind == "rename" and p.endswith(METADATA_NAME)
    )
    assert ("fsync", str(step_dir)) in before[last_metadata_rename:], "directory not fsynced after .metadata's rename"


def test_uploads_elsewhere_do_not_fsync(monkeypatch):
    calls: list[int] = []
    monkeypatch.setattr(os, "fsync", calls.append)
    writer = DigestingWriter(
        f"memory://ftrain-fsync-{os.getpid()}/{DIRNAME}",
        options=StorageOptions(),
        algorithm="xxh3_128",
        publisher=_Publisher(),
    )
    dcp.save({"w": torch.ones(8)}, storage_writer=writer, no_dist=True)
    assert calls == []


def test_metadata_problems_bound_the_paths_export_rebuilds():
    md = Metadata(
        state_dict_metadata={"a.b": BytesStorageMetadata(), "c": BytesStorageMetadata()},
        storage_data={
            MetadataIndex("a.b"): _StorageInfo("__0_0.distcp", 0, 1),
            MetadataIndex("c"): _StorageInfo("__0_0.distcp", 1, 1),
        },
        planner_data={"a.b": ("a", 10**12), "c": "c", "unrelated": 5},
    )
    problems = metadata_problems(md, FILES)
    assert len(problems) == 2, problems
    assert "planner path of 'a.b' holds 1000000000000" in problems[0] and "'c' is str" in problems[1]
    md.planner_data = {"a.b": ("a", 3), "c": ("c",)}
    assert metadata_problems(md, FILES) == []


@pytest.mark.parametrize("url", ["memory://ftrain-read-range", "file://{tmp}/rr"])
def test_read_range_returns_exactly_the_bytes_asked_for(url, tmp_path):
    storage = Storage(url.format(tmp=tmp_path))
    storage.write_bytes("d/f.distcp", bytes(range(100)))
    assert storage.read_range("d/f.distcp", 10, 5) == bytes(range(10, 15))
    assert storage.read_range("d/f.distcp", 100, 0) == b""
    with pytest.raises(EOFError, match="d/f.distcp: wanted bytes 95..105, the file ended after 5"):
        storage.read_range("d/f.distcp", 95, 10)
    with pytest.raises(ValueError, match="must be >= 0"):
        storage.read_range("d/f.distcp", -1, 5)
    storage.remove("d", recursive=True)
