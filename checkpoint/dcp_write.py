"""DCP storage glue, writing: a writer that digests every file as it streams out.

The writer wraps the filesystem's ``create_stream`` so each file's bytes pass through a hasher
on their way to storage (no second read) and stream straight into a
:meth:`ftrain.checkpoint.storage.Storage.open_upload`: on S3, parts upload in the background while DCP
serialises the next bytes (a file of at most one part, ``.metadata`` among them, is one PUT from
memory); on local disk the bytes go straight into the temp file that is renamed into place. No
file is staged locally first. A failure while writing (in DCP or in storage) aborts that file's
upload, so no object appears. Each rank's digests ride back to the coordinator on
DCP's own gather of write results; the coordinator's ``finish`` writes ``.metadata`` (also
digested) and the writer's ``extra_files`` (a caller's own files of the step, e.g. a Session's
``user_state.json``: written whole and digested like the rest), and then hands the complete file
table to a committer, which writes the manifest. If any rank fails, DCP's gather fails first and
no manifest is written.

FACTS.md traps handled here: storage options are passed to the writer and ``checkpoint_id``
is never set (``reset()`` would drop them); ``sync_files=False`` (S3 files have no fileno, and
the fallback is a host-wide ``os.sync()``). A step is never overwritten: DCP's own check looks
only for ``.metadata``, so the publisher's ``prepare`` refuses a committed step and clears a
torn one before any rank writes (DCP runs with ``overwrite=True`` and its own look for an
earlier ``.metadata`` is switched off: it would only warn "overwriting" before the publisher refuses).
On a local filesystem every written file is fsynced and renamed into place, and its directory
fsynced, before the manifest can commit the step. DCP's ``.metadata.tmp`` is never stored: it
is held in memory (digested) until DCP renames it, and the rename writes ``.metadata`` whole.
Reading is :mod:`ftrain.checkpoint.dcp_read`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import posixpath
import threading
from collections.abc import Iterator
from typing import Any, Protocol

from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from ftrain.checkpoint.digest import BLOCKS_SUFFIX, BlockHasher, digest_bytes
from ftrain.checkpoint.errors import ChecksumMismatchError
from ftrain.checkpoint.local_cache import CacheFile, StepCache
from ftrain.checkpoint.manifest import MANIFEST_NAME, FileEntry
from ftrain.checkpoint.safe_pickle import METADATA_NAME
from ftrain.checkpoint.storage import Storage, StorageOptions

#: what a file's writes are gathered into before they are digested and stored
WRITE_BUFFER_BYTES = 1 << 20

#: the niceness a background save runs at: under CPU contention the training steps go first
BACKGROUND_NICE = 10


def yield_to_training() -> None:
    """Run the calling thread at a lower CPU priority, if it is a background one (an async save's
    thread: serialising, hashing and uploading): a save must not slow the steps beside it more
    than the cores allow. The training (main) thread is never touched; nor is a thread already
    lowered (niceness is per thread on Linux; elsewhere this does nothing)."""
    if threading.current_thread() is threading.main_thread() or not hasattr(os, "setpriority"):
        return
    tid = threading.get_native_id()
    try:
        if os.getpriority(os.PRIO_PROCESS, tid) < BACKGROUND_NICE:
            os.setpriority(os.PRIO_PROCESS, tid, BACKGROUND_NICE)
    except OSError:  # not permitted here: the save just runs at the training's priority
        pass


class _HashingStream(io.RawIOBase):
    """A write-only stream that hashes what it forwards; refuses to seek backwards."""

    def __init__(self, inner: Any, algorithm: str):
        super().__init__()
        self._inner = inner
        self._hasher = BlockHasher(algorithm)
        self.size_bytes = 0
        self.error: BaseException | None = None
        """What the last failed write raised (torch.save's C++ writer reports it as its own
        RuntimeError, "unexpected pos", losing the storage error)."""

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self._hasher.update(view)
        try:
            self._inner.write(view)
        except BaseException as e:
            self.error = e
            raise
        self.size_bytes += view.nbytes
        return view.nbytes

    def tell(self) -> int:
        return self.size_bytes

    def seek(self, offset: int, whence: int = 0) -> int:
        target = offset if whence == 0 else self.size_bytes + offset if whence == 1 else None
        if target != self.size_bytes:
            raise io.UnsupportedOperation("digesting stream is append-only")
        return self.size_bytes

    def hexdigest(self) -> str:
        return self._hasher.hexdigest()

    def entry(self) -> FileEntry:
        """The manifest's entry for what went through (no block digests)."""
        return FileEntry(self.size_bytes, self.hexdigest())

    def block_digests(self) -> list[str]:
        return self._hasher.block_digests()

    @property
    def block_bytes(self) -> int:
        return self._hasher.block_bytes


