"""Storage without a server: error classification, retries with a fake sleep, memory:// and
file:// round trips, ``/``-joined keys. The real-S3 behaviour is in tests/integration."""

from __future__ import annotations

import ast
import errno
import logging
from pathlib import Path

import pytest
from botocore.exceptions import ClientError, EndpointConnectionError, ReadTimeoutError
from s3fs.errors import translate_boto_error

from checkpoint.errors import FatalStorageError, TransientStorageError
from checkpoint.storage import Storage, StorageOptions, classify

REPO = Path(__file__).resolve().parents[2]  # not tests.support: it imports torch


def client_error(code: str = "", status: int = 400, op: str = "PutObject") -> ClientError:
    """A botocore ClientError as the S3 client raises it (``code`` empty: status only)."""
    error = {"Code": code, "Message": f"the {code or status} message"} if code else {}
    return ClientError({"Error": error, "ResponseMetadata": {"HTTPStatusCode": status}}, op)


class FakeSleep:
    def __init__(self) -> None:
        self.calls: list[float] = []

    def __call__(self, seconds: float) -> None:
        self.calls.append(seconds)


class Flaky:
    """A callable that raises ``errors`` in order, then returns ``value``."""

    def __init__(self, *errors: BaseException, value: object = "ok") -> None:
        self.errors = list(errors)
        self.value = value
        self.calls = 0

    def __call__(self) -> object:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return self.value


# -- classify -------------------------------------------------------------------------------
@pytest.mark.parametrize("code,status", [
    ("SlowDown", 503), ("ServiceUnavailable", 503), ("InternalError", 500), ("RequestTimeout", 400),
    ("Throttling", 400), ("", 503), ("", 500), ("", 502), ("", 504),
])
def test_client_error_transient(code, status):
    assert isinstance(classify(client_error(code, status)), TransientStorageError)


@pytest.mark.parametrize("code,status", [
    ("AccessDenied", 403), ("InvalidAccessKeyId", 403), ("SignatureDoesNotMatch", 403),
    ("NoSuchBucket", 404), ("InvalidBucketName", 400), ("", 403),
])
def test_client_error_fatal(code, status):
    assert isinstance(classify(client_error(code, status)), FatalStorageError)


@pytest.mark.parametrize("code,status,expected", [
    ("SlowDown", 503, TransientStorageError),      # s3fs: OSError(EBUSY), cause = ClientError
    ("InternalError", 500, TransientStorageError),  # s3fs: OSError(EREMOTEIO)
    ("RequestTimeout", 400, TransientStorageError),  # s3fs: TimeoutError
    ("RequestTimeTooSkewed", 403, TransientStorageError),  # s3fs: PermissionError; code wins
    ("AccessDenied", 403, FatalStorageError),       # s3fs: PermissionError
    ("InvalidAccessKeyId", 403, FatalStorageError),
    ("NoSuchBucket", 404, FatalStorageError),        # s3fs: FileNotFoundError; a config error
])
def test_s3fs_translated_errors(code, status, expected):
    translated = translate_boto_error(client_error(code, status))
    assert isinstance(classify(translated), expected)


def test_missing_key_stays_file_not_found():
    translated = translate_boto_error(client_error("NoSuchKey", 404, "GetObject"))
    assert isinstance(translated, FileNotFoundError)
    assert classify(translated) is translated


@pytest.mark.parametrize("exc", [
    ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused"),
    ConnectionResetError(errno.ECONNRESET, "reset"),
    OSError(errno.ETIMEDOUT, "timed out"),
    TimeoutError("read timed out"),
    EndpointConnectionError(endpoint_url="http://127.0.0.1:1"),
    ReadTimeoutError(endpoint_url="http://127.0.0.1:1"),
])
def test_network_errors_transient(exc):
    assert isinstance(classify(exc), TransientStorageError)


def test_cause_chain_is_followed():
    try:
        try:
            raise ConnectionRefusedError(errno.ECONNREFUSED, "refused")
        except ConnectionRefusedError as inner:
            raise RuntimeError("wrapped by a library") from inner
    except RuntimeError as outer:
        assert isinstance(classify(outer), TransientStorageError)


