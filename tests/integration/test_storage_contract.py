"""The storage contract: what the checkpoint service relies on, run against every registered
backend (:func:`ftrain.checkpoint.backends.registered_backends`) through :class:`Storage`.

Each backend has a root here (``ROOTS``): a temp directory for ``local``, the session's
SeaweedFS server (the ``seaweed`` fixture, under a fresh prefix) for ``s3``, ``memory://`` for
the ``generic`` fsspec fallback. A new backend is its module plus its entry in ``ROOTS``;
:func:`test_every_backend_has_a_root` fails until it has one. Backend-specific behaviour (S3
outages, credentials, multipart uploads; local temp files) is tested in their own modules.
"""

from __future__ import annotations

import dataclasses
import os
import time
import uuid
from collections.abc import Callable, Iterator

import pytest

from ftrain.checkpoint.backends import registered_backends
from ftrain.checkpoint.errors import FatalStorageError, TransientStorageError
from ftrain.checkpoint.storage import Storage, StorageOptions, classify

pytestmark = pytest.mark.timeout(120)


def _local_root(request: pytest.FixtureRequest) -> tuple[str, StorageOptions]:
    tmp_path = request.getfixturevalue("tmp_path")
    return f"file://{tmp_path}/root", StorageOptions()


def _s3_root(request: pytest.FixtureRequest) -> tuple[str, StorageOptions]:
    seaweed = request.getfixturevalue("seaweed")  # started only when an s3 case runs
    return seaweed.url(request.getfixturevalue("s3_prefix")), seaweed.storage_options()


def _generic_root(request: pytest.FixtureRequest) -> tuple[str, StorageOptions]:
    return f"memory://contract-{uuid.uuid4().hex[:12]}", StorageOptions()


#: Backend name -> (root URL, options) for one test, on a root nothing else uses.
ROOTS: dict[str, Callable[[pytest.FixtureRequest], tuple[str, StorageOptions]]] = {
    "local": _local_root,
    "s3": _s3_root,
    "generic": _generic_root,
}


@pytest.fixture
def sleeps() -> list[float]:
    """The retry waits of the ``storage`` under test, in seconds."""
    return []


@pytest.fixture(params=sorted(registered_backends()))
def storage(request: pytest.FixtureRequest, sleeps: list[float]) -> Iterator[Storage]:
    if request.param not in ROOTS:
        pytest.fail(f"storage backend {request.param!r} has no root in ROOTS")
    url, options = ROOTS[request.param](request)

    def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        time.sleep(seconds)  # the retry backoff itself, not synchronisation

    s = Storage(url, options, sleep=sleep)
    assert type(s.backend) is registered_backends()[request.param]
    try:
        yield s
    finally:
        s.remove("", recursive=True)


def test_every_backend_has_a_root():
    assert sorted(ROOTS) == sorted(registered_backends())


# -- round trips ----------------------------------------------------------------------------
def test_round_trip(storage):
    data = os.urandom((3 << 20) - 1000)  # three 1 MiB chunks, the last one short
    storage.write_bytes("step-1/shard-0.bin", data)
    storage.write_bytes("step-1/manifest.json", b"{}")
    storage.write_bytes("step-2/deep/er/file", b"x")
    assert storage.read_bytes("step-1/shard-0.bin") == data
    assert storage.exists("step-1/shard-0.bin") and storage.exists("step-1")
    assert not storage.exists("step-1/nope")
    assert storage.size_bytes("step-1/shard-0.bin") == len(data)
    assert storage.listdir() == ["step-1", "step-2"]
    assert storage.listdir("step-1") == ["manifest.json", "shard-0.bin"]
    assert storage.listdir("step-2/deep") == ["er"]
    chunks = list(storage.iter_chunks("step-1/shard-0.bin", chunk_bytes=1 << 20))
    assert len(chunks) == 3 and b"".join(chunks) == data
    storage.write_bytes("step-1/manifest.json", b'{"v": 2}')  # overwrite
    assert storage.read_bytes("step-1/manifest.json") == b'{"v": 2}'
    storage.remove("step-1", recursive=True)
    assert storage.listdir() == ["step-2"]
    assert not storage.exists("step-1/shard-0.bin")
    storage.remove("step-1", recursive=True)  # removing what is gone is not an error
    storage.remove("", recursive=True)
    assert storage.listdir() == []


def test_empty_object(storage):
    storage.write_bytes("empty", b"")
    assert storage.read_bytes("empty") == b""
    assert storage.size_bytes("empty") == 0
    assert list(storage.iter_chunks("empty")) == []
    assert storage.listdir() == ["empty"]


