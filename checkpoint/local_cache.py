"""A node-local disk copy of the newest committed step (``checkpoint.local_cache_dir``).

Every file a rank writes into a step is also written, as it streams to storage, under
``<local_cache_dir>/<key>/<step dir>/`` (``<key>``: a hash of the checkpoint URL, so that jobs
sharing a node and a cache directory never read each other's files; ``source.txt`` beside the
step directories names the URL). A load reads what the cache holds before it asks storage: a
cached file is used only when its size is the manifest's, and each block of it only once its
digest matches the manifest's (:mod:`ftrain.checkpoint.fetch` checks it exactly as it checks bytes
from storage), so the cache needs no trust for what it *returns*: a damaged, stale or foreign
file is read from storage instead and dropped from the cache. The manifest itself always comes
from storage: it is the commit point, and a step no manifest commits is never read from here.

What the cache must not do is let someone else steer the job's own writes, deletes or reads
(the directory may sit in ``/tmp`` under a name anyone can predict). So, with
:mod:`ftrain.contract.local_files` (the one implementation of node-local file safety):

- ``<local_cache_dir>/<key>`` and each step directory are private (:func:`private_dir`: created
  ``0700``; an existing one must be a real directory of this user that group and others cannot
  write, in a parent they cannot rename it out of). An unsafe or unusable root turns the cache
  off for this process with one warning that names ``checkpoint.local_cache_dir``, the path and
  the fix; saves and loads go on without it.
- A file is written under a fresh unpredictable name (``<name>.<random>.partial``) created with
  ``O_EXCL | O_NOFOLLOW`` (:func:`create_new`, mode ``0600``) and renamed over ``<name>`` once
  its upload succeeded: a link planted under any name is never written through (a rename
  replaces a link, it does not follow it).
- Sizes are taken with ``lstat`` and ranges read from regular files opened without following
  links and without blocking (:func:`open_regular`): a link, FIFO, device or directory at a
  file's name is "not cached" (storage serves it), never a hang or a read outside the cache.
- Removal never follows a link: a link or other non-directory where a step directory should be
  is unlinked itself, and directories are removed by ``shutil.rmtree``'s fd-based walk (which
  unlinks links inside rather than descending them).

After a commit only that step is kept. The cache is best effort: a full disk or any other
local error drops the file from the cache (logged once per file) and never fails a save or a
load.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import secrets
import shutil
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ftrain.checkpoint.manifest import parse_step_dir
from ftrain.contract.local_files import UnsafeLocalDirError, create_new, open_regular, private_dir

log = logging.getLogger(__name__)

SETTING = "checkpoint.local_cache_dir"
_PARTIAL_SUFFIX = ".partial"


def cache_root(local_cache_dir: str, url: str) -> str:
    """Where the cache of checkpoint root ``url`` lives under ``local_cache_dir``."""
    key = hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:16]
    return os.path.join(os.path.abspath(os.path.expanduser(local_cache_dir)), key)


def _remove_entry(path: str) -> None:
    """Remove what is at ``path`` without following a link: a directory by rmtree's fd-based
    walk, anything else (a link, a file, a FIFO) by unlinking the name itself."""
    try:
        st = os.lstat(path)
    except OSError:
        return
    if stat.S_ISDIR(st.st_mode) and shutil.rmtree.avoids_symlink_attacks:
        shutil.rmtree(path, ignore_errors=True)
    elif not stat.S_ISDIR(st.st_mode):
        with contextlib.suppress(OSError):
            os.unlink(path)


@dataclass(frozen=True, slots=True)
class LocalCache:
    """The cache of one checkpoint root (picklable: a process-mode save carries it).
    ``usable`` is False when the root was refused or could not be made: every step of it is
    then empty and every write a no-op."""

    root: str
    url: str
    usable: bool = True

    @classmethod
    def open(cls, local_cache_dir: str, url: str) -> LocalCache:
        root = cache_root(local_cache_dir, url)
        try:
            private_dir(root, SETTING)
            with contextlib.suppress(FileExistsError):
                fd = create_new(os.path.join(root, "source.txt"))
                with os.fdopen(fd, "w") as fh:
                    fh.write(url + "\n")
        except UnsafeLocalDirError as e:
            log.warning("the local checkpoint cache is OFF: %s", e)
            return cls(root, url, usable=False)
        except OSError as e:
            log.warning(
                "the local checkpoint cache is OFF: %s=%s cannot be used (%s); fix it or set %s to "
                "another directory (or to empty to silence this)",
                SETTING,
                local_cache_dir,
                e,
                SETTING,
            )
            return cls(root, url, usable=False)
        return cls(root, url)

    def step(self, dirname: str) -> StepCache:
        return StepCache(os.path.join(self.root, dirname), self.usable)

    def keep_only(self, dirname: str) -> None:
        """Drop every cached step but ``dirname`` (the one just committed or loaded), and the
        unfinished files of writers that died in it."""
        if not self.usable:
            return
        try:
            names = os.listdir(self.root)
        except OSError:
            return
        for name in names:
            if parse_step_dir(name) is not None and name != dirname:
                _remove_entry(os.path.join(self.root, name))
        kept = os.path.join(self.root, dirname)
        with contextlib.suppress(OSError):
            if stat.S_ISDIR(os.lstat(kept).st_mode):
                for name in os.listdir(kept):
                    if name.endswith(_PARTIAL_SUFFIX):
                        _remove_entry(os.path.join(kept, name))


@dataclass(frozen=True, slots=True)
class StepCache:
    """One step directory's cached files."""

    path: str
    usable: bool = True

    def size_bytes(self, name: str) -> int | None:
        """The cached size of ``name``, or None when no regular file of that name is cached
        (a link, FIFO, device or directory there is not a cached file)."""
        if not self.usable:
            return None
        try:
            st = os.lstat(os.path.join(self.path, name))
        except OSError:
            return None
        return st.st_size if stat.S_ISREG(st.st_mode) else None

    def read_range(self, name: str, start: int, end: int) -> bytes:
        """Bytes ``start..end`` of cached file ``name`` (fewer if it is shorter); OSError if it
        is gone or is no longer a regular file (a link is never followed)."""
        if not self.usable:
            raise OSError(f"the local cache is off: {name} is not cached")
        fd = open_regular(os.path.join(self.path, name))
        try:
            return os.pread(fd, end - start, start)
        finally:
            os.close(fd)

    def discard(self, name: str) -> None:
        if self.usable:
            _remove_entry(os.path.join(self.path, name))

    @contextlib.contextmanager
    def writing(self, name: str) -> Iterator[CacheFile]:
        """A file to copy ``name``'s bytes into as they are stored; it enters the cache only when
        the block ends without an error (the file was stored), else it is removed."""
        out = CacheFile(os.path.join(self.path, name), self.usable)
        try:
            yield out
        except BaseException:
            out.abandon()
            raise
        out.keep()

    def write_bytes(self, name: str, data: bytes | memoryview) -> None:
        """Cache ``name`` (already stored) whole."""
        with self.writing(name) as out:
            out.write(data)


