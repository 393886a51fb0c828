"""A node-local disk copy of the newest committed step (``checkpoint.local_cache_dir``).

Every file a rank writes into a step is also written, as it streams to storage, under
``<local_cache_dir>/<key>/<step dir>/`` (``<key>``: a hash of the checkpoint URL, so that jobs
sharing a node and a cache directory never read each other's files; ``source.txt`` beside the
step directories names the URL). A load reads what the cache holds before it asks storage: a
cached file is used only when its size is the manifest's, and each block of it only once its
digest matches the manifest's (:mod:`checkpoint.fetch` checks it exactly as it checks bytes
from storage), so the cache needs no trust: a damaged, stale or foreign file is read from
storage instead and dropped from the cache. The manifest itself always comes from storage: it
is the commit point, and a step no manifest commits is never read from here.

After a commit only that step is kept. The cache is best effort: a full disk or any other
local error drops the file from the cache (logged once per file) and never fails a save or a
load. A file in the cache is complete: it is written as ``<name>.partial`` and renamed into
place once its upload has succeeded.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from checkpoint.manifest import parse_step_dir

log = logging.getLogger(__name__)

_PARTIAL_SUFFIX = ".partial"


def cache_root(local_cache_dir: str, url: str) -> str:
    """Where the cache of checkpoint root ``url`` lives under ``local_cache_dir``."""
    key = hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:16]
    return os.path.join(os.path.abspath(os.path.expanduser(local_cache_dir)), key)


@dataclass(frozen=True, slots=True)
class LocalCache:
    """The cache of one checkpoint root (picklable: a process-mode save carries it)."""

    root: str
    url: str

    @classmethod
    def open(cls, local_cache_dir: str, url: str) -> LocalCache:
        cache = cls(cache_root(local_cache_dir, url), url)
        try:
            os.makedirs(cache.root, exist_ok=True)
            source = os.path.join(cache.root, "source.txt")
            if not os.path.exists(source):
                with open(source, "w") as fh:
                    fh.write(url + "\n")
        except OSError as e:
            log.warning("checkpoint.local_cache_dir %s is not usable (%s): it stays empty", local_cache_dir, e)
        return cache

    def step(self, dirname: str) -> StepCache:
        return StepCache(os.path.join(self.root, dirname))

    def keep_only(self, dirname: str) -> None:
        """Drop every cached step but ``dirname`` (the one just committed or loaded)."""
        try:
            names = os.listdir(self.root)
        except OSError:
            return
        for name in names:
            if parse_step_dir(name) is not None and name != dirname:
                shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)


@dataclass(frozen=True, slots=True)
class StepCache:
    """One step directory's cached files."""

    path: str

    def size_bytes(self, name: str) -> int | None:
        """The cached size of ``name``, or None when it is not cached."""
        try:
            return os.stat(os.path.join(self.path, name)).st_size
        except OSError:
            return None

    def read_range(self, name: str, start: int, end: int) -> bytes:
        """Bytes ``start..end`` of cached file ``name`` (fewer if it is shorter); OSError if gone."""
        with open(os.path.join(self.path, name), "rb") as fh:
            return os.pread(fh.fileno(), end - start, start)

    def discard(self, name: str) -> None:
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(self.path, name))

    @contextlib.contextmanager
    def writing(self, name: str) -> Iterator[CacheFile]:
        """A file to copy ``name``'s bytes into as they are stored; it enters the cache only when
        the block ends without an error (the file was stored), else it is removed."""
        out = CacheFile(os.path.join(self.path, name))
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
    """A cached file being written: a local error turns it off instead of failing the save."""

    def __init__(self, path: str):
        self._path = path
        self._fh: Any = None
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            self._fh = open(path + _PARTIAL_SUFFIX, "wb")
        except OSError as e:
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
            self._fh.close()
            os.replace(self._path + _PARTIAL_SUFFIX, self._path)
        except OSError as e:
            self._give_up(e)
        self._fh = None

    def abandon(self) -> None:
        if self._fh is not None:
            with contextlib.suppress(OSError):
                self._fh.close()
            self._fh = None
        with contextlib.suppress(OSError):
            os.unlink(self._path + _PARTIAL_SUFFIX)

    def _give_up(self, err: OSError) -> None:
        log.warning("local checkpoint cache: not keeping %s (%s)", self._path, err)
        self.abandon()


__all__ = ["LocalCache", "StepCache", "CacheFile", "cache_root"]
