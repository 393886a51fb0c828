"""The record beside a token file: what wrote it, in which element type, for which vocabulary.

A token file is raw (no header), so a uint32 file read as uint16 looks like valid data: every
other token becomes 0, every id stays in range and the loss falls. ``ftrain data tokenize`` and
:func:`~ftrain.data.tokens.write_token_file` therefore write ``<file>.json`` beside it::

    {"format": "ftrain-token-file", "version": 1, "dtype": "uint32", "num_tokens": 1000001,
     "size_bytes": 4000004, "fingerprint": "xxh3-128:...", "vocab_size": 50257,
     "document_token": 50256, "tokenizer": {"path": "tokenizer.json", "sha256": "..."}}

:class:`~ftrain.data.tokens.TokenFileSource` reads it: ``token_dtype = "auto"`` takes its dtype;
an explicit one that differs, a file whose size or fingerprint is not the recorded one, or a
vocabulary larger than the model's is refused, naming both values and the key to change. A file
without a record reads as before (auto: by ``model.vocab_size``), and says which dtype it assumed.

What must stay true: the record is written after its token file, atomically (create_new, then a
rename); it is untrusted input when read (bounded size, every field checked).
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ftrain.data.errors import DataError
from ftrain.data.files import atomic_output

FORMAT = "ftrain-token-file"
VERSION = 1
#: a record is a few hundred bytes; anything much larger is not one
MAX_RECORD_BYTES = 64 * 1024
DTYPES = ("uint16", "uint32")
_ITEMSIZE = {"uint16": 2, "uint32": 4}
_MAX_INT = 2**63 - 1


def record_path(token_file: str | os.PathLike) -> Path:
    """Where the record of ``token_file`` lives: ``<token_file>.json``."""
    p = Path(token_file)
    return p.with_name(p.name + ".json")


@dataclass(frozen=True)
class TokenFileRecord:
    """What the writer of a token file knew about it."""

    dtype: str
    num_tokens: int
    size_bytes: int
    fingerprint: str
    vocab_size: int | None = None
    document_token: int = -1
    #: ``{"path": ..., "sha256": ...}`` of the tokenizer.json that encoded it (None: unknown)
    tokenizer: dict[str, str] | None = None

    def to_json(self) -> bytes:
        body = {"format": FORMAT, "version": VERSION, **asdict(self)}
        return (json.dumps(body, indent=1, sort_keys=True) + "\n").encode()

    @classmethod
    def parse(cls, raw: bytes, where: str) -> TokenFileRecord:
        """A record from untrusted bytes; DataError naming ``where`` and what is wrong."""
        try:
            obj = json.loads(raw)
        except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
            raise DataError(f"{where} is not a token-file record (not JSON: {str(e)[:200]})") from e
        if not isinstance(obj, dict) or obj.get("format") != FORMAT:
            raise DataError(
                f'{where} is not a token-file record (no "format": "{FORMAT}"); it sits where ftrain looks for '
                "one: rename or remove it"
            )
        if obj.get("version") != VERSION:
            raise DataError(
                f"{where}: record version {str(obj.get('version'))[:20]} is not {VERSION} (a newer ftrain?)"
            )
        dtype = obj.get("dtype")
        if dtype not in DTYPES:
            raise DataError(f"{where}: dtype {str(dtype)[:40]!r} is not one of {', '.join(DTYPES)}")
        num_tokens = _int(obj, "num_tokens", where, 0)
        size_bytes = _int(obj, "size_bytes", where, 0)
        fp = obj.get("fingerprint")
        if not isinstance(fp, str) or not 0 < len(fp) <= 200:
            raise DataError(f"{where}: fingerprint must be a short string")
        vocab = obj.get("vocab_size")
        vocab_size = None if vocab is None else _int(obj, "vocab_size", where, 1)
        document_token = _int(obj, "document_token", where, -1) if "document_token" in obj else -1
        tok = obj.get("tokenizer")
        tokenizer = None
        if tok is not None:
            if not isinstance(tok, dict) or not all(isinstance(v, str) and len(v) <= 4096 for v in tok.values()):
                raise DataError(f"{where}: tokenizer must be an object of short strings")
            tokenizer = {str(k): str(v) for k, v in tok.items()}
        return cls(dtype, num_tokens, size_bytes, fp, vocab_size, document_token, tokenizer)


def _int(obj: dict[str, Any], key: str, where: str, minimum: int) -> int:
    value = obj.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= _MAX_INT:
        raise DataError(f"{where}: {key} must be an integer >= {minimum}, got {str(value)[:40]}")
    return value


def write_record(token_file: str | os.PathLike, record: TokenFileRecord) -> Path:
    """Write ``record`` beside ``token_file`` (atomically); returns its path."""
    path = record_path(token_file)
    with atomic_output(path) as fh:
        fh.write(record.to_json())
    return path


def read_record(token_file: str | os.PathLike) -> TokenFileRecord | None:
    """The record beside ``token_file``, None if there is none; DataError if it cannot be used."""
    path = record_path(token_file)
    where = f"token-file record {str(path)!r}"
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise DataError(f"{where} cannot be read: {e}") from e
    if not stat.S_ISREG(st.st_mode):
        raise DataError(f"{where} is not a regular file; rename or remove it")
    if st.st_size > MAX_RECORD_BYTES:
        raise DataError(f"{where} has {st.st_size} bytes, more than a record's {MAX_RECORD_BYTES}; rename or remove it")
    try:
        with open(path, "rb") as fh:
            raw = fh.read(MAX_RECORD_BYTES + 1)
    except OSError as e:
        raise DataError(f"{where} cannot be read: {e}") from e
    return TokenFileRecord.parse(raw, where)


def itemsize(dtype: str) -> int:
    return _ITEMSIZE[dtype]