class CacheFile:
    """A cached file being written (under a fresh unpredictable name, created without following
    links): a local error turns it off instead of failing the save."""

    def __init__(self, path: str, usable: bool = True):
        self._path = path
        self._partial = f"{path}.{secrets.token_hex(8)}{_PARTIAL_SUFFIX}"
        self._fh: Any = None
        self._created = False  #: ``_partial`` is ours to remove
        if not usable:
            return
        try:
            private_dir(os.path.dirname(path), SETTING)
            fd = create_new(self._partial)
            self._created = True
            self._fh = os.fdopen(fd, "wb")
        except OSError as e:  # UnsafeLocalDirError included
            self._give_up(e)

    def write(self, data: bytes | memoryview) -> None:
        if self._fh is None:
            return
        try:
            self._fh.write(data)
        except OSError as e:
            self._give_up(e)

    def keep(self) -> None:
        if self._fh is None:
            return
        try:
            fh, self._fh = self._fh, None
            fh.close()
            os.replace(self._partial, self._path)  # replaces whatever is at the name, link or not
            self._created = False
        except OSError as e:
            self._give_up(e)

    def abandon(self) -> None:
        if self._fh is not None:
            with contextlib.suppress(OSError):
                self._fh.close()
            self._fh = None
        if self._created:
            self._created = False
            with contextlib.suppress(OSError):
                os.unlink(self._partial)

    def _give_up(self, err: Exception) -> None:
        log.warning("local checkpoint cache: not keeping %s (%s)", self._path, err)
        self.abandon()


__all__ = ["LocalCache", "StepCache", "CacheFile", "cache_root", "SETTING"]
