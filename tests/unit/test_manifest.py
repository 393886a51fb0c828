"""Digests and the manifest: round trips, canonical bytes, HMAC, and every way a manifest is refused."""

from __future__ import annotations

import json

import pytest
import xxhash

from ftrain.checkpoint.digest import ALGORITHMS, digest_bytes, digest_stream, new_hasher
from ftrain.checkpoint.errors import ManifestError
from ftrain.checkpoint.manifest import (
    CORRUPT_NAME,
    FORMAT_VERSION,
    HMAC_DOMAIN,
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    FileEntry,
    Manifest,
    canonical_json,
    hmac_key_from_env,
    job_problem,
    manifest_hmac,
    parse_json_bounded,
    parse_step_dir,
    step_dir_name,
)

KEY = b"secret-key"
JOB = "job-a"


def make_manifest(**overrides) -> Manifest:
    fields = dict(
        step=1200,
        round=3,
        world_size=2,
        layout={"strategy": "fsdp", "mesh": [2]},
        config_hash="abc123",
        config={"train": {"steps": 10, "lr": 0.001}},
        trainer={"cursor": {"epoch": 0, "next_index": 19200}},
        digest_algorithm="xxh3_128",
        files={
            "__0_0.distcp": FileEntry(10, digest_bytes(b"0" * 10, "xxh3_128")),
            ".metadata": FileEntry(3, digest_bytes(b"abc", "xxh3_128")),
        },
        created_time=1700000000.25,
        job=JOB,
    )
    fields.update(overrides)
    return Manifest(**fields)


def as_obj(m: Manifest, key: bytes | None = None) -> dict:
    return json.loads(m.to_json(key))


def encode(obj: dict) -> bytes:
    return json.dumps(obj).encode()


# -- digest ----------------------------------------------------------------------------------
def test_known_digest_values():
    assert digest_bytes(b"123456789", "crc32c") == "e3069283"  # the CRC-32C check value
    assert digest_bytes(b"hello", "xxh3_128") == xxhash.xxh3_128(b"hello").hexdigest()
    assert digest_bytes(b"", "crc32c") == "00000000"


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_stream_equals_whole_and_accepts_memoryview(algorithm):
    data = bytes(range(256)) * 41
    chunks = [data[i : i + 1000] for i in range(0, len(data), 1000)]
    assert digest_stream(chunks, algorithm) == (len(data), digest_bytes(data, algorithm))
    assert digest_stream([], algorithm) == (0, digest_bytes(b"", algorithm))
    h = new_hasher(algorithm)
    h.update(memoryview(data))
    assert h.hexdigest() == digest_bytes(data, algorithm)
    assert digest_bytes(data, algorithm) != digest_bytes(data[:-1] + b"\x00", algorithm)


def test_unknown_algorithm_names_module_and_choices():
    with pytest.raises(ValueError, match=r"checkpoint\.digest.*'sha1'.*xxh3_128, crc32c"):
        new_hasher("sha1")


# -- step directory names --------------------------------------------------------------------
def test_step_dir_names():
    assert step_dir_name(1200) == "step-000001200"
    assert step_dir_name(0) == "step-000000000"
    assert step_dir_name(12_345_678_901) == "step-12345678901"
    for step in (0, 7, 1200, 999_999_999, 1_000_000_000):
        assert parse_step_dir(step_dir_name(step)) == step
    assert parse_step_dir("step-000001200/") == 1200
    for bad in ("step-1200", "step-0000001200", "step-00000120x", "latest", "step-000001200.tmp", ""):
        assert parse_step_dir(bad) is None, bad
    with pytest.raises(ValueError):
        step_dir_name(-1)


# -- round trip and canonical bytes --------------------------------------------------------
@pytest.mark.parametrize("key", [None, KEY])
def test_round_trip(key):
    m = make_manifest()
    assert Manifest.from_json(m.to_json(key), key) == m
    assert m.format == FORMAT_VERSION
    assert m.total_size_bytes == 13


def test_canonical_json_is_independent_of_dict_order():
    a = make_manifest(layout={"a": 1, "b": 2}, files={"x": FileEntry(1, "0" * 32), "y": FileEntry(2, "1" * 32)})
    b = make_manifest(layout={"b": 2, "a": 1}, files={"y": FileEntry(2, "1" * 32), "x": FileEntry(1, "0" * 32)})
    assert a.to_json() == b.to_json()
    assert a.to_json(KEY) == b.to_json(KEY)
    assert b" " not in a.to_json()  # fixed compact separators


def test_crc32c_manifest_round_trip():
    m = make_manifest(
        digest_algorithm="crc32c", files={".metadata": FileEntry(9, digest_bytes(b"123456789", "crc32c"))}
    )
    assert Manifest.from_json(m.to_json()) == m


def test_hmac_ignored_without_key():
    m = make_manifest()
    assert Manifest.from_json(m.to_json(KEY)) == m


# -- refusals --------------------------------------------------------------------------------
def refused(data: bytes, match: str, key: bytes | None = None) -> None:
    with pytest.raises(ManifestError, match=match):
        Manifest.from_json(data, key)


