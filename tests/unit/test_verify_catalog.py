"""Catalog states, file verification, the corrupt marker, rank splitting, and ``ftrain ckpt ls/show/verify``."""

from __future__ import annotations

import argparse
import json
import uuid

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ftrain.checkpoint.catalog import committed_before, fallback_order, list_steps, newest_committed, read_manifest
from ftrain.checkpoint.digest import digest_bytes
from ftrain.checkpoint.errors import ManifestError
from ftrain.checkpoint.manifest import CORRUPT_NAME, MANIFEST_NAME, FileEntry, Manifest, step_dir_name
from ftrain.checkpoint.storage import Storage
from ftrain.checkpoint.verify import Problem, mark_corrupt, split_files, verify_files, verify_step
from ftrain.cli.ckpt import add_parsers as add_ckpt_parser

KEY = b"test-hmac-key"


def dcp_metadata(step: int) -> bytes:
    """A real (empty) DCP Metadata pickle: verify also parses .metadata with the allow-list."""
    import pickle

    from torch.distributed.checkpoint.metadata import Metadata

    return pickle.dumps(Metadata(state_dict_metadata={}, planner_data={"step": step}))


def step_files(step: int) -> dict[str, bytes]:
    return {
        "__0_0.distcp": bytes([step % 251]) * 300,
        "__1_0.distcp": b"rank-one" * 20,
        ".metadata": dcp_metadata(step),
    }


def write_step(
    storage: Storage,
    step: int,
    *,
    files: dict[str, bytes] | None = None,
    commit: bool = True,
    key: bytes | None = None,
    algorithm: str = "xxh3_128",
    created_time: float = 1.7e9,
) -> Manifest:
    """A hand-made step directory: files, then (if ``commit``) the manifest, last."""
    files = step_files(step) if files is None else files
    dirname = step_dir_name(step)
    for name, data in files.items():
        storage.write_bytes(f"{dirname}/{name}", data)
    manifest = Manifest(
        step=step,
        round=1,
        world_size=2,
        layout={"strategy": "ddp"},
        config_hash="h",
        config={},
        trainer={"cursor": [0, step * 16]},
        digest_algorithm=algorithm,
        files={n: FileEntry(len(d), digest_bytes(d, algorithm)) for n, d in files.items()},
        created_time=created_time,
    )
    if commit:
        storage.write_bytes(f"{dirname}/{MANIFEST_NAME}", manifest.to_json(key))
    return manifest


@pytest.fixture
def storage(tmp_path) -> Storage:
    return Storage(f"file://{tmp_path}/ckpt")


@pytest.fixture
def mem_storage():
    root = f"memory://ftrain-test-{uuid.uuid4().hex}"
    s = Storage(root)
    yield s
    s.remove("", recursive=True)


def flip_byte(storage: Storage, rel: str, index: int = 7) -> None:
    data = bytearray(storage.read_bytes(rel))
    data[index] ^= 0x01
    storage.write_bytes(rel, bytes(data))


# -- catalog ---------------------------------------------------------------------------------
def test_catalog_states(storage):
    write_step(storage, 100)
    write_step(storage, 200)
    write_step(storage, 300, commit=False)
    write_step(storage, 400)
    storage.write_bytes(f"{step_dir_name(400)}/{CORRUPT_NAME}", json.dumps({"reason": "digest mismatch"}).encode())
    write_step(storage, 500, commit=False)
    storage.write_bytes(f"{step_dir_name(500)}/{MANIFEST_NAME}", b"{truncated")
    storage.write_bytes("latest", b"step-000000500")
    storage.write_bytes("step-1/junk", b"not a canonical step dir")

    steps = list_steps(storage)
    assert [(s.step, s.state) for s in steps] == [
        (100, "committed"),
        (200, "committed"),
        (300, "uncommitted"),
        (400, "corrupt"),
        (500, "corrupt"),
    ]
    by_step = {s.step: s for s in steps}
    assert by_step[100].manifest is not None and by_step[100].error is None
    assert by_step[300].manifest is None and by_step[300].error is None
    assert by_step[400].marked and "digest mismatch" in by_step[400].error and by_step[400].manifest is not None
    assert not by_step[500].marked and "not valid JSON" in by_step[500].error and by_step[500].manifest is None
    assert newest_committed(steps).step == 200
    assert [s.step for s in committed_before(steps, 200)] == [100]
    assert [s.step for s in committed_before(steps, 10_000)] == [200, 100]
    assert [s.step for s in fallback_order(steps)] == [200, 100]
    assert newest_committed([]) is None


