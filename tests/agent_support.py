"""A job of real agents on one machine, for integration tests: start and kill "nodes", read
the shared event log and the metrics, wait on conditions with deadlines."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ftrain.metrics import read_jsonl
from tests.support import REPO, TINY_CONFIG, kill_tree, worker_env

AGENT_DEFAULTS = ("--lease-ttl-s", "2", "--settle-s", "1", "--hang-timeout-s", "5", "--start-timeout-s", "120",
                  "--backoff-initial-s", "0.2")


def wait_for(predicate: Callable[[], Any], timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")


class AgentJob:
    """Agents of one job sharing an events file, a metrics file and a checkpoint directory."""

    def __init__(self, workdir: Path, etcd_endpoint: str, *, job: str = "job", steps: int = 120,
                 ckpt_interval: int = 20, step_sleep_s: float = 0.03, config: str = TINY_CONFIG,
                 overrides: tuple[str, ...] = ()):
        self.workdir = workdir
        self.etcd = etcd_endpoint
        self.job = job
        self.events_path = workdir / "events.jsonl"
        self.metrics_path = workdir / "metrics.jsonl"
        self.ckpt_dir = workdir / "ckpt"
        self.config_path = workdir / "config.toml"
        workdir.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(config)
        self.worker_args = [str(self.config_path), f"--train.steps={steps}", f"--checkpoint.uri={self.ckpt_dir}",
                            f"--checkpoint.interval={ckpt_interval}", f"--logging.metrics_path={self.metrics_path}",
                            f"--logging.events_path={self.events_path}", "--logging.log_every=1000", *overrides]
        self.step_sleep_s = step_sleep_s
        self.agents: dict[str, subprocess.Popen] = {}

    def start(self, node_id: str, *agent_args: str, nnodes: str = "1:2", nproc: int = 1,
              env: dict[str, str] | None = None) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "ftrain", "agent", "--etcd", self.etcd, "--job", self.job, "--nnodes", nnodes,
               "--nproc-per-node", str(nproc), "--node-id", node_id, "--run-dir", str(self.workdir / node_id),
               "--events", str(self.events_path), *AGENT_DEFAULTS, *agent_args, "--", *self.worker_args]
        log = open(self.workdir / f"agent-{node_id}.log", "ab")
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True,
                                env=worker_env(FTRAIN_FAULT_STEP_SLEEP_S=str(self.step_sleep_s), FTRAIN_LOG_LEVEL="INFO",
                                               **(env or {})))
        log.close()
        self.agents[node_id] = proc
        return proc

    # -- reading ---------------------------------------------------------------------------
    def events(self, name: str | None = None, **match: Any) -> list[dict[str, Any]]:
        if not self.events_path.exists():
            return []
        return [e for e in read_jsonl(self.events_path)
                if (name is None or e["event"] == name) and all(e.get(k) == v for k, v in match.items())]

    def wait_event(self, name: str, timeout_s: float = 60, **match: Any) -> dict[str, Any]:
        return wait_for(lambda: (self.events(name, **match) or [None])[-1], timeout_s,
                        f"event {name} {match or ''} (log: {self.log_tail()})")

    def step(self) -> int:
        if not self.metrics_path.exists():
            return 0
        return max((m["step"] for m in read_jsonl(self.metrics_path)), default=0)

    def wait_step(self, step: int, timeout_s: float = 90) -> int:
        return wait_for(lambda: self.step() >= step and self.step(), timeout_s, f"training step {step}")

    def worker_pids(self, node_id: str, worker_round: int | None = None) -> list[int]:
        started = self.events("worker_started", node=node_id)
        if worker_round is not None:
            started = [e for e in started if e["round"] == worker_round]
        newest = max((e["round"] for e in started), default=None)
        return [e["pid"] for e in started if e["round"] == newest]

    def committed_steps(self) -> list[int]:
        return sorted({e["step"] for e in self.events("ckpt_committed")})

    def log_tail(self, max_chars: int = 3000) -> str:
        parts = []
        for node_id in self.agents:
            path = self.workdir / f"agent-{node_id}.log"
            if path.exists():
                parts.append(f"--- agent {node_id}:\n{path.read_text(errors='replace')[-max_chars:]}")
        return "\n".join(parts)

    # -- acting ----------------------------------------------------------------------------
    def kill_agent(self, node_id: str, sig: int = signal.SIGKILL) -> None:
        os.kill(self.agents[node_id].pid, sig)

    def wait_exit(self, node_id: str, timeout_s: float = 120) -> int:
        try:
            return self.agents[node_id].wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"agent {node_id} still running after {timeout_s:.0f}s:\n{self.log_tail()}") from None

    def close(self) -> None:
        for proc in self.agents.values():
            if proc.poll() is None:
                kill_tree(proc)
            else:
                proc.wait()
