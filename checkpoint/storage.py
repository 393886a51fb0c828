"""Storage over fsspec, chosen by URL: ``file://`` (or a plain path), ``s3://``, ``memory://``.

S3 endpoint and credentials come from :class:`StorageOptions` or the standard AWS variables
(``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_ENDPOINT_URL``, ``AWS_REGION``); they
are never logged (``repr`` hides the secret). Every call is retried with exponential backoff
and jitter when the error is transient (:class:`TransientStorageError`) and raised at once
when it is not (:class:`FatalStorageError`, ``FileNotFoundError``).

What must stay true: :meth:`Storage.write_bytes` is all-or-nothing on every backend (one S3
PUT or a multipart upload aborted on failure; on local disk a fsynced temp file renamed into
place, parents created, directory fsynced), so a reader never sees a torn object; DCP files
uploaded to a local filesystem are durable the same way (:meth:`Storage.upload_local_durable`)
before the manifest that commits them is written; metadata calls (``exists``,
``size_bytes``, ``listdir``) never answer from a stale listing cache; keys are joined with
``/``, never ``os.path``.
"""

from __future__ import annotations

import errno
import logging
import os
import posixpath
import re
import shutil
import uuid
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Callable, Iterator, TypeVar

import fsspec
from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception_type,
    stop_after_attempt,
    stop_after_delay,
    wait_exponential,
    wait_random,
)

from checkpoint.errors import FatalStorageError, TransientStorageError

log = logging.getLogger(__name__)
T = TypeVar("T")

_TRANSIENT_CODES = {"SlowDown", "ServiceUnavailable", "InternalError", "RequestTimeout", "Throttling",
                    "ThrottlingException", "RequestTimeTooSkewed", "503", "500", "502", "504"}
_TRANSIENT_ERRNOS = {errno.ECONNREFUSED, errno.ECONNRESET, errno.ETIMEDOUT, errno.EPIPE, errno.EHOSTUNREACH,
                     errno.ECONNABORTED, errno.ENETUNREACH}
#: In-flight temp files of :func:`_write_local_atomic`, hidden from listings.
_LOCAL_TMP_NAME = re.compile(r"\.tmp-[0-9a-f]{32}$")


@dataclass(slots=True)
class StorageOptions:
    """Where and how to reach object storage. Empty fields fall back to the AWS variables."""

    endpoint_url: str = ""
    access_key_id: str = ""
    secret_access_key: str = field(default="", repr=False)
    region: str = ""
    retry_timeout_s: float = 60.0
    max_attempts: int = 8
    connect_timeout_s: float = 5.0
    """S3 only: seconds to wait for a TCP connection (s3fs's default)."""
    read_timeout_s: float = 15.0
    """S3 only: seconds to wait on a silent socket before the attempt fails (s3fs's default)."""

    def fsspec_kwargs(self, protocol: str) -> dict[str, Any]:
        if protocol not in ("s3", "s3a"):
            return {}
        endpoint = self.endpoint_url or os.environ.get("AWS_ENDPOINT_URL", "")
        region = self.region or os.environ.get("AWS_REGION", "") or os.environ.get("AWS_DEFAULT_REGION", "")
        kwargs: dict[str, Any] = {"client_kwargs": {}, "config_kwargs": {
            "retries": {"max_attempts": 1},
            "connect_timeout": self.connect_timeout_s,
            "read_timeout": self.read_timeout_s,
        }}
        if endpoint:
            kwargs["client_kwargs"]["endpoint_url"] = endpoint
        if region:
            kwargs["client_kwargs"]["region_name"] = region
        key = self.access_key_id or os.environ.get("AWS_ACCESS_KEY_ID", "")
        secret = self.secret_access_key or os.environ.get("AWS_SECRET_ACCESS_KEY", "")
        if key and secret:
            kwargs["key"], kwargs["secret"] = key, secret
        return kwargs


def _error_code(exc: BaseException | None) -> str:
    """The S3 error code of a botocore ``ClientError`` (else its HTTP status, else "")."""
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return ""
    err = response.get("Error", {})
    return str(err.get("Code", "")) or str(response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))