def test_catalog_with_hmac_key(mem_storage):
    write_step(mem_storage, 1, key=KEY)
    write_step(mem_storage, 2)  # no HMAC
    write_step(mem_storage, 3, key=b"another key")
    states = {s.step: (s.state, s.error) for s in list_steps(mem_storage, KEY)}
    assert states[1] == ("committed", None)
    assert states[2][0] == "corrupt" and "no 'hmac'" in states[2][1]
    assert states[3][0] == "corrupt" and "HMAC mismatch" in states[3][1]
    assert all(s.state == "committed" for s in list_steps(mem_storage))  # without a key nothing is checked


def test_manifest_in_the_wrong_directory_is_corrupt(storage):
    write_step(storage, 5)
    storage.write_bytes(
        f"{step_dir_name(6)}/{MANIFEST_NAME}", storage.read_bytes(f"{step_dir_name(5)}/{MANIFEST_NAME}")
    )
    assert {s.step: s.state for s in list_steps(storage)} == {5: "committed", 6: "corrupt"}
    with pytest.raises(ManifestError, match="says step 5"):
        read_manifest(storage, step_dir_name(6))


def test_empty_root(tmp_path):
    assert list_steps(Storage(f"file://{tmp_path}/nothing-here")) == []


# -- verify ----------------------------------------------------------------------------------
@pytest.mark.parametrize("algorithm", ["xxh3_128", "crc32c"])
def test_verify_clean_step(mem_storage, algorithm):
    write_step(mem_storage, 10, algorithm=algorithm)
    report = verify_step(mem_storage, step_dir_name(10))
    assert report.ok and report.problems == [] and report.step == 10 and not report.corrupt
    assert report.files_checked == 3 and report.bytes_checked == sum(map(len, step_files(10).values()))


def test_verify_streams_in_small_chunks(storage):
    m = write_step(storage, 10)
    assert verify_files(storage, step_dir_name(10), m, chunk_bytes=7) == []


def test_verify_detects_flipped_byte(storage):
    write_step(storage, 10)
    flip_byte(storage, f"{step_dir_name(10)}/__1_0.distcp")
    report = verify_step(storage, step_dir_name(10))
    assert not report.ok and report.corrupt
    assert [(p.file, p.kind) for p in report.problems] == [("__1_0.distcp", "digest")]
    assert str(report.problems[0]).startswith("__1_0.distcp: digest: xxh3_128 expected ")


def test_verify_detects_truncated_file(storage):
    write_step(storage, 10)
    rel = f"{step_dir_name(10)}/__0_0.distcp"
    storage.write_bytes(rel, storage.read_bytes(rel)[:-1])
    problems = verify_step(storage, step_dir_name(10)).problems
    assert [(p.file, p.kind) for p in problems] == [("__0_0.distcp", "size")]
    assert "expected 300 bytes, found 299" in problems[0].detail


def test_verify_detects_deleted_file(storage):
    write_step(storage, 10)
    storage.remove(f"{step_dir_name(10)}/.metadata")
    problems = verify_step(storage, step_dir_name(10)).problems
    assert [(p.file, p.kind) for p in problems] == [(".metadata", "missing")]


