"""DCP storage glue, reading: a reader that trusts nothing it has not hashed.

``.metadata`` is digested and unpickled with an allow-list, its storage references must stay
inside the files the manifest lists, only those files can be opened (each digested as it is
fetched), and every non-tensor item in a shard is unpickled by torch's weights-only allow-list
(:mod:`ftrain.checkpoint.safe_pickle`), whatever planner DCP was given. Writing is
:mod:`ftrain.checkpoint.dcp_write`.
"""

from __future__ import annotations

import contextlib
import io
import logging
import pickle
import tempfile
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem

from ftrain.checkpoint.digest import new_hasher
from ftrain.checkpoint.errors import ChecksumMismatchError, UnsafeMetadataError, UnsafePickleError
from ftrain.checkpoint.fetch import SparseFile
from ftrain.checkpoint.manifest import FileEntry
from ftrain.checkpoint.safe_pickle import (
    METADATA_NAME,
    SafeBytesLoadMixin,
    SafeLoadPlanner,
    metadata_problems,
    safe_load_bytes,
)
from ftrain.checkpoint.storage import Storage, StorageOptions

log = logging.getLogger(__name__)

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
        prefetched: Mapping[str, SparseFile | bytes] | None = None,
    ):
        self._inner = inner
        self._files = files
        self._algorithm = algorithm
        self._storage = storage
        self._root = root.rstrip("/")
        self._spool_bytes = spool_bytes
        self._prefetched = dict(prefetched or {})

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
        if name in self._prefetched:  # fetched and verified before the load began
            held = self._prefetched[name]
            yield held.open() if isinstance(held, SparseFile) else io.BytesIO(held)
            return
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
    stored by :func:`ftrain.checkpoint.safe_pickle.safe_load_bytes` (allow-list unpickler), never by the
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
                "pass planner=ftrain.checkpoint.safe_pickle.SafeLoadPlanner()"
            )


class VerifiedReader(FsspecReader):
    """FsspecReader that trusts nothing it has not hashed: ``.metadata`` must match the
    manifest before it is unpickled (with an allow-list), every storage reference in it must
    point inside a listed file (:func:`ftrain.checkpoint.safe_pickle.metadata_problems`), every data
    file is digested as it is fetched, before DCP reads from it, and every non-tensor item is
    unpickled with torch's weights-only allow-list whatever planner DCP was given."""

    def __init__(
        self,
        url: str,
        *,
        options: StorageOptions,
        files: dict[str, FileEntry],
        algorithm: str,
        prefetched: Mapping[str, SparseFile | bytes] | None = None,
        metadata: Metadata | None = None,
    ):
        """``prefetched``: files (or the parts of them the load reads) already fetched and
        verified (:func:`ftrain.checkpoint.fetch.fetch_files`), served from memory; any other file is
        fetched and digested whole when DCP opens it. ``metadata``: ``.metadata`` already parsed
        (by :func:`load_metadata`) from the verified bytes in ``prefetched``: not parsed again."""
        storage = Storage(url, options)
        super().__init__(url, **storage.storage_kwargs)
        self._files = files
        self._expected = files[METADATA_NAME]
        self._algorithm = algorithm
        self._parsed = metadata if metadata is not None and prefetched and METADATA_NAME in prefetched else None
        # torch infers ``fs`` as its concrete FileSystem class; DCP calls only the FileSystemBase
        # methods on it, which the wrapper provides or delegates.
        self.fs = _VerifyingReadFileSystem(  # type: ignore[assignment]
            self.fs, files, algorithm, storage, str(url), prefetched=prefetched
        )

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._parsed is not None:
            return self._with_load_id(self._parsed)
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as fh:
            data = fh.read(self._expected.size_bytes + 1)  # a grown file is refused, not read whole
        hasher = new_hasher(self._algorithm)
        hasher.update(data)
        if len(data) != self._expected.size_bytes or hasher.hexdigest() != self._expected.digest:
            raise ChecksumMismatchError(
                f"{path}: does not match the manifest (size {len(data)}, expected {self._expected.size_bytes})"
            )
        return self._with_load_id(load_metadata(data))

    def _with_load_id(self, metadata: Metadata) -> Metadata:
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


def needed_ranges(
    state_dict: dict[str, Any], metadata: bytes | Metadata, files: Mapping[str, FileEntry], is_coordinator: bool
) -> dict[str, list[tuple[int, int]]]:
    """The byte ranges of each data file that a DCP load of ``state_dict`` on this rank reads
    (the planner run ahead of the load, on ``.metadata``: its bytes, parsed here with the
    allow-list unpickler, or what :func:`load_metadata` made of them). Empty when the metadata
    is unusable or points outside ``files`` (whoever checks the step reports why)."""
    try:
        if isinstance(metadata, bytes):
            metadata = load_metadata(metadata)
        if metadata_problems(metadata, files):
            return {}
        planner = SafeLoadPlanner()
        planner.set_up_planner(state_dict, metadata, is_coordinator)
        plan = planner.create_local_plan()
    except Exception as e:  # noqa: BLE001 - the load itself reports it (or whoever verifies the step)
        log.warning("could not plan the load ahead: %s", e)
        return {}
    ranges: dict[str, list[tuple[int, int]]] = {}
    for item in plan.items:
        info = metadata.storage_data[item.storage_index]
        ranges.setdefault(info.relative_path, []).append((info.offset, info.offset + info.length))
    return ranges


def needed_files(
    state_dict: dict[str, Any], metadata: bytes | Metadata, files: Mapping[str, FileEntry], is_coordinator: bool
) -> list[str]:
    """The data files a DCP load of ``state_dict`` on this rank reads (see :func:`needed_ranges`)."""
    return sorted(needed_ranges(state_dict, metadata, files, is_coordinator))
