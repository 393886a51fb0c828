"""A token-file source: a flat uint16/uint32 array of token ids, memory-mapped.

The layout is the one nanoGPT and Megatron's simple loaders use: the corpus tokenised and
concatenated into one array, written raw (native little-endian, no header). Sample ``i`` is the
window ``tokens[i*seq_len : i*seq_len + seq_len + 1]``; consecutive windows share exactly one
token (the last target of one is the first input of the next), so every token but the first is
a target exactly once per epoch.

Beside the file, ``<file>.json`` (:mod:`ftrain.data.token_record`) says what its writer knew:
the element type, the token count, the vocabulary. An open checks the file against it and takes
its dtype for ``token_dtype = "auto"``; without one, auto picks by the vocabulary as before (and
refuses a file that plainly holds uint32 ids: every second uint16 zero).

At open time only the file's size, its record and its two ends (:func:`~ftrain.data.files.fingerprint`)
are read; :meth:`TokenFileSource.sample` reads only the windows asked for, and checks every id
against the model's vocabulary.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np

from ftrain.data.errors import DataError, as_sample_ids
from ftrain.data.files import atomic_output, fingerprint
from ftrain.data.token_record import TokenFileRecord, read_record, record_path, write_record

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

    def __init__(
        self,
        path: str | os.PathLike,
        seq_len: int,
        vocab_size: int,
        dtype: str = "auto",
        *,
        dtype_key: str = "data.token_dtype",
    ):
        """``dtype_key``: the setting that chose ``dtype`` (named in errors)."""
        if int(seq_len) != seq_len or seq_len <= 0:
            raise DataError(f"TokenFileSource: seq_len must be a positive integer, got {seq_len!r}")
        if int(vocab_size) != vocab_size or vocab_size <= 0:
            raise DataError(f"TokenFileSource: vocab_size must be a positive integer, got {vocab_size!r}")
        self.path = Path(path)
        self.seq_len = int(seq_len)
        self.vocab_size = int(vocab_size)
        resolve_dtype(dtype, self.vocab_size)  # a bad name is an error before the file is looked at
        try:
            size_bytes = self.path.stat().st_size
        except FileNotFoundError:
            raise DataError(
                f"token file {str(self.path)!r} does not exist; set data.source to a flat "
                f'uint16/uint32 token file (see ftrain.data.write_token_file) or to "synthetic"'
            ) from None
        if not self.path.is_file():
            raise DataError(f"token file {str(self.path)!r} is not a regular file; set data.source to a token file")
        self.size_bytes = size_bytes
        #: cheap content identity (size, both ends): recorded in checkpoints, checked against the record
        self.fingerprint = fingerprint(self.path, size_bytes)
        self.record = read_record(self.path)
        self.dtype = self._checked_dtype(dtype, dtype_key)
        itemsize = self.dtype.itemsize
        if size_bytes % itemsize:
            other = "uint32" if itemsize == 2 else "uint16"
            raise DataError(
                f"token file {str(self.path)!r} has {size_bytes} bytes, not a multiple of the "
                f"{self.dtype.name} element size ({itemsize} bytes): the file is truncated or "
                f"{dtype_key} is wrong (was it written as {other}?)"
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
            "token file %s: %d tokens (%s, %s), %d samples of seq_len=%d",
            self.path,
            self.num_tokens,
            self.dtype.name,
            f"from {record_path(self.path).name}" if self.record is not None else f"{dtype_key}={dtype}",
            self.num_samples,
            self.seq_len,
        )

    def _checked_dtype(self, requested: str, key: str) -> np.dtype:
        """The element type: the record's (checked against ``requested`` and the file), else
        ``requested`` resolved by the vocabulary (auto: refused if the file plainly holds uint32)."""
        name = str(self.path)
        record = self.record
        if record is None:
            resolved = resolve_dtype(requested, self.vocab_size)
            if requested == "auto":
                logger.warning(
                    "token file %s has no record (%s): assuming %s from model.vocab_size=%d; set %s if it was "
                    "written otherwise",
                    name,
                    record_path(self.path).name,
                    resolved.name,
                    self.vocab_size,
                    key,
                )
                if resolved.itemsize == 2:
                    self._refuse_plain_uint32(key)
            return resolved
        where = f"{record_path(self.path).name} (its record)"
        if requested != "auto" and requested != record.dtype:
            raise DataError(
                f"token file {name!r} was written as {record.dtype} ({where} says so) but {key} = "
                f'"{requested}": set {key} = "{record.dtype}" (or "auto")'
            )
        expected = record.num_tokens * _DTYPES[record.dtype].itemsize
        if record.size_bytes != expected or self.size_bytes != expected:
            raise DataError(
                f"token file {name!r} has {self.size_bytes} bytes but {where} records {record.num_tokens} "
                f"{record.dtype} tokens ({expected} bytes): the file was changed or cut short after it was "
                "written; write it again (ftrain data tokenize) or remove the stale record"
            )
        if record.fingerprint != self.fingerprint:
            raise DataError(
                f"token file {name!r} is not the file {where} was written for (fingerprint "
                f"{self.fingerprint} != {record.fingerprint}): it was rewritten since; write it again "
                "(ftrain data tokenize) or remove the stale record"
            )
        if record.vocab_size is not None and record.vocab_size > self.vocab_size:
            raise DataError(
                f"token file {name!r} was written with a vocabulary of {record.vocab_size} ({where}) but "
                f"model.vocab_size = {self.vocab_size}: set model.vocab_size >= {record.vocab_size}"
            )
        return _DTYPES[record.dtype]

    def _refuse_plain_uint32(self, key: str) -> None:
        """Without a record, a uint32 file of small ids read as uint16 has a zero at every odd
        position (the high halves): refuse it rather than train on every other token."""
        if self.size_bytes < 4096 or self.size_bytes % 4:
            return
        head = np.fromfile(self.path, dtype="<u2", count=min(self.size_bytes, 1 << 16) // 2)
        if not head[1::2].any() and head[0::2].any():
            raise DataError(
                f"token file {str(self.path)!r} looks like uint32 (every second uint16 of its first "
                f'{head.size // 2} is 0) but {key} = "auto" reads it as uint16 (model.vocab_size='
                f'{self.vocab_size}): set {key} = "uint32" (or "uint16" if it really is)'
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


def write_token_file(
    path: str | os.PathLike,
    tokens: np.ndarray,
    dtype: str = "uint16",
    *,
    vocab_size: int | None = None,
    document_token: int = -1,
    tokenizer: dict[str, str] | None = None,
) -> None:
    """Write ``tokens`` as a flat token file and its record ``<path>.json`` (each atomically: a new
    temporary file beside it, created without following links, then a rename)."""
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
    if vocab_size is not None and arr.size and arr.max() >= vocab_size:
        raise DataError(f"write_token_file: token id {arr.max()} is not in a vocabulary of {vocab_size}")
    path = Path(path)
    with atomic_output(path) as fh:
        fh.write(np.ascontiguousarray(arr.astype(target, copy=False)).data)
    size_bytes = arr.size * target.itemsize
    write_record(
        path,
        TokenFileRecord(
            dtype=dtype,
            num_tokens=int(arr.size),
            size_bytes=size_bytes,
            fingerprint=fingerprint(path, size_bytes),
            vocab_size=vocab_size,
            document_token=document_token,
            tokenizer=tokenizer,
        ),
    )