@pytest.mark.parametrize("exc", [ValueError("bad"), FileNotFoundError("k"), FileExistsError("k"),
                                 TransientStorageError("t"), FatalStorageError("f")])
def test_unknown_and_classified_errors_pass_through(exc):
    assert classify(exc) is exc


def test_permission_error_fatal():
    assert isinstance(classify(PermissionError("denied")), FatalStorageError)


# -- retries with an injected sleep ---------------------------------------------------------
def make_storage(tmp_path: Path, sleep: FakeSleep, **options: object) -> Storage:
    return Storage(f"file://{tmp_path}", StorageOptions(**options), sleep=sleep)


def test_transient_errors_retried_until_success(tmp_path, caplog):
    sleep = FakeSleep()
    storage = make_storage(tmp_path, sleep, max_attempts=5)
    fn = Flaky(ConnectionRefusedError(errno.ECONNREFUSED, "refused"), client_error("SlowDown", 503),
               client_error("", 500))
    with caplog.at_level(logging.WARNING, logger="checkpoint.storage"):
        assert storage.retry(fn, "op") == "ok"
    assert fn.calls == 4
    assert len(sleep.calls) == 3
    assert all(0 < s <= 5.5 for s in sleep.calls)
    assert [r.levelno for r in caplog.records].count(logging.WARNING) == 3
    assert "attempt 1" in caplog.records[0].getMessage()


def test_transient_errors_give_up_after_max_attempts(tmp_path):
    sleep = FakeSleep()
    storage = make_storage(tmp_path, sleep, max_attempts=4)
    errors = [ConnectionResetError(errno.ECONNRESET, f"reset {i}") for i in range(10)]
    fn = Flaky(*errors)
    with pytest.raises(TransientStorageError) as info:
        storage.retry(fn, "op")
    assert fn.calls == 4
    assert len(sleep.calls) == 3
    assert isinstance(info.value.__cause__, ConnectionResetError)  # raise ... from e


def test_backoff_grows(tmp_path):
    sleep = FakeSleep()
    storage = make_storage(tmp_path, sleep, max_attempts=6)
    with pytest.raises(TransientStorageError):
        storage.retry(Flaky(*[TimeoutError()] * 6), "op")
    # exponential 0.2, 0.4, 0.8, 1.6, 3.2 plus jitter in [0, 0.5]
    assert sleep.calls[-1] > sleep.calls[0]
    assert sleep.calls[0] <= 0.7 and sleep.calls[-1] >= 3.2


@pytest.mark.parametrize("exc,expected", [
    (client_error("AccessDenied", 403), FatalStorageError),
    (client_error("NoSuchBucket", 404), FatalStorageError),
    (PermissionError("denied"), FatalStorageError),
    (FileNotFoundError("missing"), FileNotFoundError),
    (ValueError("a bug"), ValueError),
])
def test_fatal_errors_not_retried(tmp_path, exc, expected):
    sleep = FakeSleep()
    storage = make_storage(tmp_path, sleep)
    fn = Flaky(exc)
    with pytest.raises(expected):
        storage.retry(fn, "op")
    assert fn.calls == 1
    assert sleep.calls == []


def test_operations_go_through_retry(tmp_path, monkeypatch):
    sleep = FakeSleep()
    storage = Storage("memory://retry-ops", StorageOptions(max_attempts=3), sleep=sleep)
    storage.write_bytes("k", b"v")
    real = storage.fs.cat_file
    flaky = Flaky(ConnectionRefusedError(errno.ECONNREFUSED, "refused"), value=None)

    def cat_file(path, *args, **kwargs):
        flaky()
        return real(path, *args, **kwargs)

    monkeypatch.setattr(storage.fs, "cat_file", cat_file)
    assert storage.read_bytes("k") == b"v"
    assert flaky.calls == 2 and len(sleep.calls) == 1
    storage.remove("", recursive=True)