def classify(exc: BaseException) -> BaseException:
    """Map a backend exception to TransientStorageError / FatalStorageError (or keep it)."""
    if isinstance(exc, FileNotFoundError) and _error_code(exc.__cause__) == "NoSuchBucket":
        # s3fs turns NoSuchBucket into FileNotFoundError; a missing bucket is configuration.
        return FatalStorageError(f"NoSuchBucket: {exc}")
    if isinstance(exc, (TransientStorageError, FatalStorageError, FileNotFoundError, FileExistsError)):
        return exc
    # s3fs re-raises a ClientError as a builtin (PermissionError, OSError(EBUSY), ...) whose
    # __cause__ keeps the S3 code: judge both by that code
    code = _error_code(exc) or _error_code(exc.__cause__)
    name = type(exc).__name__
    if code in _TRANSIENT_CODES or name in ("EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError",
                                            "ConnectionClosedError", "ServerDisconnectedError",
                                            "ClientOSError", "ClientPayloadError", "ResponseStreamingError",
                                            "IncompleteReadError", "TimeoutError"):
        return TransientStorageError(f"{name}: {exc}")
    if isinstance(exc, (ConnectionError, TimeoutError)) or (isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS):
        return TransientStorageError(f"{name}: {exc}")
    if isinstance(exc, PermissionError) or code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch",
                                                     "NoSuchBucket", "403", "InvalidBucketName"):
        return FatalStorageError(f"{name}: {exc}")
    cause = exc.__cause__ or exc.__context__
    if cause is not None and cause is not exc:
        mapped = classify(cause)
        if isinstance(mapped, TransientStorageError):
            return mapped
    if isinstance(exc, OSError) and "Connect" in str(exc):
        return TransientStorageError(f"{name}: {exc}")
    return exc


