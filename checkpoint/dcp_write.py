"""DCP storage glue, writing: a writer that digests every file as it streams out.

The writer wraps the filesystem's ``create_stream`` so each file's bytes pass through a hasher
on their way to storage (no second read). Each rank's digests ride back to the coordinator on
DCP's own gather of write results; the coordinator's ``finish`` writes ``.metadata`` (also
digested) and then hands the complete file table to a committer, which writes the manifest.
If any rank fails, DCP's gather fails first and no manifest is written.

FACTS.md traps handled here: storage options are passed to the writer and ``checkpoint_id``
is never set (``reset()`` would drop them); ``sync_files=False`` (S3 files have no fileno, and
the fallback is a host-wide ``os.sync()``). A step is never overwritten: DCP's own check looks
only for ``.metadata``, so the publisher's ``prepare`` refuses a committed step and clears a
torn one before any rank writes (DCP runs with ``overwrite=True`` so it does not re-check).
On a local filesystem every uploaded file is fsynced and renamed into place, and its directory
fsynced (also after DCP renames ``.metadata.tmp``), before the manifest can commit the step.
Reading is :mod:`checkpoint.dcp_read`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import posixpath
import shutil
import tempfile
import threading
from collections.abc import Iterator
from typing import Any, Protocol

from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from checkpoint.digest import new_hasher
from checkpoint.errors import ChecksumMismatchError
from checkpoint.manifest import FileEntry
from checkpoint.safe_pickle import METADATA_NAME
from checkpoint.storage import Storage, StorageOptions, fsync_dir


class _HashingStream(io.RawIOBase):
    """A write-only stream that hashes what it forwards; refuses to seek backwards."""

    def __init__(self, inner: Any, algorithm: str):
        super().__init__()
        self._inner = inner
        self._hasher = new_hasher(algorithm)
        self.size_bytes = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self._hasher.update(view)
        self._inner.write(view)
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


class _DigestingFileSystem:
    """Delegates to torch's fsspec FileSystem, except that each written file is digested while
    it is produced, staged locally (memory, or a temp file past ``spool_bytes``), and uploaded
    whole with retries: a storage hiccup retries one file, not the whole checkpoint, and a
    failed upload never leaves a half-written object behind."""

    def __init__(self, inner: Any, algorithm: str, storage: Storage, spool_bytes: int = 64 << 20):
        self._inner = inner
        self._algorithm = algorithm
        self._storage = storage
        self._spool_bytes = spool_bytes
        self._lock = threading.Lock()
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
        name = posixpath.basename(str(path))
        with tempfile.SpooledTemporaryFile(max_size=self._spool_bytes) as spool:
            stream = _HashingStream(spool, self._algorithm)
            yield stream
            self._upload(str(path), spool, stream.size_bytes)
            with self._lock:
                self.files[name] = FileEntry(size_bytes=stream.size_bytes, digest=stream.hexdigest())

    def _upload(self, path: str, spool: Any, size_bytes: int) -> None:
        """Upload one staged file whole. On a local filesystem the file is fsynced, renamed into
        place and its directory fsynced before this returns (the manifest, written after every
        upload, must never commit a shard a power loss could tear); elsewhere one PUT."""
        name = posixpath.basename(path)
        if self._storage.local_path(path) is not None:
            self._storage.upload_local_durable(path, spool)
            return
        fs = self._inner.fs
        if size_bytes <= self._spool_bytes:
            spool.seek(0)
            data = spool.read()
            self._storage.retry(lambda: fs.pipe_file(path, data), f"upload {name}")
            return
        spool.seek(0)
        with tempfile.NamedTemporaryFile() as local:
            shutil.copyfileobj(spool, local, 8 << 20)
            local.flush()
            self._storage.retry(lambda: fs.put_file(local.name, path), f"upload {name}")

    def rename(self, path: Any, new_path: Any) -> None:
        """DCP renames ``.metadata.tmp`` to ``.metadata``; on a local filesystem the directory is
        fsynced afterwards, so the new name is durable before the manifest commits it."""
        self._inner.rename(path, new_path)
        local = self._storage.local_path(str(new_path))
        if local is not None:
            fsync_dir(posixpath.dirname(local) or ".")


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

    The publisher must be picklable for process-based async saves.
    """

    def __init__(
        self, url: str, *, options: StorageOptions, algorithm: str, publisher: Publisher, thread_count: int = 1
    ):
        self._storage = Storage(url, options)
        super().__init__(
            url, sync_files=False, overwrite=True, thread_count=thread_count, **self._storage.storage_kwargs
        )
        self._algorithm = algorithm
        self._publisher = publisher
        self._wrap_fs()

    def _wrap_fs(self) -> None:
        self._digesting_fs = _DigestingFileSystem(self.fs, self._algorithm, self._storage)
        # torch infers ``fs`` as its concrete FileSystem class; DCP calls only the FileSystemBase
        # methods on it, which the wrapper provides or delegates.
        self.fs = self._digesting_fs  # type: ignore[assignment]

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
        results = super().write_data(plan, planner).wait()
        entries = {k: v for k, v in self._digesting_fs.files.items() if k.endswith(".distcp")}
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
        files_written = self._digesting_fs.files
        meta = files_written.get(METADATA_NAME + ".tmp") or files_written.get(METADATA_NAME)
        if meta is None:
            raise ChecksumMismatchError("the .metadata file was written without a digest")
        files[METADATA_NAME] = meta
        self._publisher.commit(files)
