"""What one node agent runs with: :class:`AgentOptions` (its ``[agent]`` settings and what is
not a key of the config file), checked before anything is created, and the file through which
its workers reach etcd as it does.

What must stay true:

- :meth:`AgentOptions.validate` refuses, with a ValueError naming the option, what
  :class:`ftrain.agents.config.AgentConfig` cannot check alone: ids that are not safe in key paths, no
  training config, a node range whose minimum (or every count) the training layout cannot use, a
  user without a password, TLS files that do not exist.
- workers reach etcd (the checkpoint fence) with the agent's credentials and TLS files through
  a 0600 file in the run dir (:func:`write_client_file`, named to them by
  ``FTRAIN_ETCD_CLIENT_FILE``): no secret on a command line, and ``FTRAIN_ETCD_PASSWORD`` is
  removed from the workers' environment.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
from dataclasses import dataclass, field
from typing import Any

from ftrain.agents.config import AgentConfig
from ftrain.agents.job_keys import validate_id
from ftrain.agents.policy import Policy
from ftrain.contract.local_files import replace_file


@dataclass(kw_only=True)
class AgentOptions:
    """What one agent runs with: its settings (``config``, the ``[agent]`` keys: their one
    definition and default is :class:`AgentConfig`) and what is not a key of the config file."""

    config: AgentConfig
    worker_args: list[str]  #: CONFIG.toml and --section.key=value overrides for ``ftrain train`` (or the script's)
    #: a user's training script run instead of ``ftrain train`` (restart recovery only: docs/library.md)
    script: str = ""
    events_path: str = ""
    worker_env: dict[str, str] = field(default_factory=dict)
    etcd_username: str | None = None
    etcd_password: str | None = None
    etcd_ca_cert: str | None = None
    etcd_cert: str | None = None  #: client certificate (PEM) for https endpoints that require one
    etcd_key: str | None = None  #: its private key (PEM), if not in the certificate file
    device_hour_price: float = 0.0  #: accounting.device_hour_price: lost time's cost in the metrics and status
    pipeline_degrees: tuple[int, ...] = (1,)  #: the training layout's pipeline degrees (see :class:`Policy`)
    fixed_tp_size: int = 1  #: and its fixed tensor-parallel degree
    #: node counts of ``--nnodes`` the training config cannot run, each with why (naming the
    #: setting: ``ftrain.parallel.world_sizes``): rounds of these are never formed
    refused_nodes: tuple[tuple[int, str], ...] = ()

    @classmethod
    def of(cls, **kwargs: Any) -> AgentOptions:
        """From flat keyword arguments: this class's fields, and ``[agent]`` keys that go into
        ``config`` (as :meth:`AgentConfig.of` takes them); ``node_id`` defaults to the host name."""
        own = {f.name for f in dataclasses.fields(cls)} - {"config"}
        settings = {k: v for k, v in kwargs.items() if k not in own}
        settings.setdefault("node_id", socket.gethostname())
        return cls(config=AgentConfig.of(**settings), **{k: v for k, v in kwargs.items() if k in own})

    def policy(self) -> Policy:
        return Policy.from_config(
            self.config,
            pipeline_degrees=self.pipeline_degrees,
            fixed_tp_size=self.fixed_tp_size,
            refused=self.refused_nodes,
        )

    def validate(self) -> None:
        """What :class:`AgentConfig` cannot check alone: the ids as they reach key paths, the
        training config, the etcd credentials and TLS files (ValueError naming the option)."""
        validate_id(self.config.job, "--job")
        validate_id(self.config.node_id, "--node-id")
        if self.script:
            if not os.path.isfile(self.script):
                raise ValueError(f"--script: no such file {self.script!r}")
        elif not self.worker_args:
            raise ValueError("no training config: pass it after '--', e.g. -- configs/demo.toml")
        policy = self.policy()
        if policy.usable_nodes(self.config.max_nodes) < self.config.min_nodes:
            raise ValueError(
                f"--nnodes {self.config.nnodes} with --nproc-per-node {self.config.nproc_per_node} gives no world size "
                f"the training layout can use ({policy.layout_needs()}: the pipeline x tensor-parallel degrees"
                f"{policy.refused_text()}): change --nnodes or --nproc-per-node, or parallel.pp_size / pp_fallback / "
                "tp_size"
            )
        low = self.config.min_nodes
        if not policy.runs(low):  # a round of MIN nodes would be formed, and could not run
            fit = next(n for n in range(low, self.config.max_nodes + 1) if policy.runs(n))
            raise ValueError(
                f"--nnodes {self.config.nnodes}: a round of the minimum, {policy.cannot_run(low)}; "
                f"or use --nnodes {fit}:{self.config.max_nodes}, the fewest nodes the layout runs on"
            )
        if (self.etcd_username is None) != (self.etcd_password is None):
            raise ValueError("--etcd-user needs the password in FTRAIN_ETCD_PASSWORD (set it, or drop --etcd-user)")
        for option, path in (
            ("--etcd-ca-cert", self.etcd_ca_cert),
            ("--etcd-cert", self.etcd_cert),
            ("--etcd-key", self.etcd_key),
        ):
            if path and not os.path.isfile(path):
                raise ValueError(f"{option}: no such file {path!r}")

    def etcd_client_settings(self) -> dict[str, str]:
        """What a worker needs to reach etcd as this agent does (credentials, TLS files as
        absolute paths); empty when the agent uses none."""
        settings = {
            "username": self.etcd_username,
            "password": self.etcd_password,
            "ca_cert": self.etcd_ca_cert and os.path.abspath(self.etcd_ca_cert),
            "cert": self.etcd_cert and os.path.abspath(self.etcd_cert),
            "key": self.etcd_key and os.path.abspath(self.etcd_key),
        }
        return {k: v for k, v in settings.items() if v}


def write_client_file(run_dir: str, settings: dict[str, str]) -> str | None:
    """Write ``settings`` as JSON to ``<run_dir>/etcd-client.json``, readable by this user only
    (created 0600, never widened); its path, or None when there is nothing to write."""
    if not settings:
        return None
    path = os.path.join(run_dir, "etcd-client.json")
    replace_file(path, json.dumps(settings).encode(), 0o600)  # a new file under a random name, renamed over
    return path


__all__ = ["AgentOptions", "write_client_file"]