class Storage:
    """A root URL on some fsspec filesystem, with retried I/O and paths relative to the root."""

    def __init__(self, url: str, options: StorageOptions | None = None,
                 sleep: Callable[[float], None] | None = None):
        self.url = url.rstrip("/")
        self.options = options or StorageOptions()
        protocol = fsspec.utils.get_protocol(self.url)
        self.protocol = "file" if protocol in ("file", "local") else protocol
        self.storage_kwargs = self.options.fsspec_kwargs(self.protocol)
        self.fs, self.root = fsspec.core.url_to_fs(self.url, **self.storage_kwargs)
        self._sleep = sleep

    def __repr__(self) -> str:
        return f"Storage({self.url!r})"

    # -- paths -------------------------------------------------------------------------
    def path(self, *parts: str) -> str:
        """Backend path of ``parts`` under the root (always ``/``-joined, never os.path)."""
        return posixpath.join(self.root, *[p.strip("/") for p in parts if p])

    def child_url(self, *parts: str) -> str:
        return "/".join([self.url, *[p.strip("/") for p in parts if p]])

    # -- retries -----------------------------------------------------------------------
    def retry(self, fn: Callable[[], T], what: str) -> T:
        def before_sleep(state: RetryCallState) -> None:
            log.warning("storage %s failed (attempt %d), retrying: %s", what, state.attempt_number,
                        state.outcome.exception() if state.outcome else "?")

        kwargs: dict[str, Any] = {}
        if self._sleep is not None:
            kwargs["sleep"] = self._sleep
        retrying = Retrying(
            retry=retry_if_exception_type(TransientStorageError),
            stop=stop_after_delay(self.options.retry_timeout_s) | stop_after_attempt(self.options.max_attempts),
            # = wait_exponential_jitter(0.2, max=5, jitter=0.5) without its tenacity-9.2
            # deprecation of `initial` (tenacity 8 has no `multiplier` there)
            wait=wait_exponential(multiplier=0.2, max=5.0) + wait_random(0, 0.5),
            before_sleep=before_sleep,
            reraise=True,
            **kwargs,
        )

        return retrying(lambda: _classified(fn))

    def invalidate(self, path: str = "") -> None:
        self.fs.invalidate_cache(path or None)

    # -- operations --------------------------------------------------------------------
    def read_bytes(self, rel: str) -> bytes:
        return self.retry(lambda: self.fs.cat_file(self.path(rel)), f"read {rel}")

    def read_range(self, rel: str, offset: int, length: int) -> bytes:
        """Bytes ``offset .. offset+length`` of ``rel``, exactly ``length`` of them: a shorter
        answer (the file ends first) raises ``EOFError`` naming the file."""
        if offset < 0 or length < 0:
            raise ValueError(f"read_range {rel}: offset {offset} and length {length} must be >= 0")
        if length == 0:
            return b""
        data = self.retry(lambda: self.fs.cat_file(self.path(rel), start=offset, end=offset + length),
                          f"read {rel}[{offset}:{offset + length}]")
        if len(data) != length:
            raise EOFError(f"{rel}: wanted bytes {offset}..{offset + length}, the file ended after {len(data)}")
        return data

    def local_path(self, path: str) -> str | None:
        """The filesystem path of ``path`` (a URL or backend path) on a local filesystem; None
        on any other backend."""
        if self.protocol != "file":
            return None
        return self.fs._strip_protocol(str(path))

    def upload_local_durable(self, path: str, data: bytes | BinaryIO) -> None:
        """Local filesystem only: write ``path`` (a URL or local path) atomically and durably
        (fsynced file, renamed into place, fsynced directory), retried on transient errors."""
        local = self.local_path(path)
        if local is None:
            raise ValueError(f"upload_local_durable: {self.url} is not a local filesystem")
        self.retry(lambda: _write_local_atomic(local, data), f"write {posixpath.basename(local)}")

    def write_bytes(self, rel: str, data: bytes) -> None:
        """Write a whole object, all or nothing (see the module docstring)."""
        path = self.path(rel)
        if self.protocol == "file":
            self.retry(lambda: _write_local_atomic(path, data), f"write {rel}")
        else:
            # One PUT (multipart above 100 MiB, aborted by s3fs on failure); never a buffered
            # file whose close() after a failed write() could commit a truncated object.
            self.retry(lambda: self.fs.pipe_file(path, data), f"write {rel}")

    def exists(self, rel: str) -> bool:
        path = self.path(rel)

        def check() -> bool:
            self.fs.invalidate_cache(path)  # s3fs answers from a cached parent listing otherwise
            return self.fs.exists(path)

        return self.retry(check, f"exists {rel}")

    def size_bytes(self, rel: str) -> int:
        path = self.path(rel)

        def size() -> int:
            self.fs.invalidate_cache(path)
            return int(self.fs.size(path))

        return self.retry(size, f"size {rel}")

    def listdir(self, rel: str = "") -> list[str]:
        """Names (not paths) directly under ``rel``; empty if it does not exist (a missing
        bucket is not "empty": it raises :class:`FatalStorageError`)."""
        path = self.path(rel)

        def ls() -> list[str]:
            self.fs.invalidate_cache(path)
            try:
                entries = self.fs.ls(path, detail=False)
            except FileNotFoundError as e:
                if isinstance(classify(e), FatalStorageError):
                    raise  # NoSuchBucket: a misconfigured bucket must not look like "no checkpoints"
                return []
            names = {posixpath.basename(e.rstrip("/")) for e in entries}
            return sorted(n for n in names if not _LOCAL_TMP_NAME.search(n))

        return self.retry(ls, f"list {rel}")

    def remove(self, rel: str, recursive: bool = False) -> None:
        """Delete a file, or with ``recursive`` everything under ``rel``; missing is not an error.

        On S3 a recursive remove also deletes the ``dir/`` entries of the removed tree, deepest
        first: SeaweedFS keeps empty directories and would go on listing a removed prefix.
        """
        path = self.path(rel)
        s3 = self.protocol in ("s3", "s3a")

        def rm() -> None:
            dirs = self._s3_dirs_under(path) if s3 and recursive else set()
            try:
                self.fs.rm(path, recursive=recursive)
            except FileNotFoundError:
                pass
            if s3 and recursive:
                self._delete_s3_dir_entries(sorted(dirs))
                self.fs.invalidate_cache(path)

        self.retry(rm, f"remove {rel}")

    def _s3_dirs_under(self, path: str) -> set[str]:
        """``path`` and every directory below it, walked with fresh delimiter listings (empty
        SeaweedFS directories appear only there; s3fs's ``find(withdirs=True)`` also leaves out
        directories whose parent listing happens to be cached)."""
        dirs, todo = {path}, [path]
        while todo:
            try:
                entries = self.fs.ls(todo.pop(), detail=True, refresh=True)
            except FileNotFoundError:
                continue
            for entry in entries:
                name = entry["name"].rstrip("/")
                if entry["type"] == "directory" and name not in dirs:
                    dirs.add(name)
                    todo.append(name)
        return dirs

    def _delete_s3_dir_entries(self, dirs: list[str]) -> None:
        """DeleteObjects on ``d/`` for each directory path, deepest first (a no-op on AWS S3;
        SeaweedFS refuses a non-empty one, so nothing but empty directories can go)."""
        bucket = self.root.partition("/")[0]
        keys = {d.partition("/")[2].strip("/") for d in dirs}
        ordered = sorted((k + "/" for k in keys if k), key=lambda k: (-k.count("/"), k))
        for i in range(0, len(ordered), 1000):
            self.fs.call_s3("delete_objects", Bucket=bucket,
                            Delete={"Objects": [{"Key": k} for k in ordered[i:i + 1000]], "Quiet": True})

    def iter_chunks(self, rel: str, chunk_bytes: int = 8 << 20) -> Iterator[bytes]:
        """Stream a file's bytes. Opening is retried; a failure mid-stream is classified and
        raised (no retry: the caller retries the whole read)."""
        path = self.path(rel)
        fh = self.retry(lambda: self.fs.open(path, "rb", block_size=chunk_bytes), f"open {rel}")
        with fh:
            while chunk := _classified(lambda: fh.read(chunk_bytes)):
                yield chunk

    def clear_multipart_uploads(self, rel: str = "") -> int:
        """Abort unfinished multipart uploads under ``rel`` (S3 only); returns how many."""
        if self.protocol not in ("s3", "s3a"):
            return 0
        bucket, _, key = self.path(rel).partition("/")
        key = key + "/" if key else key  # a directory prefix: step-1 must not match step-10
        key = key.strip("/")
        fs = self.fs

        def under(upload_key: str) -> bool:  # "run1" must not match "run10/..."
            return not key or upload_key == key or upload_key.startswith(key + "/")

        def abort() -> int:
            aborted = 0
            page_kwargs: dict[str, Any] = {"Bucket": bucket, "Prefix": key}
            while True:
                page = fs.call_s3("list_multipart_uploads", **page_kwargs)
                for up in page.get("Uploads", []):
                    if not under(up["Key"]):
                        continue
                    try:
                        fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=up["Key"],
                                   UploadId=up["UploadId"])
                    except FileNotFoundError:  # NoSuchUpload: gone already (e.g. a retried call)
                        continue
                    aborted += 1
                if not page.get("IsTruncated"):
                    return aborted
                page_kwargs.update(KeyMarker=page.get("NextKeyMarker", ""),
                                   UploadIdMarker=page.get("NextUploadIdMarker", ""))

        return self.retry(abort, f"abort multipart uploads under {rel}")


def _classified(fn: Callable[[], T]) -> T:
    """Call ``fn``; re-raise what it raises as :func:`classify` maps it (chained)."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - classified and re-raised
        mapped = classify(e)
        if mapped is e:
            raise
        raise mapped from e


def _write_local_atomic(path: str, data: bytes | BinaryIO) -> None:
    """Create parents, write a temp file beside ``path``, fsync, rename over it, fsync the dir.

    ``data`` is bytes or a readable binary file (copied from its start, so a retry rewrites it
    whole)."""
    parent = posixpath.dirname(path) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = f"{path}.tmp-{uuid.uuid4().hex}"
    try:
        with open(tmp, "wb") as fh:
            if isinstance(data, (bytes, bytearray, memoryview)):
                fh.write(data)
            else:
                data.seek(0)
                shutil.copyfileobj(data, fh, 8 << 20)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    fsync_dir(parent)


def fsync_dir(path: str) -> None:
    """fsync a local directory, so that renames and new names inside it survive a power loss."""
    dir_fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
