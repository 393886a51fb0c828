"""``ftrain data tokenize``: text and JSONL in, a flat token file out, with a tokenizer trained here
on a few strings (nothing is downloaded)."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from ftrain.cli import main
from ftrain.data import TokenFileSource
from ftrain.data.errors import DataError
from ftrain.data.token_record import read_record
from ftrain.data.tokenize import TokenizeProgress, load_tokenizer, output_dtype, pieces, read_tokenizer, tokenize_files
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


# -- bounded memory, safe files, errors said before the work (issue 38: items 10, 11, 12, 19) --
def test_a_long_text_streams_in_pieces_cut_at_line_ends_and_encodes_as_a_whole(tmp_path, tokenizer_path):
    """A text longer than --batch-chars is read and encoded a piece at a time, each piece ending
    at a line end; the ids are those of the whole text encoded at once."""
    tok = load_tokenizer(tokenizer_path)
    text = "".join(f"{DOCS[0]} line {i} {DOCS[3]}\n" for i in range(400))
    source = tmp_path / "long.txt"
    source.write_text(text)
    with open(source, "rb") as raw:
        parts = list(pieces(source, raw, "text", piece_chars=1000))
    assert len(parts) > len(text) // 1000 and all(len(p) <= 1000 for p, _ in parts)
    assert [end for _, end in parts] == [False] * (len(parts) - 1) + [True]  # one document
    assert all(p.endswith("\n") for p, _ in parts) and "".join(p for p, _ in parts) == text
    out = tmp_path / "long.bin"
    result = tokenize_files([source], tok, out, document_token=0, batch_chars=1000)
    whole = tok.encode(text, add_special_tokens=False).ids + [0]
    assert np.fromfile(out, dtype="<u2").tolist() == whole and result.inputs[0].documents == 1


def test_a_gzip_bomb_is_read_a_piece_at_a_time():
    """A 256 MiB text in a .gz of 800 KB: the first piece comes after reading a little of it."""
    line = b"The quick brown fox jumps over the lazy dog.\n"
    member = gzip.compress(line * ((1 << 20) // len(line)), 9)
    raw = io.BytesIO(member * 256)
    parts = pieces(Path("bomb.txt.gz"), raw, "text", piece_chars=1 << 16)
    first, end = next(parts)
    assert len(first) <= 1 << 16 and not end
    assert raw.tell() <= 1 << 16  # of 800 KB: the decompressed rest is neither read nor held


def test_tokenize_of_a_gzip_bomb_keeps_its_memory_bounded(tmp_path, tokenizer_path):
    """A 801 KB .gz of 256 MiB of text: the command holds ~1 MiB of text at a time (peak RSS, from
    the kernel's accounting of the child, stays far below the input; it was 2.8 GB within 4 s
    before). Stopped once 2 MB of tokens are out: proof enough that it streams."""
    line = b"The quick brown fox jumps over the lazy dog.\n"
    member = gzip.compress(line * ((1 << 20) // len(line)), 9)
    bomb = tmp_path / "bomb.txt.gz"
    bomb.write_bytes(member * 256)
    out = tmp_path / "out.bin"
    argv = [sys.executable, "-m", "ftrain", "data", "tokenize", str(bomb), "--tokenizer", str(tokenizer_path)]
    limit = 3 << 30  # a cap for the machine's sake, never reached when memory is bounded

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    proc = subprocess.Popen([*argv, "--out", str(out), "--progress=off"], cwd=REPO, preexec_fn=cap)
    # The peak is the process's own high-water mark (VmHWM starts afresh at exec), read while it
    # runs: the kernel's rusage of the child also counts the RSS it had as a fork of this test
    # process before exec, which in a long suite is ~0.8 GB of pytest's own.
    peak_kib, written = 0, 0
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None and written <= 2_000_000:
            peak_kib = max(peak_kib, _high_water_kib(proc.pid))
            written = sum(p.stat().st_size for p in tmp_path.glob(".out.bin.tmp-*"))
            time.sleep(0.05)  # polling the output's size, not waiting for an event
        peak_kib = max(peak_kib, _high_water_kib(proc.pid))
    finally:
        proc.kill()
        proc.wait()
    assert written > 2_000_000, f"it wrote {written} bytes and ended with {proc.returncode}"
    assert 0 < peak_kib * 1024 < 400e6, f"peak RSS {peak_kib / 1024:.0f} MB"


def _high_water_kib(pid: int) -> int:
    """The peak resident size of ``pid`` since its exec (``VmHWM``), 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            return next((int(line.split()[1]) for line in fh if line.startswith("VmHWM:")), 0)
    except OSError:
        return 0


def test_temporary_files_do_not_follow_a_planted_link(tmp_path, tokenizer_path):
    """The old temporary name (``.<out>.tmp-<pid>``) was predictable: a link planted there in a shared
    directory made tokenize write through it, over the victim."""
    tok = load_tokenizer(tokenizer_path)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    out = tmp_path / "corpus.bin"
    (tmp_path / f".corpus.bin.tmp-{os.getpid()}").symlink_to(victim)
    tokenize_files([jsonl(tmp_path / "a.jsonl", DOCS)], tok, out, document_token=0)
    assert victim.read_bytes() == b"precious"
    assert len(split_documents(np.fromfile(out, dtype="<u2"), 0)) == len(DOCS)


