"""The ``[agent]`` section of the config file: the node agent's settings (one definition each).

``ftrain agent``'s options are these keys (an option overrides the file); workers ignore the
section except ``agent.job``. Standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass

from contract.config import ConfigError, at_least, check_floats, int_range, opt, parse_nnodes, positive


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
        300.0, "Limit for start-up, checkpoint loads and saves (no step heartbeat), and for all members to start.")
    max_restarts: int = opt(10, "Failures (worker exit, hang, start timeout) allowed within restart_window_s.")
    restart_window_s: float = opt(3600.0, "Window of the restart budget.")
    backoff_initial_s: float = opt(1.0, "Wait before the 2nd restart in the window; doubles after each failure.")
    backoff_max_s: float = opt(30.0, "Longest wait between restarts.")
    deterministic_failures: int = opt(
        3, "The workers failed with the same error at the same step this many times in a row: stop the job "
        "with that error instead of spending the restart budget (0: never).")
    scale_up: str = opt(
        "checkpoint", "Nodes that join a running job enter at the next committed checkpoint, or immediately.",
        ("checkpoint", "immediate"),
    )
    metrics_port: int = opt(-1, "Prometheus metrics port (0: any free port, -1: off).")
    run_dir: str = opt("", "Worker logs and stack dumps (default: a new temporary directory).")

    def __post_init__(self) -> None:
        check_floats("agent", self)
        parse_nnodes(self.nnodes, "agent.nnodes")
        positive("agent.nproc_per_node", self.nproc_per_node)
        if self.lease_ttl_s < 2:
            raise ConfigError("agent.lease_ttl_s", f"must be >= 2 (etcd's minimum lease), got {self.lease_ttl_s}")
        at_least("agent.settle_s", self.settle_s, 0)
        for name in ("hang_timeout_s", "start_timeout_s", "restart_window_s"):
            positive(f"agent.{name}", getattr(self, name))
        at_least("agent.max_restarts", self.max_restarts, 0)
        at_least("agent.deterministic_failures", self.deterministic_failures, 0)
        at_least("agent.backoff_initial_s", self.backoff_initial_s, 0)
        at_least("agent.backoff_max_s", self.backoff_max_s, self.backoff_initial_s)
        int_range("agent.metrics_port", self.metrics_port, -1, 65535)
