"""Every command and configuration the docs show is one that works: a doc that rots is worse than
none.

Each fenced block of README.md, docs/*.md and bench/README.md says what it holds:

- ``sh``: commands. The block must be valid shell (``bash -n``), and each command must parse as
  what it names: ``ftrain ...`` (or ``python -m ftrain``) with ftrain's own parser, its
  ``--section.key=value`` overrides loaded with the config it names (a chaos scenario loaded as
  ``ftrain chaos run`` loads it); ``torchrun ...`` with
  torch's parser, then the ``-m ftrain`` part as above, or the example script it names with the
  script's own parser; ``make T`` a target of the Makefile;
  ``python bench/x.py ...`` with that benchmark's own parser (its ``main`` stops once the
  arguments are parsed); ``python -m module`` an importable module.
- ``toml``: configuration, loaded as ``ftrain train`` would load a file holding it.
- ``text``: diagrams and sample output; a line starting with ``$ `` is a command, checked as above.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed.run as torchrun

from ftrain.chaos.scenario import load_scenario
from ftrain.cli import build_parser
from ftrain.cli.config import load_job_config
from ftrain.contract.config import ConfigError
from ftrain.testbed.procs import REPO

PAGES = sorted([REPO / "README.md", REPO / "bench" / "README.md", *(REPO / "docs").glob("*.md")])
KINDS = ("sh", "toml", "text")
#: programs a doc may name that are not ftrain's (they need no check beyond the shell's syntax)
OTHER_PROGRAMS = ("export", "openssl", "sbatch", "srun", "kubectl", "curl")


def blocks(page: Path) -> list[tuple[int, str, str]]:
    """(line, kind, text) of every fenced block of ``page``."""
    out, kind, start, body = [], None, 0, []
    for n, line in enumerate(page.read_text().splitlines(), 1):
        if line.startswith("```"):
            if kind is None:
                kind, start, body = line[3:].strip(), n, []
            else:
                out.append((start, kind, "\n".join(body)))
                kind = None
        elif kind is not None:
            body.append(line)
    assert kind is None, f"{page}:{start}: a block that is never closed"
    return out


def commands(text: str) -> list[list[str]]:
    """The commands of a shell block: continuations joined, comments dropped, ``$(...)`` as one
    word, leading ``VAR=value`` assignments left out."""
    out = []
    for line in re.sub(r"\\\n\s*", " ", text).splitlines():
        words = shlex.split(re.sub(r"\$\([^)]*\)", "X", line), comments=True)
        while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=\S*", words[0]):
            words = words[1:]
        if words:
            out.append(words)
    return out


class _Parsed(Exception):
    """Raised by a script's parser once it parsed its arguments: the script does not run."""


def _script_arguments(script: Path, argv: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """A benchmark's or an example's ``main(argv)``, stopped once its parser took ``argv``."""
    spec = importlib.util.spec_from_file_location(f"doc_{script.parent.name}_{script.stem}", script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look their module up
    spec.loader.exec_module(module)
    parse = argparse.ArgumentParser.parse_args

    def parsed(self, args=None, namespace=None):
        parse(self, args, namespace)  # SystemExit(2) on a flag the benchmark does not take
        raise _Parsed

    with monkeypatch.context() as m:
        m.setattr(argparse.ArgumentParser, "parse_args", parsed)
        with pytest.raises(_Parsed):
            module.main(argv)


def _ftrain_arguments(argv: list[str]) -> None:
    args, overrides = build_parser(argv).parse_known_args(argv)
    config = getattr(args, "config", None) or next((a for a in argv if a.endswith(".toml")), None)
    assert all(o.startswith("--") and "=" in o for o in overrides), f"not ftrain's: {overrides}"
    if config and args.command == "chaos":
        load_scenario(REPO / config)
    elif config:
        assert (REPO / config).is_file() or not overrides, f"{config}: no such file for {overrides}"
        if (REPO / config).is_file():
            load_job_config(REPO / config, overrides)


def check_command(words: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    program = Path(words[0]).name
    if program in ("python", "python3"):
        if words[1:2] == ["-m"]:
            module, rest = words[2], words[3:]
            if module == "ftrain":
                return _ftrain_arguments(rest)
            if module == "torch.distributed.run":
                return check_command(["torchrun", *rest], monkeypatch)
            assert importlib.util.find_spec(module) is not None, f"no module {module}"
            return None
        script = REPO / words[1]
        assert script.is_file(), f"no script {words[1]}"
        if script.parent.name == "bench":
            _script_arguments(script, words[2:], monkeypatch)
        return None
    if program == "ftrain":
        return _ftrain_arguments(words[1:])
    if program == "torchrun":
        args = torchrun.get_args_parser().parse_args(words[1:])
        if args.module:
            assert args.training_script == "ftrain", words
            return _ftrain_arguments(args.training_script_args)
        script = REPO / args.training_script  # a script of the repository's: an example
        assert script.is_file() and script.parts[-3] == "examples", f"no example {args.training_script}"
        return _script_arguments(script, args.training_script_args, monkeypatch)
    if program == "make":
        targets = re.findall(r"^([\w-]+):", (REPO / "Makefile").read_text(), re.M)
        for target in (w for w in words[1:] if "=" not in w):
            assert target in targets, f"make {target}: no such target"
        return None
    assert program in OTHER_PROGRAMS, f"{program}: not a command the docs test knows how to check"
    return None


def _all_blocks() -> list[tuple[str, str, str]]:
    return [(f"{page.relative_to(REPO)}:{line}", kind, text) for page in PAGES for line, kind, text in blocks(page)]


@pytest.mark.parametrize(("where", "kind", "text"), [pytest.param(*b, id=b[0]) for b in _all_blocks()])
def test_every_doc_block_runs_or_parses(where, kind, text, tmp_path, monkeypatch):
    assert kind in KINDS, f"{where}: say what the block holds (```sh, ```toml or ```text), not {kind!r}"
    if kind == "toml":
        path = tmp_path / "doc.toml"
        path.write_text(text)
        load_job_config(path)
        return
    if kind == "text":
        text = "\n".join(line[2:] for line in text.splitlines() if line.startswith("$ "))
    else:
        syntax = subprocess.run(["bash", "-n"], input=text, capture_output=True, text=True)
        assert syntax.returncode == 0, f"{where}: {syntax.stderr}"
    for words in commands(text):
        try:
            check_command(words, monkeypatch)
        except SystemExit as e:
            pytest.fail(f"{where}: {shlex.join(words)}: its parser refused it (exit {e.code})")


def test_the_checker_refuses_what_rotted(monkeypatch):
    for bad in (
        "ftrain train configs/demo.toml --train.stesp=5",
        "ftrain plan configs/demo.toml --world-sise 8",
        "torchrun --standalone --nproc-per-node 2 -m ftrain train configs/demo.toml --parallel.pp_sise=2",
        "make no-such-target",
        "python bench/strategies.py --no-such-flag",
        "python -m ftrain.no_such_module",
        "ftrain_old train x.toml",
    ):
        with pytest.raises((AssertionError, SystemExit, ConfigError)):
            for words in commands(bad):
                check_command(words, monkeypatch)
    assert commands("A=1 B=2 ftrain x \\\n  --y $(hostname -i)  # comment") == [["ftrain", "x", "--y", "X"]]
