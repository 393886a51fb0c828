"""S3 and S3-compatible servers (``s3://``, ``s3a://``) through s3fs.

Endpoint and credentials come from :class:`checkpoint.storage.StorageOptions` or the standard
AWS variables (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_ENDPOINT_URL``,
``AWS_REGION``). What must stay true: botocore never retries (``Storage`` does, with backoff,
and only transient errors); a write is one PUT (multipart above 100 MiB, aborted by s3fs on
failure); a recursive remove leaves no directory entry behind that would go on listing the
removed prefix; a missing bucket is a configuration error, never "no such object".
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, ClassVar

from checkpoint.backends.generic import FsspecBackend
from checkpoint.errors import FatalStorageError, TransientStorageError

if TYPE_CHECKING:
    from checkpoint.storage import StorageOptions

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
                "retries": {"max_attempts": 1},
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
        bucket, _, key = path.partition("/")
        key = key.strip("/")
        fs = self.fs

        def under(upload_key: str) -> bool:  # "run1" must not match "run10/..."
            return not key or upload_key == key or upload_key.startswith(key + "/")

        aborted = 0
        page_kwargs: dict[str, Any] = {"Bucket": bucket, "Prefix": key}
        while True:
            page = fs.call_s3("list_multipart_uploads", **page_kwargs)
            for up in page.get("Uploads", []):
                if not under(up["Key"]):
                    continue
                try:
                    fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=up["Key"], UploadId=up["UploadId"])
                except FileNotFoundError:  # NoSuchUpload: gone already (e.g. a retried call)
                    continue
                aborted += 1
            if not page.get("IsTruncated"):
                return aborted
            page_kwargs.update(
                KeyMarker=page.get("NextKeyMarker", ""), UploadIdMarker=page.get("NextUploadIdMarker", "")
            )


def _error_code(exc: BaseException | None) -> str:
    """The S3 error code of a botocore ``ClientError`` (else its HTTP status, else "")."""
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return ""
    err = response.get("Error", {})
    return str(err.get("Code", "")) or str(response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))


BACKEND = S3Backend
