"""``ftrain agent`` and ``ftrain status`` (registered into the ``ftrain`` command line)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import socket
import sys
from typing import TYPE_CHECKING, Any

from ftrain.agents.agent_options import AgentOptions
from ftrain.agents.assemble import build_agent
from ftrain.agents.config import AgentConfig, option_name
from ftrain.agents.errors import AgentError, EtcdUnavailableError, NodeIdTakenError
from ftrain.cli.config import load_job_config
from ftrain.contract import exits
from ftrain.contract.config import ConfigError
from ftrain.contract.local_files import UnsafeLocalDirError
from ftrain.parallel import strategies
from ftrain.parallel.pipeline_stages import pipeline_degrees

if TYPE_CHECKING:
    from ftrain.config import Config

log = logging.getLogger(__name__)

_TYPES = {"int": int, "float": float, "str": str}


def add_config_options(p: argparse.ArgumentParser) -> None:
    """One option per :class:`AgentConfig` key (``--nproc-per-node`` for ``nproc_per_node``),
    with the key's type, choices and help; unset (None) unless given, so the file's value stays."""
    for f in dataclasses.fields(AgentConfig):
        p.add_argument(
            option_name(f.name),
            dest=f.name,
            type=_TYPES[str(f.type)],
            choices=f.metadata.get("choices"),
            default=None,
            help=f"{f.metadata['help']} (agent.{f.name})",
        )


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "agent",
        help="run this node's agent: join the job in etcd, supervise workers, restart elastically",
        description="ftrain agent --etcd URL --job ID --nnodes MIN:MAX --nproc-per-node N -- CONFIG.toml "
        "[--section.key=value ...]. Options default to the config file's [agent] section.",
    )
    add_config_options(p)
    p.add_argument("--events", default=None, help="agent events file (default: the config's logging.events_path)")
    p.add_argument("--etcd-user", default=None, help="etcd user (password from FTRAIN_ETCD_PASSWORD)")
    p.add_argument("--etcd-ca-cert", default=None, help="CA bundle for https etcd endpoints")
    p.add_argument("--etcd-cert", default=None, help="client certificate (PEM) for https etcd endpoints")
    p.add_argument("--etcd-key", default=None, help="the client certificate's private key (PEM)")
    p.add_argument(
        "--script",
        default=None,
        help="run this training script of yours (its loop uses ftrain.Session, docs/library.md) instead of "
        "ftrain train; what follows -- are its own arguments; recovery is restart unless --recovery live (then its "
        "loop must run in ftrain.Session.run, which serves round after round in-process)",
    )
    p.add_argument(
        "worker_args", nargs="*", help="after --: CONFIG.toml and --section.key=value overrides (or the script's)"
    )
    p.set_defaults(func=agent_main, takes_overrides=True)

    p = sub.add_parser("status", help="a job's nodes, leader, round, heartbeats, checkpoints and restarts")
    p.add_argument("--etcd", required=True, help="etcd client URLs, comma-separated")
    p.add_argument("--job", required=True, help="job id")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument(
        "--dump",
        action="store_true",
        help="first ask every agent to dump its workers' flight records and stacks (a 'dumped' event) and show "
        "what the records say",
    )
    p.add_argument("--dump-timeout-s", type=float, default=10.0, help="how long to wait for the agents' dumps")
    p.add_argument("--etcd-user", default=None, help="etcd user (password from FTRAIN_ETCD_PASSWORD)")
    p.add_argument("--etcd-ca-cert", default=None, help="CA bundle for https etcd endpoints")
    p.add_argument("--etcd-cert", default=None, help="client certificate (PEM)")
    p.add_argument("--etcd-key", default=None, help="the client certificate's private key (PEM)")
    p.set_defaults(func=_status_main)


def resolve_config(file_config: AgentConfig, args: argparse.Namespace) -> AgentConfig:
    """The file's ``[agent]`` section with the options given on the command line over it; a bad
    value is a :class:`ConfigError` naming the key and, when an option gave it, the option."""
    given = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(AgentConfig)
        if getattr(args, f.name, None) is not None
    }
    try:
        config = dataclasses.replace(file_config, **given)
    except ConfigError as e:
        name = e.key.removeprefix("agent.")
        if name not in given:
            raise
        raise ConfigError(e.key, f"{str(e).removeprefix(e.key + ': ')} (given as {option_name(name)})") from None
    missing = [f"{option_name(n)} (or agent.{n})" for n in ("etcd", "job") if not getattr(config, n)]
    if missing:
        raise ConfigError("agent", f"missing {' and '.join(missing)}")
    return config if config.node_id else dataclasses.replace(config, node_id=socket.gethostname())


def resolve_options(args: argparse.Namespace, overrides: list[str]) -> AgentOptions:
    worker_args = [*args.worker_args, *overrides]
    if getattr(args, "script", None):
        return _script_options(args, worker_args)
    if not worker_args:
        raise ConfigError("", "no training config: ftrain agent [options] -- CONFIG.toml [--section.key=value ...]")
    cfg = load_job_config(worker_args[0], worker_args[1:])  # fail here, not in every worker
    config = resolve_config(cfg.agent, args)
    return AgentOptions(
        config=config,
        worker_args=worker_args,
        events_path=args.events if args.events is not None else cfg.logging.events_path,
        **_etcd_access(args),
        device_hour_price=cfg.accounting.device_hour_price,
        pipeline_degrees=pipeline_degrees(cfg.parallel),
        fixed_tp_size=strategies.fixed_tp_size(cfg.parallel),
        refused_nodes=refused_node_counts(cfg, config),
    )


def refused_node_counts(cfg: Config, agent: AgentConfig) -> tuple[tuple[int, str], ...]:
    """The node counts of ``--nnodes MIN:MAX`` whose world size the job's config cannot run
    (:mod:`ftrain.parallel.world_sizes`: what a worker would stop on at start), each with why,
    logged once: the leader never forms a round of them. None that can: a :class:`ConfigError`
    naming the setting and the node counts that would run it. A check that cannot be made here
    (e.g. a strategy this host cannot import) is logged and skipped: the leader then learns a
    refused size from the workers' config error, at the first round of it."""
    from ftrain.parallel import world_sizes  # numpy and the data package: only for an agent that starts

    counts = range(agent.min_nodes, agent.max_nodes + 1)
    nproc = agent.nproc_per_node
    try:
        refused = world_sizes.node_count_refusals(cfg, counts, nproc)
    except Exception as e:  # noqa: BLE001 - anything but a verdict: the workers will give theirs
        log.warning(
            "cannot tell which node counts of --nnodes %s the training config runs at (%s: %s): rounds take any "
            "count, and one the workers refuse with a config error is not formed again",
            agent.nnodes,
            type(e).__name__,
            e,
        )
        return ()
    if len(refused) == len(counts):
        raise _nothing_runs(cfg, agent, refused)
    if refused:
        log.warning(
            "--nnodes %s with --nproc-per-node %d: rounds of %s node(s) are never formed (the job cannot run at "
            "that world size: %s); with that many nodes live, a round takes the most that can run and the others "
            "wait as spares",
            agent.nnodes,
            nproc,
            ", ".join(map(str, refused)),
            "; ".join(f"{n * nproc} ranks: {e}" for n, e in refused.items()),
        )
    return tuple((n, f"{e}") for n, e in sorted(refused.items()))


