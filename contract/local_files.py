"""Node-local files that the job writes and reads back later (the memory tier's
``checkpoint.memory_dir``, the ``checkpoint.local_cache_dir``, the flight records in the run
dir, read by the agent): a directory only this user can
write, files opened without following links, reads of regular files only and never more bytes
than asked for.

Such directories sit where other local users may write too (``/dev/shm``, ``/tmp``) under names
anyone can predict, so nothing found there is trusted:

- :func:`private_dir` creates a directory ``0700`` (and any missing parents below an existing
  one, also ``0700``), or accepts an existing one only if it is a real directory (not a link),
  owned by this user and not writable by group or others, inside a parent that others cannot
  rename it out of (not writable by them, or sticky, as ``/tmp`` and ``/dev/shm`` are).
  Anything else is a :class:`UnsafeLocalDirError` that names the setting, the path and the fix.
- :func:`create_new` opens a new file ``0600`` with ``O_CREAT | O_EXCL | O_NOFOLLOW``: a link or
  a file planted under the name makes it fail instead of writing through it.
- :func:`replace_file` writes a whole file through such a new file under a random name beside it,
  then renames it over the name (a rename replaces a link, it never follows one).
- :func:`open_append` opens a log to append to without following a link: a regular file of this
  user's, created if missing; a link, a FIFO or someone else's file there is an OSError.
- :func:`read_regular` reads at most ``limit_bytes + 1`` bytes of a regular file opened with
  ``O_NOFOLLOW | O_NONBLOCK``: a link, FIFO, device or directory is an :class:`OSError`, never
  a hang or an unbounded read.

What must stay true: every path the job writes under these directories is created by the job
itself, and every read is bounded by a size the caller already trusts (a manifest's).
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


class UnsafeLocalDirError(OSError):
    """A node-local directory the job would use can be written, or replaced, by someone else."""

    def __init__(self, setting: str, path: Path, problem: str):
        self.setting, self.path, self.problem = setting, path, problem
        super().__init__(
            f"{setting}: {path} {problem}; other local users could plant or read files there. Remove it "
            f"(rm -rf {path}) to let this job create it (mode 0700), or choose another {setting}"
        )


def _problem(st: os.stat_result) -> str:
    """Why a directory's own status makes it unsafe ("" if it is fine)."""
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if st.st_uid != os.geteuid():
        return f"is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})"
    return ""


def _parent_problem(parent: Path) -> str:
    """Why others could rename a directory out of ``parent`` and put theirs in ("" if not)."""
    st = os.stat(parent)
    if not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return ""
    if not st.st_mode & stat.S_ISVTX:
        return f"is inside {parent}, which group or others may write and which is not sticky"
    if st.st_uid not in (0, os.geteuid()):  # a sticky directory's owner may still rename anything in it
        return f"is inside {parent}, which others may write and which belongs to uid {st.st_uid}"
    return ""


def private_dir(path: str | Path, setting: str) -> Path:
    """``path`` as a directory only this user can write (see the module doc), created ``0700``
    with its missing parents; :class:`UnsafeLocalDirError` if an existing one is not safe,
    :class:`OSError` if it cannot be created."""
    path = Path(os.path.abspath(os.path.expanduser(str(path))))
    missing = []
    probe = path
    while not os.path.lexists(probe):
        missing.append(probe)
        probe = probe.parent
    for new in reversed(missing):
        try:
            os.mkdir(new, 0o700)
        except FileExistsError:
            pass  # made meanwhile (another rank of this node): checked below like any existing one
    st = os.lstat(path)
    problem = _problem(st) or _parent_problem(path.parent)
    if problem:
        raise UnsafeLocalDirError(setting, path, problem)
    if missing:
        os.chmod(path, 0o700)  # checked above: a directory of ours, not a link
    return path


def create_new(path: str | Path) -> int:
    """A file descriptor for writing a new file ``path`` (``0600``); FileExistsError if anything,
    a link included, is there already."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, 0o600)


def replace_file(path: str | os.PathLike[str], data: bytes, mode: int = 0o644) -> None:
    """Write ``data`` as the whole of ``path``, at once: a new file beside it (:func:`create_new`,
    a random name), given ``mode`` (less the umask's bits is the caller's business), then renamed
    over ``path``. Nothing is written through a link planted under either name."""
    path = Path(path)
    for _ in range(8):
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
        try:
            fd = create_new(tmp)
            break
        except FileExistsError:
            continue  # someone else's name: never touched
    else:
        raise FileExistsError(f"no free temporary name beside {path}")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            os.fchmod(fh.fileno(), mode)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def open_append(path: str | os.PathLike[str], mode: int = 0o644) -> int:
    """A file descriptor appending to ``path``: created (``mode``) if missing, else a regular file
    this user owns; OSError for a link, a FIFO, a device or another user's file."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | _NOFOLLOW | _NONBLOCK | _CLOEXEC, mode)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(f"{path} is not a regular file")
        if st.st_uid != os.geteuid():
            raise OSError(f"{path} belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()})")
        if _NONBLOCK:
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_regular(path: str | Path) -> int:
    """A file descriptor for reading the regular file ``path``; OSError for a link, a FIFO, a
    device, a directory or a missing file."""
    fd = os.open(path, os.O_RDONLY | _NOFOLLOW | _NONBLOCK | _CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path} is not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_regular(path: str | Path, limit_bytes: int) -> bytes:
    """At most ``limit_bytes + 1`` bytes of the regular file ``path`` (one more than the caller
    expects shows that it is too long without reading all of it); OSError as :func:`open_regular`."""
    fd = open_regular(path)
    try:
        chunks, left = [], limit_bytes + 1
        while left > 0:
            chunk = os.read(fd, min(left, 8 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


__all__ = [
    "UnsafeLocalDirError",
    "create_new",
    "open_append",
    "open_regular",
    "private_dir",
    "read_regular",
    "replace_file",
]