def test_a_lone_surrogate_names_the_file_line_and_fix(tmp_path, tokenizer_path):
    tok = load_tokenizer(tokenizer_path)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": "half a pair: \\ud83d here"}\n')
    out = tmp_path / "out.bin"
    with pytest.raises(DataError, match=r"bad\.jsonl:2: 'text' holds a lone UTF-16 surrogate \\ud83d at character 13"):
        tokenize_files([bad], tok, out)
    assert not out.exists()
    bad.write_text('{"text": "a whole pair: \\ud83d\\ude00"}\n')  # a pair is one character: fine
    tokenize_files([bad], tok, out)
    assert tok.decode(np.fromfile(out, dtype="<u2").tolist()) == "a whole pair: \U0001f600"


def test_a_jsonl_line_longer_than_the_limit_is_named(tmp_path, tokenizer_path):
    tok = load_tokenizer(tokenizer_path)
    big = jsonl(tmp_path / "big.jsonl", ["short", "x" * 5000])
    with pytest.raises(DataError, match=r"big\.jsonl:2: a line longer than 1,000 characters \(--max-line-chars\)"):
        tokenize_files([big], tok, tmp_path / "out.bin", max_line_chars=1000)


class _Counting:
    """A tokenizer that counts its encode calls (to prove nothing was encoded)."""

    def __init__(self, tok):
        self.tok, self.calls = tok, 0

    def get_vocab_size(self, with_added_tokens: bool = True) -> int:
        return self.tok.get_vocab_size(with_added_tokens=with_added_tokens)

    def encode_batch(self, batch, add_special_tokens=False):
        self.calls += 1
        return self.tok.encode_batch(batch, add_special_tokens=add_special_tokens)


@pytest.mark.parametrize(
    ("out", "words"),
    [
        ("missing/corpus.bin", "directory '{tmp}/missing' does not exist; create it (mkdir -p {tmp}/missing)"),
        ("a_dir", "'{tmp}/a_dir' is an existing directory; give the path of a file"),
        ("a.jsonl/corpus.bin", "'{tmp}/a.jsonl' is not a directory"),
    ],
)
def test_a_bad_out_is_refused_before_any_work(tmp_path, tokenizer_path, out, words):
    tok = _Counting(load_tokenizer(tokenizer_path))
    (tmp_path / "a_dir").mkdir()
    source = jsonl(tmp_path / "a.jsonl", DOCS)
    with pytest.raises(DataError, match="^--out ") as info:
        tokenize_files([source], tok, tmp_path / out)
    assert words.format(tmp=tmp_path) in str(info.value)
    assert tok.calls == 0


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_an_out_in_a_read_only_directory_is_refused_before_any_work(tmp_path, tokenizer_path):
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o555)
    tok = _Counting(load_tokenizer(tokenizer_path))
    with pytest.raises(DataError, match="is not writable by this user"):
        tokenize_files([jsonl(tmp_path / "a.jsonl", DOCS)], tok, ro / "c.bin")
    assert tok.calls == 0


def test_the_command_checks_out_first_and_takes_a_tokenizer_directory(tmp_path, tokenizer_path, capsys):
    a = jsonl(tmp_path / "a.jsonl", DOCS)
    saved = tmp_path / "saved"
    saved.mkdir()
    argv = ["data", "tokenize", str(a), "--progress=off", "--tokenizer"]
    assert main([*argv, str(saved), "--out", str(tmp_path / "o.bin")]) == 1
    err = capsys.readouterr().err
    assert f"tokenizer '{saved}' is a directory without a tokenizer.json (it holds: nothing)" in err
    (saved / "tokenizer_config.json").write_text("{}")
    assert main([*argv, str(saved), "--out", str(tmp_path / "o.bin")]) == 1
    assert "(it holds: tokenizer_config.json)" in capsys.readouterr().err
    (saved / "tokenizer.json").write_bytes(tokenizer_path.read_bytes())
    assert main([*argv, str(saved), "--out", str(tmp_path / "o.bin")]) == 0
    assert main([*argv, str(tmp_path / "nothing-here"), "--out", str(tmp_path / "nope" / "o.bin")]) == 1
    assert "directory" in capsys.readouterr().err  # --out is judged first, before the tokenizer


def test_the_output_carries_a_record_of_how_it_was_written(tmp_path, tokenizer_path):
    tok, info = read_tokenizer(tokenizer_path)
    assert info == {"path": str(tokenizer_path), "sha256": hashlib.sha256(tokenizer_path.read_bytes()).hexdigest()}
    out = tmp_path / "c.bin"
    result = tokenize_files(
        [jsonl(tmp_path / "a.jsonl", DOCS)], tok, out, document_token=0, dtype="uint32", tokenizer_info=info
    )
    record = read_record(out)
    assert record is not None
    assert (record.dtype, record.num_tokens, record.size_bytes) == ("uint32", result.tokens, out.stat().st_size)
    assert (record.vocab_size, record.document_token, record.tokenizer) == (tok.get_vocab_size(), 0, info)
    # a uint32 file of a 300-token vocabulary: auto reads it as uint32 (from the record), not as uint16
    src = TokenFileSource(out, seq_len=4, vocab_size=tok.get_vocab_size())
    assert src.dtype.name == "uint32" and src.num_tokens == result.tokens


def test_a_number_too_long_to_parse_names_the_line(tmp_path, tokenizer_path):
    """json.loads raises a plain ValueError (not a JSONDecodeError) past Python's 4300 digits."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": "x", "id": ' + "7" * 5000 + "}\n")
    with pytest.raises(DataError, match=r"bad\.jsonl:2: cannot be parsed .*fix or drop the line"):
        tokenize_files([bad], load_tokenizer(tokenizer_path), tmp_path / "out.bin")
