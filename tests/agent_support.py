"""The agent tests' job: :class:`ftrain.chaos.cluster.Cluster` on the tiny config, slowed to ~30 ms a
step so that faults land mid-run, checkpointing every 20 steps to a local directory. These
tests are about the restart path (``--recovery restart``: torchrun per round, loads from
storage); live recovery has its own (tests/integration/test_live_recovery.py)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ftrain.chaos.cluster import FAST_AGENT_OPTIONS, Cluster
from ftrain.testbed.jobs import TINY_CONFIG
from ftrain.testbed.wait import wait_for

__all__ = ["AgentJob", "wait_for"]


class AgentJob(Cluster):
    def __init__(
        self,
        workdir: Path,
        etcd_endpoint: str,
        *,
        steps: int = 120,
        ckpt_interval: int = 20,
        overrides: Sequence[str] = (),
    ):
        workdir.mkdir(parents=True, exist_ok=True)
        config = workdir / "config.toml"
        config.write_text(TINY_CONFIG)
        super().__init__(
            workdir,
            etcd_endpoint,
            config,
            steps=steps,
            ckpt_interval=ckpt_interval,
            step_sleep_s=0.03,
            overrides=overrides,
            agent_options=[*FAST_AGENT_OPTIONS, "--recovery", "restart"],
        )
