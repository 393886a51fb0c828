"""The ``ftrain`` command line: the top layer, the one place that composes every package.

    ftrain train CONFIG.toml [--section.key=value ...]   run training (torchrun runs this per worker)
    ftrain worker CONFIG.toml [--section.key=value ...]  a live worker (ftrain agent --recovery live starts it)
    ftrain plan CONFIG.toml [--world-size N] [--device-memory-gb G] [--section.key=value ...]
    ftrain config CONFIG.toml [--section.key=value ...]  print the resolved configuration
    ftrain config --reference                           print every key as Markdown
    ftrain data tokenize IN... --tokenizer T --out F    text/JSONL files -> a flat token file
    ftrain ckpt ls|show|verify|gc|export URI ...        inspect and maintain checkpoints
    ftrain agent [options] -- CONFIG.toml [overrides]   this node's agent (see agents/)
    ftrain status --etcd URL --job ID [--json] [--dump] a job's nodes, round, steps and restarts
    ftrain analyze EVENTS_OR_RUN_DIR [--json]           name the culprit of each hang from the flight records
    ftrain report RUN_DIR [--out DIR] [--config C]      an HTML report of a job: curves, timeline, lost time
    ftrain local up                                     local etcd + SeaweedFS S3 for trying it out
    ftrain chaos run SCENARIO.toml [--seed N]           fault injection that proves nothing was lost

Each command lives in its own module, imported only when that command runs: a worker
(``ftrain train``) loads the runtime and nothing of the node agent or chaos (a test checks the
modules a worker imports). Nothing below this package imports it.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import signal
import sys

from ftrain.contract import exits
from ftrain.contract.config import ConfigError

#: command -> the module that defines it (``add_parsers(sub)``)
COMMANDS = {
    "train": "ftrain.cli.train",
    "worker": "ftrain.cli.train",
    "plan": "ftrain.cli.plan",
    "ckpt": "ftrain.cli.ckpt",
    "agent": "ftrain.cli.agent",
    "status": "ftrain.cli.agent",
    "analyze": "ftrain.cli.analyze",
    "report": "ftrain.cli.report",
    "local": "ftrain.cli.local",
    "chaos": "ftrain.cli.chaos",
    "config": "ftrain.cli.config",
    "data": "ftrain.cli.data",
}


def _setup_logging() -> None:
    level = os.environ.get("FTRAIN_LOG_LEVEL", "INFO" if os.environ.get("RANK", "0") == "0" else "WARNING")
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser, with only the command named in ``argv`` loaded (all of them for help)."""
    parser = argparse.ArgumentParser(prog="ftrain", description="Fault-tolerant training runtime for PyTorch.")
    sub = parser.add_subparsers(dest="command", required=True)
    words = [a for a in (argv or []) if not a.startswith("-")]
    wanted = [COMMANDS[words[0]]] if words and words[0] in COMMANDS else list(COMMANDS.values())
    for module in dict.fromkeys(wanted):
        importlib.import_module(module).add_parsers(sub)
    return parser


#: the exit status of a command whose reader went away (``ftrain status ... | head``): a shell's
#: for a process ended by SIGPIPE, which is what the command would have met without Python's handler
BROKEN_PIPE = 128 + signal.SIGPIPE


def main(argv: list[str] | None = None) -> int:
    _setup_logging()
    argv = sys.argv[1:] if argv is None else argv
    args, overrides = build_parser(argv).parse_known_args(argv)
    try:
        code = args.func(args, overrides)
        sys.stdout.flush()  # here, not at exit: a reader gone is met where it is handled
        return code
    except ConfigError as e:
        print(f"ftrain: config error: {e}", file=sys.stderr)
        return exits.USAGE
    except BrokenPipeError:
        return _reader_gone()


def _reader_gone() -> int:
    """The reader of stdout closed it (``| head`` had enough): end quietly, as a command ended by
    SIGPIPE does, with no traceback; what is still buffered goes nowhere (Python's own flush at
    exit would otherwise raise again: the documented way, stdout onto /dev/null)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # no file descriptor behind stdout (redirected in-process)
        pass
    return BROKEN_PIPE


if __name__ == "__main__":
    sys.exit(main())
