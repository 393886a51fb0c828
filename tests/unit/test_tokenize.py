"""``ftrain data tokenize``: text and JSONL in, a flat token file out, with a tokenizer trained here
on a few strings (nothing is downloaded)."""

from __future__ import annotations

import gzip
import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from ftrain.cli import main
from ftrain.data import TokenFileSource
from ftrain.data.errors import DataError
from ftrain.data.tokenize import TokenizeProgress, load_tokenizer, output_dtype, tokenize_files
from ftrain.testbed.procs import REPO

EOT = "<|endoftext|>"
DOCS = [
    "The quick brown fox jumps over the lazy dog.",
    "héllo wörld ✓\n\nA second paragraph,\r\nwith a CRLF.",
    "",  # an empty document still ends with the boundary token
    "  leading and trailing spaces  ",
]


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory) -> Path:
    """A byte-level BPE (every text round-trips) with ``<|endoftext|>`` as id 0."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(DOCS * 5, trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


def split_documents(tokens: np.ndarray, boundary: int) -> list[np.ndarray]:
    """The documents of a token file whose every document ends with ``boundary``."""
    assert tokens.size and tokens[-1] == boundary
    ends = np.flatnonzero(tokens == boundary)
    return np.split(tokens, ends + 1)[:-1]


def jsonl(path: Path, docs: list[str], key: str = "text") -> Path:
    path.write_text("".join(json.dumps({key: d, "id": i}) + "\n" for i, d in enumerate(docs)), encoding="utf-8")
    return path


def test_jsonl_round_trip_with_a_boundary_after_each_document(tmp_path, tokenizer_path):
    tok = load_tokenizer(tokenizer_path)
    eot = tok.token_to_id(EOT)
    out = tmp_path / "corpus.bin"
    result = tokenize_files([jsonl(tmp_path / "a.jsonl", DOCS)], tok, out, document_token=eot)
    tokens = np.fromfile(out, dtype="<u2")
    assert result.dtype == "uint16" and result.tokens == tokens.size == out.stat().st_size // 2
    docs = split_documents(tokens, eot)
    assert len(docs) == len(DOCS) and result.inputs[0].documents == len(DOCS)
    for doc, text in zip(docs, DOCS, strict=True):
        assert doc[-1] == eot and eot not in doc[:-1]
        assert tok.decode(doc[:-1].tolist()) == text
    assert docs[2].tolist() == [eot]  # the empty document
    assert not list(tmp_path.glob(".corpus.bin.tmp-*"))


def test_text_files_are_one_document_each_and_inputs_keep_their_order(tmp_path, tokenizer_path):
    tok = load_tokenizer(tokenizer_path)
    a, b = tmp_path / "a.txt", tmp_path / "b.md"
    a.write_bytes(DOCS[1].encode())  # newline="" keeps the CRLF
    b.write_text(DOCS[0])
    gz = tmp_path / "c.jsonl.gz"
    gz.write_bytes(gzip.compress(jsonl(tmp_path / "c.jsonl", DOCS[2:], key="body").read_bytes()))
    out = tmp_path / "mix.bin"
    result = tokenize_files([a, b, gz], tok, out, text_key="body", document_token=0)
    docs = split_documents(np.fromfile(out, dtype="<u2"), 0)
    assert [tok.decode(d[:-1].tolist()) for d in docs] == [DOCS[1], DOCS[0], *DOCS[2:]]
    assert [(Path(i.path).name, i.documents) for i in result.inputs] == [("a.txt", 1), ("b.md", 1), ("c.jsonl.gz", 2)]
    assert [i.tokens for i in result.inputs] == [d.size for d in docs[:2]] + [docs[2].size + docs[3].size]
    summary = result.summary()
    assert "a.txt" in summary and "c.jsonl.gz" in summary and f"{result.tokens:,} tokens (uint16" in summary


def test_without_a_document_token_documents_are_simply_concatenated(tmp_path, tokenizer_path):
    tok = load_tokenizer(tokenizer_path)
    out = tmp_path / "plain.bin"
    tokenize_files([jsonl(tmp_path / "a.jsonl", DOCS[:2])], tok, out)
    tokens = np.fromfile(out, dtype="<u2")
    assert tok.decode(tokens.tolist()) == DOCS[0] + DOCS[1]
    assert 0 not in tokens.tolist()


def test_the_output_trains_as_a_token_file(tmp_path, tokenizer_path):
    tok = load_tokenizer(tokenizer_path)
    out = tmp_path / "c.bin"
    tokenize_files([jsonl(tmp_path / "a.jsonl", DOCS * 3)], tok, out, document_token=0)
    src = TokenFileSource(out, seq_len=8, vocab_size=tok.get_vocab_size())
    rows = src.sample(np.arange(src.num_samples))
    assert rows.shape == (src.num_samples, 9) and rows.max() < tok.get_vocab_size()


def test_dtype_follows_the_vocabulary_and_uint32_can_be_asked_for(tmp_path, tokenizer_path):
    assert output_dtype(65536, -1).name == "uint16"
    assert output_dtype(65537, -1).name == "uint32"
    assert output_dtype(100, 70_000).name == "uint32"  # the boundary token counts
    with pytest.raises(DataError, match="--dtype uint16 cannot hold token id 99999"):
        output_dtype(100_000, -1, "uint16")
    tok = load_tokenizer(tokenizer_path)
    out = tmp_path / "wide.bin"
    result = tokenize_files([jsonl(tmp_path / "a.jsonl", DOCS[:1])], tok, out, dtype="uint32")
    assert result.dtype == "uint32"
    assert tok.decode(np.fromfile(out, dtype="<u4").tolist()) == DOCS[0]


def test_bad_input_names_file_and_line_and_leaves_the_output_as_it_was(tmp_path, tokenizer_path):
    tok = load_tokenizer(tokenizer_path)
    out = tmp_path / "out.bin"
    out.write_bytes(b"old!")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n\n{"content": "no text key"}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:3: no 'text' key \(its keys: content\); pass --text-key"):
        tokenize_files([bad], tok, out)
    bad.write_text('{"text": "fine"}\n{"text": 3}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:2: 'text' is a int, not a string"):
        tokenize_files([bad], tok, out)
    bad.write_text('{"text": "fine"}\nnot json\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:2: not a JSON object"):
        tokenize_files([bad], tok, out)
    latin = tmp_path / "latin.txt"
    latin.write_bytes("café".encode("latin-1"))
    with pytest.raises(DataError, match=r"latin\.txt: not UTF-8"):
        tokenize_files([latin], tok, out)
    with pytest.raises(DataError, match="document_token=300 is not in the tokenizer's vocabulary"):
        tokenize_files([latin], tok, out, document_token=300)
    with pytest.raises(DataError, match="missing.txt' does not exist"):
        tokenize_files([tmp_path / "missing.txt"], tok, out)
    assert out.read_bytes() == b"old!"
    assert not list(tmp_path.glob(".out.bin.tmp-*"))


def test_progress_draws_lines_off_a_terminal_and_a_bar_on_one():
    lines = io.StringIO()
    progress = TokenizeProgress(1000, "auto", stream=lines, clock=iter(range(100)).__next__)
    for done in range(0, 1001, 50):
        progress.update(done, tokens=done * 2)
    progress.close()
    assert [line.split()[1] for line in lines.getvalue().splitlines()] == [f"{p}%" for p in range(10, 101, 10)]

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    bar = Terminal()
    now = [0.0]
    progress = TokenizeProgress(1000, "auto", stream=bar, clock=lambda: now[0], redraw_s=1.0)
    for done in (100, 200, 300):  # within one redraw interval: drawn once
        progress.update(done, tokens=1)
    now[0] = 5.0
    progress.update(1000, tokens=2)
    progress.close()
    drawn = bar.getvalue().split("\r")[1:]
    assert [d.split("]")[0] for d in drawn] == ["[" + "#" * 2 + "." * 22, "[" + "#" * 24]
    assert drawn[0].startswith("[##......................] 0.1/1.0 kB, 1 tokens\x1b[K")  # no rate at t=0
    assert drawn[1] == "[########################] 1.0/1.0 kB, 2 tokens, 200.0 B/s\x1b[K\n"


# -- the command -----------------------------------------------------------------------------
def test_the_command_writes_the_file_and_summarises_each_input(tmp_path, tokenizer_path, capsys):
    a, b = jsonl(tmp_path / "a.jsonl", DOCS[:2]), jsonl(tmp_path / "b.jsonl", DOCS[2:])
    out = tmp_path / "out.bin"
    argv = ["data", "tokenize", str(a), str(b), "--tokenizer", str(tokenizer_path), "--out", str(out)]
    assert main([*argv, "--data.document_token=0", "--progress=lines"]) == 0
    captured = capsys.readouterr()
    assert "tokenize: 100%" in captured.err
    assert "a.jsonl" in captured.out and "b.jsonl" in captured.out and "document token 0" in captured.out
    assert len(split_documents(np.fromfile(out, dtype="<u2"), 0)) == len(DOCS)

    config = tmp_path / "c.toml"
    config.write_text("[data]\ndocument_token = 0\n")
    assert main([*argv, "--config", str(config), "--progress=off"]) == 0
    assert len(split_documents(np.fromfile(out, dtype="<u2"), 0)) == len(DOCS)


def test_the_command_names_the_key_or_the_file_on_errors(tmp_path, tokenizer_path, capsys):
    a = jsonl(tmp_path / "a.jsonl", DOCS)
    argv = ["data", "tokenize", str(a), "--tokenizer", str(tokenizer_path), "--out", str(tmp_path / "o.bin")]
    assert main([*argv, "--data.document_token=-5"]) == 2
    assert "data.document_token: must be in [-1" in capsys.readouterr().err
    assert main([*argv, "--text-key=body", "--progress=off"]) == 1
    assert "a.jsonl:1: no 'body' key" in capsys.readouterr().err
    assert main([*argv[:3], "--tokenizer", str(tmp_path / "none.json"), "--out", str(tmp_path / "o.bin")]) == 1
    assert "none.json' does not exist" in capsys.readouterr().err
    assert not (tmp_path / "o.bin").exists()


def test_without_tokenizers_installed_the_command_says_how_to_get_it(tmp_path, tokenizer_path):
    """A real interpreter in which ``import tokenizers`` fails, as it does when the hf extra is absent."""
    a = jsonl(tmp_path / "a.jsonl", DOCS)
    script = (
        "import sys; sys.modules['tokenizers'] = None\n"  # makes `import tokenizers` raise ImportError
        "from ftrain.cli import main\n"
        f"sys.exit(main(['data', 'tokenize', {str(a)!r}, '--tokenizer', {str(tokenizer_path)!r}, "
        f"'--out', {str(tmp_path / 'o.bin')!r}]))\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "pip install 'ftrain[hf]'" in proc.stderr
