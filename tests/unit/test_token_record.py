"""The record beside a token file (``<file>.json``): a file is read in the element type it was
written in, and a file that is not the one its record describes is refused (issue 38, item 15);
the writers create their temporary files without following links (item 11)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import numpy as np
import pytest

from ftrain.config import DataConfig, ModelConfig
from ftrain.data import DataError, TokenFileSource, build_source, write_token_file
from ftrain.data import files as data_files
from ftrain.data.token_record import MAX_RECORD_BYTES, read_record, record_path

TOKENS = np.random.default_rng(0).integers(1, 300, size=2001)


def test_a_uint32_file_of_a_small_vocabulary_reads_as_uint32(tmp_path: Path) -> None:
    """auto picked uint16 for a vocabulary under 65,536: every other token read as 0, silently."""
    path = tmp_path / "c.bin"
    write_token_file(path, TOKENS, "uint32", vocab_size=300)
    src = TokenFileSource(path, seq_len=10, vocab_size=300)
    assert src.dtype.name == "uint32" and src.num_tokens == TOKENS.size
    np.testing.assert_array_equal(src.sample(np.array([3]))[0], TOKENS[30:41])
    record = read_record(path)
    assert record is not None and (record.dtype, record.num_tokens, record.vocab_size) == ("uint32", 2001, 300)
    assert record.size_bytes == path.stat().st_size == 4 * 2001


def test_an_explicit_dtype_that_is_not_the_recorded_one_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "c.bin"
    write_token_file(path, TOKENS, "uint32")
    with pytest.raises(DataError) as info:
        TokenFileSource(path, seq_len=10, vocab_size=300, dtype="uint16")
    assert 'was written as uint32 (c.bin.json (its record) says so) but data.token_dtype = "uint16"' in str(info.value)
    assert 'set data.token_dtype = "uint32" (or "uint16")' not in str(info.value)
    assert 'set data.token_dtype = "uint32" (or "auto")' in str(info.value)
    assert TokenFileSource(path, seq_len=10, vocab_size=300, dtype="uint32").dtype.name == "uint32"


def test_a_mixture_names_the_source_key(tmp_path: Path) -> None:
    a, b = tmp_path / "a.bin", tmp_path / "b.bin"
    write_token_file(a, TOKENS, "uint16")
    write_token_file(b, TOKENS, "uint32")
    data = DataConfig(sources=[{"path": str(a), "weight": 1}, {"path": str(b), "weight": 1, "token_dtype": "uint16"}])
    with pytest.raises(
        DataError, match=r'data\.sources\[1\]\.token_dtype = "uint16": set data\.sources\[1\]\.token_dtype'
    ):
        build_source(data, ModelConfig(vocab_size=300, seq_len=10))


def test_a_file_cut_short_or_rewritten_since_its_record_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "c.bin"
    write_token_file(path, TOKENS, "uint16")
    with open(path, "r+b") as fh:
        fh.truncate(2000 * 2)
    with pytest.raises(DataError, match=r"has 4000 bytes but c\.bin\.json \(its record\) records 2001 uint16 tokens"):
        TokenFileSource(path, seq_len=10, vocab_size=300)
    write_token_file(path, TOKENS, "uint16")
    data = bytearray(path.read_bytes())
    data[-2:] = b"\x07\x00"  # same size, another last token
    path.write_bytes(bytes(data))
    with pytest.raises(DataError, match="is not the file c.bin.json .* was written for"):
        TokenFileSource(path, seq_len=10, vocab_size=300)


def test_a_vocabulary_larger_than_the_model_is_refused_at_open(tmp_path: Path) -> None:
    path = tmp_path / "c.bin"
    write_token_file(path, TOKENS, "uint16", vocab_size=50257)
    with pytest.raises(
        DataError, match="a vocabulary of 50257 .* model.vocab_size = 300: set model.vocab_size >= 50257"
    ):
        TokenFileSource(path, seq_len=10, vocab_size=300)


def test_a_file_without_a_record_reads_as_before_and_says_what_it_assumed(tmp_path: Path, caplog) -> None:
    path = tmp_path / "legacy.bin"
    TOKENS.astype("<u2").tofile(path)
    with caplog.at_level(logging.WARNING, logger="ftrain.data.tokens"):
        src = TokenFileSource(path, seq_len=10, vocab_size=300)
    assert src.dtype.name == "uint16"
    assert "has no record (legacy.bin.json): assuming uint16 from model.vocab_size=300" in caplog.text


def test_a_raw_uint32_file_is_not_read_as_uint16(tmp_path: Path) -> None:
    """Without a record, a file whose every second uint16 is 0 is uint32 of small ids: refused under
    auto (naming the key), read as asked when the dtype is given."""
    path = tmp_path / "legacy32.bin"
    TOKENS.astype("<u4").tofile(path)
    with pytest.raises(DataError, match=r'looks like uint32 .* set data\.token_dtype = "uint32"'):
        TokenFileSource(path, seq_len=10, vocab_size=300)
    assert TokenFileSource(path, seq_len=10, vocab_size=300, dtype="uint32").num_tokens == TOKENS.size
    assert TokenFileSource(path, seq_len=10, vocab_size=300, dtype="uint16").num_tokens == 2 * TOKENS.size


@pytest.mark.parametrize(
    ("content", "words"),
    [
        (b"not json", "is not a token-file record (not JSON"),
        (b'{"format": "something else"}', "rename or remove it"),
        (b'{"format": "ftrain-token-file", "version": 2}', "record version 2 is not 1"),
        (b'{"format": "ftrain-token-file", "version": 1, "dtype": "int8"}', "dtype 'int8' is not one of"),
        (
            b'{"format": "ftrain-token-file", "version": 1, "dtype": "uint16", "num_tokens": 1e999}',
            "num_tokens must be an integer",
        ),
        (b"[" * 50_000, "not JSON"),  # deeper than the parser goes
        (b" " * (MAX_RECORD_BYTES + 1), "more than a record's"),
    ],
)
def test_a_bad_record_is_named(tmp_path: Path, content: bytes, words: str) -> None:
    path = tmp_path / "c.bin"
    write_token_file(path, TOKENS, "uint16")
    record_path(path).write_bytes(content)
    with pytest.raises(DataError, match="c.bin.json") as info:
        TokenFileSource(path, seq_len=10, vocab_size=300)
    assert words in str(info.value)


def test_write_token_file_does_not_follow_a_planted_link(tmp_path: Path, monkeypatch) -> None:
    """The old temporary name (``.<name>.tmp-<pid>``) was predictable: a link planted there made the
    write go through it, over the victim. Now the name is random and created O_EXCL|O_NOFOLLOW: even
    a link under the very name chosen is never written through."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    out = tmp_path / "c.bin"
    (tmp_path / f".c.bin.tmp-{os.getpid()}").symlink_to(victim)
    names = iter(["planted", "fresh", "fresh2"])
    (tmp_path / f".c.bin.tmp-{os.getpid()}-planted").symlink_to(victim)
    monkeypatch.setattr(data_files.secrets, "token_hex", lambda n: next(names))
    write_token_file(out, TOKENS, "uint16")
    assert victim.read_bytes() == b"precious"
    assert np.array_equal(np.fromfile(out, dtype="<u2"), TOKENS)
    assert json.loads(record_path(out).read_text())["num_tokens"] == TOKENS.size
    assert (out.stat().st_mode & 0o777) == 0o666 & ~_umask()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
