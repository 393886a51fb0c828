"""``ftrain.checkpoint.fetch``: each block once, verified before its bytes are handed out; files of
manifests without block digests whole."""

from __future__ import annotations

import json
import os

import pytest

import ftrain.checkpoint.fetch as fetch
from ftrain.checkpoint.digest import BlockHasher, digest_bytes
from ftrain.checkpoint.errors import ChecksumMismatchError, ManifestError
from ftrain.checkpoint.fetch import fetch_files, pieces_for
from ftrain.checkpoint.manifest import MANIFEST_NAME, FileEntry, Manifest, step_dir_name
from ftrain.checkpoint.storage import Storage
from tests.unit.test_verify_catalog import write_step

FILES = {"__0_0.distcp": os.urandom(10_000), "__1_0.distcp": os.urandom(7_001), ".metadata": b"m" * 50, "e": b""}
BLOCK = 1024


@pytest.fixture
def storage(tmp_path) -> Storage:
    return Storage(f"file://{tmp_path}/ckpt")


@pytest.fixture(autouse=True)
def small_batches(monkeypatch):
    monkeypatch.setattr(fetch, "BATCH_BYTES", 3000)  # several batches


def write_blocked_step(storage: Storage, step: int) -> Manifest:
    """A step whose large files have block digests of BLOCK bytes listed beside them."""
    manifest = write_step(storage, step, files=FILES, commit=False)
    for name, data in FILES.items():
        hasher = BlockHasher(manifest.digest_algorithm, BLOCK)
        hasher.update(data)
        blocks = hasher.block_digests()
        if len(blocks) > 1:
            listing = json.dumps(blocks).encode()
            storage.write_bytes(f"{step_dir_name(step)}/{name}.blocks", listing)
            manifest.files[name + ".blocks"] = FileEntry(len(listing), digest_bytes(listing, manifest.digest_algorithm))
            manifest.files[name] = FileEntry(len(data), hasher.hexdigest(), BLOCK, name + ".blocks")
    storage.write_bytes(f"{step_dir_name(step)}/{MANIFEST_NAME}", manifest.to_json())
    return manifest


def everything() -> dict[str, None]:
    return dict.fromkeys(FILES)


def test_whole_files_are_kept_and_the_others_only_verified(storage):
    manifest = write_step(storage, 4, files=FILES)  # no block digests: whole files
    got = fetch_files(storage, step_dir_name(4), manifest, everything(), keep={"__0_0.distcp", "e"})
    assert got.problems == []
    assert {n: f.whole() for n, f in got.data.items()} == {"__0_0.distcp": FILES["__0_0.distcp"], "e": b""}
    assert got.bytes_read == sum(len(d) for d in FILES.values())  # every byte once


def test_only_the_blocks_covering_the_wanted_ranges_are_read(storage):
    manifest = write_blocked_step(storage, 4)
    big = FILES["__0_0.distcp"]
    wanted = {"__0_0.distcp": [(1500, 1600), (5000, 6500)]}  # blocks 1, 4, 5, 6
    assert pieces_for(manifest.files["__0_0.distcp"], wanted["__0_0.distcp"]) == [1, 4, 5, 6]
    got = fetch_files(storage, step_dir_name(4), manifest, wanted, keep={"__0_0.distcp"})
    listing = manifest.files["__0_0.distcp.blocks"].size_bytes
    assert got.problems == [] and got.bytes_read == listing + 4 * BLOCK
    with got.data["__0_0.distcp"].open() as fh:
        fh.seek(5000)
        assert fh.read(1500) == big[5000:6500]
        fh.seek(0)
        with pytest.raises(ChecksumMismatchError, match="not fetched and verified"):
            fh.read(10)  # block 0 was never verified: its bytes are not handed out


def test_a_block_damaged_in_storage_is_a_problem_after_a_second_read(storage, tmp_path):
    manifest = write_blocked_step(storage, 4)
    path = tmp_path / "ckpt" / step_dir_name(4) / "__0_0.distcp"
    data = bytearray(path.read_bytes())
    data[5000] ^= 1  # block 4
    path.write_bytes(bytes(data))
    got = fetch_files(storage, step_dir_name(4), manifest, everything(), keep=set(FILES))
    assert [(p.file, p.kind) for p in got.problems] == [("__0_0.distcp", "digest")]
    assert "block 4" in got.problems[0].detail
    assert "__0_0.distcp" not in got.data and set(got.data) == set(FILES) - {"__0_0.distcp"}
    listings = sum(e.size_bytes for n, e in manifest.files.items() if n.endswith(".blocks"))
    assert got.bytes_read == sum(len(d) for d in FILES.values()) + listings + BLOCK  # the bad block twice


def test_bytes_damaged_once_in_flight_are_read_again_and_accepted(storage, monkeypatch):
    manifest = write_blocked_step(storage, 4)
    real = storage.fs.cat_ranges
    calls = {"n": 0}

    def flip_the_first_batch(paths, starts, ends, **kwargs):
        out = real(paths, starts, ends, **kwargs)
        calls["n"] += 1
        if calls["n"] == 1:
            out[0] = bytes([out[0][0] ^ 0xFF]) + out[0][1:]
        return out

    monkeypatch.setattr(storage.fs, "cat_ranges", flip_the_first_batch)
    got = fetch_files(storage, step_dir_name(4), manifest, everything(), keep=set(FILES))
    assert got.problems == [] and {n: f.whole() for n, f in got.data.items()} == FILES


def test_missing_resized_and_unlisted_files_are_problems_without_a_read(storage, tmp_path):
    manifest = write_step(storage, 4, files=FILES)
    directory = tmp_path / "ckpt" / step_dir_name(4)
    (directory / "__1_0.distcp").unlink()
    (directory / ".metadata").write_bytes(b"m" * 51)
    got = fetch_files(storage, step_dir_name(4), manifest, {**everything(), "other": None}, keep=set(FILES))
    kinds = sorted((p.file, p.kind) for p in got.problems)
    assert kinds == [(".metadata", "size"), ("__1_0.distcp", "missing"), ("other", "manifest")]
    assert got.bytes_read == len(FILES["__0_0.distcp"])  # the sound files only ("e" is empty)
    assert set(got.data) == {"__0_0.distcp", "e"}


def test_a_listing_that_does_not_fit_its_file_is_a_problem_and_its_file_is_not_read(storage):
    manifest = write_blocked_step(storage, 4)
    listing = json.dumps(["0" * 32] * 9).encode()  # 10000 bytes need 10 blocks of 1024
    storage.write_bytes(f"{step_dir_name(4)}/__0_0.distcp.blocks", listing)
    manifest.files["__0_0.distcp.blocks"] = FileEntry(len(listing), digest_bytes(listing, manifest.digest_algorithm))
    got = fetch_files(storage, step_dir_name(4), manifest, {"__0_0.distcp": None}, keep={"__0_0.distcp"})
    assert [(p.file, p.kind) for p in got.problems] == [("__0_0.distcp.blocks", "manifest")]
    assert got.data == {} and got.bytes_read == len(listing)


def test_a_manifest_refuses_block_digests_without_their_listing():
    entry = FileEntry(3000, "0" * 32, BLOCK, "missing.blocks")
    with pytest.raises(ManifestError, match="'missing.blocks' is not listed"):
        Manifest(
            step=1,
            round=1,
            world_size=1,
            layout={},
            config_hash="h",
            config={},
            trainer={},
            digest_algorithm="xxh3_128",
            files={".metadata": FileEntry(1, "0" * 32), "a": entry},
            created_time=1.0,
        )
