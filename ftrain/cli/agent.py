"""``ftrain agent`` and ``ftrain status`` (registered into the ``ftrain`` command line)."""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys

from agents.agent import Agent, AgentOptions
from agents.errors import AgentError, EtcdUnavailableError, NodeIdTakenError
from contract import exits
from contract.config import ConfigError, parse_nnodes
from ftrain.cli.config import load_job_config

log = logging.getLogger(__name__)

# option -> AgentConfig field; every one may also come from the config file's [agent] section
_FROM_CONFIG = ("etcd", "job", "nnodes", "nproc_per_node", "node_id", "host", "lease_ttl_s", "settle_s",
                "hang_timeout_s", "start_timeout_s", "max_restarts", "restart_window_s", "backoff_initial_s",
                "backoff_max_s", "deterministic_failures", "scale_up", "metrics_port", "run_dir")


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "agent", help="run this node's agent: join the job in etcd, supervise workers, restart elastically",
        description="ftrain agent --etcd URL --job ID --nnodes MIN:MAX --nproc-per-node N -- CONFIG.toml "
                    "[--section.key=value ...]. Options default to the config file's [agent] section.")
    p.add_argument("--etcd", help="etcd client URLs, comma-separated")
    p.add_argument("--job", help="job id shared by the job's agents")
    p.add_argument("--nnodes", help="MIN:MAX (or N) nodes")
    p.add_argument("--nproc-per-node", type=int, help="workers per node")
    p.add_argument("--node-id", help="unique node id (default: host name)")
    p.add_argument("--host", help="address other nodes reach this one at")
    p.add_argument("--lease-ttl-s", type=int, help="etcd lease TTL in seconds (node-loss detection)")
    p.add_argument("--settle-s", type=float, help="quiet membership time before a round forms")
    p.add_argument("--hang-timeout-s", type=float, help="heartbeat silence that counts as a hang")
    p.add_argument("--start-timeout-s", type=float, help="limit for start-up, loads and saves")
    p.add_argument("--max-restarts", type=int, help="failures allowed within --restart-window-s")
    p.add_argument("--restart-window-s", type=float)
    p.add_argument("--backoff-initial-s", type=float)
    p.add_argument("--backoff-max-s", type=float)
    p.add_argument("--scale-up", choices=("checkpoint", "immediate"), help="when joining nodes enter")
    p.add_argument("--metrics-port", type=int, help="Prometheus port (0: any free one, -1: off)")
    p.add_argument("--run-dir", help="worker logs and stack dumps")
    p.add_argument("--events", default=None, help="agent events file (default: the config's logging.events_path)")
    p.add_argument("--etcd-user", default=None, help="etcd user (password from FTRAIN_ETCD_PASSWORD)")
    p.add_argument("--etcd-ca-cert", default=None, help="CA bundle for https etcd endpoints")
    p.add_argument("--etcd-cert", default=None, help="client certificate (PEM) for https etcd endpoints")
    p.add_argument("--etcd-key", default=None, help="the client certificate's private key (PEM)")
    p.add_argument("--deterministic-failures", type=int, default=None,
                   help="stop the job when the workers fail with the same error at the same step this many "
                        "times in a row (default 3; 0: never)")
    p.add_argument("worker_args", nargs="*", help="after --: CONFIG.toml and --section.key=value overrides")
    p.set_defaults(func=agent_main, takes_overrides=True)

    p = sub.add_parser("status", help="a job's nodes, leader, round, heartbeats, checkpoints and restarts")
    p.add_argument("--etcd", required=True, help="etcd client URLs, comma-separated")
    p.add_argument("--job", required=True, help="job id")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--etcd-user", default=None, help="etcd user (password from FTRAIN_ETCD_PASSWORD)")
    p.add_argument("--etcd-ca-cert", default=None, help="CA bundle for https etcd endpoints")
    p.add_argument("--etcd-cert", default=None, help="client certificate (PEM)")
    p.add_argument("--etcd-key", default=None, help="the client certificate's private key (PEM)")
    p.set_defaults(func=_status_main)


def resolve_options(args: argparse.Namespace, overrides: list[str]) -> AgentOptions:
    worker_args = [*args.worker_args, *overrides]
    if not worker_args:
        raise ConfigError("", "no training config: ftrain agent [options] -- CONFIG.toml [--section.key=value ...]")
    cfg = load_job_config(worker_args[0], worker_args[1:])  # fail here, not in every worker
    values = {name: getattr(cfg.agent, name) for name in _FROM_CONFIG}
    for name in _FROM_CONFIG:
        given = getattr(args, name, None)
        if given is not None:
            values[name] = given
    missing = [f"--{n.replace('_', '-')} (or agent.{n})" for n in ("etcd", "job") if not values[n]]
    if missing:
        raise ConfigError("agent", f"missing {' and '.join(missing)}")
    low, high = parse_nnodes(values.pop("nnodes"))
    password = os.environ.get("FTRAIN_ETCD_PASSWORD") if args.etcd_user else None
    return AgentOptions(
        etcd=[e for e in values.pop("etcd").split(",") if e], min_nodes=low, max_nodes=high,
        node_id=values.pop("node_id") or socket.gethostname(), worker_args=worker_args,
        events_path=args.events if args.events is not None else cfg.logging.events_path,
        etcd_username=args.etcd_user, etcd_password=password, etcd_ca_cert=args.etcd_ca_cert,
        etcd_cert=args.etcd_cert, etcd_key=args.etcd_key, **values)


def agent_main(args: argparse.Namespace, overrides: list[str]) -> int:
    opts = resolve_options(args, overrides)
    try:
        agent = Agent(opts)
    except ValueError as e:
        print(f"ftrain agent: {e}", file=sys.stderr)
        return exits.USAGE
    try:
        return agent.run()
    except NodeIdTakenError as e:
        print(f"ftrain agent: {e}", file=sys.stderr)
        return exits.USAGE
    except EtcdUnavailableError as e:
        print(f"ftrain agent: cannot reach etcd at {','.join(opts.etcd)}: {e}", file=sys.stderr)
        return exits.USAGE
    except AgentError as e:
        print(f"ftrain agent: {e}", file=sys.stderr)
        return exits.FAILED


def _status_main(args: argparse.Namespace, overrides: list[str]) -> int:
    from agents.status import status_main

    password = os.environ.get("FTRAIN_ETCD_PASSWORD") if args.etcd_user else None
    if args.etcd_user and password is None:
        print("ftrain status: --etcd-user needs the password in FTRAIN_ETCD_PASSWORD", file=sys.stderr)
        return exits.USAGE
    client_options = {"username": args.etcd_user, "password": password, "ca_cert": args.etcd_ca_cert,
                      "cert": args.etcd_cert, "key": args.etcd_key}
    try:
        return status_main([e for e in args.etcd.split(",") if e], args.job, as_json=args.json,
                           client_options=client_options)
    except ValueError as e:  # a bad --job or --etcd
        print(f"ftrain status: {e}", file=sys.stderr)
        return exits.USAGE
    except EtcdUnavailableError as e:
        print(f"ftrain status: cannot reach etcd at {args.etcd}: {e}", file=sys.stderr)
        return exits.USAGE
    except AgentError as e:
        print(f"ftrain status: {e}", file=sys.stderr)
        return exits.USAGE
