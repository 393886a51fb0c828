"""Any fsspec filesystem no other backend claims (``memory://``, ``gs://``, ...), and the base
the other fsspec-based backends refine.

What must stay true: :meth:`FsspecBackend.write` is one ``pipe_file`` call (a whole object,
never a buffered file whose ``close()`` after a failed ``write()`` could commit a truncated
one); a streamed upload (:class:`WholeUpload`) collects the bytes locally (memory up to one
part, then a temp file) and stores them whole on commit, with the same one call (``put_file``
from the temp file), retried whole; metadata calls drop fsspec's listing cache for the path
first.
"""

from __future__ import annotations

import posixpath
import tempfile
from typing import TYPE_CHECKING, Any, BinaryIO, ClassVar

import fsspec

from ftrain.checkpoint.backends import ANY_SCHEME, Retry, Upload, UploadSettings

if TYPE_CHECKING:
    from ftrain.checkpoint.storage import StorageOptions


class FsspecBackend:
    """A root URL on an fsspec filesystem, built from the URL alone."""

    schemes: ClassVar[tuple[str, ...]] = (ANY_SCHEME,)

    def __init__(self, url: str, options: StorageOptions) -> None:
        self.storage_kwargs = self.fsspec_kwargs(options)
        self.fs: Any
        self.fs, self.root = fsspec.core.url_to_fs(url, **self.storage_kwargs)

    @classmethod
    def fsspec_kwargs(cls, options: StorageOptions) -> dict[str, Any]:
        return {}

    @staticmethod
    def classify_error(exc: BaseException) -> BaseException | None:
        return None

    def read(self, path: str, start: int | None = None, end: int | None = None) -> bytes:
        return bytes(self.fs.cat_file(path, start=start, end=end))

    def open_read(self, path: str, block_size: int) -> BinaryIO:
        fh: BinaryIO = self.fs.open(path, "rb", block_size=block_size)
        return fh

    def write(self, path: str, data: bytes) -> None:
        self.fs.pipe_file(path, data)

    def exists(self, path: str) -> bool:
        self.fs.invalidate_cache(path)  # s3fs answers from a cached parent listing otherwise
        return bool(self.fs.exists(path))

    def size_bytes(self, path: str) -> int:
        self.fs.invalidate_cache(path)
        return int(self.fs.size(path))

    def list_names(self, path: str) -> list[str]:
        self.fs.invalidate_cache(path)
        entries = self.fs.ls(path, detail=False)
        return sorted({posixpath.basename(e.rstrip("/")) for e in entries})

    def remove(self, path: str, recursive: bool) -> None:
        try:
            self.fs.rm(path, recursive=recursive)
        except FileNotFoundError:
            pass

    def open_upload(self, path: str, settings: UploadSettings) -> Upload:
        return WholeUpload(self.fs, path, settings.part_size_bytes, settings.retry)

    def clear_multipart_uploads(self, path: str) -> int:
        return 0  # no multipart uploads outside S3

    def pending_uploads(self, path: str) -> dict[str, float]:
        return {}

    def local_path(self, path: str) -> str | None:
        return None


class WholeUpload:
    """Bytes collected in memory up to ``memory_bytes``, past that in a local temp file, and
    stored as one whole object on commit (``pipe_file``, or ``put_file`` from the temp file),
    the whole store retried: for filesystems without a streaming write that is all or nothing."""

    def __init__(self, fs: Any, path: str, memory_bytes: int, retry: Retry) -> None:
        self._fs, self._path, self._memory_bytes, self._retry = fs, path, memory_bytes, retry
        self._buffer: bytearray | None = bytearray()
        self._spill: Any = None  # a NamedTemporaryFile once the bytes outgrow memory_bytes

    def write(self, data: memoryview) -> None:
        if self._spill is not None:
            self._spill.write(data)
            return
        if self._buffer is None:
            raise ValueError(f"upload of {self._path} is already finished")
        self._buffer += data
        if len(self._buffer) > self._memory_bytes:
            self._spill = tempfile.NamedTemporaryFile(prefix="ftrain-upload-")  # closed by abort
            self._spill.write(self._buffer)
            self._buffer = bytearray()

    def commit(self) -> None:
        name = posixpath.basename(self._path)
        if self._spill is not None:
            self._spill.flush()
            spill_name = self._spill.name
            self._retry(lambda: self._fs.put_file(spill_name, self._path), f"upload {name}")
        elif self._buffer is not None:
            data = bytes(self._buffer)
            self._retry(lambda: self._fs.pipe_file(self._path, data), f"upload {name}")
        else:
            raise ValueError(f"upload of {self._path} is already finished")
        self.abort()  # only frees the local copy now

    def abort(self) -> None:
        self._buffer = None
        if self._spill is not None:
            spill, self._spill = self._spill, None
            try:
                spill.close()
            except OSError:
                pass


BACKEND = FsspecBackend
