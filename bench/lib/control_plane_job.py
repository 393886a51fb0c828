"""One simulated job for the control-plane benchmark: N node agents of one code tree on one
etcd, laid out over processes (:mod:`control_plane_sim`), and the figures of one run.

Layout: up to ``own_process_max`` nodes every agent runs in a process of its own (as real agents
do); above it the leader and ``sampled`` followers run in processes of their own and the other
followers are hosted ``hosted_per_process`` to a process (still real agents, ticked by one driver
thread per process). Per-agent CPU is read from the processes of one agent; the hosted ones give
a second follower figure. The leader is the first to register (the oldest agent leads).

One run, in order: start and wait for every agent to run the same round (the first round may
form at N - 1 and take the last node by a scale-up; ``nnodes`` is ``N-1:N+1``); warm up; the
measurement window (CPU of every process, etcd's counters, the agents' ticks); ``ftrain status``;
a node loss (SIGKILL of a follower's own process: its lease runs out) until the ``round`` key
changes; a join (a new agent in a process of its own) until a round that includes it.

What must stay true: every process started here is recorded and killed (its whole tree) by
:meth:`SimJob.close`; nothing measured in the window comes from this process (it sends etcd no
request then: it only reads ``/metrics``, ``/proc`` and its children's pipes).
"""

from __future__ import annotations

import json
import os
import queue
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.lib.control_plane_probe import KeyTimes, cpu_rates, cpu_snapshot, etcd_rates, rss_bytes, scrape
from ftrain.testbed.procs import kill_tree

HERE = Path(__file__).resolve().parent
SIM_SCRIPT = HERE / "control_plane_sim.py"
STATUS_PROBE = HERE / "control_plane_status_probe.py"
JOB = "cpbench"


class RunFailed(RuntimeError):
    """The job did not get where the run needed it (its figures stop here, with this reason)."""


@dataclass(frozen=True)
class Tree:
    """A checkout whose ``ftrain`` the processes import (``PYTHONPATH=root``)."""

    name: str  #: "new" (today's tree) or "old" (an older commit)
    root: str

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["PYTHONPATH"] = self.root
        env.pop("PYTHONSAFEPATH", None)
        return env


@dataclass(frozen=True)
class Settings:
    lease_ttl_s: int
    settle_s: float = 2.0
    nproc_per_node: int = 1
    step_s: float = 0.5
    own_process_max: int = 64
    sampled: int = 4
    hosted_per_process: int = 128
    warmup_s: float = 5.0
    status_repeats: int = 3


def node_id(i: int) -> str:
    return f"n{i:05d}"


@dataclass
class Layout:
    """Which agents run in which process: ``own`` one per process (the leader first), ``hosted`` many."""

    own: list[str]
    hosted: list[list[str]] = field(default_factory=list)

    @classmethod
    def of(cls, n: int, settings: Settings) -> Layout:
        ids = [node_id(i) for i in range(n)]
        if n <= settings.own_process_max:
            return cls(own=ids)
        own, rest = ids[: 1 + settings.sampled], ids[1 + settings.sampled :]
        per = settings.hosted_per_process
        return cls(own=own, hosted=[rest[i : i + per] for i in range(0, len(rest), per)])

    def describe(self) -> str:
        if not self.hosted:
            return f"{len(self.own)} agents, one process each"
        return (
            f"leader + {len(self.own) - 1} sampled followers in processes of their own, "
            f"{sum(map(len, self.hosted))} followers hosted in {len(self.hosted)} processes "
            f"(up to {max(map(len, self.hosted))} each)"
        )


