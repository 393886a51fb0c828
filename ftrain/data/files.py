"""The files :mod:`ftrain.data` writes and the fingerprint it takes of the files it reads.

- :func:`check_output` judges an output path before any work: its directory exists and can be
  written, and the path is not a directory (``ftrain data tokenize --out``: said at once, not
  after minutes of tokenizing).
- :func:`atomic_output` writes a file whole or not at all: a temporary file beside it, created
  with :func:`ftrain.contract.local_files.create_new` (``O_CREAT | O_EXCL | O_NOFOLLOW``, a
  random name: a link or a file someone planted under a predictable name in a shared directory
  makes the create fail, never writes through it), fsynced, then renamed over the final name
  (a rename replaces a link there, it never follows it).
- :func:`fingerprint` is a cheap identity of a file: its size and an xxh3 digest of its first
  and last :data:`FINGERPRINT_BLOCK_BYTES` (never a full read of a terabyte corpus). It tells a
  rewritten, truncated or appended file from the one a record or a checkpoint was made for; an
  edit confined to the middle of a large file escapes it.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import xxhash

from ftrain.contract.local_files import create_new
from ftrain.data.errors import DataError

#: bytes read at each end of a file for its :func:`fingerprint`
FINGERPRINT_BLOCK_BYTES = 64 * 1024
_CREATE_TRIES = 8


def fingerprint(path: str | os.PathLike, size_bytes: int | None = None) -> str:
    """``"xxh3-128:<hex>"`` of the file's size and its first and last 64 KiB."""
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size if size_bytes is None else int(size_bytes)
        h = xxhash.xxh3_128(size.to_bytes(8, "little"))
        h.update(fh.read(FINGERPRINT_BLOCK_BYTES))
        if size > FINGERPRINT_BLOCK_BYTES:
            fh.seek(max(FINGERPRINT_BLOCK_BYTES, size - FINGERPRINT_BLOCK_BYTES))
            h.update(fh.read(FINGERPRINT_BLOCK_BYTES))
    return "xxh3-128:" + h.hexdigest()


def check_output(path: str | os.PathLike, what: str) -> Path:
    """``path`` as an output that can be written; DataError naming ``what`` (``--out``) and the fix."""
    out = Path(path)
    if not out.name or out.name in (".", ".."):
        raise DataError(f"{what} {str(path)!r} names a directory; give the path of the file to write")
    parent = out.parent
    try:
        st = os.stat(parent)
    except FileNotFoundError:
        raise DataError(
            f"{what} {str(path)!r}: directory {str(parent)!r} does not exist; create it (mkdir -p {parent})"
        ) from None
    except OSError as e:
        raise DataError(f"{what} {str(path)!r}: directory {str(parent)!r} cannot be used ({e})") from e
    if not stat.S_ISDIR(st.st_mode):
        raise DataError(f"{what} {str(path)!r}: {str(parent)!r} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise DataError(
            f"{what} {str(path)!r}: directory {str(parent)!r} is not writable by this user; choose another {what}"
        )
    if out.is_dir():
        raise DataError(f"{what} {str(path)!r} is an existing directory; give the path of a file (e.g. {out}/data.bin)")
    return out


def _create_temp(final: Path) -> tuple[Path, int]:
    """A new temporary file beside ``final`` (random name, O_EXCL|O_NOFOLLOW): (path, fd)."""
    for _ in range(_CREATE_TRIES):
        tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}-{secrets.token_hex(6)}")
        try:
            return tmp, create_new(tmp)
        except FileExistsError:
            continue  # someone else's file (or link) under that name: never touched, try another
        except OSError as e:
            raise DataError(f"cannot create a file in {str(final.parent)!r} to write {str(final)!r}: {e}") from e
    raise DataError(f"cannot create a temporary file beside {str(final)!r}: every name tried exists")


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike) -> Iterator[BinaryIO]:
    """A binary file to write ``path`` through: on a normal exit it is fsynced and renamed over
    ``path``; on an exception it is removed and ``path`` is left as it was."""
    final = Path(path)
    tmp, fd = _create_temp(final)
    try:
        with os.fdopen(fd, "wb") as fh:
            yield fh
            fh.flush()
            os.fchmod(fh.fileno(), 0o666 & ~_umask())  # created 0600: the mode a plain open() would give
            os.fsync(fh.fileno())
        try:
            os.replace(tmp, final)
        except OSError as e:
            raise DataError(f"cannot write {str(final)!r}: {e}") from e
        _fsync_dir(final.parent)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def _umask() -> int:
    """This process's umask, read without changing it (``/proc``); 0o022 where it cannot be read."""
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    return 0o022


def _fsync_dir(directory: Path) -> None:
    with contextlib.suppress(OSError):  # some filesystems cannot fsync a directory: the rename stands
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
