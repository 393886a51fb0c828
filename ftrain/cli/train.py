"""``ftrain train``: the worker entry point (torchrun starts one per rank); ``ftrain worker``: a
live worker (an agent under ``--recovery live`` starts it, see :mod:`ftrain.recovery.live`).

Imports the runtime only: the node agent and chaos are other processes.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from ftrain.checkpoint.errors import CheckpointError
from ftrain.config import load_config
from ftrain.contract import exits
from ftrain.data import DataError


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="run training (the worker entry point torchrun launches)")
    p.add_argument("config", help="TOML config file")
    p.set_defaults(func=_cmd_train)
    w = sub.add_parser(
        "worker", help="a live worker: serves the rounds its agent assigns (ftrain agent --recovery live)"
    )
    w.add_argument("config", help="TOML config file")
    w.set_defaults(func=_cmd_worker)


def _cmd_train(args: argparse.Namespace, overrides: list[str]) -> int:
    cfg = load_config(args.config, overrides)
    from ftrain.train import train  # heavy imports only once the config is known to be good

    return _run(lambda: train(cfg))


def _cmd_worker(args: argparse.Namespace, overrides: list[str]) -> int:
    cfg = load_config(args.config, overrides)
    from ftrain.recovery.live import serve  # imported before any assignment: that is what makes a spare warm

    return _run(lambda: serve(cfg))


def _run(work: Callable[[], object]) -> int:
    try:
        work()
    except DataError as e:
        print(f"ftrain: data error: {e}", file=sys.stderr)
        return exits.USAGE
    except CheckpointError as e:
        print(f"ftrain: checkpoint error: {e}", file=sys.stderr)
        return exits.CHECKPOINT
    from ftrain.distributed import exit_without_teardown  # already imported by the work

    exit_without_teardown(exits.OK)
    return exits.OK  # not reached