def test_verify_detects_hand_edited_manifest_by_hmac(storage):
    write_step(storage, 10, key=KEY)
    rel = f"{step_dir_name(10)}/{MANIFEST_NAME}"
    obj = json.loads(storage.read_bytes(rel))
    obj["files"]["__0_0.distcp"]["size_bytes"] = 301
    storage.write_bytes(rel, json.dumps(obj).encode())
    problems = verify_step(storage, step_dir_name(10), KEY).problems
    assert [(p.file, p.kind) for p in problems] == [(MANIFEST_NAME, "manifest")]
    assert "HMAC mismatch" in problems[0].detail


def test_verify_detects_hand_edited_manifest_by_digest(storage):
    """Without a key, an edited manifest no longer matches the bytes it describes."""
    write_step(storage, 10)
    rel = f"{step_dir_name(10)}/{MANIFEST_NAME}"
    obj = json.loads(storage.read_bytes(rel))
    obj["files"][".metadata"]["digest"] = "0" * 32
    storage.write_bytes(rel, json.dumps(obj).encode())
    problems = verify_step(storage, step_dir_name(10)).problems
    assert [(p.file, p.kind) for p in problems] == [(".metadata", "digest")]


def test_verify_uncommitted_and_unparsable(storage):
    write_step(storage, 10, commit=False)
    assert [(p.file, p.kind) for p in verify_step(storage, step_dir_name(10)).problems] == [(MANIFEST_NAME, "missing")]
    storage.write_bytes(f"{step_dir_name(10)}/{MANIFEST_NAME}", b'{"format": 1}')
    problems = verify_step(storage, step_dir_name(10)).problems
    assert [(p.file, p.kind) for p in problems] == [(MANIFEST_NAME, "manifest")]


def test_verify_subset_and_unknown_name(storage):
    m = write_step(storage, 10)
    flip_byte(storage, f"{step_dir_name(10)}/__0_0.distcp")
    assert verify_files(storage, step_dir_name(10), m, names=["__1_0.distcp", ".metadata"]) == []
    problems = verify_files(storage, step_dir_name(10), m, names=["__0_0.distcp", "nope"])
    assert [(p.file, p.kind) for p in problems] == [("__0_0.distcp", "digest"), ("nope", "manifest")]


def test_verify_unreadable_is_not_proof_of_corruption(storage, tmp_path):
    m = write_step(storage, 10)
    storage.remove(f"{step_dir_name(10)}/.metadata")
    (tmp_path / "ckpt" / step_dir_name(10) / ".metadata").mkdir()  # a directory where a file should be
    problems = verify_files(storage, step_dir_name(10), m)
    assert [(p.file, p.kind) for p in problems] == [(".metadata", "unreadable")]


def test_mark_corrupt_writes_marker_and_deletes_nothing(storage):
    write_step(storage, 10)
    dirname = step_dir_name(10)
    before = storage.listdir(dirname)
    flip_byte(storage, f"{dirname}/.metadata", 0)
    report = verify_step(storage, dirname)
    mark_corrupt(storage, dirname, report.problems, "verification failed before load", now_s=123.0)
    assert storage.listdir(dirname) == sorted([*before, CORRUPT_NAME])
    marker = json.loads(storage.read_bytes(f"{dirname}/{CORRUPT_NAME}"))
    assert marker == {
        "time": 123.0,
        "reason": "verification failed before load",
        "problems": [{"file": ".metadata", "kind": "digest", "detail": report.problems[0].detail}],
    }
    (info,) = list_steps(storage)
    assert info.state == "corrupt" and info.marked and "verification failed before load" in info.error


def test_problem_str():
    assert str(Problem("a.distcp", "size", "expected 1 bytes, found 0")) == "a.distcp: size: expected 1 bytes, found 0"


