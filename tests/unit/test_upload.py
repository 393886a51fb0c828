"""Streamed writes (``Storage.open_upload``) without a server: the S3 multipart logic against an
in-memory fake of s3fs's ``call_s3`` (parts, bounded parallelism, per-part retries, abort), the
local durable temp file and the generic whole-object fallback. Against a real S3 server (and
through DCP) they are tested in tests/integration/test_checkpoint_upload.py.

No sleeps: the fake's part uploads wait on events the test sets, with deadlines.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from botocore.exceptions import ClientError

from ftrain.checkpoint.errors import FatalStorageError, TransientStorageError
from ftrain.checkpoint.storage import Storage, StorageOptions
from ftrain.testbed.wait import wait_for

MiB = 1 << 20
PART = 5 * MiB  # S3's smallest part


def client_error(code: str, status: int) -> ClientError:
    return ClientError({"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}, "Op")


class FakeS3:
    """The few S3 calls an upload makes, on dicts; ``part_hook(number, attempt)`` runs before a
    part is stored (to block it, or raise)."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.uploads: dict[str, dict[int, bytes]] = {}
        self.calls: list[tuple[str, int | None]] = []
        self.part_attempts: dict[int, int] = {}
        self.part_hook: Callable[[int, int], None] | None = None
        self.complete_hook: Callable[[int], None] | None = None
        self.abort_error: BaseException | None = None
        self._lock = threading.Lock()

    def split_path(self, path: str) -> tuple[str, str, None]:
        bucket, _, key = path.partition("/")
        return bucket, key, None

    def invalidate_cache(self, path: str | None = None) -> None:
        pass

    def call_s3(self, method: str, **kw: Any) -> dict[str, Any]:
        with self._lock:
            self.calls.append((method, kw.get("PartNumber")))
        key = kw["Key"]
        if method == "put_object":
            self.objects[key] = bytes(kw["Body"])
            return {}
        if method == "create_multipart_upload":
            upload_id = f"up-{len(self.uploads) + 1}"
            self.uploads[upload_id] = {}
            return {"UploadId": upload_id}
        if method == "upload_part":
            number = kw["PartNumber"]
            with self._lock:
                self.part_attempts[number] = attempt = self.part_attempts.get(number, 0) + 1
            if self.part_hook is not None:
                self.part_hook(number, attempt)
            self.uploads[kw["UploadId"]][number] = bytes(kw["Body"])
            return {"ETag": f'"etag-{number}"'}
        if method == "complete_multipart_upload":
            attempt = sum(1 for m, _ in self.calls if m == method)
            if kw["UploadId"] not in self.uploads:
                raise FileNotFoundError(f"NoSuchUpload {kw['UploadId']}")
            parts = self.uploads.pop(kw["UploadId"])
            listed = kw["MultipartUpload"]["Parts"]
            assert [p["PartNumber"] for p in listed] == sorted(parts)
            assert all(p["ETag"] == f'"etag-{p["PartNumber"]}"' for p in listed)
            self.objects[key] = b"".join(parts[n] for n in sorted(parts))
            if self.complete_hook is not None:
                self.complete_hook(attempt)
            return {}
        if method == "abort_multipart_upload":
            if self.abort_error is not None:
                raise self.abort_error
            if self.uploads.pop(kw["UploadId"], None) is None:
                raise FileNotFoundError(f"NoSuchUpload {kw['UploadId']}")
            return {}
        if method == "head_object":
            if key not in self.objects:
                raise FileNotFoundError(key)
            return {"ContentLength": len(self.objects[key])}
        raise AssertionError(f"unexpected call {method}")

    def count(self, method: str) -> int:
        return sum(1 for m, _ in self.calls if m == method)


class RecordingSleep:
    def __init__(self) -> None:
        self.calls: list[float] = []

    def __call__(self, seconds: float) -> None:
        self.calls.append(seconds)


@pytest.fixture
def sleep() -> RecordingSleep:
    return RecordingSleep()


@pytest.fixture
def fake() -> FakeS3:
    return FakeS3()


def s3_storage(fake: FakeS3, sleep: RecordingSleep, **options: Any) -> Storage:
    opts = StorageOptions(
        endpoint_url="http://127.0.0.1:1",
        access_key_id="K",
        secret_access_key="S",
        upload_part_size_bytes=PART,
        **options,
    )
    storage = Storage("s3://bucket/run", opts, sleep=sleep)
    storage.fs = fake
    return storage


def write_all(upload: Any, data: bytes, chunk_bytes: int = 3 * MiB + 17) -> None:
    view = memoryview(data)
    for i in range(0, len(data), chunk_bytes):
        upload.write(view[i : i + chunk_bytes])


# -- S3: what goes up -----------------------------------------------------------------------
@pytest.mark.parametrize("size", [0, 1000, PART])
def test_a_file_of_at_most_one_part_is_one_put(fake, sleep, size):
    storage = s3_storage(fake, sleep)
    data = os.urandom(size)
    with storage.open_upload("step-1/small") as upload:
        write_all(upload, data)
    assert fake.objects == {"run/step-1/small": data}
    assert [m for m, _ in fake.calls] == ["put_object"]


