"""``ftrain chaos ...`` (registered into the ``ftrain`` command line; the runner, which needs
torch, is imported only when a chaos command runs, so other commands start fast)."""

from __future__ import annotations

import argparse
import os

from ftrain.testbed.procs import REPO


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chaos", help="fault-injection scenarios that prove nothing was lost")
    chaos = p.add_subparsers(dest="chaos_command", required=True)
    r = chaos.add_parser("run", help="run a scenario and check its invariants")
    r.add_argument("scenario", help="scenario TOML file (see chaos/scenarios/)")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--out", default=None, help="output directory (default: runs/chaos/<name>-<seed>-<time>)")
    r.add_argument(
        "--cache-dir",
        default=os.environ.get("FTRAIN_CHAOS_CACHE", str(REPO / "runs" / "chaos-cache")),
        help="where golden runs are kept (keyed by config hash)",
    )
    r.add_argument(
        "--recovery",
        choices=("live", "restart"),
        default=None,
        help="the agents' recovery mode (default: the scenario's agent options, else the agents' default)",
    )
    r.add_argument(
        "--fault-every-s",
        type=float,
        default=None,
        metavar="S",
        help="mean seconds between the random campaign's faults (exponential waits), instead of the scenario's",
    )
    r.set_defaults(func=_run)


def _run(args: argparse.Namespace, overrides: list[str]) -> int:
    from ftrain.chaos.runner import run_main

    return run_main(args)
