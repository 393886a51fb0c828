"""The ``[agent]`` section of the config file: the node agent's settings (one definition each).

Every setting of the node agent is a key here, with its one default and its help text:
``ftrain agent``'s per-key options are generated from these fields (an option overrides the
file), :class:`ftrain.agents.agent.AgentOptions` holds an instance, and the leader's
:class:`ftrain.agents.leader.Policy` is derived from one. Workers ignore the section except
``agent.job``. Standard library only.

What must stay true: an instance is valid (``__post_init__`` raises :class:`ConfigError` naming
the key), whether it came from a file, from options or from code.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ftrain.contract.config import ConfigError, at_least, check_floats, int_range, opt, parse_nnodes, positive


def option_name(key: str) -> str:
    """``ftrain agent``'s option for an ``[agent]`` key: ``nproc_per_node`` -> ``--nproc-per-node``."""
    return "--" + key.replace("_", "-")


@dataclass(kw_only=True, slots=True)
class AgentConfig:
    """Read by ``ftrain agent`` (its command-line options override these); workers ignore it."""

    etcd: str = opt("", "etcd client URLs, comma-separated (http://host:port,...).")
    job: str = opt("", "Job id: the agents of one job share it (and its keys in etcd).")
    nnodes: str = opt("1:1", "MIN:MAX nodes (or N): rounds need at least MIN live agents and take at most MAX.")
    nproc_per_node: int = opt(1, "Workers per node.")
    node_id: str = opt("", "This agent's node id (default: the host name); unique among live agents.")
    host: str = opt("127.0.0.1", "Address the other nodes reach this one at (rendezvous when it is node rank 0).")
    lease_ttl_s: int = opt(5, "etcd lease TTL: a node whose agent is silent this long is lost (min 2).")
    settle_s: float = opt(2.0, "Membership must be quiet this long before a round forms (last call for joiners).")
    hang_timeout_s: float = opt(120.0, "No heartbeat from a training worker for this long: dump stacks, restart.")
    start_timeout_s: float = opt(
        300.0, "Limit for start-up, checkpoint loads and saves (no step heartbeat), and for all members to start."
    )
    max_restarts: int = opt(10, "Failures (worker exit, hang, start timeout) allowed within restart_window_s.")
    restart_window_s: float = opt(3600.0, "Window of the restart budget.")
    backoff_initial_s: float = opt(1.0, "Wait before the 2nd restart in the window; doubles after each failure.")
    backoff_max_s: float = opt(30.0, "Longest wait between restarts.")
    deterministic_failures: int = opt(
        3,
        "The workers failed with the same error at the same step this many times in a row: stop the job "
        "with that error instead of spending the restart budget (0: never). Under live recovery, also the worker "
        "processes failing before they are ready in a row after which no spare is started ahead of need.",
    )
    scale_up: str = opt(
        "checkpoint",
        "Nodes that join a running job enter at the next committed checkpoint, or immediately.",
        ("checkpoint", "immediate"),
    )
    drain_timeout_s: float = opt(
        120.0, "On SIGTERM the workers finish the step and save; after this long they are killed."
    )
    recovery: str = opt(
        "live",
        "On a failure, restart: every worker restarts (a new torchrun, a load from storage); live: the "
        "healthy workers keep their processes and move to the new round in-process, dead ones are replaced "
        "by warm spares and take the state from a live peer.",
        ("live", "restart"),
    )
    spares: int = opt(1, "recovery=live: worker processes kept started ahead of need on this node (torch imported).")
    on_straggler: str = opt(
        "warn",
        "A node whose slowest rank is persistently busier per step than the other nodes' (its peers "
        "wait for it): warn (an event, a metric, a line in ftrain status), evict (also form a round without it; "
        "it may join again after straggler_rejoin_s) or off.",
        ("off", "warn", "evict"),
    )
    straggler_factor: float = opt(
        1.25,
        "A node is slow when its busy time per step (not blocked on communication) is this many times the others'.",
    )
    straggler_after_s: float = opt(3.0, "Slow for this long without a break: a straggler.")
    straggler_rejoin_s: float = opt(30.0, "on_straggler=evict: an evicted node may join again after this long.")
    drain_after_corruptions: int = opt(
        2,
        "Drain this node (its hardware is suspect) once the consistency check has found its ranks' "
        "parameters or optimizer state corrupt this many times: silent data corruption (0: never).",
    )
    metrics_port: int = opt(-1, "Prometheus metrics port (0: any free port, -1: off).")
    run_dir: str = opt("", "Worker logs and stack dumps (default: a new temporary directory).")

    def __post_init__(self) -> None:
        check_floats("agent", self)
        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            if choices and getattr(self, f.name) not in choices:
                raise ConfigError(f"agent.{f.name}", f"{getattr(self, f.name)!r} is not one of {', '.join(choices)}")
        parse_nnodes(self.nnodes, "agent.nnodes")
        positive("agent.nproc_per_node", self.nproc_per_node)
        if self.lease_ttl_s < 2:
            raise ConfigError("agent.lease_ttl_s", f"must be >= 2 (etcd's minimum lease), got {self.lease_ttl_s}")
        at_least("agent.settle_s", self.settle_s, 0)
        for name in ("hang_timeout_s", "start_timeout_s", "restart_window_s", "drain_timeout_s"):
            positive(f"agent.{name}", getattr(self, name))
        at_least("agent.max_restarts", self.max_restarts, 0)
        at_least("agent.deterministic_failures", self.deterministic_failures, 0)
        at_least("agent.spares", self.spares, 0)
        at_least("agent.drain_after_corruptions", self.drain_after_corruptions, 0)
        if not self.straggler_factor > 1:
            raise ConfigError("agent.straggler_factor", f"must be > 1, got {self.straggler_factor}")
        positive("agent.straggler_after_s", self.straggler_after_s)
        at_least("agent.straggler_rejoin_s", self.straggler_rejoin_s, 0)
        at_least("agent.backoff_initial_s", self.backoff_initial_s, 0)
        at_least("agent.backoff_max_s", self.backoff_max_s, self.backoff_initial_s)
        int_range("agent.metrics_port", self.metrics_port, -1, 65535)

    @classmethod
    def of(
        cls,
        *,
        min_nodes: int | None = None,
        max_nodes: int | None = None,
        etcd: str | Sequence[str] = "",
        **settings: Any,
    ) -> AgentConfig:
        """Built in code: the keys as keyword arguments, and for convenience ``min_nodes`` and
        ``max_nodes`` instead of ``nnodes`` (``max_nodes`` defaults to ``min_nodes``) and
        ``etcd`` as a list of URLs."""
        if min_nodes is not None:
            settings["nnodes"] = f"{min_nodes}:{max_nodes if max_nodes is not None else min_nodes}"
        elif max_nodes is not None:
            raise ConfigError("agent.nnodes", "max_nodes needs min_nodes")
        return cls(etcd=etcd if isinstance(etcd, str) else ",".join(etcd), **settings)

    @property
    def min_nodes(self) -> int:
        return parse_nnodes(self.nnodes, "agent.nnodes")[0]

    @property
    def max_nodes(self) -> int:
        return parse_nnodes(self.nnodes, "agent.nnodes")[1]

    @property
    def endpoints(self) -> list[str]:
        """``etcd`` as a list of URLs."""
        return [e for e in self.etcd.split(",") if e]