#: How DCP names the ``.metadata`` it is writing (``__<rank>.metadata.tmp`` without collectives).
_METADATA_TMP_SUFFIX = METADATA_NAME + ".tmp"


class _MemoryFile:
    """Where a ``.metadata.tmp`` goes: kept in memory until DCP renames it (it is small)."""

    def __init__(self) -> None:
        self.data = bytearray()

    def write(self, data: memoryview) -> None:
        self.data += data


class _Tee:
    """Writes to storage, and the same bytes to the local cache."""

    def __init__(self, upload: Any, copy: CacheFile):
        self._upload = upload
        self._copy = copy

    def write(self, data: memoryview) -> None:
        self._upload.write(data)
        self._copy.write(data)


class _DigestingFileSystem:
    """Delegates to torch's fsspec FileSystem, except that each written file is digested while
    it is produced and streamed to storage through :meth:`Storage.open_upload`: a storage hiccup
    retries one part (S3) or one file, not the whole checkpoint, and a failed write never
    leaves an object behind (nor a half-written one).

    DCP writes ``.metadata`` as ``.metadata.tmp`` and renames it; the temp file is never stored
    (it is held in memory, digested) and the rename writes ``.metadata`` whole, once
    (:meth:`Storage.write_bytes`: one PUT; on local disk fsynced, renamed into place, directory
    fsynced). The other calls DCP makes here (``mkdir``, ``exists``, ``rm_file``) are retried.
    With a ``cache`` (:mod:`ftrain.checkpoint.local_cache`), every stored file is also written there,
    from the same bytes as they stream out."""

    def __init__(self, inner: Any, algorithm: str, storage: Storage, cache: StepCache | None = None):
        self._inner = inner
        self._algorithm = algorithm
        self._storage = storage
        self._cache = cache
        self._lock = threading.Lock()
        self._held: dict[str, tuple[bytes, FileEntry]] = {}
        self.files: dict[str, FileEntry] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    @property
    def inner(self) -> Any:
        """The wrapped torch FileSystem: what a pickled writer carries in place of this one."""
        return self._inner

    @contextlib.contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
        if "w" not in mode:
            with self._inner.create_stream(path, mode) as stream:
                yield stream
            return
        rel = self._relative(path)
        if rel.endswith(_METADATA_TMP_SUFFIX):
            held = _MemoryFile()
            stream = _HashingStream(held, self._algorithm)
            yield stream
            with self._lock:
                self._held[rel] = (bytes(held.data), stream.entry())
            return
        name, entries = posixpath.basename(rel), {}
        with self._caching(name) as copy, self._storage.open_upload(rel) as upload:
            stream = _HashingStream(upload if copy is None else _Tee(upload, copy), self._algorithm)
            # DCP's torch.save of an item writes it in dozens of small pieces (headers, names,
            # padding), and flushes after each item: gathered here, the digest and the upload
            # see about one write per item. DCP closes the stream when done (which flushes it)
            buffered = io.BufferedWriter(stream, WRITE_BUFFER_BYTES)
            try:
                yield buffered
                if not buffered.closed:
                    buffered.flush()
            except BaseException as e:
                if stream.error is not None and stream.error is not e:
                    raise stream.error from e  # the storage error, not torch's "unexpected pos"
                raise
        blocks = stream.block_digests()
        if len(blocks) > 1:  # beside it, what lets a reader verify just the blocks it reads
            listing = json.dumps(blocks).encode()
            self.write_whole(rel + BLOCKS_SUFFIX, listing)
            entries[name + BLOCKS_SUFFIX] = FileEntry(len(listing), digest_bytes(listing, self._algorithm))
            entries[name] = dataclasses.replace(
                stream.entry(), block_bytes=stream.block_bytes, blocks_file=name + BLOCKS_SUFFIX
            )
        else:
            entries[name] = stream.entry()
        with self._lock:  # stored (committed) by now
            self.files.update(entries)

    def rename(self, path: Any, new_path: Any) -> None:
        """DCP renames ``.metadata.tmp`` to ``.metadata``: the held bytes are written under the
        new name, durably on a local filesystem, before the manifest can commit them."""
        rel, new_rel = self._relative(path), self._relative(new_path)
        with self._lock:
            held = self._held.pop(rel, None)
        if held is None:
            raise ValueError(f"DCP renamed {rel}, which this writer did not write")
        data, entry = held
        self.write_whole(new_rel, data)
        with self._lock:
            self.files[posixpath.basename(new_rel)] = entry

    def _caching(self, name: str) -> contextlib.AbstractContextManager[CacheFile | None]:
        """Where the local cache copy of ``name`` goes (None without a cache); it is kept once
        the upload inside it has completed."""
        return contextlib.nullcontext() if self._cache is None else self._cache.writing(name)

    def write_whole(self, rel: str, data: bytes) -> None:
        self._storage.write_bytes(rel, data)
        if self._cache is not None:
            self._cache.write_bytes(posixpath.basename(rel), data)

    def mkdir(self, path: Any) -> None:
        self._storage.retry(lambda: self._inner.mkdir(path), "mkdir")

    def exists(self, path: Any) -> bool:
        return self._storage.exists(self._relative(path))

    def rm_file(self, path: Any) -> None:
        self._storage.remove(self._relative(path))

    def _relative(self, path: Any) -> str:
        """``path`` (DCP joins the writer's URL and a file name) relative to the storage root."""
        path, root = str(path), self._storage.url
        if not path.startswith(root + "/"):
            raise ValueError(f"DCP wrote {path!r}, outside the checkpoint directory {root!r}")
        return path[len(root) + 1 :]


