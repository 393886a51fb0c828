"""The DCP glue on a local filesystem, single process: digests recorded while writing match
the bytes on disk, and a file changed after verification is refused when DCP reads it."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ftrain.checkpoint.dcp_read import METADATA_NAME, VerifiedReader
from ftrain.checkpoint.dcp_write import DigestingWriter
from ftrain.checkpoint.digest import BLOCK_BYTES, digest_bytes
from ftrain.checkpoint.errors import ChecksumMismatchError
from ftrain.checkpoint.manifest import FileEntry
from ftrain.checkpoint.storage import StorageOptions


class RecordingPublisher:
    def __init__(self):
        self.prepared = False
        self.files: dict[str, FileEntry] = {}

    def prepare(self):
        self.prepared = True

    def commit(self, files):
        self.files = files


@pytest.fixture
def saved(tmp_path):
    publisher = RecordingPublisher()
    state = {"w": torch.arange(65536, dtype=torch.float32), "b": torch.ones(7)}
    writer = DigestingWriter(str(tmp_path), options=StorageOptions(), algorithm="xxh3_128", publisher=publisher)
    dcp.save(state, storage_writer=writer, no_dist=True)
    return tmp_path, publisher


def test_writer_digests_match_the_bytes_written(saved):
    root, publisher = saved
    assert publisher.prepared
    assert METADATA_NAME in publisher.files and any(n.endswith(".distcp") for n in publisher.files)
    for name, entry in publisher.files.items():
        data = (root / name).read_bytes()
        assert entry.size_bytes == len(data) and entry.digest == digest_bytes(data, "xxh3_128"), name


def test_a_file_larger_than_a_block_has_its_block_digests_listed_beside_it(saved):
    root, publisher = saved
    shard = next(n for n in publisher.files if n.endswith(".distcp"))  # 256 KiB of "w": 4+ blocks
    entry = publisher.files[shard]
    assert entry.block_bytes == BLOCK_BYTES and entry.blocks_file == shard + ".blocks"
    data = (root / shard).read_bytes()
    listed = json.loads((root / entry.blocks_file).read_bytes())
    spans = [data[i : i + BLOCK_BYTES] for i in range(0, len(data), BLOCK_BYTES)]
    assert listed == [digest_bytes(b, "xxh3_128") for b in spans] and len(spans) > 1
    assert publisher.files[METADATA_NAME].block_bytes == 0  # one block: the file's digest is enough


def test_reader_loads_verified_bytes(saved):
    root, publisher = saved
    target = {"w": torch.zeros(65536), "b": torch.zeros(7)}
    dcp.load(
        target,
        storage_reader=VerifiedReader(str(root), options=StorageOptions(), files=publisher.files, algorithm="xxh3_128"),
        no_dist=True,
    )
    assert torch.equal(target["w"], torch.arange(65536, dtype=torch.float32))


def test_a_shard_changed_after_verification_is_refused(saved):
    """The window between the verification pass and DCP's read: the reader hashes what it reads."""
    root, publisher = saved
    shard = next(root / n for n in publisher.files if n.endswith(".distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    target = {"w": torch.zeros(65536), "b": torch.zeros(7)}
    reader = VerifiedReader(str(root), options=StorageOptions(), files=publisher.files, algorithm="xxh3_128")
    with pytest.raises(BaseException) as err:  # DCP wraps it in CheckpointException (a BaseException)
        dcp.load(target, storage_reader=reader, no_dist=True)
    assert "changed since it was verified" in str(err.value) or isinstance(err.value, ChecksumMismatchError)
