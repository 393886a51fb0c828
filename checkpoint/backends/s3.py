"""S3 and S3-compatible servers (``s3://``, ``s3a://``) through s3fs.

Endpoint and credentials come from :class:`ftrain.checkpoint.storage.StorageOptions` or the standard
AWS variables (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_ENDPOINT_URL``,
``AWS_REGION``). What must stay true: botocore never retries (``Storage`` does, with backoff,
and only transient errors); a write is one PUT (multipart above 100 MiB, aborted by s3fs on
failure); a streamed upload (:class:`S3Upload`) is one PUT when it fits in one part, else a
multipart upload whose parts go up in the background while the caller writes (each part
retried on its own, a bounded number in flight), completed on commit and aborted on any
failure, so no object ever appears unless every byte was stored (a killed process leaves an
invisible pending upload: ``clear_multipart_uploads``); a recursive remove leaves no directory
entry behind that would go on listing the removed prefix; a missing bucket is a configuration
error, never "no such object".
"""

from __future__ import annotations

import logging
import os
import posixpath
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import datetime
from typing import TYPE_CHECKING, Any, ClassVar

from ftrain.checkpoint.backends import Upload, UploadSettings
from ftrain.checkpoint.backends.generic import FsspecBackend
from ftrain.checkpoint.errors import FatalStorageError, TransientStorageError

if TYPE_CHECKING:
    from ftrain.checkpoint.storage import StorageOptions

log = logging.getLogger(__name__)

#: S3's limits on multipart uploads: part numbers 1..10000, parts (except the last) 5 MiB to
#: 5 GiB; a single PUT is at most 5 GiB.
MAX_PARTS = 10_000
MIN_PART_SIZE_BYTES = 5 << 20
MAX_PART_SIZE_BYTES = 5 << 30

#: S3 error codes (or HTTP statuses) worth retrying.
_TRANSIENT_CODES = {
    "SlowDown",
    "ServiceUnavailable",
    "InternalError",
    "RequestTimeout",
    "Throttling",
    "ThrottlingException",
    "RequestTimeTooSkewed",
    "503",
    "500",
    "502",
    "504",
}
#: S3 error codes (or HTTP statuses) retrying cannot fix: credentials, bucket.
_FATAL_CODES = {
    "AccessDenied",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "NoSuchBucket",
    "403",
    "InvalidBucketName",
}
#: botocore's connection-level errors, all worth retrying.
_TRANSIENT_TYPE_NAMES = {
    "EndpointConnectionError",
    "ConnectTimeoutError",
    "ReadTimeoutError",
    "ConnectionClosedError",
    "ResponseStreamingError",
    "IncompleteReadError",
    "FlexibleChecksumError",  # a body that fails its S3 checksum: damaged in flight, read it again
}