# -- round trips ----------------------------------------------------------------------------
@pytest.fixture(params=["memory", "file"])
def storage(request, tmp_path):
    if request.param == "memory":
        url = f"memory://unit-{request.node.name.replace('[', '-').rstrip(']')}"
    else:
        url = f"file://{tmp_path}/root"
    s = Storage(url, sleep=FakeSleep())
    yield s
    s.remove("", recursive=True)


def test_round_trip(storage):
    data = bytes(range(256)) * 1000
    storage.write_bytes("step-1/shard-0.bin", data)
    storage.write_bytes("step-1/manifest.json", b"{}")
    storage.write_bytes("step-2/deep/er/file", b"x")
    assert storage.read_bytes("step-1/shard-0.bin") == data
    assert storage.exists("step-1/shard-0.bin") and storage.exists("step-1")
    assert not storage.exists("step-1/nope")
    assert storage.size_bytes("step-1/shard-0.bin") == len(data)
    assert storage.listdir() == ["step-1", "step-2"]
    assert storage.listdir("step-1") == ["manifest.json", "shard-0.bin"]
    assert storage.listdir("step-2/deep") == ["er"]
    assert b"".join(storage.iter_chunks("step-1/shard-0.bin", chunk_bytes=10_000)) == data
    assert len(list(storage.iter_chunks("step-1/shard-0.bin", chunk_bytes=100_000))) == 3
    storage.write_bytes("step-1/manifest.json", b'{"v": 2}')  # overwrite
    assert storage.read_bytes("step-1/manifest.json") == b'{"v": 2}'
    storage.remove("step-1", recursive=True)
    assert storage.listdir() == ["step-2"]
    assert not storage.exists("step-1/shard-0.bin")
    storage.remove("step-1", recursive=True)  # removing what is gone is not an error


def test_missing(storage):
    assert storage.listdir("no/such/prefix") == []
    assert not storage.exists("no/such/key")
    with pytest.raises(FileNotFoundError):
        storage.read_bytes("no/such/key")
    with pytest.raises(FileNotFoundError):
        storage.size_bytes("no/such/key")
    with pytest.raises(FileNotFoundError):
        list(storage.iter_chunks("no/such/key"))


def test_empty_object(storage):
    storage.write_bytes("empty", b"")
    assert storage.read_bytes("empty") == b""
    assert storage.size_bytes("empty") == 0
    assert list(storage.iter_chunks("empty")) == []


def test_local_write_is_atomic_and_leaves_no_temp_files(tmp_path):
    storage = Storage(str(tmp_path / "plain-path"))  # a plain path means file://
    assert storage.protocol == "file"
    storage.write_bytes("a/b/manifest.json", b"old")
    storage.write_bytes("a/b/manifest.json", b"new")
    assert sorted(p.name for p in (tmp_path / "plain-path/a/b").iterdir()) == ["manifest.json"]
    # an in-flight temp file of another writer is not listed
    (tmp_path / "plain-path/a/b/shard.bin.tmp-0123456789abcdef0123456789abcdef").write_bytes(b"")
    assert storage.listdir("a/b") == ["manifest.json"]


def test_clear_multipart_uploads_is_noop_off_s3(storage):
    assert storage.clear_multipart_uploads() == 0


# -- paths ----------------------------------------------------------------------------------
def test_s3_paths_are_slash_joined():
    storage = Storage("s3://bucket/runs/exp1/", StorageOptions(endpoint_url="http://127.0.0.1:1",
                                                             access_key_id="K", secret_access_key="S"))
    assert storage.url == "s3://bucket/runs/exp1"
    assert storage.root == "bucket/runs/exp1"
    assert storage.path("step-10/", "/shard-0") == "bucket/runs/exp1/step-10/shard-0"
    assert storage.path("a/b/c") == "bucket/runs/exp1/a/b/c"
    assert storage.path("", "x") == "bucket/runs/exp1/x"
    assert storage.child_url("step-10", "manifest.json") == "s3://bucket/runs/exp1/step-10/manifest.json"