def _nothing_runs(cfg: Config, agent: AgentConfig, refused: dict[int, ConfigError]) -> ConfigError:
    """No node count of ``--nnodes`` runs: the error names the setting (the largest count's) and
    the node counts that would."""
    from ftrain.parallel import world_sizes

    nproc = agent.nproc_per_node
    up_to = max(64, 4 * agent.max_nodes)
    fits = world_sizes.workable_node_counts(cfg, nproc, up_to)
    counts = ", ".join(map(str, fits)) + (", ..." if len(fits) == world_sizes.SHOWN else "")
    where = (
        f"node counts that would run it at --nproc-per-node {nproc}: {counts}"
        if fits
        else f"no node count up to {up_to} runs it at --nproc-per-node {nproc}"
    )
    why = "; ".join(f"{n} node(s) = {n * nproc} ranks: {e}" for n, e in sorted(refused.items()))
    key = refused[agent.max_nodes].key or "agent.nnodes"
    return ConfigError(
        key,
        f"no node count of --nnodes {agent.nnodes} can run this job ({why}); {where}: change --nnodes or "
        "the setting named",
    )


def _script_options(args: argparse.Namespace, script_args: list[str]) -> AgentOptions:
    """``--script``: no training config to read (the [agent] keys come from the options alone, the
    layout is one process per rank), and restart recovery unless the options ask for live (the
    script's loop then serves rounds through :meth:`ftrain.Session.run`)."""
    if args.recovery is None:
        args = argparse.Namespace(**{**vars(args), "recovery": "restart"})
    return AgentOptions(
        config=resolve_config(AgentConfig(), args),
        worker_args=script_args,
        script=args.script,
        events_path=args.events or "",
        **_etcd_access(args),
    )