def test_invalid_json():
    refused(b"{not json", "not valid JSON")
    refused(b"\xff\xfe", "not valid JSON")
    refused(b"[1, 2]", "must be a JSON object")


def test_unknown_format_version():
    obj = as_obj(make_manifest())
    refused(encode({**obj, "format": 3}), "unknown manifest format version 3")
    refused(encode({k: v for k, v in obj.items() if k != "format"}), "'format' is missing")
    refused(encode({**obj, "format": "1"}), "'format'")


@pytest.mark.parametrize(
    "name",
    [
        "step",
        "round",
        "world_size",
        "layout",
        "config_hash",
        "config",
        "trainer",
        "digest_algorithm",
        "files",
        "created_time",
        "job",
    ],
)
def test_missing_field_is_named(name):
    obj = as_obj(make_manifest())
    del obj[name]
    refused(encode(obj), f"'{name}' is missing")


@pytest.mark.parametrize(
    "name,value",
    [
        ("step", "1200"),
        ("step", True),
        ("step", 1.5),
        ("round", None),
        ("world_size", [2]),
        ("layout", "fsdp"),
        ("config_hash", 7),
        ("config", []),
        ("trainer", 3),
        ("digest_algorithm", 1),
        ("files", []),
        ("created_time", "now"),
        ("job", 7),
    ],
)
def test_ill_typed_field_is_named(name, value):
    obj = as_obj(make_manifest())
    obj[name] = value
    refused(encode(obj), f"'{name}'")


@pytest.mark.parametrize(
    "name,value,match",
    [
        ("step", -1, "'step' must be >= 0"),
        ("world_size", 0, "'world_size' must be >= 1"),
        ("digest_algorithm", "md5", "'digest_algorithm' is 'md5'"),
    ],
)
def test_bad_field_values(name, value, match):
    obj = as_obj(make_manifest())
    obj[name] = value
    refused(encode(obj), match)


@pytest.mark.parametrize(
    "name,entry,match",
    [
        ("f", {"size_bytes": 1}, "bad file entry 'f'"),
        ("f", {"size_bytes": 1, "digest": "0" * 32, "x": 1}, "bad file entry 'f'"),
        ("f", [1, "0" * 32], "bad file entry 'f'"),
        ("f", {"size_bytes": -1, "digest": "0" * 32}, "bad file entry 'f': size_bytes"),
        ("f", {"size_bytes": "1", "digest": "0" * 32}, "bad file entry 'f': size_bytes"),
        ("f", {"size_bytes": 1, "digest": "0" * 8}, "bad file entry 'f': digest must be 32"),
        ("f", {"size_bytes": 1, "digest": "G" * 32}, "bad file entry 'f': digest"),
        ("../escape", {"size_bytes": 1, "digest": "0" * 32}, "bad file entry '../escape'"),
        ("/abs", {"size_bytes": 1, "digest": "0" * 32}, "bad file entry '/abs'"),
        ("a//b", {"size_bytes": 1, "digest": "0" * 32}, "bad file entry 'a//b'"),
        ("", {"size_bytes": 1, "digest": "0" * 32}, "bad file entry ''"),
        (MANIFEST_NAME, {"size_bytes": 1, "digest": "0" * 32}, "reserved"),
        (CORRUPT_NAME, {"size_bytes": 1, "digest": "0" * 32}, "reserved"),
    ],
)
def test_bad_file_entry(name, entry, match):
    obj = as_obj(make_manifest())
    obj["files"][name] = entry
    refused(encode(obj), match)


def test_constructor_refuses_bad_values_too():
    with pytest.raises(ManifestError, match="digest_algorithm"):
        make_manifest(digest_algorithm="sha256")
    with pytest.raises(ManifestError, match="bad file entry"):
        make_manifest(files={"../x": FileEntry(1, "0" * 32)})


def test_hmac_missing_while_key_set():
    refused(make_manifest().to_json(), "no 'hmac'", KEY)


def test_hmac_wrong_key():
    refused(make_manifest().to_json(KEY), "HMAC mismatch", b"other-key")


@pytest.mark.parametrize(
    "edit",
    [
        lambda o: o.update(step=1300),
        lambda o: o["files"]["__0_0.distcp"].update(digest="f" * 32),
        lambda o: o["trainer"]["cursor"].update(next_index=0),
        lambda o: o.update(hmac="0" * 64),
        lambda o: o.update(hmac=5),
        lambda o: o.update(extra="field"),
        lambda o: o.update(job="job-b"),
        lambda o: o.update(round=4),
        lambda o: o.update(created_time=1700000001.0),
    ],
)
def test_hmac_detects_edits(edit):
    obj = as_obj(make_manifest(), KEY)
    edit(obj)
    refused(encode(obj), "HMAC|hmac", KEY)


def test_edited_manifest_reencoded_with_same_content_still_passes():
    """HMAC covers the content, not the byte layout: pretty-printed JSON of the same object passes."""
    obj = as_obj(make_manifest(), KEY)
    assert Manifest.from_json(json.dumps(obj, indent=4).encode(), KEY) == make_manifest()


