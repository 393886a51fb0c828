"""Text to token files: what ``ftrain data tokenize`` does (imported by that command only).

Each input is read as documents -- a JSONL file (``.jsonl``/``.json``, optionally ``.gz``) one per
line, its text under ``text_key``; any other file one document, its whole text -- encoded with a
Hugging Face ``tokenizers`` tokenizer (``tokenizer.json``, no special tokens added), and appended
to one flat token file in the layout :class:`~ftrain.data.tokens.TokenFileSource` reads, followed
by ``document_token`` after each document when it is not -1; then its record ``<out>.json``
(:mod:`ftrain.data.token_record`: dtype, token count, vocabulary, the tokenizer's sha256).

Memory is bounded by two settings, whatever the input (a small ``.gz`` can hold gigabytes of
text): documents are streamed, a text longer than ``batch_chars`` is encoded in pieces of at most
that many characters, cut at a line end where there is one (else before a space; tokenizers split
there anyway, so the ids match a whole encoding but for a rare merge across a cut), each
``encode_batch`` call gets at most ``batch_chars`` characters, and a JSONL line longer than
``max_line_chars`` is an error naming it (it must be read whole to be parsed).

What must stay true: ``--out`` is checked before any work; the output appears whole or not at
all (a temporary file beside it, created without following links, then a rename); every id fits
the output's dtype (uint16 if the vocabulary fits, else uint32) or nothing is written; errors
name the file and line.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import logging
import os
import re
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, TextIO, cast

import numpy as np

from ftrain.data.errors import DataError
from ftrain.data.files import atomic_output, check_output, fingerprint
from ftrain.data.token_record import TokenFileRecord, write_record

logger = logging.getLogger(__name__)

#: At most this many documents (or pieces) per ``encode_batch`` call.
BATCH_DOCUMENTS = 1024
#: Default ``--batch-chars``: text characters encoded at once (the tokenizer holds ~40 bytes per one).
BATCH_CHARS = 1 << 20
#: Default ``--max-line-chars``: the longest JSONL line read (a line is parsed whole).
MAX_LINE_CHARS = 64 << 20
#: The largest tokenizer.json read (real ones are a few to a few tens of MB).
MAX_TOKENIZER_BYTES = 1 << 30
TOKENIZER_FILE = "tokenizer.json"
#: UTF-16 surrogates: a JSON ``\\ud800`` without its pair parses into one, which is no text
_SURROGATE = re.compile("[\\ud800-\\udfff]")
INSTALL_HINT = "pip install 'ftrain[hf]'"
_DTYPES: dict[str, np.dtype] = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}


class TokenizerMissingError(DataError):
    """The ``tokenizers`` package is not installed."""


def load_tokenizer(path: str | os.PathLike) -> Any:
    """A ``tokenizers.Tokenizer`` from a ``tokenizer.json`` (or a directory holding one)."""
    return read_tokenizer(path)[0]


def read_tokenizer(path: str | os.PathLike) -> tuple[Any, dict[str, str]]:
    """``(tokenizer, {"path", "sha256"})``: the tokenizer from a ``tokenizer.json``, or from a
    directory holding one (as ``save_pretrained`` writes it), and the digest of the bytes it was
    built from. ``tokenizers`` is imported here, not at module import."""
    try:
        from tokenizers import Tokenizer
    except ImportError as e:
        raise TokenizerMissingError(
            f"ftrain data tokenize needs the Hugging Face tokenizers package: {INSTALL_HINT}"
        ) from e
    path = Path(path)
    if path.is_dir():
        inside = path / TOKENIZER_FILE
        if not inside.is_file():
            readable = os.access(path, os.R_OK | os.X_OK)
            names = sorted(p.name for p in path.iterdir())[:12] if readable else []
            held = ", ".join(names) if names else "nothing" if readable else "nothing readable"
            raise DataError(
                f"tokenizer {str(path)!r} is a directory without a {TOKENIZER_FILE} (it holds: {held}); give the "
                f"path of a {TOKENIZER_FILE}, or a directory that has one (e.g. from AutoTokenizer.save_pretrained)"
            )
        path = inside
    elif not path.exists():
        raise DataError(f"tokenizer {str(path)!r} does not exist; give the path of a {TOKENIZER_FILE}")
    elif not path.is_file():
        raise DataError(f"tokenizer {str(path)!r} is not a regular file; give the path of a {TOKENIZER_FILE}")
    try:
        with open(path, "rb") as fh:
            raw = fh.read(MAX_TOKENIZER_BYTES + 1)
    except OSError as e:
        raise DataError(f"tokenizer {str(path)!r} cannot be read: {e}") from e
    if len(raw) > MAX_TOKENIZER_BYTES:
        raise DataError(f"tokenizer {str(path)!r} is larger than {MAX_TOKENIZER_BYTES} bytes: not a {TOKENIZER_FILE}")
    try:
        tokenizer = Tokenizer.from_str(raw.decode("utf-8"))
    except Exception as e:  # tokenizers raises a bare Exception on a malformed file
        raise DataError(f"tokenizer {str(path)!r} is not a {TOKENIZER_FILE} tokenizers can read: {e}") from e
    return tokenizer, {"path": str(path), "sha256": hashlib.sha256(raw).hexdigest()}


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


def pieces(
    path: Path,
    raw: IO[bytes],
    text_key: str,
    *,
    piece_chars: int = BATCH_CHARS,
    max_line_chars: int = MAX_LINE_CHARS,
) -> Iterator[tuple[str, bool]]:
    """The text of one input, read from ``raw`` (its bytes; gunzipped here if ``.gz``), as
    ``(piece, ends_a_document)``: no piece is longer than ``piece_chars`` characters and nothing
    longer than ``max_line_chars`` (a JSONL line) is ever held."""
    stream = cast(IO[bytes], gzip.GzipFile(fileobj=raw)) if path.suffix.lower() == ".gz" else raw
    text = io.TextIOWrapper(stream, encoding="utf-8", newline="")
    try:
        if not is_jsonl(path):
            yield from _ends(_split_stream(text, piece_chars))
            return
        lineno = 0
        while True:
            line = text.readline(max_line_chars + 1)
            if not line:
                return
            lineno += 1
            if len(line) > max_line_chars and not line.endswith("\n"):
                raise DataError(
                    f"{path}:{lineno}: a line longer than {max_line_chars:,} characters (--max-line-chars); a JSONL "
                    "line is parsed whole: raise --max-line-chars if the machine has the memory, or split the document"
                )
            if not line.strip():
                continue
            yield from _ends(_split_text(_jsonl_text(path, lineno, line, text_key), piece_chars))
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text ({e})") from e
    except (OSError, EOFError) as e:  # a truncated or corrupt .gz
        raise DataError(f"{path}: cannot be read ({e})") from e
    finally:
        text.detach()  # the caller owns ``raw`` (and reads its position for progress)


def _cut(text: str, limit: int) -> int:
    """Where to end a piece of at most ``limit`` characters of ``text``: after its last line end,
    else before its last space, else at ``limit``."""
    newline = text.rfind("\n", 0, limit)
    if newline >= 0:
        return newline + 1
    space = max(text.rfind(" ", 0, limit), text.rfind("\t", 0, limit))
    return space if space > 0 else limit


def _split_text(text: str, limit: int) -> Iterator[str]:
    """``text`` in pieces of at most ``limit`` characters (at least one piece, maybe empty)."""
    start = 0
    while len(text) - start > limit:
        cut = _cut(text[start : start + limit], limit)
        yield text[start : start + cut]
        start += cut
    yield text[start:]


def _split_stream(text: IO[str], limit: int) -> Iterator[str]:
    """A text stream in pieces of at most ``limit`` characters (at least one piece, maybe empty),
    reading at most ``limit`` characters ahead."""
    held = ""
    while True:
        more = text.read(limit)
        held += more
        while len(held) > limit or (held and not more):
            if len(held) <= limit:  # the end of the stream: the rest is the last piece
                yield held
                return
            cut = _cut(held, limit)
            yield held[:cut]
            held = held[cut:]
        if not more:
            yield held  # an empty stream is one empty document
            return


def _ends(parts: Iterator[str]) -> Iterator[tuple[str, bool]]:
    """Each part with whether it is the last (the end of its document)."""
    previous: str | None = None
    for part in parts:
        if previous is not None:
            yield previous, False
        previous = part
    if previous is not None:
        yield previous, True


def _jsonl_text(path: Path, lineno: int, line: str, text_key: str) -> str:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"{path}:{lineno}: not a JSON object ({e})") from e
    except ValueError as e:  # a number too long to convert (Python's 4300-digit limit)
        raise DataError(f"{path}:{lineno}: cannot be parsed ({str(e)[:200]}); fix or drop the line") from e
    except RecursionError as e:
        raise DataError(f"{path}:{lineno}: JSON nested too deeply to parse") from e
    if not isinstance(record, dict):
        raise DataError(f"{path}:{lineno}: expected a JSON object with a {text_key!r} key, got {type(record).__name__}")
    if text_key not in record:
        keys = ", ".join(sorted(record)[:10]) or "none"
        raise DataError(f"{path}:{lineno}: no {text_key!r} key (its keys: {keys}); pass --text-key")
    value = record[text_key]
    if not isinstance(value, str):
        raise DataError(f"{path}:{lineno}: {text_key!r} is a {type(value).__name__}, not a string")
    bad = _SURROGATE.search(value)
    if bad is not None:
        raise DataError(
            f"{path}:{lineno}: {text_key!r} holds a lone UTF-16 surrogate \\u{ord(bad.group()):04x} at character "
            f"{bad.start()} (a JSON \\ud800-\\udfff escape without its pair is no text): fix or drop the line, "
            "e.g. re-export it with the surrogate pairs intact"
        )
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
    tokenizer_info: dict[str, str] | None = None,
    batch_chars: int = BATCH_CHARS,
    max_line_chars: int = MAX_LINE_CHARS,
) -> TokenizeResult:
    """Encode ``inputs`` in order into the token file ``out`` (written atomically) and its record
    (``tokenizer_info``: the tokenizer's path and sha256, :func:`read_tokenizer`)."""
    out = check_output(out, "--out")  # before any work
    for name, value in (("--batch-chars", batch_chars), ("--max-line-chars", max_line_chars)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise DataError(f"{name} must be a positive integer, got {value!r}")
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
    result = TokenizeResult(out, target.name, vocab_size, document_token)
    progress = progress or TokenizeProgress(sum(p.stat().st_size for p in paths), mode="off")
    try:
        with atomic_output(out) as sink:
            done_bytes = 0
            for path in paths:
                summary = InputSummary(str(path), size_bytes=path.stat().st_size)
                result.inputs.append(summary)
                with open(path, "rb") as raw:
                    parts = pieces(path, raw, text_key, piece_chars=batch_chars, max_line_chars=max_line_chars)
                    for batch, ends in _batches(parts, batch_chars):
                        ids = _encode(tokenizer, batch, ends, document_token, target)
                        sink.write(ids.data)
                        summary.documents += sum(ends)
                        summary.tokens += int(ids.size)
                        progress.update(done_bytes + raw.tell(), result.tokens)
                done_bytes += summary.size_bytes
                progress.update(done_bytes, result.tokens)
    finally:
        progress.close()
    size_bytes = result.tokens * target.itemsize
    write_record(
        out,
        TokenFileRecord(
            dtype=target.name,
            num_tokens=result.tokens,
            size_bytes=size_bytes,
            fingerprint=fingerprint(out, size_bytes),
            vocab_size=vocab_size,
            document_token=document_token,
            tokenizer=tokenizer_info,
        ),
    )
    logger.info("tokenized %d files into %s: %d tokens (%s)", len(paths), out, result.tokens, target.name)
    return result


def _batches(parts: Iterator[tuple[str, bool]], batch_chars: int) -> Iterator[tuple[list[str], list[bool]]]:
    """Pieces grouped into ``encode_batch`` calls of at most ``batch_chars`` characters (a piece
    is never longer) and :data:`BATCH_DOCUMENTS` pieces."""
    batch: list[str] = []
    ends: list[bool] = []
    size = 0
    for text, end in parts:
        if batch and (size + len(text) > batch_chars or len(batch) == BATCH_DOCUMENTS):
            yield batch, ends
            batch, ends, size = [], [], 0
        batch.append(text)
        ends.append(end)
        size += len(text)
    if batch:
        yield batch, ends


def _encode(tokenizer: Any, batch: list[str], ends: list[bool], document_token: int, target: np.dtype) -> np.ndarray:
    encode = getattr(tokenizer, "encode_batch_fast", None) or tokenizer.encode_batch  # fast: no offsets
    encodings = encode(batch, add_special_tokens=False)
    parts = []
    for enc, end in zip(encodings, ends, strict=True):
        parts.append(np.asarray(enc.ids, dtype=np.int64))
        if end and document_token >= 0:
            parts.append(np.array([document_token], dtype=np.int64))
    ids = np.concatenate(parts) if parts else np.empty(0, np.int64)
    if ids.size and ids.max() > np.iinfo(target).max:  # an added token beyond get_vocab_size()
        raise DataError(f"token id {int(ids.max())} does not fit {target.name}; pass --dtype uint32")
    return np.ascontiguousarray(ids.astype(target))
