"""The ``ftrain`` command line.

    ftrain train CONFIG.toml [--section.key=value ...]   run training (torchrun runs this per worker)
    ftrain plan CONFIG.toml [--world-size N] [--device-memory-gb G] [--section.key=value ...]
    ftrain config CONFIG.toml [--section.key=value ...]  print the resolved configuration
    ftrain config --reference                           print every key as Markdown
    ftrain ckpt ls|show|verify|gc|export URI ...        inspect and maintain checkpoints
    ftrain agent [options] -- CONFIG.toml [overrides]   this node's agent (see agents/)
    ftrain status --etcd URL --job ID [--json]          a job's nodes, round, steps and restarts
    ftrain local up                                     local etcd + SeaweedFS S3 for trying it out
    ftrain chaos run SCENARIO.toml [--seed N]           fault injection that proves nothing was lost

The CLI is the one place in ``ftrain`` that reaches into ``agents`` (and ``chaos``): the
runtime itself never does.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from checkpoint.errors import CheckpointError
from ftrain.config import ConfigError, load_config, reference_markdown
from ftrain.ckpt_cli import add_ckpt_parser
from ftrain.data import DataError

log = logging.getLogger("ftrain")

EXIT_CONFIG = 2
EXIT_CHECKPOINT = 3  #: no step can be loaded, or commits keep failing: the message says which and why


def _setup_logging() -> None:
    level = os.environ.get("FTRAIN_LOG_LEVEL", "INFO" if os.environ.get("RANK", "0") == "0" else "WARNING")
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _cmd_train(args: argparse.Namespace, overrides: list[str]) -> int:
    cfg = load_config(args.config, overrides)
    from ftrain.train import train  # heavy imports only once the config is known to be good

    train(cfg)
    _exit_without_teardown(0)
    return 0  # not reached


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


def _cmd_plan(args: argparse.Namespace, overrides: list[str]) -> int:
    cfg = load_config(args.config, overrides)
    from ftrain.plan import plan_report

    print(plan_report(cfg, world_size=args.world_size, device_memory_bytes=int(args.device_memory_gb * 2**30)
                      if args.device_memory_gb else None, gpus_per_node=args.gpus_per_node))
    return 0


def _cmd_config(args: argparse.Namespace, overrides: list[str]) -> int:
    if args.reference:
        print(reference_markdown())
        return 0
    cfg = load_config(args.config, overrides)
    print(json.dumps(cfg.to_dict(), indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ftrain", description="Fault-tolerant training runtime for PyTorch.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="run training (the worker entry point torchrun launches)")
    p.add_argument("config", help="TOML config file")
    p.set_defaults(func=_cmd_train)

    p = sub.add_parser("plan", help="per-rank memory estimate for every strategy, and a recommendation")
    p.add_argument("config", nargs="?", help="TOML config file (defaults if omitted)")
    p.add_argument("--world-size", type=int, default=8, help="ranks in the job (default 8)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="ranks per node, for HSDP groups (default 8)")
    p.add_argument("--device-memory-gb", type=float, default=None,
                   help="memory per rank in GiB (default: this machine's GPU, else 80)")
    p.set_defaults(func=_cmd_plan)

    add_ckpt_parser(sub)

    from agents.cli import add_parsers as add_agent_parsers
    from ftrain.local_cli import add_parsers as add_local_parsers

    add_agent_parsers(sub)
    add_local_parsers(sub)

    from chaos.cli import add_parsers as add_chaos_parsers

    add_chaos_parsers(sub)

    p = sub.add_parser("config", help="print the resolved configuration, or the reference of all keys")
    p.add_argument("config", nargs="?", help="TOML config file")
    p.add_argument("--reference", action="store_true", help="print every key, type, default and meaning")
    p.set_defaults(func=_cmd_config)
    return parser


def main(argv: list[str] | None = None) -> int:
    _setup_logging()
    args, overrides = build_parser().parse_known_args(argv)
    try:
        return args.func(args, overrides)
    except ConfigError as e:
        print(f"ftrain: config error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    except DataError as e:
        print(f"ftrain: data error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    except CheckpointError as e:
        print(f"ftrain: checkpoint error: {e}", file=sys.stderr)
        return EXIT_CHECKPOINT


if __name__ == "__main__":
    sys.exit(main())
