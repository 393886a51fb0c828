"""Text to token files: what ``ftrain data tokenize`` does (imported by that command only).

Each input is read as documents -- a JSONL file (``.jsonl``/``.json``, optionally ``.gz``) one per
line, its text under ``text_key``; any other file one document, its whole text -- encoded with a
Hugging Face ``tokenizers`` tokenizer (``tokenizer.json``, no special tokens added), and appended
to one flat token file in the layout :class:`~ftrain.data.tokens.TokenFileSource` reads, followed
by ``document_token`` after each document when it is not -1.

What must stay true: the output appears whole or not at all (a temporary file beside it, then a
rename); every id fits the output's dtype (uint16 if the vocabulary fits, else uint32) or
nothing is written; errors name the file and line.
"""

from __future__ import annotations

import gzip
import io
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, TextIO, cast

import numpy as np

from ftrain.data.errors import DataError

logger = logging.getLogger(__name__)

#: Documents encoded per ``encode_batch`` call (the tokenizer parallelises within a batch).
BATCH_DOCUMENTS = 1024
INSTALL_HINT = "pip install 'ftrain[hf]'"
_DTYPES: dict[str, np.dtype] = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}


class TokenizerMissingError(DataError):
    """The ``tokenizers`` package is not installed."""


def load_tokenizer(path: str | os.PathLike) -> Any:
    """A ``tokenizers.Tokenizer`` from a ``tokenizer.json``; imported here, not at module import."""
    try:
        from tokenizers import Tokenizer
    except ImportError as e:
        raise TokenizerMissingError(
            f"ftrain data tokenize needs the Hugging Face tokenizers package: {INSTALL_HINT}"
        ) from e
    path = Path(path)
    if not path.is_file():
        raise DataError(f"tokenizer {str(path)!r} does not exist; give the path of a tokenizer.json")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception on a malformed file
        raise DataError(f"tokenizer {str(path)!r} is not a tokenizer.json tokenizers can read: {e}") from e


def output_dtype(vocab_size: int, document_token: int, requested: str = "auto") -> np.dtype:
    """uint16 when every id (the vocabulary and the document token) fits, else uint32; a requested
    dtype that is too small is an error."""
    largest = max(vocab_size - 1, document_token)
    if requested == "auto":
        return _DTYPES["uint16"] if largest <= np.iinfo(np.uint16).max else _DTYPES["uint32"]
    if requested not in _DTYPES:
        raise DataError(f"--dtype {requested!r} is not one of auto, uint16, uint32")
    if largest > np.iinfo(_DTYPES[requested]).max:
        raise DataError(
            f"--dtype {requested} cannot hold token id {largest} (vocabulary of {vocab_size}); use --dtype uint32"
        )
    return _DTYPES[requested]


@dataclass
class InputSummary:
    """What one input file gave."""

    path: str
    documents: int = 0
    tokens: int = 0  #: including the document tokens
    size_bytes: int = 0


@dataclass
class TokenizeResult:
    out: Path
    dtype: str
    vocab_size: int
    document_token: int
    inputs: list[InputSummary] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return sum(i.tokens for i in self.inputs)

    def summary(self) -> str:
        width = max(len(i.path) for i in self.inputs)
        lines = [
            f"{i.path:<{width}}  {i.documents:>10,} documents  {i.tokens:>14,} tokens  "
            f"{i.tokens / max(1, i.documents):>8.1f} tokens/document"
            for i in self.inputs
        ]
        boundary = f", document token {self.document_token}" if self.document_token >= 0 else ""
        lines.append(
            f"{self.out}: {self.tokens:,} tokens ({self.dtype}, vocabulary {self.vocab_size}{boundary}), "
            f"{self.out.stat().st_size:,} bytes"
        )
        return "\n".join(lines)


def is_jsonl(path: Path) -> bool:
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] == ".gz":
        suffixes = suffixes[:-1]
    return bool(suffixes) and suffixes[-1] in (".jsonl", ".json")


def documents(path: Path, raw: IO[bytes], text_key: str) -> Iterator[str]:
    """The documents of one input, read from ``raw`` (its bytes; gunzipped here if ``.gz``)."""
    stream = cast(IO[bytes], gzip.GzipFile(fileobj=raw)) if path.suffix.lower() == ".gz" else raw
    text = io.TextIOWrapper(stream, encoding="utf-8", newline="")
    try:
        if not is_jsonl(path):
            yield text.read()
            return
        for lineno, line in enumerate(text, start=1):
            if not line.strip():
                continue
            yield _jsonl_text(path, lineno, line, text_key)
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text ({e})") from e
    except (OSError, EOFError) as e:  # a truncated or corrupt .gz
        raise DataError(f"{path}: cannot be read ({e})") from e
    finally:
        text.detach()  # the caller owns ``raw`` (and reads its position for progress)


def _jsonl_text(path: Path, lineno: int, line: str, text_key: str) -> str:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"{path}:{lineno}: not a JSON object ({e})") from e
    if not isinstance(record, dict):
        raise DataError(f"{path}:{lineno}: expected a JSON object with a {text_key!r} key, got {type(record).__name__}")
    if text_key not in record:
        keys = ", ".join(sorted(record)[:10]) or "none"
        raise DataError(f"{path}:{lineno}: no {text_key!r} key (its keys: {keys}); pass --text-key")
    value = record[text_key]
    if not isinstance(value, str):
        raise DataError(f"{path}:{lineno}: {text_key!r} is a {type(value).__name__}, not a string")
    return value


