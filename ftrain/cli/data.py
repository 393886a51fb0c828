"""``ftrain data``: prepare training data.

    ftrain data tokenize INPUT... --tokenizer tokenizer.json --out corpus.bin
        [--text-key text] [--dtype auto|uint16|uint32] [--config CONFIG.toml] [--data.document_token=N]
        [--batch-chars N] [--max-line-chars N]

``tokenize`` encodes text and JSONL files (``.gz`` too) with a Hugging Face tokenizer into one flat
token file that ``data.source`` or a ``[[data.sources]]`` table can name, and its record
``<out>.json`` (dtype, token count, vocabulary, tokenizer digest: checked when training opens it);
``data.document_token`` (from ``--config`` or an override) is appended after each document.
Memory stays bounded whatever the input (``--batch-chars``, ``--max-line-chars``). Exit codes:
0 written, 1 bad input (nothing written), 2 usage or configuration error.
"""

from __future__ import annotations

import argparse
import os
import sys

from ftrain.config import load_config
from ftrain.contract import exits


def add_parsers(sub: argparse._SubParsersAction) -> None:
    data = sub.add_parser(
        "data", help="prepare training data", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = data.add_subparsers(dest="data_command", required=True)
    p = commands.add_parser(
        "tokenize",
        help="text/JSONL files -> a flat token file (Hugging Face tokenizers)",
        description="Encode text and JSONL files into one flat uint16/uint32 token file, written atomically. "
        "Overrides such as --data.document_token=N are read like ftrain train's.",
    )
    p.add_argument("inputs", nargs="+", help="text files (one document each) or JSONL files (one per line), .gz too")
    p.add_argument(
        "--tokenizer", required=True, help="a Hugging Face tokenizer.json, or a directory holding one (save_pretrained)"
    )
    p.add_argument("--out", required=True, help="the token file to write (replaced whole, or left untouched)")
    p.add_argument("--text-key", default="text", help="JSONL: the key holding each document's text (default text)")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "uint16", "uint32"),
        help="token element type (default auto: uint16 if the vocabulary fits)",
    )
    p.add_argument(
        "--batch-chars",
        type=int,
        default=None,
        help="text characters encoded at once; peak memory is about 40 bytes per one (default 1048576)",
    )
    p.add_argument(
        "--max-line-chars",
        type=int,
        default=None,
        help="JSONL: the longest line read, parsed whole (default 67108864); a longer one is an error naming it",
    )
    p.add_argument("--config", default=None, help="TOML config whose [data] section is read (data.document_token)")
    p.add_argument(
        "--progress",
        default="auto",
        choices=("auto", "bar", "lines", "off"),
        help="auto: a bar on a terminal, lines otherwise",
    )
    p.set_defaults(func=_cmd_tokenize)


def _cmd_tokenize(args: argparse.Namespace, overrides: list[str]) -> int:
    cfg = load_config(args.config, overrides)  # ConfigError -> exit 2, naming the key
    from ftrain.data.errors import DataError
    from ftrain.data.files import check_output
    from ftrain.data.tokenize import (
        BATCH_CHARS,
        MAX_LINE_CHARS,
        TokenizeProgress,
        TokenizerMissingError,
        read_tokenizer,
        tokenize_files,
    )

    try:
        check_output(args.out, "--out")  # before the tokenizer is read, let alone the inputs
        tokenizer, info = read_tokenizer(args.tokenizer)
        total_bytes = sum(_size(p) for p in args.inputs)
        result = tokenize_files(
            args.inputs,
            tokenizer,
            args.out,
            text_key=args.text_key,
            dtype=args.dtype,
            document_token=cfg.data.document_token,
            progress=TokenizeProgress(total_bytes, args.progress),
            tokenizer_info=info,
            batch_chars=BATCH_CHARS if args.batch_chars is None else args.batch_chars,
            max_line_chars=MAX_LINE_CHARS if args.max_line_chars is None else args.max_line_chars,
        )
    except TokenizerMissingError as e:
        print(f"ftrain data tokenize: {e}", file=sys.stderr)
        return exits.USAGE
    except DataError as e:
        print(f"ftrain data tokenize: error: {e} ({args.out} left as it was)", file=sys.stderr)
        return exits.FAILED
    print(result.summary())
    return exits.OK


def _size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0  # tokenize_files names the missing file
