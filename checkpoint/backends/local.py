"""Local files (``file://`` URLs and plain paths), written durably.

What must stay true: a write creates parent directories, writes a temp file beside the target,
fsyncs it, renames it into place and fsyncs the directory, so after it returns the object is
whole and survives a power loss, and a crash before leaves the old object (or none) plus at most
a temp file; listings never show those temp files.
"""

from __future__ import annotations

import os
import posixpath
import re
import shutil
import uuid
from typing import BinaryIO, ClassVar

import fsspec

from checkpoint.backends.generic import FsspecBackend

#: In-flight temp files of :func:`write_local_atomic`, hidden from listings.
_LOCAL_TMP_NAME = re.compile(r"\.tmp-[0-9a-f]{32}$")


class LocalBackend(FsspecBackend):
    """A directory on a local filesystem."""

    schemes: ClassVar[tuple[str, ...]] = ("file", "local")

    def write(self, path: str, data: bytes) -> None:
        write_local_atomic(path, data)

    def list_names(self, path: str) -> list[str]:
        return [n for n in super().list_names(path) if not _LOCAL_TMP_NAME.search(n)]

    def local_path(self, path: str) -> str | None:
        return str(fsspec.core.strip_protocol(str(path)))


def write_local_atomic(path: str, data: bytes | BinaryIO) -> None:
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


BACKEND = LocalBackend
