"""What the memory tier keeps in this host's memory, and what it gives back.

The tier's saves write to fsspec's in-process memory filesystem (``memory://``): the
:class:`Publisher` keeps the manifest of such a save in memory, :func:`take_files` hands the files
over without a copy, :func:`drop_files` clears what is left. Freed staging buffers go back to the
OS (:func:`give_back_freed`: glibc keeps small freed blocks resident), and buffers a peer's
sizes would make larger than the host's available memory are refused before they are allocated
(:func:`too_big_to_receive`).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import time
from typing import Any

import fsspec

from ftrain.checkpoint.manifest import FileEntry, Manifest

log = logging.getLogger(__name__)


def too_big_to_receive(size_bytes: int, rank: int) -> str:
    """Why this rank cannot take ``size_bytes`` from its peers ("" when it can): the sizes come
    from a snapshot's manifest, read from a node-local directory, and buffers are allocated from
    them before any byte arrives; more than the host's available memory is refused, not tried."""
    available = available_memory_bytes()
    if available is not None and size_bytes > available:
        return f"rank {rank} would receive {size_bytes} bytes, more than its host's {available} available"
    return ""


@functools.cache
def _malloc_trim() -> Any:
    """glibc's ``malloc_trim`` (None elsewhere)."""
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def give_back_freed() -> None:
    """Hand the heap's free pages back to the OS. A staged copy of the state is many tensors,
    most below glibc's mmap threshold: freed, they stay in malloc's arenas, resident, and the
    host would count a third copy of the state that the tier no longer holds."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def available_memory_bytes() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (None where it cannot be read)."""
    try:
        with open("/proc/meminfo", "rb") as fh:
            for line in fh:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


class Publisher:
    """The coordinator's end of a snapshot's DCP save: the manifest, in memory (picklable)."""

    def __init__(self, fields: dict[str, Any], hmac_key: bytes | None = None):
        self.fields = fields
        self.hmac_key = hmac_key
        self.manifest_bytes: bytes | None = None

    def prepare(self) -> None:
        return None

    def commit(self, files: dict[str, FileEntry]) -> None:
        self.manifest_bytes = Manifest(files=files, created_time=time.time(), **self.fields).to_json(self.hmac_key)


def take_files(url: str) -> dict[str, bytes]:
    """The files this process wrote under ``url`` (memory://), taken out of the memory
    filesystem: a file's bytes are handed over, not copied (a copy of a rank's files beside
    them is the memory the tier must not hold)."""
    fs, path = fsspec.core.url_to_fs(url)
    names = [p.rsplit("/", 1)[-1] for p in fs.ls(path, detail=False)] if fs.exists(path) else []
    files = {}
    for name in names:
        held = getattr(fs, "store", {}).pop(f"{path}/{name}", None)
        # a MemoryFile is a BytesIO: getvalue() hands over its buffer while nothing else views it
        files[name] = held.getvalue() if held is not None else fs.cat_file(f"{path}/{name}")
    fs.rm(path, recursive=True)
    return files


def drop_files(url: str) -> None:
    """Remove what is left under ``url`` (memory://), if anything; best effort."""
    try:
        fs, path = fsspec.core.url_to_fs(url)
        if fs.exists(path):
            fs.rm(path, recursive=True)
    except Exception as e:  # noqa: BLE001 - memory it may keep; nothing else depends on it
        log.debug("memory tier: could not drop %s: %s", url, e)
