"""Real ``ftrain agent`` processes for the control-plane benchmark's faithfulness check: N agents
(:mod:`control_plane_agent`: the production command line, stand-in workers) on their own etcd,
measured over a window exactly as the simulated ones are (etcd's counters server side, the
agents' CPU from ``/proc``), so the simulation's etcd traffic per node can be compared with theirs.

What must stay true: the agents run with the same ``[agent]`` settings as the simulated ones
(``lease_ttl_s``, ``settle_s``, ``nnodes`` N-1:N+1, restart recovery, ``scale_up`` immediate, no
metrics server); every process started here is killed with its whole tree by :meth:`RealJob.close`.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.lib.control_plane_job import JOB, RunFailed, Settings, Tree, node_id
from bench.lib.control_plane_probe import cpu_rates, cpu_snapshot, etcd_rates, scrape
from ftrain.testbed.jobs import TINY_CONFIG
from ftrain.testbed.procs import kill_tree

AGENT_SCRIPT = Path(__file__).resolve().parent / "control_plane_agent.py"


class RealJob:
    """N real agents of ``tree`` on the etcd at ``endpoint``."""

    def __init__(self, tree: Tree, n: int, endpoint: str, client, settings: Settings, run_dir: Path):
        self.tree, self.n, self.endpoint, self.client, self.settings = tree, n, endpoint, client, settings
        self.run_dir = run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        self.config = run_dir / "config.toml"
        self.config.write_text(TINY_CONFIG)
        self.procs: dict[str, subprocess.Popen] = {}
        self.prefix = f"/ftrain/jobs/{JOB}/"

    def _spawn(self, nid: str) -> subprocess.Popen:
        s = self.settings
        options = {
            "--etcd": self.endpoint,
            "--job": JOB,
            "--nnodes": f"{max(1, self.n - 1)}:{self.n + 1}",
            "--nproc-per-node": s.nproc_per_node,
            "--node-id": nid,
            "--host": "127.0.0.1",
            "--lease-ttl-s": s.lease_ttl_s,
            "--settle-s": s.settle_s,
            "--recovery": "restart",
            "--scale-up": "immediate",
            "--metrics-port": -1,
            "--hang-timeout-s": 600,
            "--start-timeout-s": 600,
            "--run-dir": self.run_dir / nid,
            "--events": self.run_dir / "events.jsonl",
        }
        argv = [str(a) for kv in options.items() for a in kv]
        with open(self.run_dir / f"{nid}.log", "ab") as log:
            return subprocess.Popen(
                [sys.executable, str(AGENT_SCRIPT), "agent", *argv, "--", str(self.config)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.tree.env(),
                cwd=self.run_dir,
                start_new_session=True,
            )

    def _wait(self, predicate, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate():
            dead = [nid for nid, p in self.procs.items() if p.poll() is not None]
            if dead:
                log = (self.run_dir / f"{dead[0]}.log").read_text(errors="replace")[-3000:]
                raise RunFailed(f"{what}: agent {dead[0]} exited; its log:\n{log}")
            if time.monotonic() > deadline:
                raise RunFailed(f"{what}: not within {timeout_s:.0f}s")
            time.sleep(0.5)  # polling etcd before the window, not synchronisation

    def _all_running(self) -> bool:
        """Every agent's published status says it runs workers of the current round."""
        from ftrain.agents.status import job_status

        s = job_status(self.client, JOB)
        nodes = [n for n in s.get("nodes", []) if n.get("live")]
        current = self.client.get(self.prefix + "round")
        return (
            current is not None
            and len(nodes) == self.n
            and all(n.get("state") == "running" and n.get("worker_round") == int(current.value) for n in nodes)
        )

    def start(self, timeout_s: float) -> float:
        t0 = time.monotonic()
        first = node_id(0)
        self.procs[first] = self._spawn(first)
        self._wait(lambda: (kv := self.client.get(self.prefix + "leader")) and kv.value == first.encode(), 60, "leader")
        for i in range(1, self.n):
            self.procs[node_id(i)] = self._spawn(node_id(i))
        self._wait(self._all_running, timeout_s, f"all {self.n} real agents run one round")
        return time.monotonic() - t0

    def measure(self, window_s: float, etcd_pid: int) -> dict:
        time.sleep(self.settings.warmup_s)  # a fixed warm-up and window: what is measured, not a wait
        pids = [p.pid for p in self.procs.values()]
        cpu0, etcd0 = cpu_snapshot(pids), scrape(self.endpoint)
        time.sleep(window_s)
        cpu1, etcd1 = cpu_snapshot(pids), scrape(self.endpoint)
        window = etcd1.at - etcd0.at
        cores = cpu_rates(cpu0, cpu1, window)
        etcd = etcd_rates(etcd0, etcd1)
        leader = self.procs[node_id(0)].pid
        followers = [c for pid, c in cores.items() if pid != leader]
        return {
            "window_s": round(window, 2),
            "leader_cpu_core_per_s": round(cores.get(leader, float("nan")), 5),
            "follower_cpu_core_per_s": round(statistics.mean(followers), 5) if followers else None,
            "etcd": etcd,
            "etcd_requests_per_s_per_node": round(etcd["requests_per_s"] / self.n, 3),
            "etcd_tx_bytes_per_s_per_node": round(etcd["tx_bytes_per_s"] / self.n, 1),
            "etcd_rx_bytes_per_s_per_node": round(etcd["rx_bytes_per_s"] / self.n, 1),
        }

    def close(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                kill_tree(p)


__all__ = ["RealJob"]
