"""A token-file source: a flat uint16/uint32 array of token ids, memory-mapped.

The layout is the one nanoGPT and Megatron's simple loaders use: the corpus tokenised and
concatenated into one array, written raw (native little-endian, no header). Sample ``i`` is the
window ``tokens[i*seq_len : i*seq_len + seq_len + 1]``; consecutive windows share exactly one
token (the last target of one is the first input of the next), so every token but the first is
a target exactly once per epoch.

Nothing is read at open time beyond the file size; :meth:`TokenFileSource.sample` reads only
the windows asked for, and checks every id against the model's vocabulary.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np

from ftrain.data.errors import DataError, as_sample_ids

logger = logging.getLogger(__name__)

_DTYPES: dict[str, np.dtype] = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}


def resolve_dtype(dtype: str, vocab_size: int) -> np.dtype:
    """The element type named by ``data.token_dtype`` ("auto": uint16 if it fits the vocabulary)."""
    if dtype == "auto":
        return _DTYPES["uint16"] if vocab_size <= 65536 else _DTYPES["uint32"]
    if dtype not in _DTYPES:
        raise DataError(f"data.token_dtype: {dtype!r} is not one of auto, uint16, uint32")
    return _DTYPES[dtype]


class TokenFileSource:
    """Samples of ``seq_len + 1`` tokens from a flat token file; ``num_samples = (n - 1) // seq_len``."""

    #: Real text has no known optimum.
    entropy_floor_nats: float | None = None

    def __init__(self, path: str | os.PathLike, seq_len: int, vocab_size: int, dtype: str = "auto"):
        if int(seq_len) != seq_len or seq_len <= 0:
            raise DataError(f"TokenFileSource: seq_len must be a positive integer, got {seq_len!r}")
        if int(vocab_size) != vocab_size or vocab_size <= 0:
            raise DataError(f"TokenFileSource: vocab_size must be a positive integer, got {vocab_size!r}")
        self.path = Path(path)
        self.seq_len = int(seq_len)
        self.vocab_size = int(vocab_size)
        self.dtype = resolve_dtype(dtype, self.vocab_size)
        try:
            size_bytes = self.path.stat().st_size
        except FileNotFoundError:
            raise DataError(
                f"token file {str(self.path)!r} does not exist; set data.source to a flat "
                f'uint16/uint32 token file (see ftrain.data.write_token_file) or to "synthetic"'
            ) from None
        if not self.path.is_file():
            raise DataError(f"token file {str(self.path)!r} is not a regular file; set data.source to a token file")
        itemsize = self.dtype.itemsize
        if size_bytes % itemsize:
            other = "uint32" if itemsize == 2 else "uint16"
            raise DataError(
                f"token file {str(self.path)!r} has {size_bytes} bytes, not a multiple of the "
                f"{self.dtype.name} element size ({itemsize} bytes): the file is truncated or "
                f"data.token_dtype is wrong (was it written as {other}?)"
            )
        self.num_tokens = size_bytes // itemsize
        if self.num_tokens < self.seq_len + 1:
            raise DataError(
                f"token file {str(self.path)!r} holds {self.num_tokens} tokens, fewer than one "
                f"sample needs (model.seq_len + 1 = {self.seq_len + 1}); use a larger file or a "
                f"smaller model.seq_len"
            )
        self.num_samples = (self.num_tokens - 1) // self.seq_len
        self._tokens = np.memmap(self.path, dtype=self.dtype, mode="r", shape=(self.num_tokens,))
        self._window = np.arange(self.seq_len + 1, dtype=np.int64)
        logger.info(
            "token file %s: %d tokens (%s), %d samples of seq_len=%d",
            self.path,
            self.num_tokens,
            self.dtype.name,
            self.num_samples,
            self.seq_len,
        )

    def __repr__(self) -> str:
        return (
            f"TokenFileSource({str(self.path)!r}, seq_len={self.seq_len}, vocab_size={self.vocab_size}, "
            f"dtype={self.dtype.name!r}, num_samples={self.num_samples})"
        )

    def __getstate__(self) -> dict:
        # Pickle the path, not the mapped bytes (a pickled memmap would copy the whole file,
        # e.g. into every data-loader worker); the copy maps the file again.
        state = self.__dict__.copy()
        del state["_tokens"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._tokens = np.memmap(self.path, dtype=self.dtype, mode="r", shape=(self.num_tokens,))

    def sample(self, ids: np.ndarray) -> np.ndarray:
        """Token rows for global sample ids: int64 of shape ``(len(ids), seq_len + 1)``."""
        ids = as_sample_ids(ids, self.num_samples, f"token file {str(self.path)!r}")
        offsets = ids[:, None] * self.seq_len + self._window
        rows = np.asarray(self._tokens[offsets], dtype=np.int64)
        if rows.size and rows.max() >= self.vocab_size:
            where = np.argwhere(rows >= self.vocab_size)[0]
            token = int(rows[tuple(where)])
            position = int(offsets[tuple(where)])
            raise DataError(
                f"token id {token} >= model.vocab_size={self.vocab_size} in {str(self.path)!r} "
                f"(token index {position}, sample {int(ids[where[0]])}); raise model.vocab_size "
                f"to the tokenizer's vocabulary size or check data.token_dtype"
            )
        return rows


def write_token_file(path: str | os.PathLike, tokens: np.ndarray, dtype: str = "uint16") -> None:
    """Write ``tokens`` as a flat token file (atomically: a temporary file, then a rename)."""
    if dtype not in _DTYPES:
        raise DataError(f"write_token_file: dtype {dtype!r} is not one of uint16, uint32")
    arr = np.asarray(tokens)
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise DataError(f"write_token_file: tokens must be integers, got dtype {arr.dtype}")
    arr = arr.reshape(-1)
    target = _DTYPES[dtype]
    limit = np.iinfo(target).max
    if arr.size and (arr.min() < 0 or arr.max() > limit):
        raise DataError(
            f"write_token_file: token ids must be in [0, {limit}] for {dtype}, got "
            f"[{arr.min()}, {arr.max()}]; use dtype='uint32' for larger vocabularies"
        )
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        arr.astype(target).tofile(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