def _etcd_access(args: argparse.Namespace) -> dict[str, Any]:
    """The agent's etcd credentials and TLS files from its options (the password from the environment)."""
    return {
        "etcd_username": args.etcd_user,
        "etcd_password": os.environ.get("FTRAIN_ETCD_PASSWORD") if args.etcd_user else None,
        "etcd_ca_cert": args.etcd_ca_cert,
        "etcd_cert": args.etcd_cert,
        "etcd_key": args.etcd_key,
    }


def agent_main(args: argparse.Namespace, overrides: list[str]) -> int:
    opts = resolve_options(args, overrides)
    try:
        agent = build_agent(opts)
    except (ValueError, UnsafeLocalDirError) as e:  # a bad option; a run dir others could write
        print(f"ftrain agent: {e}", file=sys.stderr)
        return exits.USAGE
    try:
        return agent.run()
    except NodeIdTakenError as e:
        print(f"ftrain agent: {e}", file=sys.stderr)
        return exits.USAGE
    except EtcdUnavailableError as e:
        print(f"ftrain agent: cannot reach etcd at {','.join(opts.config.endpoints)}: {e}", file=sys.stderr)
        return exits.USAGE
    except AgentError as e:
        print(f"ftrain agent: {e}", file=sys.stderr)
        return exits.FAILED


def _status_main(args: argparse.Namespace, overrides: list[str]) -> int:
    from ftrain.agents.status import status_main

    password = os.environ.get("FTRAIN_ETCD_PASSWORD") if args.etcd_user else None
    if args.etcd_user and password is None:
        print("ftrain status: --etcd-user needs the password in FTRAIN_ETCD_PASSWORD", file=sys.stderr)
        return exits.USAGE
    client_options = {
        "username": args.etcd_user,
        "password": password,
        "ca_cert": args.etcd_ca_cert,
        "cert": args.etcd_cert,
        "key": args.etcd_key,
    }
    try:
        return status_main(
            [e for e in args.etcd.split(",") if e],
            args.job,
            as_json=args.json,
            client_options=client_options,
            dump_timeout_s=args.dump_timeout_s if args.dump else None,
        )
    except ValueError as e:  # a bad --job or --etcd
        print(f"ftrain status: {e}", file=sys.stderr)
        return exits.USAGE
    except EtcdUnavailableError as e:
        print(f"ftrain status: cannot reach etcd at {args.etcd}: {e}", file=sys.stderr)
        return exits.USAGE
    except AgentError as e:
        print(f"ftrain status: {e}", file=sys.stderr)
        return exits.USAGE