class S3Backend(FsspecBackend):
    """A bucket and key prefix on an S3 endpoint."""

    schemes: ClassVar[tuple[str, ...]] = ("s3", "s3a")

    @classmethod
    def fsspec_kwargs(cls, options: StorageOptions) -> dict[str, Any]:
        endpoint = options.endpoint_url or os.environ.get("AWS_ENDPOINT_URL", "")
        region = options.region or os.environ.get("AWS_REGION", "") or os.environ.get("AWS_DEFAULT_REGION", "")
        kwargs: dict[str, Any] = {
            "client_kwargs": {},
            "config_kwargs": {
                # one attempt in all ("max_attempts" counts retries in botocore's legacy mode)
                "retries": {"total_max_attempts": 1},
                "connect_timeout": options.connect_timeout_s,
                "read_timeout": options.read_timeout_s,
            },
        }
        if endpoint:
            kwargs["client_kwargs"]["endpoint_url"] = endpoint
        if region:
            kwargs["client_kwargs"]["region_name"] = region
        key = options.access_key_id or os.environ.get("AWS_ACCESS_KEY_ID", "")
        secret = options.secret_access_key or os.environ.get("AWS_SECRET_ACCESS_KEY", "")
        if key and secret:
            kwargs["key"], kwargs["secret"] = key, secret
        return kwargs

    @staticmethod
    def classify_error(exc: BaseException) -> BaseException | None:
        """By the S3 error code of a botocore ``ClientError``, or of the one s3fs keeps as
        ``__cause__`` when it re-raises it as a builtin (PermissionError, OSError(EBUSY), ...)."""
        if isinstance(exc, FileNotFoundError):
            # s3fs turns NoSuchBucket into FileNotFoundError; a missing bucket is configuration.
            return FatalStorageError(f"NoSuchBucket: {exc}") if _error_code(exc.__cause__) == "NoSuchBucket" else None
        code = _error_code(exc) or _error_code(exc.__cause__)
        name = type(exc).__name__
        if code in _TRANSIENT_CODES or name in _TRANSIENT_TYPE_NAMES:
            return TransientStorageError(f"{name}: {exc}")
        if code in _FATAL_CODES:
            return FatalStorageError(f"{name}: {exc}")
        return None

    def open_upload(self, path: str, settings: UploadSettings) -> Upload:
        if not MIN_PART_SIZE_BYTES <= settings.part_size_bytes <= MAX_PART_SIZE_BYTES:
            raise ValueError(
                f"upload_part_size_bytes must be {MIN_PART_SIZE_BYTES}..{MAX_PART_SIZE_BYTES} on S3 "
                f"(S3's limits on a part), got {settings.part_size_bytes}"
            )
        return S3Upload(self.fs, path, settings)

    def remove(self, path: str, recursive: bool) -> None:
        """Also deletes the ``dir/`` entries of a removed tree, deepest first: SeaweedFS keeps
        empty directories and would go on listing a removed prefix."""
        dirs = self._dirs_under(path) if recursive else set()
        super().remove(path, recursive)
        if recursive:
            self._delete_dir_entries(sorted(dirs))
            self.fs.invalidate_cache(path)

    def _dirs_under(self, path: str) -> set[str]:
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

    def _delete_dir_entries(self, dirs: list[str]) -> None:
        """DeleteObjects on ``d/`` for each directory path, deepest first (a no-op on AWS S3;
        SeaweedFS refuses a non-empty one, so nothing but empty directories can go)."""
        bucket = self.root.partition("/")[0]
        keys = {d.partition("/")[2].strip("/") for d in dirs}
        ordered = sorted((k + "/" for k in keys if k), key=lambda k: (-k.count("/"), k))
        for i in range(0, len(ordered), 1000):
            self.fs.call_s3(
                "delete_objects",
                Bucket=bucket,
                Delete={"Objects": [{"Key": k} for k in ordered[i : i + 1000]], "Quiet": True},
            )

    def clear_multipart_uploads(self, path: str) -> int:
        bucket = path.partition("/")[0]
        aborted = 0
        for key, upload_id, _ in self._uploads_under(path):
            try:
                self.fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id)
            except FileNotFoundError:  # NoSuchUpload: gone already (e.g. a retried call)
                continue
            aborted += 1
        return aborted

    def pending_uploads(self, path: str) -> dict[str, float]:
        prefix = path.partition("/")[2].strip("/")
        out: dict[str, float] = {}
        for key, _, started_s in self._uploads_under(path):
            rel = key[len(prefix) :].lstrip("/") if prefix else key
            out[rel] = max(out.get(rel, started_s), started_s)
        return out

    def _uploads_under(self, path: str) -> Iterator[tuple[str, str, float]]:
        """``(key, upload id, started at, Unix s)`` of every unfinished upload under ``path``."""
        bucket, _, key = path.partition("/")
        key = key.strip("/")

        def under(upload_key: str) -> bool:  # "run1" must not match "run10/..."
            return not key or upload_key == key or upload_key.startswith(key + "/")

        page_kwargs: dict[str, Any] = {"Bucket": bucket, "Prefix": key}
        while True:
            page = self.fs.call_s3("list_multipart_uploads", **page_kwargs)
            for up in page.get("Uploads", []):
                if under(up["Key"]):
                    started = up.get("Initiated")
                    yield up["Key"], up["UploadId"], started.timestamp() if isinstance(started, datetime) else 0.0
            if not page.get("IsTruncated"):
                return
            page_kwargs.update(
                KeyMarker=page.get("NextKeyMarker", ""), UploadIdMarker=page.get("NextUploadIdMarker", "")
            )