class TokenizeProgress:
    """A redrawn bar on a terminal, a line per tenth of the input otherwise (logs, CI); off: nothing.

    ``clock`` is injectable: the bar redraws at most every ``redraw_s`` seconds of it."""

    def __init__(
        self,
        total_bytes: int,
        mode: str = "auto",
        stream: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
        redraw_s: float = 0.2,
    ):
        self.stream = stream or sys.stderr
        self.mode = ("bar" if self.stream.isatty() else "lines") if mode == "auto" else mode
        self.total_bytes = max(1, total_bytes)
        self.clock = clock
        self.redraw_s = redraw_s
        self._start = clock()
        self._drawn = float("-inf")
        self._tenths = 0

    def update(self, done_bytes: int, tokens: int) -> None:
        if self.mode == "off":
            return
        fraction = min(1.0, done_bytes / self.total_bytes)
        elapsed_s = self.clock() - self._start
        rate = f", {_bytes(done_bytes / elapsed_s)}/s" if elapsed_s > 0 else ""
        text = f"{_bytes(done_bytes, self.total_bytes)}, {tokens:,} tokens{rate}"
        if self.mode == "bar":
            now = self.clock()
            if now - self._drawn < self.redraw_s and fraction < 1.0:
                return
            self._drawn = now
            width = 24
            filled = int(width * fraction)
            self.stream.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {text}\x1b[K")
        elif int(fraction * 10) > self._tenths:
            self._tenths = int(fraction * 10)
            self.stream.write(f"tokenize: {self._tenths * 10}% {text}\n")
        self.stream.flush()

    def close(self) -> None:
        if self.mode == "bar":
            self.stream.write("\n")
            self.stream.flush()


def _bytes(count: float, total: float | None = None) -> str:
    """``count`` (and ``/total``) in the unit of the larger: "1.5 MB", "0.3/1.0 kB"."""
    scale, unit = next(
        ((s, u) for s, u in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB")) if max(count, total or 0) >= s), (1.0, "B")
    )
    shown = f"{count / scale:.1f}" + (f"/{total / scale:.1f}" if total is not None else "")
    return f"{shown} {unit}"


def tokenize_files(
    inputs: Sequence[str | os.PathLike],
    tokenizer: Any,
    out: str | os.PathLike,
    *,
    text_key: str = "text",
    dtype: str = "auto",
    document_token: int = -1,
    progress: TokenizeProgress | None = None,
) -> TokenizeResult:
    """Encode ``inputs`` in order into the token file ``out`` (written atomically)."""
    paths = [Path(p) for p in inputs]
    if not paths:
        raise DataError("no input files: give text or JSONL files to tokenize")
    for p in paths:
        if not p.is_file():
            raise DataError(f"input {str(p)!r} does not exist or is not a file")
    vocab_size = int(tokenizer.get_vocab_size(with_added_tokens=True))
    if document_token >= vocab_size:
        raise DataError(
            f"data.document_token={document_token} is not in the tokenizer's vocabulary of {vocab_size}; "
            "use its end-of-text token's id (tokenizer.token_to_id('<|endoftext|>') or the like)"
        )
    target = output_dtype(vocab_size, document_token, dtype)
    out = Path(out)
    result = TokenizeResult(out, target.name, vocab_size, document_token)
    progress = progress or TokenizeProgress(sum(p.stat().st_size for p in paths), mode="off")
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as sink:
            done_bytes = 0
            for path in paths:
                summary = InputSummary(str(path), size_bytes=path.stat().st_size)
                result.inputs.append(summary)
                with open(path, "rb") as raw:
                    for batch in _batches(documents(path, raw, text_key)):
                        ids = _encode(tokenizer, batch, document_token, target)
                        ids.tofile(sink)
                        summary.documents += len(batch)
                        summary.tokens += int(ids.size)
                        progress.update(done_bytes + raw.tell(), result.tokens)
                done_bytes += summary.size_bytes
                progress.update(done_bytes, result.tokens)
            sink.flush()
            os.fsync(sink.fileno())
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
        progress.close()
    logger.info("tokenized %d files into %s: %d tokens (%s)", len(paths), out, result.tokens, target.name)
    return result


def _batches(docs: Iterator[str]) -> Iterator[list[str]]:
    batch: list[str] = []
    for doc in docs:
        batch.append(doc)
        if len(batch) == BATCH_DOCUMENTS:
            yield batch
            batch = []
    if batch:
        yield batch


def _encode(tokenizer: Any, batch: list[str], document_token: int, target: np.dtype) -> np.ndarray:
    encodings = tokenizer.encode_batch(batch, add_special_tokens=False)
    parts = []
    for enc in encodings:
        parts.append(np.asarray(enc.ids, dtype=np.int64))
        if document_token >= 0:
            parts.append(np.array([document_token], dtype=np.int64))
    ids = np.concatenate(parts) if parts else np.empty(0, np.int64)
    if ids.size and ids.max() > np.iinfo(target).max:  # an added token beyond get_vocab_size()
        raise DataError(f"token id {int(ids.max())} does not fit {target.name}; pass --dtype uint32")
    return ids.astype(target)
