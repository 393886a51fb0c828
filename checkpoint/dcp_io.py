"""DCP storage glue: a writer that digests every file as it streams out, and a reader that
checks ``.metadata`` against the manifest and unpickles it with an allow-list.

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

Reading trusts nothing from storage: ``.metadata`` is digested and unpickled with an allow-list,
its storage references must stay inside the files the manifest lists, only those files can be
opened (each digested as it is fetched), and every non-tensor item in a shard is unpickled by
torch's weights-only allow-list (:mod:`checkpoint.safe_pickle`), whatever planner DCP was given.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import pickle
import posixpath
import shutil
import tempfile
import threading
from collections.abc import Iterator
from typing import Any, Protocol

import torch
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem, SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from checkpoint.digest import new_hasher
from checkpoint.errors import ChecksumMismatchError, UnsafeMetadataError, UnsafePickleError
from checkpoint.manifest import FileEntry
from checkpoint.safe_pickle import (
    METADATA_NAME,
    SafeBytesLoadMixin,
    metadata_problems,
    safe_load_bytes,
)
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


# -- reading ---------------------------------------------------------------------------

_ALLOWED_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "MetadataIndex",
        "ChunkStorageMetadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "TensorProperties",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
}


class RestrictedUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata only: its dataclasses, torch.Size, dtypes and layouts."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafePickleError(f".metadata refers to {module}.{name}, which DCP metadata never contains")


def load_metadata(data: bytes) -> Metadata:
    metadata = RestrictedUnpickler(io.BytesIO(data)).load()
    if not isinstance(metadata, Metadata):
        raise UnsafePickleError(f".metadata holds a {type(metadata).__name__}, not DCP Metadata")
    return metadata


class _VerifyingReadFileSystem:
    """Serves DCP's reads of data files from a local copy whose digest was checked first.

    Each file a rank reads is fetched once (retried whole on transient errors) through the
    hasher into a spool (memory, or a temp file past ``spool_bytes``) and compared with the
    manifest before DCP sees a byte of it: a file that changed after the verification pass
    cannot be loaded silently. Only files the manifest lists, named relative to the step root,
    can be opened at all (``.metadata`` is handed over raw: :meth:`VerifiedReader.read_metadata`
    digests it itself); nothing can be written.
    """

    def __init__(
        self,
        inner: Any,
        files: dict[str, FileEntry],
        algorithm: str,
        storage: Storage,
        root: str,
        spool_bytes: int = 256 << 20,
    ):
        self._inner = inner
        self._files = files
        self._algorithm = algorithm
        self._storage = storage
        self._root = root.rstrip("/")
        self._spool_bytes = spool_bytes

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def _listed_name(self, path: Any) -> str:
        """``path`` relative to the step root; ChecksumMismatchError unless the manifest lists it."""
        text = str(path)
        prefix = self._root + "/"
        name = text[len(prefix) :] if text.startswith(prefix) else None
        if name is None or (name != METADATA_NAME and name not in self._files):
            raise ChecksumMismatchError(
                f"{text}: not listed in the manifest of {self._root}; refusing to read "
                "unverified bytes (a forged or corrupt .metadata points at it)"
            )
        return name

    @contextlib.contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
        if "r" not in mode or any(ch in mode for ch in "wa+x"):
            raise ChecksumMismatchError(f"{path}: VerifiedReader opens files read-only, not with mode {mode!r}")
        name = self._listed_name(path)
        if name == METADATA_NAME:
            with self._inner.create_stream(path, mode) as stream:
                yield stream
            return
        expected = self._files[name]
        with tempfile.SpooledTemporaryFile(max_size=self._spool_bytes) as spool:

            def fetch() -> tuple[int, str]:
                spool.seek(0)
                spool.truncate()
                hasher, size = new_hasher(self._algorithm), 0
                with self._inner.create_stream(path, "rb") as src:
                    while chunk := src.read(16 << 20):
                        hasher.update(chunk)
                        spool.write(chunk)
                        size += len(chunk)
                        if size > expected.size_bytes:  # grown since the manifest: stop spooling
                            break
                return size, hasher.hexdigest()

            size, digest = self._storage.retry(fetch, f"read {name}")
            if size != expected.size_bytes or digest != expected.digest:
                raise ChecksumMismatchError(
                    f"{name}: changed since it was verified (size {size}, expected "
                    f"{expected.size_bytes}; digest {digest}, expected {expected.digest})"
                )
            spool.seek(0)
            yield spool


class _SafeBytesPlanner(LoadPlanner):
    """Stands in for DCP's planner inside :meth:`VerifiedReader.read_data`: bytes items are
    stored by :func:`checkpoint.safe_pickle.safe_load_bytes` (allow-list unpickler), never by the
    planner's own ``load_bytes`` (``torch.load(weights_only=False)`` in DCP's default planner);
    everything else goes to the real planner."""

    def __init__(self, planner: LoadPlanner):
        self._planner = planner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)

    def set_up_planner(self, *args: Any, **kwargs: Any) -> None:
        self._planner.set_up_planner(*args, **kwargs)

    def create_local_plan(self) -> LoadPlan:
        return self._planner.create_local_plan()

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return self._planner.create_global_plan(global_plan)

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return self._planner.finish_plan(central_plan)

    def resolve_bytes(self, read_item: ReadItem) -> io.BytesIO:
        return self._planner.resolve_bytes(read_item)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        return self._planner.resolve_tensor(read_item)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        self._planner.commit_tensor(read_item, tensor)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        if isinstance(self._planner, SafeBytesLoadMixin):
            self._planner.load_bytes(read_item, value)  # already the allow-list loader
        elif isinstance(self._planner, DefaultLoadPlanner):
            safe_load_bytes(self._planner, read_item, value)
        else:
            raise UnsafePickleError(
                f"item {read_item.storage_index.fqn!r}: planner {type(self._planner).__name__} is "
                "not a DefaultLoadPlanner, so VerifiedReader cannot store its bytes items safely; "
                "pass planner=checkpoint.safe_pickle.SafeLoadPlanner()"
            )


class VerifiedReader(FsspecReader):
    """FsspecReader that trusts nothing it has not hashed: ``.metadata`` must match the
    manifest before it is unpickled (with an allow-list), every storage reference in it must
    point inside a listed file (:func:`checkpoint.safe_pickle.metadata_problems`), every data
    file is digested as it is fetched, before DCP reads from it, and every non-tensor item is
    unpickled with torch's weights-only allow-list whatever planner DCP was given."""

    def __init__(self, url: str, *, options: StorageOptions, files: dict[str, FileEntry], algorithm: str):
        storage = Storage(url, options)
        super().__init__(url, **storage.storage_kwargs)
        self._files = files
        self._expected = files[METADATA_NAME]
        self._algorithm = algorithm
        # torch infers ``fs`` as its concrete FileSystem class; DCP calls only the FileSystemBase
        # methods on it, which the wrapper provides or delegates.
        self.fs = _VerifyingReadFileSystem(self.fs, files, algorithm, storage, str(url))  # type: ignore[assignment]

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as fh:
            data = fh.read(self._expected.size_bytes + 1)  # a grown file is refused, not read whole
        hasher = new_hasher(self._algorithm)
        hasher.update(data)
        if len(data) != self._expected.size_bytes or hasher.hexdigest() != self._expected.digest:
            raise ChecksumMismatchError(
                f"{path}: does not match the manifest (size {len(data)}, expected {self._expected.size_bytes})"
            )
        metadata = load_metadata(data)
        storage_meta: StorageMeta | None = getattr(metadata, "storage_meta", None)
        if storage_meta is None:
            storage_meta = metadata.storage_meta = StorageMeta()
        storage_meta.load_id = self.load_id
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Refuse (UnsafeMetadataError) a ``.metadata`` that points outside the manifest's files."""
        problems = metadata_problems(metadata, self._files)
        if problems:
            raise UnsafeMetadataError(f"{METADATA_NAME} of {self.path}: " + "; ".join(problems))
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)

    def read_data(self, plan: Any, planner: Any) -> Any:
        return super().read_data(plan, _SafeBytesPlanner(planner))