def test_file_paths_are_slash_joined(tmp_path):
    storage = Storage(f"file://{tmp_path}")
    assert storage.path("a/b", "c") == f"{tmp_path.as_posix()}/a/b/c"
    assert storage.child_url("a", "b/") == f"file://{tmp_path}/a/b"


def test_storage_module_never_uses_os_path():
    """Keys must be ``/``-joined on every OS: ``os.path`` is ``ntpath`` on Windows."""
    tree = ast.parse((REPO / "checkpoint/storage.py").read_text())
    uses = [node.lineno for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and node.attr == "path"
            and isinstance(node.value, ast.Name) and node.value.id == "os"]
    imports = [node.lineno for node in ast.walk(tree)
               if isinstance(node, ast.ImportFrom) and node.module in ("os.path", "ntpath")]
    assert uses == [] and imports == []


# -- options --------------------------------------------------------------------------------
def test_options_repr_hides_secret():
    options = StorageOptions(endpoint_url="http://e", access_key_id="AKID", secret_access_key="s3cr3t")
    assert "s3cr3t" not in repr(options)
    storage = Storage("s3://b/p", options)
    assert "s3cr3t" not in repr(storage) and "AKID" not in repr(storage)


def test_options_fall_back_to_aws_env(monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://env:9000")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "ENVKEY")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "ENVSECRET")
    monkeypatch.setenv("AWS_REGION", "eu-west-1")
    kwargs = StorageOptions().fsspec_kwargs("s3")
    assert kwargs["key"] == "ENVKEY" and kwargs["secret"] == "ENVSECRET"
    assert kwargs["client_kwargs"] == {"endpoint_url": "http://env:9000", "region_name": "eu-west-1"}
    explicit = StorageOptions(endpoint_url="http://x", access_key_id="K", secret_access_key="S",
                              read_timeout_s=2.0).fsspec_kwargs("s3")
    assert explicit["key"] == "K" and explicit["client_kwargs"]["endpoint_url"] == "http://x"
    assert explicit["config_kwargs"]["read_timeout"] == 2.0
    assert explicit["config_kwargs"]["retries"] == {"max_attempts": 1}  # tenacity retries, not botocore
    assert StorageOptions().fsspec_kwargs("file") == {}


# -- multipart cleanup (fake S3 client) -----------------------------------------------------
class FakeMultipartS3:
    """Just ``call_s3`` for list/abort multipart uploads, with pages of two."""

    def __init__(self, keys: list[str]) -> None:
        self.uploads = [{"Key": k, "UploadId": f"u{i}"} for i, k in enumerate(keys)]
        self.aborted: list[str] = []

    def call_s3(self, method: str, **kw: object) -> dict:
        if method == "list_multipart_uploads":
            live = [u for u in self.uploads if u["Key"].startswith(str(kw["Prefix"]))
                    and u["UploadId"] not in self.aborted]
            start = next((i for i, u in enumerate(live) if u["UploadId"] == kw.get("UploadIdMarker")), -1) + 1
            page = live[start:start + 2]
            truncated = start + 2 < len(live)
            out: dict = {"Uploads": page, "IsTruncated": truncated}
            if truncated:
                out.update(NextKeyMarker=page[-1]["Key"], NextUploadIdMarker=page[-1]["UploadId"])
            return out
        assert method == "abort_multipart_upload"
        self.aborted.append(str(kw["UploadId"]))
        return {}


def test_clear_multipart_uploads_pages_and_respects_prefix_boundary():
    storage = Storage("s3://bucket/run1", StorageOptions(endpoint_url="http://127.0.0.1:1",
                                                       access_key_id="K", secret_access_key="S"))
    fake = FakeMultipartS3(["run1/a", "run1/b/c", "run1/d", "run10/x", "run1/e", "other/y"])
    storage.fs = fake
    assert storage.clear_multipart_uploads() == 4
    assert sorted(fake.aborted) == ["u0", "u1", "u2", "u4"]  # not run10/x, not other/y