# -- split_files -----------------------------------------------------------------------------
def _manifest_with_sizes(sizes: list[int]) -> Manifest:
    return Manifest(
        step=1,
        round=0,
        world_size=1,
        layout={},
        config_hash="",
        config={},
        trainer={},
        digest_algorithm="crc32c",
        files={f"f{i:03d}": FileEntry(s, "0" * 8) for i, s in enumerate(sizes)},
        created_time=0.0,
    )


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(0, 10_000), max_size=30), world_size=st.integers(1, 9))
def test_split_files_covers_every_file_once(sizes, world_size):
    m = _manifest_with_sizes(sizes)
    parts = [split_files(m, r, world_size) for r in range(world_size)]
    flat = [name for part in parts for name in part]
    assert sorted(flat) == sorted(m.files) and len(flat) == len(set(flat))
    assert parts == [split_files(m, r, world_size) for r in range(world_size)]  # deterministic
    loads = [sum(m.files[n].size_bytes for n in part) for part in parts]
    if sizes:  # greedy largest-first: no rank exceeds the ideal share by more than the largest file
        assert max(loads) <= sum(sizes) / world_size + max(sizes) + len(sizes)


def test_split_files_rejects_bad_rank():
    with pytest.raises(ValueError):
        split_files(_manifest_with_sizes([1]), 2, 2)


def test_ranks_split_the_verification(storage):
    m = write_step(storage, 10)
    flip_byte(storage, f"{step_dir_name(10)}/__1_0.distcp")
    found = [p.file for r in range(2) for p in verify_files(storage, step_dir_name(10), m, split_files(m, r, 2))]
    assert found == ["__1_0.distcp"]


# -- CLI -------------------------------------------------------------------------------------
def run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="ftrain")
    add_ckpt_parser(parser.add_subparsers(dest="command", required=True))
    args, overrides = parser.parse_known_args(argv)
    return args.func(args, overrides)


def test_cli_verify_exit_codes_and_output(storage, capsys):
    write_step(storage, 100)
    write_step(storage, 200)
    write_step(storage, 300, commit=False)
    assert run_cli(["ckpt", "verify", storage.url]) == 0
    out = capsys.readouterr().out
    assert "step-000000100: OK (3 files" in out and "step-000000300: uncommitted, skipped" in out

    flip_byte(storage, f"{step_dir_name(200)}/__0_0.distcp")
    assert run_cli(["ckpt", "verify", storage.url]) == 1
    out = capsys.readouterr().out
    assert "step-000000200: FAILED" in out and "__0_0.distcp: digest:" in out and "step-000000100: OK" in out

    assert run_cli(["ckpt", "verify", storage.url, "100"]) == 0
    assert run_cli(["ckpt", "verify", storage.url, "step-000000200"]) == 1
    assert "__0_0.distcp: digest" in capsys.readouterr().out
    assert run_cli(["ckpt", "verify", storage.url, "300"]) == 1
    assert "manifest.json: missing" in capsys.readouterr().out


def test_cli_verify_with_hmac(storage, capsys, monkeypatch):
    write_step(storage, 1, key=KEY)
    monkeypatch.setenv("FTRAIN_TEST_KEY", KEY.decode())
    assert run_cli(["ckpt", "verify", storage.url, "--hmac-key-env", "FTRAIN_TEST_KEY"]) == 0
    monkeypatch.setenv("FTRAIN_TEST_KEY", "wrong")
    assert run_cli(["ckpt", "verify", storage.url, "--hmac-key-env", "FTRAIN_TEST_KEY"]) == 1
    assert "HMAC mismatch" in capsys.readouterr().out
    monkeypatch.delenv("FTRAIN_TEST_KEY")
    assert run_cli(["ckpt", "verify", storage.url, "--hmac-key-env", "FTRAIN_TEST_KEY"]) == 2
    assert "FTRAIN_TEST_KEY" in capsys.readouterr().err


def test_cli_verify_skips_steps_already_marked(storage, capsys):
    write_step(storage, 1)
    write_step(storage, 2)
    mark_corrupt(storage, step_dir_name(2), [], "chaos test")
    assert run_cli(["ckpt", "verify", storage.url]) == 0
    assert "step-000000002: marked corrupt: chaos test, skipped" in capsys.readouterr().out


