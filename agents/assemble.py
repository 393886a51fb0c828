"""The production wiring of a node agent: the parts :class:`ftrain.agents.agent.Agent` takes, built
from its options (``ftrain agent`` calls :func:`build_agent`; tests assemble their own)."""

from __future__ import annotations

import os
import tempfile

from ftrain.agents.agent import Agent
from ftrain.agents.agent_options import AgentOptions, write_client_file
from ftrain.agents.etcd import EtcdClient
from ftrain.agents.heartbeat import HeartbeatServer
from ftrain.agents.jobstore import EtcdJobStore
from ftrain.agents.live_workers import LiveWorkers
from ftrain.agents.metrics import AgentMetrics
from ftrain.agents.parts import SystemClock
from ftrain.agents.workers import WorkerGroup
from ftrain.contract.events import EventLog
from ftrain.contract.local_files import private_dir


def build_agent(opts: AgentOptions) -> Agent:
    """An agent on the real etcd, clocks, heartbeat socket, Prometheus metrics, event log and
    worker launcher (torchrun, or live workers under ``recovery = "live"``). Raises ValueError
    for bad options, before anything is created."""
    opts.validate()
    cfg = opts.config
    clock = SystemClock()
    client = EtcdClient(
        cfg.endpoints,
        timeout_s=1.0,
        retry_timeout_s=1.0,
        username=opts.etcd_username,
        password=opts.etcd_password,
        ca_cert=opts.etcd_ca_cert,
        cert=opts.etcd_cert,
        key=opts.etcd_key,
    )
    # worker logs, control files and stack dumps: a directory only this user can write
    run_dir = (
        str(private_dir(cfg.run_dir, "agent.run_dir")) if cfg.run_dir else tempfile.mkdtemp(prefix="ftrain-agent-")
    )
    return Agent(
        opts,
        store=EtcdJobStore(client),
        clock=clock,
        heartbeats=HeartbeatServer(os.path.join(tempfile.mkdtemp(prefix="ftrain-hb-"), "hb.sock")),
        metrics=AgentMetrics(
            cfg.job,
            cfg.node_id,
            clock=clock.monotonic,
            devices=cfg.nproc_per_node,
            device_hour_price=opts.device_hour_price,
        ),
        events=EventLog(opts.events_path, rank=-1),
        launcher=WorkerGroup,
        standby=(
            (
                lambda env, log_path: LiveWorkers(
                    env,
                    log_path,
                    worker_args=tuple(opts.worker_args),
                    standby=cfg.nproc_per_node + cfg.spares,
                    spares=cfg.spares,
                    script=opts.script,
                    startup_failure_limit=cfg.deterministic_failures,
                )
            )
            if cfg.recovery == "live"
            else None
        ),
        run_dir=run_dir,
        client_file=write_client_file(run_dir, opts.etcd_client_settings()),
    )
