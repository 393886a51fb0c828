"""Any fsspec filesystem no other backend claims (``memory://``, ``gs://``, ...), and the base
the other fsspec-based backends refine.

What must stay true: :meth:`FsspecBackend.write` is one ``pipe_file`` call (a whole object,
never a buffered file whose ``close()`` after a failed ``write()`` could commit a truncated
one); metadata calls drop fsspec's listing cache for the path first.
"""

from __future__ import annotations

import posixpath
from typing import TYPE_CHECKING, Any, BinaryIO, ClassVar

import fsspec

from checkpoint.backends import ANY_SCHEME

if TYPE_CHECKING:
    from checkpoint.storage import StorageOptions


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

    def clear_multipart_uploads(self, path: str) -> int:
        return 0  # no multipart uploads outside S3

    def local_path(self, path: str) -> str | None:
        return None


BACKEND = FsspecBackend