@dataclasses.dataclass(frozen=True)
class DigestedWriteResult(WriteResult):
    """A WriteResult that also carries the digests of the files this rank wrote."""

    file_entries: dict[str, FileEntry] = dataclasses.field(default_factory=dict)


class Publisher(Protocol):
    def prepare(self) -> None: ...

    def commit(self, files: dict[str, FileEntry]) -> None: ...


class DigestingWriter(FsspecWriter):
    """FsspecWriter that digests every file; its coordinator calls ``publisher.prepare()``
    before any rank writes and ``publisher.commit(files)`` after ``.metadata``.

    The publisher (and the ``cache``, where this step's files are also kept on local disk) must
    be picklable for process-based async saves.
    """

    def __init__(
        self,
        url: str,
        *,
        options: StorageOptions,
        algorithm: str,
        publisher: Publisher,
        thread_count: int = 1,
        cache: StepCache | None = None,
        extra_files: dict[str, bytes] | None = None,
    ):
        for name in extra_files or {}:
            if "/" in name or name in (METADATA_NAME, MANIFEST_NAME) or name.endswith((".distcp", BLOCKS_SUFFIX)):
                raise ValueError(f"extra file {name!r}: a plain name that no DCP file or the manifest has")
        self._extra_files = dict(extra_files or {})
        self._storage = Storage(url, options)
        super().__init__(
            url, sync_files=False, overwrite=True, thread_count=thread_count, **self._storage.storage_kwargs
        )
        self._algorithm = algorithm
        self._publisher = publisher
        self._cache = cache
        self._wrap_fs()

    def _wrap_fs(self) -> None:
        self._digesting_fs = _DigestingFileSystem(self.fs, self._algorithm, self._storage, self._cache)
        # torch infers ``fs`` as its concrete FileSystem class; DCP calls only the FileSystemBase
        # methods on it, which the wrapper provides or delegates.
        self.fs = self._digesting_fs  # type: ignore[assignment]

    def _metadata_exists(self) -> bool:
        """DCP looks for an earlier ``.metadata`` only to warn that it overwrites it; the publisher's
        ``prepare`` judges the directory instead (a committed step refused, a torn one cleared)."""
        return False

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        self._publisher.prepare()  # coordinator only, before the plan is scattered to writers
        return super().prepare_global_plan(plans)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["fs"] = state.pop("_digesting_fs").inner
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._wrap_fs()

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        yield_to_training()
        results = super().write_data(plan, planner).wait()
        entries = {
            k: v for k, v in self._digesting_fs.files.items() if k.endswith((".distcp", ".distcp" + BLOCKS_SUFFIX))
        }
        out: Future[list[WriteResult]] = Future()
        if results:
            first = results[0]
            results = [
                DigestedWriteResult(first.index, first.size_in_bytes, first.storage_data, file_entries=entries)
            ] + list(results[1:])
        out.set_result(results)
        return out

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        super().finish(metadata, results)
        files: dict[str, FileEntry] = {}
        for rank_results in results:
            for r in rank_results:
                files.update(getattr(r, "file_entries", {}))
        meta = self._digesting_fs.files.get(METADATA_NAME)
        if meta is None:
            raise ChecksumMismatchError("the .metadata file was written without a digest")
        files[METADATA_NAME] = meta
        for name, data in self._extra_files.items():  # stored (durably) before the manifest names them
            self._digesting_fs.write_whole(name, data)
            files[name] = FileEntry(len(data), digest_bytes(data, self._algorithm))
        self._publisher.commit(files)