def test_a_large_file_goes_up_in_parts_in_order(fake, sleep):
    storage = s3_storage(fake, sleep)
    data = os.urandom(3 * PART + 12345)
    with storage.open_upload("step-1/big") as upload:
        write_all(upload, data)
    assert fake.objects == {"run/step-1/big": data}
    assert fake.uploads == {}
    assert fake.count("create_multipart_upload") == 1 and fake.count("complete_multipart_upload") == 1
    assert sorted(n for m, n in fake.calls if m == "upload_part") == [1, 2, 3, 4]
    assert upload.parts_uploaded == 4


def test_a_file_of_exactly_whole_parts_has_no_empty_last_part(fake, sleep):
    storage = s3_storage(fake, sleep)
    data = os.urandom(2 * PART)
    with storage.open_upload("big") as upload:
        write_all(upload, data, chunk_bytes=PART)
    assert fake.objects["run/big"] == data
    assert sorted(n for m, n in fake.calls if m == "upload_part") == [1, 2]


def test_parts_upload_while_the_writer_goes_on_and_at_most_parts_in_flight_at_once(fake, sleep):
    """Parts 1 and 2 are held by the fake: the writer has handed them over before it finished
    writing (overlap), and never more than two parts are uploading at once (bounded memory)."""
    gate = threading.Event()
    started: set[int] = set()

    def hold(number: int, attempt: int) -> None:
        started.add(number)
        if not gate.wait(timeout=30):
            raise AssertionError("the test never opened the gate")

    fake.part_hook = hold
    storage = s3_storage(fake, sleep, upload_parts_in_flight=2)
    data = os.urandom(6 * PART + 1)
    errors: list[BaseException] = []
    written = threading.Event()
    uploads: list[Any] = []

    def writer() -> None:
        try:
            with storage.open_upload("big") as upload:
                uploads.append(upload)
                write_all(upload, data)
                written.set()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        wait_for(lambda: started == {1, 2}, 10, "parts 1 and 2 uploading")
        assert not written.is_set()  # the writer waits for a free slot: 2 parts in flight
    finally:
        gate.set()
        thread.join(timeout=30)
    assert errors == []
    assert fake.objects["run/big"] == data
    assert uploads[0].peak_parts_in_flight == 2 and uploads[0].parts_uploaded == 7


def test_a_transient_part_error_retries_that_part_only(fake, sleep, caplog):
    def flaky(number: int, attempt: int) -> None:
        if number == 2 and attempt == 1:
            raise client_error("InternalError", 500)

    fake.part_hook = flaky
    storage = s3_storage(fake, sleep)
    data = os.urandom(3 * PART + 1)
    with caplog.at_level(logging.WARNING, logger="ftrain.checkpoint.storage"):
        with storage.open_upload("big") as upload:
            write_all(upload, data)
    assert fake.objects["run/big"] == data
    assert fake.part_attempts == {1: 1, 2: 2, 3: 1, 4: 1}
    assert fake.count("create_multipart_upload") == 1 and len(sleep.calls) == 1
    assert any("big part 2" in r.getMessage() and "retrying" in r.getMessage() for r in caplog.records)


def test_a_part_that_fails_for_good_aborts_and_leaves_no_object(fake, sleep):
    def denied(number: int, attempt: int) -> None:
        if number == 2:
            raise PermissionError("AccessDenied")

    fake.part_hook = denied
    storage = s3_storage(fake, sleep)
    with pytest.raises(FatalStorageError, match="AccessDenied"):
        with storage.open_upload("big") as upload:
            upload.write(memoryview(os.urandom(2 * PART + 1)))  # hands over parts 1 and 2
            wait_for(lambda: upload._failure is not None, 10, "part 2 failed")
            upload.write(memoryview(os.urandom(PART)))  # the next part: raises at once
    assert fake.objects == {} and fake.uploads == {}
    assert fake.count("abort_multipart_upload") == 1 and fake.count("complete_multipart_upload") == 0
    assert sleep.calls == []  # fatal: never retried
    assert sorted(fake.part_attempts) == [1, 2]  # nothing was sent after the failure


def test_transient_errors_that_outlast_the_retries_abort(fake, sleep):
    def slow_down(number: int, attempt: int) -> None:
        raise client_error("SlowDown", 503)

    fake.part_hook = slow_down
    storage = s3_storage(fake, sleep, max_attempts=3)
    with pytest.raises(TransientStorageError, match="SlowDown"):
        with storage.open_upload("big") as upload:
            write_all(upload, os.urandom(3 * PART))
    assert fake.objects == {} and fake.uploads == {}
    assert fake.part_attempts[1] == 3


def test_an_error_in_the_writer_aborts_and_leaves_no_object(fake, sleep):
    storage = s3_storage(fake, sleep)
    with pytest.raises(RuntimeError, match="serialisation failed"):
        with storage.open_upload("big") as upload:
            write_all(upload, os.urandom(3 * PART))
            wait_for(lambda: upload.parts_uploaded >= 1, 10, "a part uploaded")
            raise RuntimeError("serialisation failed")
    assert fake.objects == {} and fake.uploads == {}
    assert fake.count("abort_multipart_upload") == 1