# -- key from the environment --------------------------------------------------------------
def test_hmac_key_from_env(monkeypatch):
    assert hmac_key_from_env("") is None
    monkeypatch.setenv("FTRAIN_TEST_HMAC", "k3y")
    assert hmac_key_from_env("FTRAIN_TEST_HMAC") == b"k3y"
    monkeypatch.delenv("FTRAIN_TEST_HMAC")
    with pytest.raises(ManifestError, match="FTRAIN_TEST_HMAC"):
        hmac_key_from_env("FTRAIN_TEST_HMAC")
    monkeypatch.setenv("FTRAIN_TEST_HMAC", "")
    with pytest.raises(ManifestError, match="FTRAIN_TEST_HMAC"):
        hmac_key_from_env("FTRAIN_TEST_HMAC")


# -- format 2: the HMAC binds the job, is domain-separated; format 1 --------------------------
def v1_obj(key: bytes | None = None) -> dict:
    """A format-1 manifest as the previous version wrote it (no job; HMAC over the bare JSON)."""
    import hashlib
    import hmac as hmac_mod

    obj = as_obj(make_manifest())
    del obj["job"]
    obj["format"] = 1
    if key is not None:
        obj["hmac"] = hmac_mod.new(key, canonical_json(obj), hashlib.sha256).hexdigest()
    return obj


def test_job_round_trips_and_is_signed():
    m = make_manifest(job="team/run-7")
    assert Manifest.from_json(m.to_json(KEY), KEY).job == "team/run-7"
    assert FORMAT_VERSION == 2 and as_obj(m)["format"] == 2


def test_hmac_is_domain_separated():
    """The MAC is over b"ftrain-manifest-v2\\n" + canonical JSON: a bare-JSON MAC (format 1's) never passes."""
    import hashlib
    import hmac as hmac_mod

    obj = as_obj(make_manifest())
    assert manifest_hmac(KEY, obj) == hmac_mod.new(KEY, HMAC_DOMAIN + canonical_json(obj), hashlib.sha256).hexdigest()
    obj["hmac"] = hmac_mod.new(KEY, canonical_json(obj), hashlib.sha256).hexdigest()
    refused(encode(obj), "HMAC mismatch", KEY)


def test_format_1_is_read_without_a_key_and_refused_with_one():
    m = Manifest.from_json(encode(v1_obj(KEY)))
    assert (m.format, m.job, m.step) == (1, "", 1200)
    refused(encode(v1_obj(KEY)), "format-1 manifest refused while an HMAC key is set", KEY)
    refused(encode({**v1_obj(), "job": JOB}), "format-1 manifest has no 'job'")
    with pytest.raises(ManifestError, match="only format 2"):
        m.to_json()


@pytest.mark.parametrize(
    "job,ok", [("", True), ("a" * 256, True), ("a" * 257, False), ("x\n", False), (" x", False), ("j\x00", False)]
)
def test_job_ids(job, ok):
    assert (job_problem(job) is None) == ok
    if not ok:
        with pytest.raises(ManifestError, match="'job'"):
            make_manifest(job=job)


# -- bounded parsing: hostile manifests are ManifestErrors, never crashes --------------------
def _with_raw(value: bytes) -> bytes:
    """The canonical manifest with its ``layout`` replaced by raw JSON text ``value``."""
    data = make_manifest().to_json()
    start = data.index(b'"layout":') + len(b'"layout":')
    end = data.index(b',"round"')
    return data[:start] + value + data[end:]


@pytest.mark.parametrize(
    "raw,match",
    [
        (b"[" * 100_000 + b"]" * 100_000, "nests deeper than"),
        (b'{"a":' * 65 + b"1" + b"}" * 65, "nests deeper than"),
        (b"1" * 400, "more than 40 digits"),
        (b"1e999", "not finite"),
        (b"NaN", "NaN"),
        (b"-Infinity", "Infinity"),
        (b'{"a":1,"a":2}', "repeats the key 'a'"),
    ],
)
def test_hostile_json_is_a_manifest_error(raw, match):
    with pytest.raises(ManifestError, match=match):
        Manifest.from_json(_with_raw(raw), KEY)  # refused before the HMAC is even computed


def test_brackets_inside_strings_do_not_count_as_nesting():
    m = Manifest.from_json(make_manifest(layout={"note": "[" * 500 + '\\"{' * 100}).to_json())
    assert m.layout["note"].startswith("[[[")


def test_400_digit_created_time_is_refused():
    obj = as_obj(make_manifest())
    data = encode(obj).replace(b"1700000000.25", b"9" * 400)
    refused(data, "more than 40 digits")


def test_oversized_manifest_is_refused_unparsed():
    with pytest.raises(ManifestError, match="more than the"):
        parse_json_bounded(b" " * (MAX_MANIFEST_BYTES + 1))


def test_files_must_list_metadata():
    obj = as_obj(make_manifest())
    obj["files"] = {}
    refused(encode(obj), "lists no .metadata")
