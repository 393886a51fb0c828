"""Storage by URL: a root on one backend (:mod:`ftrain.checkpoint.backends`, chosen by the URL's
scheme: local files for ``file://`` and plain paths, ``s3://``, any other fsspec scheme), with
``/``-joined paths under the root and retried I/O.

S3 endpoint and credentials come from :class:`StorageOptions` or the standard AWS variables;
they are never logged (``repr`` hides the secret). Every call is retried with exponential
backoff and jitter when the error is transient (:class:`TransientStorageError`) and raised at
once when it is not (:class:`FatalStorageError`, ``FileNotFoundError``).

What must stay true: :meth:`Storage.write_bytes` is all-or-nothing on every backend (one S3
PUT or a multipart upload aborted on failure; on local disk a fsynced temp file renamed into
place, parents created, directory fsynced), so a reader never sees a torn object; so is a
streamed write (:meth:`Storage.open_upload`, how DCP files are written): nothing is visible
until the ``with`` block ends without an error, and then the whole object is (on S3 a multipart
upload whose parts go up while the caller writes, each part retried on its own, aborted on any
error; on local disk durable as above before it returns, so before the manifest that commits
it is written); metadata calls (``exists``,
``size_bytes``, ``listdir``) never answer from a stale listing cache; a missing object is a
``FileNotFoundError``, never a storage error (so never retried, and never taken for damage by
a caller that reads a storage error as "unknown"); keys are joined with ``/``, never
``os.path``.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import posixpath
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

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

from ftrain.checkpoint.backends import StorageBackend, Upload, UploadSettings, backend_for, registered_backends
from ftrain.checkpoint.backends.local import fsync_dir
from ftrain.checkpoint.errors import FatalStorageError, TransientStorageError

__all__ = ["Storage", "StorageOptions", "classify", "fsync_dir"]

log = logging.getLogger(__name__)
T = TypeVar("T")

#: Connection-level errors of the HTTP stack under fsspec's remote filesystems (aiohttp), and
#: any library's class named TimeoutError.
_TRANSIENT_TYPE_NAMES = {"ServerDisconnectedError", "ClientOSError", "ClientPayloadError", "TimeoutError"}
_TRANSIENT_ERRNOS = {
    errno.ECONNREFUSED,
    errno.ECONNRESET,
    errno.ETIMEDOUT,
    errno.EPIPE,
    errno.EHOSTUNREACH,
    errno.ECONNABORTED,
    errno.ENETUNREACH,
}


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
    upload_part_size_bytes: int = 32 << 20
    """Streamed writes (:meth:`Storage.open_upload`): bytes per multipart part (S3: 5 MiB to
    5 GiB); a file of at most this size is one PUT. Elsewhere: bytes kept in memory before a
    local temp file takes over (backends that store whole objects)."""
    upload_parts_in_flight: int = 2
    """Streamed writes to S3: full parts uploading in the background at most, per file (the
    writer waits for one to finish before handing over the next; memory per file: this many
    parts plus the one being filled)."""

    def __post_init__(self) -> None:
        if self.upload_part_size_bytes < 1:
            raise ValueError(f"upload_part_size_bytes must be >= 1, got {self.upload_part_size_bytes}")
        if self.upload_parts_in_flight < 1:
            raise ValueError(f"upload_parts_in_flight must be >= 1, got {self.upload_parts_in_flight}")

    def fsspec_kwargs(self, protocol: str) -> dict[str, Any]:
        """fsspec filesystem arguments for ``protocol``, as its backend builds them."""
        return backend_for(protocol).fsspec_kwargs(self)


def classify(exc: BaseException) -> BaseException:
    """Map a backend exception to TransientStorageError / FatalStorageError (or keep it).

    Every backend's verdict is consulted whichever storage raised the error (libraries wrap
    each other's errors), then the generic rules: network errors are transient, a permission
    error is fatal, a wrapped transient cause makes the wrapper transient."""
    if isinstance(exc, (TransientStorageError, FatalStorageError, FileExistsError)):
        return exc
    for backend in registered_backends().values():
        verdict = backend.classify_error(exc)
        if verdict is not None:
            return verdict
    if isinstance(exc, FileNotFoundError):
        return exc
    name = type(exc).__name__
    if (
        name in _TRANSIENT_TYPE_NAMES
        or isinstance(exc, (ConnectionError, TimeoutError))
        or (isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS)
    ):
        return TransientStorageError(f"{name}: {exc}")
    if isinstance(exc, PermissionError):
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
    """A root URL on one storage backend, with retried I/O and paths relative to the root."""

    def __init__(self, url: str, options: StorageOptions | None = None, sleep: Callable[[float], None] | None = None):
        self.url = url.rstrip("/")
        self.options = options or StorageOptions()
        protocol = fsspec.utils.get_protocol(self.url)
        self.protocol = "file" if protocol in ("file", "local") else protocol
        self.backend: StorageBackend = backend_for(self.protocol)(self.url, self.options)
        self._sleep = sleep

    def __repr__(self) -> str:
        return f"Storage({self.url!r})"

    @property
    def fs(self) -> Any:
        """The backend's fsspec filesystem (replaceable, e.g. by a fake client in a test)."""
        return self.backend.fs

    @fs.setter
    def fs(self, fs: Any) -> None:
        self.backend.fs = fs

    @property
    def root(self) -> str:
        return self.backend.root

    @property
    def storage_kwargs(self) -> dict[str, Any]:
        """fsspec arguments reaching this storage (DCP's FsspecWriter/Reader need the same)."""
        return self.backend.storage_kwargs

    # -- paths -------------------------------------------------------------------------
    def path(self, *parts: str) -> str:
        """Backend path of ``parts`` under the root (always ``/``-joined, never os.path)."""
        return posixpath.join(self.root, *[p.strip("/") for p in parts if p])

    def child_url(self, *parts: str) -> str:
        return "/".join([self.url, *[p.strip("/") for p in parts if p]])

    # -- retries -----------------------------------------------------------------------
    def retry(self, fn: Callable[[], T], what: str) -> T:
        def before_sleep(state: RetryCallState) -> None:
            log.warning(
                "storage %s failed (attempt %d), retrying: %s",
                what,
                state.attempt_number,
                state.outcome.exception() if state.outcome else "?",
            )

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
        return self.retry(lambda: self.backend.read(self.path(rel)), f"read {rel}")

    def read_range(self, rel: str, offset: int, length: int) -> bytes:
        """Bytes ``offset .. offset+length`` of ``rel``, exactly ``length`` of them: a shorter
        answer (the file ends first) raises ``EOFError`` naming the file."""
        if offset < 0 or length < 0:
            raise ValueError(f"read_range {rel}: offset {offset} and length {length} must be >= 0")
        if length == 0:
            return b""
        data = self.retry(
            lambda: self.backend.read(self.path(rel), offset, offset + length),
            f"read {rel}[{offset}:{offset + length}]",
        )
        if len(data) != length:
            raise EOFError(f"{rel}: wanted bytes {offset}..{offset + length}, the file ended after {len(data)}")
        return data

    def local_path(self, path: str) -> str | None:
        """The filesystem path of ``path`` (a URL or backend path) on a local filesystem; None
        on any other backend."""
        return self.backend.local_path(path)

    @contextlib.contextmanager
    def open_upload(self, rel: str) -> Iterator[Upload]:
        """Write ``rel`` as a stream: ``with storage.open_upload(rel) as up: up.write(...)``.

        The object appears, whole, only when the block ends without an error (all or nothing,
        see the module docstring); an error in the block, or one storing it, aborts the upload
        and leaves no object. On S3 the bytes go up in parts of
        :attr:`StorageOptions.upload_part_size_bytes` while the block goes on writing (at most
        :attr:`StorageOptions.upload_parts_in_flight` at a time; ``write`` blocks beyond that),
        each part retried on transient errors; a file of at most one part is one PUT."""
        settings = UploadSettings(
            part_size_bytes=self.options.upload_part_size_bytes,
            parts_in_flight=self.options.upload_parts_in_flight,
            retry=self.retry,
        )
        path = self.path(rel)
        upload = self.backend.open_upload(path, settings)
        committed = False
        try:
            yield upload
            upload.commit()
            committed = True
        finally:
            if not committed:
                upload.abort()

    def write_bytes(self, rel: str, data: bytes) -> None:
        """Write a whole object, all or nothing (see the module docstring)."""
        self.retry(lambda: self.backend.write(self.path(rel), data), f"write {rel}")

    def exists(self, rel: str) -> bool:
        return self.retry(lambda: self.backend.exists(self.path(rel)), f"exists {rel}")

    def size_bytes(self, rel: str) -> int:
        return self.retry(lambda: self.backend.size_bytes(self.path(rel)), f"size {rel}")

    def listdir(self, rel: str = "") -> list[str]:
        """Names (not paths) directly under ``rel``; empty if it does not exist (a missing
        bucket is not "empty": it raises :class:`FatalStorageError`)."""
        path = self.path(rel)

        def ls() -> list[str]:
            try:
                return self.backend.list_names(path)
            except FileNotFoundError as e:
                if isinstance(classify(e), FatalStorageError):
                    raise  # NoSuchBucket: a misconfigured bucket must not look like "no checkpoints"
                return []

        return self.retry(ls, f"list {rel}")

    def remove(self, rel: str, recursive: bool = False) -> None:
        """Delete a file, or with ``recursive`` everything under ``rel``; missing is not an error."""
        self.retry(lambda: self.backend.remove(self.path(rel), recursive), f"remove {rel}")

    def iter_chunks(self, rel: str, chunk_bytes: int = 8 << 20) -> Iterator[bytes]:
        """Stream a file's bytes. Opening is retried; a failure mid-stream is classified and
        raised (no retry: the caller retries the whole read)."""
        path = self.path(rel)
        fh = self.retry(lambda: self.backend.open_read(path, chunk_bytes), f"open {rel}")
        with fh:
            while chunk := _classified(lambda: fh.read(chunk_bytes)):
                yield chunk

    def pending_uploads(self, rel: str = "") -> dict[str, float]:
        """Unfinished multipart uploads under the directory ``rel`` (S3 only): each key, relative
        to ``rel``, with when the newest upload to it was started (Unix seconds). Invisible to
        listings: a step directory holding nothing else is found only here."""
        return self.retry(lambda: self.backend.pending_uploads(self.path(rel)), f"list pending uploads under {rel}")

    def clear_multipart_uploads(self, rel: str = "") -> int:
        """Abort unfinished multipart uploads under the directory ``rel`` (S3 only: a sibling
        sharing the string prefix, ``step-10`` for ``step-1``, is not touched); how many."""
        return self.retry(
            lambda: self.backend.clear_multipart_uploads(self.path(rel)), f"abort multipart uploads under {rel}"
        )


def _classified(fn: Callable[[], T]) -> T:
    """Call ``fn``; re-raise what it raises as :func:`classify` maps it (chained)."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - classified and re-raised
        mapped = classify(e)
        if mapped is e:
            raise
        raise mapped from e