def test_an_error_before_any_part_leaves_nothing_at_all(fake, sleep):
    storage = s3_storage(fake, sleep)
    with pytest.raises(RuntimeError):
        with storage.open_upload("small") as upload:
            upload.write(memoryview(b"x" * 100))
            raise RuntimeError("boom")
    assert fake.calls == []


def test_a_completion_whose_reply_was_lost_is_not_a_failure(fake, sleep):
    """The first completion is applied but its reply lost (a transient error); the retry finds
    no such upload, and the object is there with the size written: done."""

    def lose_first_reply(attempt: int) -> None:
        if attempt == 1:
            raise client_error("InternalError", 500)

    fake.complete_hook = lose_first_reply
    storage = s3_storage(fake, sleep)
    data = os.urandom(2 * PART + 3)
    with storage.open_upload("big") as upload:
        write_all(upload, data)
    assert fake.objects["run/big"] == data
    assert fake.count("complete_multipart_upload") == 2 and fake.count("abort_multipart_upload") == 0


def test_an_abort_that_fails_is_logged_not_raised(fake, sleep, caplog):
    fake.abort_error = PermissionError("AccessDenied")
    storage = s3_storage(fake, sleep)
    with caplog.at_level(logging.WARNING, logger="ftrain.checkpoint.backends.s3"):
        with pytest.raises(RuntimeError, match="writer failed"):
            with storage.open_upload("big") as upload:
                write_all(upload, os.urandom(2 * PART))
                raise RuntimeError("writer failed")
    assert "invisible pending upload" in caplog.text
    assert fake.objects == {}


def test_s3_refuses_parts_smaller_than_s3_allows(fake, sleep):
    storage = s3_storage(fake, sleep)
    storage.options.upload_part_size_bytes = MiB
    with pytest.raises(ValueError, match="upload_part_size_bytes"):
        with storage.open_upload("x"):
            pass


@pytest.mark.parametrize("field", ["upload_part_size_bytes", "upload_parts_in_flight"])
def test_upload_settings_are_checked(field):
    with pytest.raises(ValueError, match=field):
        StorageOptions(**{field: 0})


# -- local disk: straight into the temp file that is renamed into place ----------------------
def test_local_upload_writes_a_hidden_temp_file_then_renames_it(tmp_path: Path):
    storage = Storage(f"file://{tmp_path}", StorageOptions(upload_part_size_bytes=MiB))
    data = os.urandom(3 * MiB + 5)
    with storage.open_upload("step-1/shard") as upload:
        write_all(upload, data, chunk_bytes=MiB)
        on_disk = list((tmp_path / "step-1").iterdir())
        assert len(on_disk) == 1 and on_disk[0].stat().st_size >= 3 * MiB  # streamed (bar io buffering)
        assert storage.listdir("step-1") == []  # the temp file is hidden
    assert (tmp_path / "step-1" / "shard").read_bytes() == data
    assert os.listdir(tmp_path / "step-1") == ["shard"]


def test_local_upload_that_fails_leaves_nothing(tmp_path: Path):
    storage = Storage(f"file://{tmp_path}", StorageOptions())
    (tmp_path / "step-1").mkdir()
    with pytest.raises(RuntimeError):
        with storage.open_upload("step-1/shard") as upload:
            upload.write(memoryview(b"partial"))
            raise RuntimeError("boom")
    assert os.listdir(tmp_path / "step-1") == []


def test_local_commit_that_fails_after_the_rename_leaves_nothing(tmp_path: Path, monkeypatch):
    import ftrain.checkpoint.backends.local as local

    def failing_fsync_dir(path: str) -> None:
        raise OSError("fsync failed")

    monkeypatch.setattr(local, "fsync_dir", failing_fsync_dir)
    storage = Storage(f"file://{tmp_path}", StorageOptions())
    with pytest.raises(OSError, match="fsync failed"):
        with storage.open_upload("shard") as upload:
            upload.write(memoryview(b"data"))
    assert os.listdir(tmp_path) == []


# -- any other fsspec filesystem: collected, then stored whole -------------------------------
def test_generic_upload_spills_to_a_temp_file_and_stores_whole(tmp_path, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    storage = Storage("memory://upload-generic", StorageOptions(upload_part_size_bytes=MiB))
    data = os.urandom(3 * MiB)
    try:
        with storage.open_upload("step-1/shard") as upload:
            write_all(upload, data, chunk_bytes=MiB // 2)
            assert not storage.exists("step-1/shard")
            assert [p.name for p in tmp_path.iterdir() if p.name.startswith("ftrain-upload-")]
        assert storage.read_bytes("step-1/shard") == data
        assert not [p for p in tmp_path.iterdir() if p.name.startswith("ftrain-upload-")]
        with pytest.raises(RuntimeError):
            with storage.open_upload("step-1/other") as upload:
                upload.write(memoryview(data))
                raise RuntimeError("boom")
        assert not storage.exists("step-1/other")
    finally:
        storage.remove("", recursive=True)
