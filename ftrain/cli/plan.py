"""``ftrain plan``: per-rank memory of every strategy for a config, and a recommendation."""

from __future__ import annotations

import argparse

from ftrain.config import load_config
from ftrain.contract import exits


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="per-rank memory estimate for every strategy, and a recommendation")
    p.add_argument("config", nargs="?", help="TOML config file (defaults if omitted)")
    p.add_argument("--world-size", type=int, default=8, help="ranks in the job (default 8)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="ranks per node, for HSDP groups (default 8)")
    p.add_argument(
        "--device-memory-gb",
        type=float,
        default=None,
        help="memory per rank in GiB (default: this machine's GPU, else 80)",
    )
    p.set_defaults(func=_cmd_plan)


def _cmd_plan(args: argparse.Namespace, overrides: list[str]) -> int:
    cfg = load_config(args.config, overrides)
    from ftrain.planning.plan_report import plan_report

    memory_bytes = int(args.device_memory_gb * 2**30) if args.device_memory_gb else None
    print(
        plan_report(cfg, world_size=args.world_size, device_memory_bytes=memory_bytes, gpus_per_node=args.gpus_per_node)
    )
    return exits.OK