def test_large_object(storage):
    """Larger than one default streaming chunk (8 MiB)."""
    data = os.urandom((8 << 20) + 4096)
    storage.write_bytes("big.distcp", data)
    assert storage.size_bytes("big.distcp") == len(data)
    assert storage.read_bytes("big.distcp") == data
    chunks = list(storage.iter_chunks("big.distcp"))
    assert [len(c) for c in chunks] == [8 << 20, 4096] and b"".join(chunks) == data
    assert storage.read_range("big.distcp", (8 << 20) - 10, 20) == data[(8 << 20) - 10 : (8 << 20) + 10]


def test_read_range(storage):
    data = bytes(range(100))
    storage.write_bytes("d/f.distcp", data)
    assert storage.read_range("d/f.distcp", 10, 5) == data[10:15]
    assert storage.read_range("d/f.distcp", 0, 100) == data
    assert storage.read_range("d/f.distcp", 100, 0) == b""
    with pytest.raises(EOFError, match="d/f.distcp"):
        storage.read_range("d/f.distcp", 95, 10)
    with pytest.raises(ValueError):
        storage.read_range("d/f.distcp", -1, 5)


# -- overwrite, delete ----------------------------------------------------------------------
def test_overwrite_replaces_the_whole_object(storage):
    storage.write_bytes("step-1/manifest.json", b"a much longer first version")
    storage.write_bytes("step-1/manifest.json", b"short")
    assert storage.read_bytes("step-1/manifest.json") == b"short"
    assert storage.size_bytes("step-1/manifest.json") == 5
    assert storage.listdir("step-1") == ["manifest.json"]  # no temp file or old version listed
    storage.write_bytes("latest", b"10")
    storage.write_bytes("latest", b"20")
    assert storage.read_bytes("latest") == b"20"


def test_remove_respects_directory_boundaries(storage):
    """step-1 is not a prefix of step-10: keys are paths, not strings."""
    for key in ("step-1/a", "step-1/sub/b", "step-10/c", "step-1.json"):
        storage.write_bytes(key, key.encode())
    storage.remove("step-1/a")  # one object
    assert storage.listdir("step-1") == ["sub"]
    storage.remove("step-1", recursive=True)
    assert storage.listdir() == ["step-1.json", "step-10"]
    assert storage.read_bytes("step-10/c") == b"step-10/c"
    assert storage.read_bytes("step-1.json") == b"step-1.json"
    storage.remove("step-1.json")
    storage.remove("step-1.json")  # gone already: not an error
    assert storage.listdir() == ["step-10"]


def test_roots_are_isolated(storage):
    """Two roots whose names share a prefix (run1, run10) never see each other's objects."""
    run1 = Storage(storage.child_url("run1"), storage.options)
    run10 = Storage(storage.child_url("run10"), storage.options)
    run1.write_bytes("step-1/f", b"1")
    run10.write_bytes("step-1/f", b"10")
    assert run1.listdir() == ["step-1"] and run10.listdir() == ["step-1"]
    run1.remove("", recursive=True)
    assert run1.listdir() == [] and not run1.exists("step-1/f")
    assert run10.read_bytes("step-1/f") == b"10"
    assert storage.listdir() == ["run10"]
    assert run1.clear_multipart_uploads() == 0 and run10.clear_multipart_uploads() == 0  # none pending


def test_another_clients_changes_are_seen_at_once(storage):
    """exists/size/listdir never answer from a listing this client made before."""
    options = dataclasses.replace(storage.options, read_timeout_s=storage.options.read_timeout_s - 1)
    other = Storage(storage.url, options)  # on S3 a separate client with its own cache
    storage.write_bytes("step-1/shard-0", b"a")
    assert storage.listdir("step-1") == ["shard-0"]
    other.write_bytes("step-1/manifest.json", b"{}")
    assert storage.exists("step-1/manifest.json")
    assert storage.size_bytes("step-1/manifest.json") == 2
    assert storage.listdir("step-1") == ["manifest.json", "shard-0"]
    other.remove("step-1/shard-0")
    assert not storage.exists("step-1/shard-0")
    assert storage.listdir("step-1") == ["manifest.json"]


# -- missing is not-found, never a storage error --------------------------------------------
def test_missing(storage, sleeps):
    """A missing object raises FileNotFoundError at once: not a storage error (so never retried,
    and never read as damage); a missing directory lists as empty."""
    assert storage.listdir() == []
    assert storage.listdir("no/such/prefix") == []
    assert not storage.exists("no/such/key")
    storage.write_bytes("step-1/manifest.json", b"{}")
    for op in (
        lambda: storage.read_bytes("no/such/key"),
        lambda: storage.size_bytes("no/such/key"),
        lambda: list(storage.iter_chunks("no/such/key")),
        lambda: storage.read_range("no/such/key", 0, 1),
        lambda: storage.read_bytes("step-1/nope"),
    ):
        with pytest.raises(FileNotFoundError) as info:
            op()
        assert not isinstance(info.value, (TransientStorageError, FatalStorageError))
        assert classify(info.value) is info.value
    storage.remove("no/such/key")
    storage.remove("no/such/prefix", recursive=True)
    assert sleeps == []
