"""Storage backends, one module per family, chosen by URL scheme.

A backend does single attempts of the few operations the checkpoint service needs, on paths
already joined under its root; :class:`ftrain.checkpoint.storage.Storage` wraps every call with path
joining, error classification and retries. Every module in this package defines ``BACKEND``, a
class satisfying :class:`StorageBackend`; the registry finds the modules by listing the package,
so adding a backend is one new module here (plus its root in
``tests/integration/test_storage_contract.py``, whose suite every backend must pass).

What must stay true: each scheme belongs to one backend; exactly one backend claims
:data:`ANY_SCHEME` and serves every fsspec scheme no other backend claims; a backend's
operations never retry and never map errors (``Storage`` does, once, asking every backend's
``classify_error``) and never answer metadata calls from a stale listing cache, except that an
:class:`Upload` retries each of its requests (a part, not the whole object) through the
:class:`Retry` that ``Storage`` hands it; an upload's object is invisible until
:meth:`Upload.commit` returns, and a failed or aborted upload leaves no object (at most an
invisible pending S3 multipart upload, which ``clear_multipart_uploads`` removes).
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any, BinaryIO, ClassVar, Protocol, TypeVar

from ftrain.checkpoint.errors import CheckpointError

if TYPE_CHECKING:
    from ftrain.checkpoint.storage import StorageOptions

#: The scheme of the fallback backend: any fsspec scheme no other backend claims.
ANY_SCHEME = "*"

T = TypeVar("T")


class Retry(Protocol):
    """``Storage.retry``: call ``fn`` until it succeeds or fails with an error that is not
    transient (classified), backing off in between; ``what`` names the operation in logs."""

    def __call__(self, fn: Callable[[], T], what: str) -> T: ...


@dataclass(frozen=True, slots=True)
class UploadSettings:
    """How :meth:`StorageBackend.open_upload` streams one object (from ``StorageOptions``)."""

    part_size_bytes: int
    """Bytes per multipart part; an object of at most this many bytes goes up as one PUT."""
    parts_in_flight: int
    """Full parts handed to the background uploader and not yet stored, at most: the writer
    blocks on the next full part until one is stored (memory stays within
    ``(parts_in_flight + 1) * part_size_bytes`` per object)."""
    retry: Retry
    """Retries one request of the upload (a part, the completion, a whole small PUT)."""


class Upload(Protocol):
    """One object being written front to back, invisible to readers until :meth:`commit`.

    ``write`` may block (a bounded number of parts are uploading) and raises as soon as a part
    has failed for good; the caller then calls :meth:`abort`, never :meth:`commit`."""

    def write(self, data: memoryview) -> None:
        """Append ``data`` (copied before this returns: the caller may reuse its buffer)."""
        ...

    def commit(self) -> None:
        """Store what was written as the whole object, all or nothing; raises if it could not
        (the caller then calls :meth:`abort`)."""
        ...

    def abort(self) -> None:
        """Discard the upload, leaving no object; idempotent, and never raises (what it cannot
        remove is an invisible pending upload, logged, which ``clear_multipart_uploads``
        removes)."""
        ...


class StorageBackend(Protocol):
    """One storage family (local files, S3, any other fsspec filesystem) under one root URL.

    Methods take backend paths (``Storage.path`` joins them under :attr:`root`) and make one
    attempt: they raise what the client library raises (``FileNotFoundError`` for a missing
    object); :func:`ftrain.checkpoint.storage.classify` decides what is transient.
    """

    schemes: ClassVar[tuple[str, ...]]
    """fsspec protocols this backend serves (``file`` for plain paths), or ``(ANY_SCHEME,)``."""
    fs: Any
    """The fsspec filesystem (DCP's ``FsspecWriter``/``FsspecReader`` get the same kwargs)."""
    root: str
    """The root URL as a backend path (no protocol; ``bucket/prefix`` on S3)."""
    storage_kwargs: dict[str, Any]
    """What fsspec was given to build :attr:`fs` (:meth:`fsspec_kwargs` of the options)."""

    def __init__(self, url: str, options: StorageOptions) -> None: ...

    @classmethod
    def fsspec_kwargs(cls, options: StorageOptions) -> dict[str, Any]:
        """fsspec filesystem arguments for ``options`` (endpoint, credentials, timeouts)."""
        ...

    @staticmethod
    def classify_error(exc: BaseException) -> BaseException | None:
        """This family's verdict on an error (a Transient/FatalStorageError to raise instead),
        or None to leave it to the generic rules. Consulted for errors from any backend:
        libraries wrap each other's errors."""
        ...

    def read(self, path: str, start: int | None = None, end: int | None = None) -> bytes:
        """The object's bytes (``start .. end`` when given; shorter if the object ends first)."""
        ...

    def open_read(self, path: str, block_size: int) -> BinaryIO:
        """A binary file open for reading, fetching ``block_size`` bytes at a time."""
        ...

    def write(self, path: str, data: bytes) -> None:
        """Create or replace the whole object, all or nothing: a reader never sees it torn."""
        ...

    def exists(self, path: str) -> bool:
        """Whether an object or a non-empty directory is at ``path``, never from a cache."""
        ...

    def size_bytes(self, path: str) -> int:
        """The object's size, never from a cache."""
        ...

    def list_names(self, path: str) -> list[str]:
        """Sorted names (not paths) directly under ``path``, never from a cache, without
        in-flight temporary files; ``FileNotFoundError`` if nothing is there."""
        ...

    def remove(self, path: str, recursive: bool) -> None:
        """Delete an object, or with ``recursive`` everything under ``path`` (so that a listing
        no longer shows it); missing is not an error."""
        ...

    def open_upload(self, path: str, settings: UploadSettings) -> Upload:
        """Start writing the object at ``path`` as a stream (nothing is visible until
        :meth:`Upload.commit`): S3 streams multipart parts while the caller writes; other
        backends write a local temp file (durable rename on local disk) or upload whole."""
        ...

    def clear_multipart_uploads(self, path: str) -> int:
        """Abort unfinished multipart uploads under the directory ``path``; how many."""
        ...

    def pending_uploads(self, path: str) -> dict[str, float]:
        """Unfinished multipart uploads under the directory ``path``: each key, relative to
        ``path``, with the newest time (Unix seconds) an upload to it was started."""
        ...

    def local_path(self, path: str) -> str | None:
        """The local filesystem path of ``path`` (a URL or backend path); None if not local."""
        ...


def collect(modules: Iterable[ModuleType]) -> dict[str, type[StorageBackend]]:
    """The ``BACKEND`` of each module, named by its module (``local``, ``s3``, ...); refuses a
    module without one, two backends claiming one scheme, and no :data:`ANY_SCHEME` fallback."""
    by_name: dict[str, type[StorageBackend]] = {}
    owner: dict[str, str] = {}
    for module in modules:
        name = module.__name__.rpartition(".")[2]
        backend = getattr(module, "BACKEND", None)
        if backend is None:
            raise CheckpointError(f"storage backend module {module.__name__} defines no BACKEND")
        for scheme in backend.schemes:
            if scheme in owner:
                raise CheckpointError(f"storage scheme {scheme!r} is claimed by both {owner[scheme]!r} and {name!r}")
            owner[scheme] = name
        by_name[name] = backend
    if ANY_SCHEME not in owner:
        raise CheckpointError(f"no storage backend claims {ANY_SCHEME!r} (the fallback for other fsspec schemes)")
    return dict(sorted(by_name.items()))


@functools.cache
def registered_backends() -> dict[str, type[StorageBackend]]:
    """Every backend of this package, by module name (imported on the first call)."""
    return collect(importlib.import_module(f"{__name__}.{info.name}") for info in pkgutil.iter_modules(__path__))


def backend_for(protocol: str) -> type[StorageBackend]:
    """The backend serving fsspec ``protocol`` (``file`` for a plain path): the one that claims
    it, else the :data:`ANY_SCHEME` fallback."""
    backends = registered_backends().values()
    claimed = [b for b in backends if protocol in b.schemes]
    return claimed[0] if claimed else next(b for b in backends if ANY_SCHEME in b.schemes)
