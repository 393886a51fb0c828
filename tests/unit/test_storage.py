"""Storage without a server: error classification, retries with a fake sleep, the backend
registry, local temp files, ``/``-joined keys. What every backend must do is the contract suite
(tests/integration/test_storage_contract.py); the real-S3 behaviour is in tests/integration."""

from __future__ import annotations

import ast
import errno
import logging
from pathlib import Path
from types import ModuleType

import pytest
from botocore.exceptions import ClientError, EndpointConnectionError, ReadTimeoutError
from s3fs.errors import translate_boto_error

from ftrain.checkpoint.backends import backend_for, collect, registered_backends
from ftrain.checkpoint.backends.generic import FsspecBackend
from ftrain.checkpoint.backends.local import LocalBackend
from ftrain.checkpoint.backends.s3 import S3Backend
from ftrain.checkpoint.errors import CheckpointError, FatalStorageError, TransientStorageError
from ftrain.checkpoint.storage import Storage, StorageOptions, classify
from ftrain.testbed.procs import REPO


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
@pytest.mark.parametrize(
    "code,status",
    [
        ("SlowDown", 503),
        ("ServiceUnavailable", 503),
        ("InternalError", 500),
        ("RequestTimeout", 400),
        ("Throttling", 400),
        ("", 503),
        ("", 500),
        ("", 502),
        ("", 504),
    ],
)
def test_client_error_transient(code, status):
    assert isinstance(classify(client_error(code, status)), TransientStorageError)


@pytest.mark.parametrize(
    "code,status",
    [
        ("AccessDenied", 403),
        ("InvalidAccessKeyId", 403),
        ("SignatureDoesNotMatch", 403),
        ("NoSuchBucket", 404),
        ("InvalidBucketName", 400),
        ("", 403),
    ],
)
def test_client_error_fatal(code, status):
    assert isinstance(classify(client_error(code, status)), FatalStorageError)


@pytest.mark.parametrize(
    "code,status,expected",
    [
        ("SlowDown", 503, TransientStorageError),  # s3fs: OSError(EBUSY), cause = ClientError
        ("InternalError", 500, TransientStorageError),  # s3fs: OSError(EREMOTEIO)
        ("RequestTimeout", 400, TransientStorageError),  # s3fs: TimeoutError
        ("RequestTimeTooSkewed", 403, TransientStorageError),  # s3fs: PermissionError; code wins
        ("AccessDenied", 403, FatalStorageError),  # s3fs: PermissionError
        ("InvalidAccessKeyId", 403, FatalStorageError),
        ("NoSuchBucket", 404, FatalStorageError),  # s3fs: FileNotFoundError; a config error
    ],
)
def test_s3fs_translated_errors(code, status, expected):
    translated = translate_boto_error(client_error(code, status))
    assert isinstance(classify(translated), expected)


def test_missing_key_stays_file_not_found():
    translated = translate_boto_error(client_error("NoSuchKey", 404, "GetObject"))
    assert isinstance(translated, FileNotFoundError)
    assert classify(translated) is translated


@pytest.mark.parametrize(
    "exc",
    [
        ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused"),
        ConnectionResetError(errno.ECONNRESET, "reset"),
        OSError(errno.ETIMEDOUT, "timed out"),
        TimeoutError("read timed out"),
        EndpointConnectionError(endpoint_url="http://127.0.0.1:1"),
        ReadTimeoutError(endpoint_url="http://127.0.0.1:1"),
    ],
)
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


@pytest.mark.parametrize(
    "exc",
    [
        ValueError("bad"),
        FileNotFoundError("k"),
        FileExistsError("k"),
        TransientStorageError("t"),
        FatalStorageError("f"),
    ],
)
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
    fn = Flaky(
        ConnectionRefusedError(errno.ECONNREFUSED, "refused"), client_error("SlowDown", 503), client_error("", 500)
    )
    with caplog.at_level(logging.WARNING, logger="ftrain.checkpoint.storage"):
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


@pytest.mark.parametrize(
    "exc,expected",
    [
        (client_error("AccessDenied", 403), FatalStorageError),
        (client_error("NoSuchBucket", 404), FatalStorageError),
        (PermissionError("denied"), FatalStorageError),
        (FileNotFoundError("missing"), FileNotFoundError),
        (ValueError("a bug"), ValueError),
    ],
)
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