@dataclass(kw_only=True, slots=True)
class AccountingConfig:
    """The ``[accounting]`` section: what lost time costs (read by ``ftrain agent`` and ``ftrain
    report``; workers ignore it)."""

    device_hour_price: float = opt(
        0.0,
        "Price of one device (a GPU, or a CPU worker) for one hour: with it the agents' metrics, ftrain status "
        "and ftrain report show what lost time cost, beside device-hours (0: device-hours only).",
    )

    def __post_init__(self) -> None:
        check_floats("accounting", self)
        at_least("accounting.device_hour_price", self.device_hour_price, 0)


def agent_flags(settings: Mapping[str, Any]) -> tuple[str, ...]:
    """``ftrain agent`` options setting these ``[agent]`` keys; checked against
    :class:`AgentConfig` here, so a misspelt key or a bad value fails before any agent starts."""
    AgentConfig(**settings)
    return tuple(arg for key, value in settings.items() for arg in (option_name(key), str(value)))


def settings_of_flags(flags: Sequence[str]) -> dict[str, Any]:
    """The ``[agent]`` keys that ``ftrain agent`` options set (the inverse of :func:`agent_flags`;
    a later option wins, options that are not keys are skipped), typed as the keys are."""
    types = {option_name(f.name): (f.name, f.type) for f in dataclasses.fields(AgentConfig)}
    cast = {"int": int, "float": float, "str": str}
    settings: dict[str, Any] = {}
    for option, value in zip(flags, flags[1:], strict=False):
        if option in types:
            key, kind = types[option]
            settings[key] = cast[str(kind)](value)
    return settings