def test_cli_ls_and_show(storage, capsys):
    write_step(storage, 100)
    write_step(storage, 200, commit=False)
    assert run_cli(["ckpt", "ls", storage.url]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["STEP", "STATE", "WORLD", "ROUND", "FILES", "SIZE", "CREATED", "NOTE"]
    assert lines[1].split()[:5] == ["100", "committed", "2", "1", "3"] and "2023-11-14T22:13:20Z" in lines[1]
    assert lines[2].split() == ["200", "uncommitted", "-", "-", "-", "-", "-"]

    assert run_cli(["ckpt", "show", storage.url, "100"]) == 0
    out = capsys.readouterr().out
    assert '"world_size": 2' in out and "__1_0.distcp" in out and "total: 3 files" in out
    assert run_cli(["ckpt", "show", storage.url, "200"]) == 1
    assert run_cli(["ckpt", "ls", storage.url, "--bogus"]) == 2


def test_verify_refuses_metadata_pickle_even_with_matching_digest(storage, tmp_path):
    import pickle

    sentinel = tmp_path / "PWNED"

    class Payload:
        def __reduce__(self):
            return (open, (str(sentinel), "w"))

    files = step_files(12)
    files[".metadata"] = pickle.dumps(Payload())
    write_step(storage, 12, files=files)  # the manifest's digest matches the malicious bytes
    report = verify_step(storage, step_dir_name(12))
    assert not report.ok
    assert [p.kind for p in report.problems] == ["unsafe"] and report.problems[0].file == ".metadata"
    assert "builtins.open" in report.problems[0].detail or "open" in report.problems[0].detail
    assert not sentinel.exists()


def test_cli_says_when_it_ran_without_an_hmac_key(storage, capsys, monkeypatch):
    """Without a key a digest only proves the bytes match a manifest the bucket's writer could
    have forged: ls and verify say so, and name signed manifests whose HMAC went unchecked."""
    from ftrain.cli.ckpt import NO_HMAC_KEY_NOTE

    write_step(storage, 1, key=KEY)
    write_step(storage, 2)
    for argv in (["ckpt", "ls", storage.url], ["ckpt", "verify", storage.url]):
        assert run_cli(argv) == 0
        err = capsys.readouterr().err
        assert (
            "no HMAC key: digests prove integrity against accidents, not against someone who can write "
            "the bucket; set checkpoint.hmac_key_env"
            in err
            and NO_HMAC_KEY_NOTE in err
        )
        assert "1 manifest(s) carry an 'hmac' field that was NOT checked (step-000000001)" in err
    assert run_cli(["ckpt", "verify", storage.url, "2"]) == 0
    err = capsys.readouterr().err
    assert NO_HMAC_KEY_NOTE in err and "NOT checked" not in err

    monkeypatch.setenv("FTRAIN_TEST_KEY", KEY.decode())
    assert run_cli(["ckpt", "verify", storage.url, "1", "--hmac-key-env", "FTRAIN_TEST_KEY"]) == 0
    err = capsys.readouterr().err
    assert "manifest HMACs checked with the key in $FTRAIN_TEST_KEY" in err and "no HMAC key" not in err


def test_verify_checks_the_pickles_a_load_would_unpickle(storage, tmp_path):
    """verify_step runs check_pickled_items: a .metadata that points outside the manifest's
    files is unsafe even though every digest matches."""
    import pickle

    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex

    files = step_files(13)
    files[".metadata"] = pickle.dumps(
        Metadata(
            state_dict_metadata={"lr": BytesStorageMetadata()},
            storage_data={MetadataIndex("lr"): _StorageInfo("../step-000000012/__0_0.distcp", 0, 10)},
        )
    )
    write_step(storage, 13, files=files)
    report = verify_step(storage, step_dir_name(13))
    assert [(p.file, p.kind) for p in report.problems] == [(".metadata", "unsafe")] and report.corrupt
    detail = report.problems[0].detail
    assert "'../step-000000012/__0_0.distcp', which is not a data file listed in the manifest" in detail