class SimProcess:
    """One ``control_plane_sim.py`` process and the JSON lines it answers with."""

    def __init__(self, tree: Tree, endpoint: str, node_ids: list[str], nnodes: str, settings: Settings, run_dir: Path):
        self.node_ids = node_ids
        self.log_path = run_dir / f"sim-{node_ids[0]}.log"
        cmd = [
            sys.executable,
            str(SIM_SCRIPT),
            "--etcd",
            endpoint,
            "--job",
            JOB,
            "--node-ids",
            ",".join(node_ids),
            "--nnodes",
            nnodes,
            "--nproc-per-node",
            str(settings.nproc_per_node),
            "--lease-ttl-s",
            str(settings.lease_ttl_s),
            "--settle-s",
            str(settings.settle_s),
            "--step-s",
            str(settings.step_s),
            "--run-dir",
            str(run_dir / "agents"),
        ]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                cmd,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                env=tree.env(),
                cwd=run_dir,
                start_new_session=True,
            )
        self.pid = self.proc.pid
        self._lines: queue.Queue[dict | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.started: dict | None = None

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                self._lines.put(json.loads(line))
            except ValueError:
                continue
        self._lines.put(None)

    def next_line(self, timeout_s: float, what: str) -> dict:
        try:
            line = self._lines.get(timeout=timeout_s)
        except queue.Empty:
            raise RunFailed(f"{what}: no answer from sim process {self.pid} in {timeout_s:.0f}s") from None
        if line is None:
            raise RunFailed(
                f"{what}: sim process {self.pid} exited ({self.proc.poll()}); log {self.log_path}:\n{self.tail()}"
            )
        return line

    def wait_started(self, timeout_s: float) -> dict:
        self.started = self.next_line(timeout_s, f"registering {len(self.node_ids)} agents")
        return self.started

    def send(self, command: str) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(command + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass

    def tail(self, max_bytes: int = 3000) -> str:
        try:
            return self.log_path.read_bytes()[-max_bytes:].decode(errors="replace")
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.proc.poll() is None:
            kill_tree(self.proc)


def ask_stats(procs: list[SimProcess], timeout_s: float = 30.0) -> list[dict]:
    """Every process's ``stats`` answer (asked of all first, so they cover the same moment)."""
    for p in procs:
        p.send("stats")
    return [p.next_line(timeout_s, "stats") for p in procs]


class SimJob:
    """N simulated agents of ``tree`` on the etcd at ``endpoint`` (see the module docstring)."""

    def __init__(self, tree: Tree, n: int, endpoint: str, client: Any, settings: Settings, run_dir: Path):
        self.tree, self.n, self.endpoint, self.client, self.settings = tree, n, endpoint, client, settings
        self.run_dir = run_dir
        (run_dir / "agents").mkdir(parents=True, exist_ok=True)
        self.layout = Layout.of(n, settings)
        self.nnodes = f"{max(1, n - 1)}:{n + 1}"
        self.own: dict[str, SimProcess] = {}
        self.hosted: list[SimProcess] = []
        self.killed: set[str] = set()
        self.prefix = f"/ftrain/jobs/{JOB}/"

    @property
    def procs(self) -> list[SimProcess]:
        return [*self.own.values(), *self.hosted]

    def _spawn(self, node_ids: list[str]) -> SimProcess:
        return SimProcess(self.tree, self.endpoint, node_ids, self.nnodes, self.settings, self.run_dir)

    # -- start -------------------------------------------------------------------------------
    def start(self, timeout_s: float) -> dict:
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        leader_id = self.layout.own[0]
        leader = self.own[leader_id] = self._spawn([leader_id])
        started = leader.wait_started(60)
        if not started["ftrain"].startswith(os.path.realpath(self.tree.root)):
            raise RunFailed(f"the sim imported ftrain from {started['ftrain']}, not from {self.tree.root}")
        self._wait(lambda: self._value("leader") == leader_id.encode(), deadline, "the first agent leads")
        for nid in self.layout.own[1:]:
            self.own[nid] = self._spawn([nid])
        self.hosted = [self._spawn(ids) for ids in self.layout.hosted]
        for p in self.procs[1:]:
            p.wait_started(max(1.0, deadline - time.monotonic()))
        registered_s = time.monotonic() - t0
        round_ = self.wait_all_running(deadline, f"all {self.n} agents run one round")
        return {"registered_s": round(registered_s, 2), "running_s": round(time.monotonic() - t0, 2), "round": round_}

    def _value(self, key: str) -> bytes | None:
        kv = self.client.get(self.prefix + key)
        return kv.value if kv is not None else None

    def _wait(self, predicate, deadline: float, what: str, poll_s: float = 0.2) -> Any:
        while True:
            value = predicate()
            if value:
                return value
            dead = [p for p in self.procs if not p.alive() and not set(p.node_ids) & self.killed]
            if dead:
                raise RunFailed(f"{what}: sim process {dead[0].pid} exited; log {dead[0].log_path}:\n{dead[0].tail()}")
            if time.monotonic() > deadline:
                raise RunFailed(f"{what}: not within the time limit")
            time.sleep(poll_s)  # polling etcd and the children before the window, not synchronisation

    def running_round(self, expected: set[str]) -> int | None:
        """The round every agent in ``expected`` runs workers of, if they all run the current one."""
        live = [p for p in self.procs if p.alive()]
        rounds: dict[str, int] = {}
        for s in ask_stats(live):
            rounds.update(s["rounds"])
        current = self._value("round")
        if current is None:
            return None
        g = int(current)
        return g if all(rounds.get(nid) == g for nid in expected) else None

    def wait_all_running(self, deadline: float, what: str) -> int:
        expected = {nid for p in self.procs for nid in p.node_ids} - self.killed
        return self._wait(lambda: self.running_round(expected), deadline, what, poll_s=1.0)

    # -- the window --------------------------------------------------------------------------
    def measure(self, window_s: float, etcd_pid: int) -> dict:
        time.sleep(self.settings.warmup_s)  # a fixed warm-up and window: what is measured, not a wait
        procs = self.procs
        pids = [p.pid for p in procs] + [etcd_pid]
        ask_stats(procs)  # resets the tick counters
        cpu0, etcd0 = cpu_snapshot(pids), scrape(self.endpoint)
        time.sleep(window_s)
        cpu1, etcd1 = cpu_snapshot(pids), scrape(self.endpoint)
        stats = ask_stats(procs)
        window = etcd1.at - etcd0.at
        cores = cpu_rates(cpu0, cpu1, window)
        return self._figures(procs, stats, cores, etcd_rates(etcd0, etcd1), window, etcd_pid)

    def _figures(self, procs, stats, cores, etcd, window_s, etcd_pid) -> dict:
        leader, followers = procs[0], procs[1 : len(self.own)]
        ticks = sum(s["ticks"] for s in stats)
        own_n = len(self.own)

        def role(select: slice) -> dict:
            chosen = list(zip(procs, stats, strict=True))[select]
            agents = sum(len(p.node_ids) for p, _ in chosen)
            if not agents:
                return {"ticks_per_agent_per_s": None, "cpu_ms_per_tick": None}
            n_ticks = sum(s["ticks"] for _, s in chosen)
            cpu = sum(cores.get(p.pid, 0.0) for p, _ in chosen) * window_s
            return {
                "ticks_per_agent_per_s": round(n_ticks / agents / window_s, 3),
                "cpu_ms_per_tick": round(1000 * cpu / n_ticks, 3) if n_ticks else None,
            }

        busy_s = sum(s["tick_busy_s"] for s in stats)
        lags = [s["lag_p99_s"] for s in stats if s["lag_p99_s"] is not None]
        hosted_agents = sum(len(p.node_ids) for p in self.hosted)
        follower_cores = [cores[p.pid] for p in followers if p.pid in cores]
        agents_cores = sum(cores.get(p.pid, 0.0) for p in procs)
        return {
            "window_s": round(window_s, 2),
            "leader_cpu_core_per_s": round(cores.get(leader.pid, float("nan")), 5),
            "follower_cpu_core_per_s": round(statistics.mean(follower_cores), 5) if follower_cores else None,
            "follower_cpu_core_per_s_max": round(max(follower_cores), 5) if follower_cores else None,
            "hosted_follower_cpu_core_per_s": (
                round(sum(cores.get(p.pid, 0.0) for p in self.hosted) / hosted_agents, 5) if hosted_agents else None
            ),
            "agents_cpu_cores": round(agents_cores, 3),
            "etcd_cpu_cores": etcd["cpu_core_per_s"],
            "etcd": etcd,
            "etcd_requests_per_s_per_node": round(etcd["requests_per_s"] / self.n, 3),
            "etcd_tx_bytes_per_s_per_node": round(etcd["tx_bytes_per_s"] / self.n, 1),
            "etcd_rx_bytes_per_s_per_node": round(etcd["rx_bytes_per_s"] / self.n, 1),
            "ticks_per_agent_per_s": round(ticks / self.n / window_s, 3),
            "tick_ms": round(1000 * busy_s / ticks, 3) if ticks else None,
            "by_role": {
                "leader": role(slice(0, 1)),
                "followers_own_process": role(slice(1, own_n)),
                "followers_hosted": role(slice(own_n, None)),
            },
            "tick_lag_p99_s_max": max(lags) if lags else None,
            "tick_errors": sum(s["errors"] for s in stats),
            "tick_error_sample": next((s["last_error"] for s in stats if s["last_error"]), ""),
            "sim_rss_bytes": sum(rss_bytes(p.pid) or 0 for p in procs),
            "etcd_rss_bytes": rss_bytes(etcd_pid),
        }

    # -- ftrain status -----------------------------------------------------------------------
    def status_times(self) -> dict:
        """``ftrain status --json`` as a user runs it (a new interpreter each time: wall time), and
        :func:`ftrain.agents.status.job_status`, the function it calls, timed in one process."""
        cli_s = []
        for _ in range(self.settings.status_repeats):
            t0 = time.monotonic()
            proc = subprocess.run(
                [sys.executable, "-m", "ftrain", "status", "--etcd", self.endpoint, "--job", JOB, "--json"],
                capture_output=True,
                text=True,
                env=self.tree.env(),
                cwd=self.run_dir,
                timeout=120,
            )
            cli_s.append(time.monotonic() - t0)
            if proc.returncode != 0:
                raise RunFailed(f"ftrain status exited {proc.returncode}: {proc.stderr[-2000:]}")
        shown = len(json.loads(proc.stdout).get("nodes", []))
        probe = subprocess.run(
            [sys.executable, str(STATUS_PROBE), "--etcd", self.endpoint, "--job", JOB, "--repeats", "5"],
            capture_output=True,
            text=True,
            env=self.tree.env(),
            cwd=self.run_dir,
            timeout=300,
        )
        if probe.returncode != 0:
            raise RunFailed(f"status probe exited {probe.returncode}: {probe.stderr[-2000:]}")
        call = json.loads(probe.stdout.strip().splitlines()[-1])
        return {
            "status_s": round(statistics.median(cli_s), 3),
            "status_cli_runs_s": [round(s, 3) for s in cli_s],
            "status_nodes_shown": shown,
            "status_call_s": call["median_s"],
            "status_import_s": call["import_s"],
        }

    # -- a node lost, a node joins -------------------------------------------------------------
    def node_loss(self, timeout_s: float) -> dict:
        """SIGKILL the last sampled follower's process; seconds until the ``round`` key changes."""
        victim = self.layout.own[-1]
        times = KeyTimes(self.client, [self.prefix + "round"], progress_timeout_s=self._watch_timeout_s())
        try:
            before = self._value("round")
            killed_at = time.monotonic()
            self.own[victim].kill()
            self.killed.add(victim)
            seen = times.first_put_after(self.prefix + "round", killed_at, timeout_s)
        finally:
            times.close()
        if seen is None:
            raise RunFailed(f"node loss: no new round within {timeout_s:.0f}s of killing {victim}")
        return {
            "node_lost": victim,
            "node_loss_to_round_s": round(seen[0] - killed_at, 3),
            "round_before": int(before or 0),
            "round_after": int(seen[1]),
        }

    def join(self, timeout_s: float) -> dict:
        """A new agent in a process of its own: seconds from its ``nodes/<id>`` put to the put of
        the ``round`` it runs (a round that includes it)."""
        deadline = time.monotonic() + timeout_s
        self.wait_all_running(deadline, "the survivors run the round after the loss")
        joiner = f"join-{self.n:05d}"
        node_key, round_key = self.prefix + f"nodes/{joiner}", self.prefix + "round"
        times = KeyTimes(self.client, [node_key, round_key], progress_timeout_s=self._watch_timeout_s())
        try:
            t0 = time.monotonic()
            self.own[joiner] = self._spawn([joiner])
            self.own[joiner].wait_started(max(1.0, deadline - time.monotonic()))
            g = self._wait(lambda: self._round_of(joiner), deadline, f"{joiner} runs a round")
            registered = times.first_put_after(node_key, t0, 5.0)
            formed = [t for t, v in times.puts[round_key] if int(v) == g]
        finally:
            times.close()
        if registered is None or not formed:
            raise RunFailed(f"join: the watch saw no registration or no round {g}")
        return {"joined": joiner, "join_to_round_s": round(formed[0] - registered[0], 3), "join_round": g}

    def _watch_timeout_s(self) -> float:
        """Longer than etcd's progress notification interval (half the agents' timeout, or less)."""
        return max(5.0, 2.0 * self.settings.lease_ttl_s)

    def _round_of(self, nid: str) -> int | None:
        s = ask_stats([self.own[nid]])[0]
        g = s["rounds"].get(nid, -1)
        return g if g > 0 else None

    def close(self) -> None:
        for p in self.procs:
            p.kill()


__all__ = ["JOB", "Layout", "RunFailed", "Settings", "SimJob", "SimProcess", "Tree"]
