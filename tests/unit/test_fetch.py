"""``checkpoint.fetch``: each file once, in pieces, verified whole before its bytes are handed out."""

from __future__ import annotations

import os

import pytest

import checkpoint.fetch as fetch
from checkpoint.fetch import fetch_files
from checkpoint.manifest import step_dir_name
from checkpoint.storage import Storage
from tests.unit.test_verify_catalog import write_step

FILES = {"__0_0.distcp": os.urandom(10_000), "__1_0.distcp": os.urandom(7_001), ".metadata": b"m" * 50, "e": b""}


@pytest.fixture
def storage(tmp_path) -> Storage:
    return Storage(f"file://{tmp_path}/ckpt")


@pytest.fixture(autouse=True)
def small_pieces(monkeypatch):
    monkeypatch.setattr(fetch, "RANGE_BYTES", 1024)  # ten pieces for the big file
    monkeypatch.setattr(fetch, "BATCH_BYTES", 3000)  # several batches


def test_verified_files_are_kept_and_the_others_only_verified(storage):
    manifest = write_step(storage, 4, files=FILES)
    got = fetch_files(storage, step_dir_name(4), manifest, FILES, keep={"__0_0.distcp", "e"})
    assert got.problems == []
    assert got.data == {"__0_0.distcp": FILES["__0_0.distcp"], "e": b""}
    assert got.bytes_read == sum(len(d) for d in FILES.values())  # every byte once


def test_a_file_damaged_in_storage_is_a_problem_after_a_second_read_and_never_handed_out(storage, tmp_path):
    manifest = write_step(storage, 4, files=FILES)
    path = tmp_path / "ckpt" / step_dir_name(4) / "__0_0.distcp"
    data = bytearray(path.read_bytes())
    data[5000] ^= 1
    path.write_bytes(bytes(data))
    got = fetch_files(storage, step_dir_name(4), manifest, FILES, keep=set(FILES))
    assert [(p.file, p.kind) for p in got.problems] == [("__0_0.distcp", "digest")]
    assert "__0_0.distcp" not in got.data and set(got.data) == set(FILES) - {"__0_0.distcp"}
    assert got.bytes_read == sum(len(d) for d in FILES.values()) + len(data)  # the bad file twice


def test_bytes_damaged_once_in_flight_are_read_again_and_accepted(storage, monkeypatch):
    manifest = write_step(storage, 4, files=FILES)
    real = storage.fs.cat_ranges
    calls = {"n": 0}

    def flip_the_first_batch(paths, starts, ends, **kwargs):
        out = real(paths, starts, ends, **kwargs)
        calls["n"] += 1
        if calls["n"] == 1:
            out[0] = bytes([out[0][0] ^ 0xFF]) + out[0][1:]
        return out

    monkeypatch.setattr(storage.fs, "cat_ranges", flip_the_first_batch)
    got = fetch_files(storage, step_dir_name(4), manifest, FILES, keep=set(FILES))
    assert got.problems == [] and got.data == FILES


def test_missing_resized_and_unlisted_files_are_problems_without_a_read(storage, tmp_path):
    manifest = write_step(storage, 4, files=FILES)
    directory = tmp_path / "ckpt" / step_dir_name(4)
    (directory / "__1_0.distcp").unlink()
    (directory / ".metadata").write_bytes(b"m" * 51)
    got = fetch_files(storage, step_dir_name(4), manifest, [*FILES, "other"], keep=set(FILES))
    kinds = sorted((p.file, p.kind) for p in got.problems)
    assert kinds == [(".metadata", "size"), ("__1_0.distcp", "missing"), ("other", "manifest")]
    assert got.bytes_read == len(FILES["__0_0.distcp"])  # the sound files only ("e" is empty)
    assert set(got.data) == {"__0_0.distcp", "e"}
