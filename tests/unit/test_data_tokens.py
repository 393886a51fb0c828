"""TokenFileSource: memmapped flat token files, windows, and errors that name the file."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest

from ftrain.config import DataConfig, ModelConfig
from ftrain.data import DataError, TokenFileSource, build_source, write_token_file


@pytest.mark.parametrize(("dtype", "vocab_size", "high"), [("uint16", 65536, 65536), ("uint32", 100_000, 100_000)])
def test_round_trip(tmp_path: Path, dtype: str, vocab_size: int, high: int) -> None:
    tokens = np.random.default_rng(0).integers(0, high, size=1001)
    tokens[:2] = [0, high - 1]  # the extremes of the type survive
    path = tmp_path / f"corpus.{dtype}.bin"
    write_token_file(path, tokens, dtype)
    assert path.stat().st_size == tokens.size * np.dtype(dtype).itemsize
    src = TokenFileSource(path, seq_len=10, vocab_size=vocab_size, dtype=dtype)
    assert src.num_tokens == 1001
    assert src.num_samples == (1001 - 1) // 10
    rows = src.sample(np.arange(src.num_samples))
    assert rows.dtype == np.int64 and rows.shape == (100, 11)
    for i in (0, 37, 99):
        np.testing.assert_array_equal(rows[i], tokens[i * 10 : i * 10 + 11])
    assert src.entropy_floor_nats is None


def test_auto_dtype_follows_vocab_size_without_a_record(tmp_path: Path) -> None:
    path = tmp_path / "t.bin"
    np.arange(64, dtype="<u2").tofile(path)  # a raw file, as other tools write them: no record beside it
    assert TokenFileSource(path, 4, vocab_size=65536).dtype == np.uint16
    assert TokenFileSource(path, 4, vocab_size=65537).dtype == np.uint32


def test_windows_overlap_by_exactly_one_token(tmp_path: Path) -> None:
    path = tmp_path / "t.bin"
    write_token_file(path, np.arange(50), "uint16")
    src = TokenFileSource(path, seq_len=7, vocab_size=64)
    rows = src.sample(np.arange(src.num_samples))
    assert src.num_samples == 7
    for a, b in zip(rows[:-1], rows[1:], strict=True):
        assert a[-1] == b[0]
        assert not set(a[:-1].tolist()) & set(b.tolist())
    # Every token but the first is a target exactly once (the last one here is the tail).
    targets = np.concatenate([r[1:] for r in rows])
    np.testing.assert_array_equal(targets, np.arange(1, 50))


def test_sample_order_and_repeats_follow_ids(tmp_path: Path) -> None:
    path = tmp_path / "t.bin"
    write_token_file(path, np.arange(100), "uint16")
    src = TokenFileSource(path, seq_len=9, vocab_size=100)
    rows = src.sample(np.array([3, 0, 3]))
    np.testing.assert_array_equal(rows[0], np.arange(27, 37))
    np.testing.assert_array_equal(rows[1], np.arange(0, 10))
    np.testing.assert_array_equal(rows[0], rows[2])


def test_pickles_by_path_not_by_content(tmp_path: Path) -> None:
    path = tmp_path / "t.bin"
    write_token_file(path, np.arange(20_000) % 300, "uint16")
    src = TokenFileSource(path, seq_len=32, vocab_size=300)
    blob = pickle.dumps(src)
    assert len(blob) < 4_000  # the 40 kB of tokens are not in it
    copy = pickle.loads(blob)
    np.testing.assert_array_equal(copy.sample(np.array([5, 600])), src.sample(np.array([5, 600])))


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.bin"
    with pytest.raises(DataError, match="does not exist") as info:
        TokenFileSource(path, 8, 256)
    assert str(path) in str(info.value)


def test_too_short_file(tmp_path: Path) -> None:
    path = tmp_path / "short.bin"
    write_token_file(path, np.arange(8), "uint16")
    with pytest.raises(DataError, match="fewer than one sample") as info:
        TokenFileSource(path, seq_len=8, vocab_size=256)
    assert str(path) in str(info.value) and "model.seq_len" in str(info.value)
    assert TokenFileSource(path, seq_len=7, vocab_size=256).num_samples == 1  # 8 tokens = one window


def test_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "empty.bin"
    path.write_bytes(b"")
    with pytest.raises(DataError, match="holds 0 tokens"):
        TokenFileSource(path, seq_len=4, vocab_size=256)


def test_size_not_a_multiple_of_dtype(tmp_path: Path) -> None:
    path = tmp_path / "odd.bin"
    path.write_bytes(b"\x01\x00" * 20 + b"\x07")
    with pytest.raises(DataError, match="not a multiple") as info:
        TokenFileSource(path, seq_len=4, vocab_size=256)
    assert str(path) in str(info.value) and "data.token_dtype" in str(info.value)
    path.write_bytes(b"\x01\x00" * 21)  # 42 bytes: fine as uint16, not as uint32
    with pytest.raises(DataError, match="uint32 element size"):
        TokenFileSource(path, seq_len=4, vocab_size=256, dtype="uint32")


def test_out_of_vocab_token_names_the_file(tmp_path: Path) -> None:
    tokens = np.arange(40)
    tokens[25] = 70_000
    path = tmp_path / "big.bin"
    write_token_file(path, tokens, "uint32")
    src = TokenFileSource(path, seq_len=8, vocab_size=65536, dtype="uint32")
    src.sample(np.array([0, 1]))  # windows before the bad token are fine
    with pytest.raises(DataError) as info:
        src.sample(np.array([0, 3]))
    message = str(info.value)
    assert "token id 70000 >= model.vocab_size=65536" in message
    assert str(path) in message


def test_vocab_boundary(tmp_path: Path) -> None:
    path = tmp_path / "edge.bin"
    write_token_file(path, np.array([0, 63, 2, 63, 64]), "uint16")
    src = TokenFileSource(path, seq_len=2, vocab_size=64)
    np.testing.assert_array_equal(src.sample(np.array([0]))[0], [0, 63, 2])  # 63 = vocab - 1 is fine
    with pytest.raises(DataError, match="token id 64 >= model.vocab_size=64"):
        src.sample(np.array([1]))  # window [2, 63, 64]


def test_out_of_range_sample_id_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "t.bin"
    write_token_file(path, np.arange(41), "uint16")
    src = TokenFileSource(path, seq_len=8, vocab_size=64)
    with pytest.raises(DataError, match="out of range") as info:
        src.sample(np.array([src.num_samples]))
    assert str(path) in str(info.value)


def test_bad_dtype_names(tmp_path: Path) -> None:
    path = tmp_path / "t.bin"
    with pytest.raises(DataError, match="uint8"):
        write_token_file(path, np.arange(4), "uint8")
    with pytest.raises(DataError, match="uint32"):
        write_token_file(path, np.array([70_000]), "uint16")
    with pytest.raises(DataError, match=r"\[0, "):
        write_token_file(path, np.array([-1]), "uint16")
    assert not path.exists()
    write_token_file(path, np.arange(16), "uint16")
    with pytest.raises(DataError, match="token_dtype"):
        TokenFileSource(path, 4, 64, dtype="int8")


def test_build_source_token_file(tmp_path: Path) -> None:
    path = tmp_path / "t.bin"
    write_token_file(path, np.arange(300) % 50, "uint16")
    src = build_source(DataConfig(source=str(path)), ModelConfig(vocab_size=50, seq_len=16))
    assert isinstance(src, TokenFileSource)
    assert src.num_samples == 299 // 16
    np.testing.assert_array_equal(src.sample(np.array([1]))[0], np.arange(16, 33) % 50)
