"""``ftrain train``: the worker entry point (torchrun starts one per rank); ``ftrain worker``: a
live worker (an agent under ``--recovery live`` starts it, see :mod:`ftrain.recovery.live`).

Imports the runtime only: the node agent and chaos are other processes.
"""

from __future__ import annotations

import argparse
import logging
import os
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
    _exit_without_teardown(exits.OK)
    return exits.OK  # not reached


def _exit_without_teardown(code: int) -> None:
    """End a finished worker without running C++ static destructors.

    After a clean run every collective has completed and the process groups are destroyed, yet
    gloo/c10d threads can still be joinable when the interpreter tears down, and destroying them
    calls std::terminate ("terminate called without an active exception", SIGABRT). The
    launcher then reports a failed rank for a run that succeeded. Nothing is left to flush but
    Python's own buffers, so flush those and leave at once.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