class FlakyBackend:
    """Wraps a backend; the first call of each of its methods raises ECONNRESET."""

    def __init__(self, inner: object) -> None:
        self.inner = inner
        self.failed: list[str] = []

    def __getattr__(self, name: str) -> object:
        attr = getattr(self.inner, name)
        if not callable(attr):
            return attr

        def call(*args: object, **kwargs: object) -> object:
            if name not in self.failed:
                self.failed.append(name)
                raise ConnectionResetError(errno.ECONNRESET, f"{name}: reset")
            return attr(*args, **kwargs)

        return call


OPERATIONS = {
    "read_bytes": lambda s: s.read_bytes("k"),
    "read_range": lambda s: s.read_range("k", 0, 1),
    "write_bytes": lambda s: s.write_bytes("k2", b"v"),
    "exists": lambda s: s.exists("k"),
    "size_bytes": lambda s: s.size_bytes("k"),
    "listdir": lambda s: s.listdir(),
    "remove": lambda s: s.remove("k", recursive=True),
    "iter_chunks": lambda s: list(s.iter_chunks("k")),
    "clear_multipart_uploads": lambda s: s.clear_multipart_uploads(),
}


@pytest.mark.parametrize("op", sorted(OPERATIONS))
def test_every_backend_call_is_retried(tmp_path, op):
    sleep = FakeSleep()
    storage = make_storage(tmp_path, sleep, max_attempts=3)
    storage.write_bytes("k", b"v")
    storage.backend = FlakyBackend(storage.backend)
    OPERATIONS[op](storage)
    assert storage.backend.failed != [] and len(sleep.calls) == len(storage.backend.failed) == 1


# -- the backend registry -------------------------------------------------------------------
S3_OPTIONS = StorageOptions(endpoint_url="http://127.0.0.1:1", access_key_id="K", secret_access_key="S")


@pytest.mark.parametrize(
    "url,backend",
    [
        ("/plain/path", LocalBackend),
        ("relative/path", LocalBackend),
        ("file:///x/y", LocalBackend),
        ("local:///x/y", LocalBackend),
        ("s3://bucket/p", S3Backend),
        ("s3a://bucket/p", S3Backend),
    ],
)
def test_backend_chosen_by_scheme(url, backend):
    assert type(Storage(url, S3_OPTIONS).backend) is backend


def test_unclaimed_schemes_go_to_the_generic_backend():
    claimed = {scheme for backend in registered_backends().values() for scheme in backend.schemes}
    unclaimed = [s for s in ("memory", "gcs", "hdfs", "an-unknown-scheme") if s not in claimed]
    assert "an-unknown-scheme" in unclaimed
    assert all(backend_for(s) is FsspecBackend for s in unclaimed)
    assert type(Storage("memory://x").backend) is backend_for("memory")


def test_every_module_of_the_package_is_a_backend():
    modules = {p.stem for p in (REPO / "checkpoint/backends").glob("*.py")} - {"__init__"}
    assert sorted(registered_backends()) == sorted(modules)
    assert {"generic": FsspecBackend, "local": LocalBackend, "s3": S3Backend}.items() <= registered_backends().items()


def test_options_ask_the_backend_for_fsspec_kwargs():
    assert S3_OPTIONS.fsspec_kwargs("s3a") == S3_OPTIONS.fsspec_kwargs("s3") == S3Backend.fsspec_kwargs(S3_OPTIONS)
    assert S3_OPTIONS.fsspec_kwargs("memory") == S3_OPTIONS.fsspec_kwargs("local") == {}


def _module(name: str, backend: type | None = None) -> ModuleType:
    module = ModuleType(f"ftrain.checkpoint.backends.{name}")
    if backend is not None:
        module.BACKEND = backend  # type: ignore[attr-defined]
    return module


def test_collect_refuses_a_module_without_backend():
    with pytest.raises(CheckpointError, match="ftrain.checkpoint.backends.helpers defines no BACKEND"):
        collect([_module("generic", FsspecBackend), _module("helpers")])


def test_collect_refuses_a_scheme_claimed_twice():
    class OtherS3(S3Backend):
        schemes = ("s3",)

    with pytest.raises(CheckpointError, match="'s3' is claimed by both 's3' and 'minio'"):
        collect([_module("generic", FsspecBackend), _module("s3", S3Backend), _module("minio", OtherS3)])


