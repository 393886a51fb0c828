"""Local files (``file://`` URLs and plain paths), written durably.

What must stay true: a write creates parent directories, writes a temp file beside the target,
fsyncs it, renames it into place and fsyncs the directory, so after it returns the object is
whole and survives a power loss, and a crash before leaves the old object (or none) plus at most
a temp file; listings never show those temp files. A streamed upload (:class:`LocalUpload`)
writes its bytes straight into that temp file as they come (no copy in memory first).
"""

from __future__ import annotations

import os
import posixpath
import re
import uuid
from typing import BinaryIO, ClassVar

import fsspec

from ftrain.checkpoint.backends import Upload, UploadSettings
from ftrain.checkpoint.backends.generic import FsspecBackend

#: In-flight temp files of :class:`LocalUpload`, hidden from listings.
_LOCAL_TMP_NAME = re.compile(r"\.tmp-[0-9a-f]{32}$")


class LocalBackend(FsspecBackend):
    """A directory on a local filesystem."""

    schemes: ClassVar[tuple[str, ...]] = ("file", "local")

    def write(self, path: str, data: bytes) -> None:
        write_local_atomic(path, data)

    def open_upload(self, path: str, settings: UploadSettings) -> Upload:
        return LocalUpload(str(fsspec.core.strip_protocol(str(path))))

    def list_names(self, path: str) -> list[str]:
        return [n for n in super().list_names(path) if not _LOCAL_TMP_NAME.search(n)]

    def local_path(self, path: str) -> str | None:
        return str(fsspec.core.strip_protocol(str(path)))


class LocalUpload:
    """A file written through a temp file beside it: ``commit`` fsyncs it, renames it over
    ``path`` and fsyncs the directory; ``abort`` removes it (and the renamed file too when the
    commit failed after the rename: a write that raised leaves no object). Parents are created
    at the start."""

    def __init__(self, path: str) -> None:
        self._path = path
        self._parent = posixpath.dirname(path) or "."
        os.makedirs(self._parent, exist_ok=True)
        self._tmp = f"{path}.tmp-{uuid.uuid4().hex}"
        self._fh: BinaryIO | None = open(self._tmp, "xb")  # closed by commit or abort
        self._renamed = self._committed = False

    def write(self, data: memoryview) -> None:
        if self._fh is None:
            raise ValueError(f"upload of {self._path} is already finished")
        self._fh.write(data)

    def commit(self) -> None:
        if self._fh is None:
            raise ValueError(f"upload of {self._path} is already finished")
        fh, self._fh = self._fh, None
        try:
            fh.flush()
            os.fsync(fh.fileno())
        finally:
            fh.close()
        os.replace(self._tmp, self._path)
        self._renamed = True
        fsync_dir(self._parent)
        self._committed = True

    def abort(self) -> None:
        if self._committed:
            return
        if self._fh is not None:
            fh, self._fh = self._fh, None
            try:
                fh.close()
            except OSError:
                pass
        for leftover in (self._path,) if self._renamed else (self._tmp,):
            try:
                os.unlink(leftover)
            except OSError:
                pass


def write_local_atomic(path: str, data: bytes) -> None:
    """Create parents, write a temp file beside ``path``, fsync, rename over it, fsync the dir."""
    upload = LocalUpload(path)
    try:
        upload.write(memoryview(data))
        upload.commit()
    except BaseException:
        upload.abort()
        raise


def fsync_dir(path: str) -> None:
    """fsync a local directory, so that renames and new names inside it survive a power loss."""
    dir_fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


BACKEND = LocalBackend