class _Aborted(Exception):
    """Raised instead of another attempt at a part once the upload is being aborted (not a
    storage error: never retried)."""


class S3Upload:
    """One object streamed to S3: bytes fill a part buffer; each full part (once more bytes
    follow it) goes to a pool of ``parts_in_flight`` threads that upload it as a multipart part,
    each part retried on its own, while the caller goes on writing; ``write`` blocks when that
    many parts are still uploading (memory: at most ``parts_in_flight + 1`` parts) and raises as
    soon as a part failed for good. ``commit`` sends the last part and completes the upload (an
    object that never filled a part is one PUT instead, and no multipart upload is created);
    ``abort`` stops the parts not yet started, waits for those uploading, and aborts the upload.

    ``parts_uploaded`` and ``peak_parts_in_flight`` say what happened (tests, logs)."""

    def __init__(self, fs: Any, path: str, settings: UploadSettings) -> None:
        self._fs = fs
        self._path = path
        self._bucket, self._key, _ = fs.split_path(path)
        self._name = posixpath.basename(path)
        self._part_size_bytes = settings.part_size_bytes
        self._parts_in_flight = settings.parts_in_flight
        self._retry = settings.retry
        self._buffer = bytearray()
        self._size_bytes = 0
        self._upload_id: str | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._slots = threading.Semaphore(settings.parts_in_flight)
        self._futures: list[Future[None]] = []
        self._lock = threading.Lock()
        self._parts: dict[int, dict[str, Any]] = {}
        self._failure: BaseException | None = None
        self._aborting = threading.Event()
        self._finished = False
        self._in_flight = 0
        self.parts_uploaded = 0
        self.peak_parts_in_flight = 0

    # -- the caller's thread -------------------------------------------------------------
    def write(self, data: memoryview) -> None:
        if self._finished:
            raise ValueError(f"upload of {self._name} is already finished")
        view = memoryview(data).cast("B")
        while view.nbytes:
            if len(self._buffer) >= self._part_size_bytes:  # full, and more bytes follow it
                self._send_part()
            room = self._part_size_bytes - len(self._buffer)
            self._buffer += view[:room]
            self._size_bytes += min(room, view.nbytes)
            view = view[room:]

    def commit(self) -> None:
        if self._finished:
            raise ValueError(f"upload of {self._name} is already finished")
        self._raise_if_failed()
        if self._upload_id is None:
            body = self._buffer
            self._retry(
                lambda: self._fs.call_s3("put_object", Bucket=self._bucket, Key=self._key, Body=body),
                f"upload {self._name}",
            )
        else:
            if self._buffer:
                self._send_part()
            for future in self._futures:
                future.result()  # the first failed part raises (classified, after its retries)
            self._complete()
        self._finished = True
        self._buffer = bytearray()
        self._fs.invalidate_cache(self._path)
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    def abort(self) -> None:
        if self._finished:
            return
        self._finished = True
        self._aborting.set()
        self._buffer = bytearray()
        for future in self._futures:
            future.cancel()
        if self._pool is not None:
            self._pool.shutdown(wait=True)  # a part uploading ends with its current attempt
        if self._upload_id is None:
            return
        upload_id = self._upload_id
        try:
            self._retry(
                lambda: self._fs.call_s3(
                    "abort_multipart_upload", Bucket=self._bucket, Key=self._key, UploadId=upload_id
                ),
                f"abort upload of {self._name}",
            )
        except FileNotFoundError:  # NoSuchUpload: gone already (e.g. an attempt whose reply was lost)
            pass
        except Exception as e:  # noqa: BLE001 - abort never raises; what is left is invisible
            log.warning(
                "could not abort the multipart upload of %s; an invisible pending upload remains "
                "until retention clears its directory's multipart uploads: %s",
                self._name,
                e,
            )

    def _send_part(self) -> None:
        """Hand the buffer to the pool as the next part (starting the multipart upload first);
        blocks while ``parts_in_flight`` parts are uploading."""
        self._raise_if_failed()
        number = len(self._futures) + 1
        if number > MAX_PARTS:
            raise FatalStorageError(
                f"upload {self._name}: more than {MAX_PARTS} parts of {self._part_size_bytes} bytes; "
                "raise upload_part_size_bytes"
            )
        pool = self._pool or self._start()
        self._slots.acquire()
        try:
            self._raise_if_failed()
        except BaseException:
            self._slots.release()
            raise
        part, self._buffer = self._buffer, bytearray()
        self._futures.append(pool.submit(self._upload_part, number, part))

    def _start(self) -> ThreadPoolExecutor:
        out = self._retry(
            lambda: self._fs.call_s3("create_multipart_upload", Bucket=self._bucket, Key=self._key),
            f"start upload of {self._name}",
        )
        self._upload_id = str(out["UploadId"])
        self._pool = ThreadPoolExecutor(max_workers=self._parts_in_flight, thread_name_prefix="ckpt-upload")
        return self._pool

    def _complete(self) -> None:
        parts = [self._parts[n] for n in sorted(self._parts)]
        attempts = 0

        def complete() -> Any:
            nonlocal attempts
            attempts += 1
            return self._fs.call_s3(
                "complete_multipart_upload",
                Bucket=self._bucket,
                Key=self._key,
                UploadId=self._upload_id,
                MultipartUpload={"Parts": parts},
            )

        try:
            self._retry(complete, f"complete upload of {self._name}")
        except FileNotFoundError:
            # NoSuchUpload on a retry: the attempt before completed it, and its reply was lost
            if attempts < 2 or not self._stored_size_is(self._size_bytes):
                raise

    def _stored_size_is(self, size_bytes: int) -> bool:
        def head() -> Any:
            return self._fs.call_s3("head_object", Bucket=self._bucket, Key=self._key)

        try:
            return int(self._retry(head, f"size {self._name}")["ContentLength"]) == size_bytes
        except FileNotFoundError:
            return False

    def _raise_if_failed(self) -> None:
        with self._lock:
            failure = self._failure
        if failure is not None:
            raise failure

    # -- the pool's threads --------------------------------------------------------------
    def _upload_part(self, number: int, body: bytearray) -> None:
        with self._lock:
            self._in_flight += 1
            self.peak_parts_in_flight = max(self.peak_parts_in_flight, self._in_flight)
        try:

            def attempt() -> Any:
                if self._aborting.is_set():
                    raise _Aborted(f"upload of {self._name} aborted")
                return self._fs.call_s3(
                    "upload_part",
                    Bucket=self._bucket,
                    Key=self._key,
                    UploadId=self._upload_id,
                    PartNumber=number,
                    Body=body,
                )

            out = self._retry(attempt, f"upload {self._name} part {number}")
            entry = {"PartNumber": number, "ETag": out["ETag"]}
            if "ChecksumSHA256" in out:  # as s3fs's S3File does
                entry["ChecksumSHA256"] = out["ChecksumSHA256"]
            with self._lock:
                self._parts[number] = entry
                self.parts_uploaded += 1
            log.debug("uploaded %s part %d (%d bytes)", self._name, number, len(body))
        except BaseException as e:
            with self._lock:
                if self._failure is None:
                    self._failure = e
            raise
        finally:
            with self._lock:
                self._in_flight -= 1
            self._slots.release()


def _error_code(exc: BaseException | None) -> str:
    """The S3 error code of a botocore ``ClientError`` (else its HTTP status, else "")."""
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return ""
    err = response.get("Error", {})
    return str(err.get("Code", "")) or str(response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))


BACKEND = S3Backend