def test_collect_needs_a_fallback():
    with pytest.raises(CheckpointError, match="no storage backend claims"):
        collect([_module("local", LocalBackend), _module("s3", S3Backend)])


# -- backend specifics (the shared contract is tests/integration/test_storage_contract.py) ----
def test_local_write_is_atomic_and_leaves_no_temp_files(tmp_path):
    storage = Storage(str(tmp_path / "plain-path"))  # a plain path means file://
    assert storage.protocol == "file"
    storage.write_bytes("a/b/manifest.json", b"old")
    storage.write_bytes("a/b/manifest.json", b"new")
    assert sorted(p.name for p in (tmp_path / "plain-path/a/b").iterdir()) == ["manifest.json"]
    # an in-flight temp file of another writer is not listed
    (tmp_path / "plain-path/a/b/shard.bin.tmp-0123456789abcdef0123456789abcdef").write_bytes(b"")
    assert storage.listdir("a/b") == ["manifest.json"]


# -- paths ----------------------------------------------------------------------------------
def test_s3_paths_are_slash_joined():
    storage = Storage(
        "s3://bucket/runs/exp1/",
        StorageOptions(endpoint_url="http://127.0.0.1:1", access_key_id="K", secret_access_key="S"),
    )
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


BACKEND_MODULES = sorted(str(p.relative_to(REPO)) for p in (REPO / "checkpoint/backends").glob("*.py"))


@pytest.mark.parametrize("module", ["checkpoint/storage.py", *BACKEND_MODULES])
def test_storage_module_never_uses_os_path(module):
    """Keys must be ``/``-joined on every OS: ``os.path`` is ``ntpath`` on Windows."""
    tree = ast.parse((REPO / module).read_text())
    uses = [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and node.attr == "path"
        and isinstance(node.value, ast.Name)
        and node.value.id == "os"
    ]
    imports = [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module in ("os.path", "ntpath")
    ]
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
    explicit = StorageOptions(
        endpoint_url="http://x", access_key_id="K", secret_access_key="S", read_timeout_s=2.0
    ).fsspec_kwargs("s3")
    assert explicit["key"] == "K" and explicit["client_kwargs"]["endpoint_url"] == "http://x"
    assert explicit["config_kwargs"]["read_timeout"] == 2.0
    assert explicit["config_kwargs"]["retries"] == {"total_max_attempts": 1}  # tenacity retries, not botocore
    assert StorageOptions().fsspec_kwargs("file") == {}


# -- multipart cleanup (fake S3 client) -----------------------------------------------------
class FakeMultipartS3:
    """Just ``call_s3`` for list/abort multipart uploads, with pages of two."""

    def __init__(self, keys: list[str]) -> None:
        self.uploads = [{"Key": k, "UploadId": f"u{i}"} for i, k in enumerate(keys)]
        self.aborted: list[str] = []

    def call_s3(self, method: str, **kw: object) -> dict:
        if method == "list_multipart_uploads":
            live = [
                u for u in self.uploads if u["Key"].startswith(str(kw["Prefix"])) and u["UploadId"] not in self.aborted
            ]
            start = next((i for i, u in enumerate(live) if u["UploadId"] == kw.get("UploadIdMarker")), -1) + 1
            page = live[start : start + 2]
            truncated = start + 2 < len(live)
            out: dict = {"Uploads": page, "IsTruncated": truncated}
            if truncated:
                out.update(NextKeyMarker=page[-1]["Key"], NextUploadIdMarker=page[-1]["UploadId"])
            return out
        assert method == "abort_multipart_upload"
        self.aborted.append(str(kw["UploadId"]))
        return {}


def test_clear_multipart_uploads_pages_and_respects_prefix_boundary():
    storage = Storage(
        "s3://bucket/run1", StorageOptions(endpoint_url="http://127.0.0.1:1", access_key_id="K", secret_access_key="S")
    )
    fake = FakeMultipartS3(["run1/a", "run1/b/c", "run1/d", "run10/x", "run1/e", "other/y"])
    storage.fs = fake
    assert storage.clear_multipart_uploads() == 4
    assert sorted(fake.aborted) == ["u0", "u1", "u2", "u4"]  # not run10/x, not other/y
