"""The systems ``bench/recovery.py`` compares, run for real: an etcd and two ``ftrain agent``
(live or restart recovery; or live, serving a user's loop: ``--script`` :mod:`bench.lib.session_loop`),
two torchruns with c10d rendezvous (default or tuned), and the floor (two static-rendezvous
torchruns started fresh from a checkpoint); the faults injected into them, and one scenario's
outcome (its marks: :mod:`bench.lib.restart_marks`, :mod:`bench.lib.live_marks`,
:mod:`bench.lib.session_marks`)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.lib.live_marks import first_live_step_after, live_marks
from bench.lib.restart_marks import Marks, first_step_after, read_glog_lines, recovery_marks, stamped
from bench.lib.session_marks import steady_step_s as session_steady_step_s
from bench.lib.session_marks import step_lines
from ftrain.agents.config import agent_flags
from ftrain.agents.workers import (
    Launch,  # the floor runs the agent's own launcher command
    descendants,
)
from ftrain.contract.events import Event
from ftrain.contract.worker_env import JOB as WORKER_JOB
from ftrain.testbed.etcd import EtcdServer, free_ports
from ftrain.testbed.jobs import TINY_CONFIG, worker_env
from ftrain.testbed.procs import kill_tree
from ftrain.testbed.wait import WaitTimeout, wait_for

REPO = Path(__file__).resolve().parents[2]

FAULTS = ("worker_kill", "node_loss", "hang")
SYSTEMS = ("ftrain_live", "ftrain_restart", "session_live", "torchrun_default", "torchrun_tuned")
#: FACTS.md: a node loss took 42.7 s with c10d defaults and 2.4 s with these.
TUNED_RDZV_CONF = "join_timeout=60,last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=2"
LEASE_TTL_S, HANG_TIMEOUT_S = 2, 4.0
AGENT_OPTIONS = agent_flags({"lease_ttl_s": LEASE_TTL_S, "settle_s": 1.0, "hang_timeout_s": HANG_TIMEOUT_S})
POLL_S = 0.05
#: the agents' job id: their workers' manifests carry it, so the floor's workers (started from a
#: copy of an ftrain run's checkpoint, as an agent would) must have it too
JOB_ID = "recovery"
SESSION_LOOP = REPO / "bench" / "lib" / "session_loop.py"


class ScenarioError(RuntimeError):
    """A scenario could not be run or did not recover in time."""


# -- reading what the processes wrote -----------------------------------------------------------
class JsonlTail:
    """The records of a JSON-lines file, read incrementally (torn lines are skipped)."""

    def __init__(self, path: Path):
        self.path = path
        self.records: list[dict[str, Any]] = []
        self._offset = 0
        self._partial = b""

    def poll(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self._offset)
                data = fh.read()
        except FileNotFoundError:
            return self.records
        self._offset += len(data)
        *lines, self._partial = (self._partial + data).split(b"\n")
        for line in lines:
            with contextlib.suppress(ValueError):
                self.records.append(json.loads(line))
        return self.records


class Launched:
    """A process started here; its output is timestamped line by line on arrival and logged."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], log_path: Path):
        self.name = name
        self.lines: list[tuple[float, str]] = []
        self.popen = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=REPO,
            start_new_session=True,
        )
        self._reader = threading.Thread(target=self._read, args=(log_path,), name=f"read-{name}", daemon=True)
        self._reader.start()

    def _read(self, log_path: Path) -> None:
        with open(log_path, "w") as log:
            for raw in self.popen.stdout:
                now = time.time()
                text = raw.decode(errors="replace").rstrip("\n")
                self.lines.append((now, text))
                log.write(f"{now:.3f} {text}\n")
                log.flush()

    def alive(self) -> bool:
        return self.popen.poll() is None

    def kill(self) -> None:
        kill_tree(self.popen)
        self._reader.join(timeout=5)


def sigkill_now(pids: Iterable[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def kill_stray_workers(events: list[dict[str, Any]]) -> None:
    """SIGKILL every worker announced in the events that still runs ``ftrain train`` (a worker whose
    launcher was SIGKILLed is reparented and missed by a process-tree walk)."""
    for pid in {e["pid"] for e in events if e.get("event") == Event.WORKER_STARTED}:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                cmdline = fh.read()
        except OSError:
            continue
        if b"ftrain" in cmdline and b"train" in cmdline:
            sigkill_now([pid, *descendants(pid)])


# -- running one scenario -----------------------------------------------------------------------
@dataclass(kw_only=True)
class Settings:
    steps: int
    ckpt_interval: int
    fault_step: int
    step_sleep_s: float
    collective_timeout_s: float
    startup_timeout_s: float
    cap_s: float
    parallel: str = "ddp"  #: ddp, or fsdp: the model sharded, a lost rank healed from the memory tier


@dataclass
class Outcome:
    system: str
    fault: str
    marks: Marks | None = None
    error: str | None = None
    notes: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    steady_step_s: float | None = None  #: median step time before the fault (the sleep excluded)


class Job:
    """The files and processes of one scenario; ``close`` kills everything it started."""

    def __init__(self, workdir: Path, settings: Settings):
        workdir.mkdir(parents=True)
        self.dir = workdir
        self.settings = settings
        self.config = workdir / "config.toml"
        config = TINY_CONFIG.replace("steps = 10", f"steps = {settings.steps}")
        self.config.write_text(config + f'\n[parallel]\nstrategy = "{settings.parallel}"\n')
        self.ckpt = workdir / "ckpt"
        self.events = JsonlTail(workdir / "events.jsonl")
        self.metrics = JsonlTail(workdir / "metrics.jsonl")
        self.procs: list[Launched] = []
        self.env = worker_env(
            TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
            PYTHONUNBUFFERED="1",
            LOGLEVEL="INFO",
            FTRAIN_FAULT_STEP_SLEEP_S=str(settings.step_sleep_s),
        )

    def train_args(self) -> list[str]:
        return [
            str(self.config),
            f"--checkpoint.uri={self.ckpt}",
            f"--checkpoint.interval={self.settings.ckpt_interval}",
            f"--logging.metrics_path={self.metrics.path}",
            f"--logging.events_path={self.events.path}",
            "--logging.progress=off",
            f"--parallel.timeout_s={self.settings.collective_timeout_s:g}",
        ]

    def start(self, name: str, cmd: list[str]) -> Launched:
        proc = Launched(name, cmd, self.env, self.dir / f"{name}.log")
        self.procs.append(proc)
        return proc

    def any_alive(self) -> bool:
        return any(p.alive() for p in self.procs)

    def lines(self) -> list[tuple[float, str]]:
        return stamped(line for p in self.procs for line in p.lines)

    def wait_training(self) -> None:
        """Until both nodes train past the fault step with a checkpoint committed."""
        fault_step = self.settings.fault_step

        def ready() -> bool:
            metrics = self.metrics.poll()
            committed = any(e.get("event") == Event.CKPT_COMMITTED for e in self.events.poll())
            return committed and bool(metrics) and metrics[-1]["world_size"] == 2 and metrics[-1]["step"] >= fault_step

        wait_for(
            ready,
            self.settings.startup_timeout_s,
            f"training at world size 2 past step {fault_step}",
            poll_s=POLL_S,
            alive=self.any_alive,
        )

    def worker_pid(self, rank: int) -> int:
        started = [
            e
            for e in self.events.poll()
            if e.get("event") == Event.WORKER_STARTED and e.get("rank") == rank and e.get("world_size") == 2
        ]
        if not started:
            raise ScenarioError(f"no worker_started event for rank {rank}")
        return started[-1]["pid"]

    def wait_recovered(self, fault: float, timeout_s: float, *, live: bool = False) -> None:
        def recovered() -> Any:
            find = first_live_step_after if live else first_step_after
            return find(fault, self.events.poll(), self.metrics.poll())

        wait_for(recovered, timeout_s, "first step after the resume", poll_s=POLL_S, alive=self.any_alive)

    def close(self) -> None:
        for proc in self.procs:
            proc.kill()
        kill_stray_workers(self.events.poll())


def steady_step_s(metrics: list[dict[str, Any]], before: float) -> float | None:
    """Median ``step_time_s`` at world size 2 before ``before``, the first 10 steps left out (warm-up)."""
    times = [m["step_time_s"] for m in metrics if m["time"] < before and m["world_size"] == 2 and m["step"] > 10]
    return round(statistics.median(times), 5) if times else None


def inject(job: Job, fault: str, node_of_rank1: Launched) -> tuple[float, str]:
    """Inject ``fault``; returns (its time, what was hit)."""
    pid = job.worker_pid(1)
    if fault == "worker_kill":
        t = time.time()
        os.kill(pid, signal.SIGKILL)
        return t, f"SIGKILL worker rank 1 (pid {pid})"
    if fault == "hang":
        t = time.time()
        os.kill(pid, signal.SIGSTOP)
        return t, f"SIGSTOP worker rank 1 (pid {pid})"
    pids = [*descendants(node_of_rank1.popen.pid), node_of_rank1.popen.pid]
    t = time.time()
    sigkill_now(pids)
    return t, f"SIGKILL node {node_of_rank1.name}: pids {sorted(pids)}"


def agent_command(endpoint: str, node: str, recovery: str, job: Job, tail: list[str]) -> list[str]:
    """``ftrain agent`` for node ``node`` of the job (one worker per node, ``--nnodes 1:2``), then ``tail``."""
    return [
        sys.executable, "-m", "ftrain", "agent", "--etcd", endpoint, "--job", JOB_ID, "--nnodes", "1:2",
        "--nproc-per-node", "1", "--node-id", node, *AGENT_OPTIONS, "--recovery", recovery,
        "--run-dir", str(job.dir / f"run-{node}"), "--events", str(job.events.path), *tail,
    ]  # fmt: skip


def run_ftrain(fault: str, workdir: Path, settings: Settings, *, live: bool) -> Outcome:
    out = Outcome("ftrain_live" if live else "ftrain_restart", fault)
    job = Job(workdir, settings)
    try:
        with EtcdServer() as etcd:
            try:
                recovery, tail = "live" if live else "restart", ["--", *job.train_args()]
                agents = [
                    job.start(f"n{i}", agent_command(etcd.endpoint, f"n{i}", recovery, job, tail)) for i in range(2)
                ]
                job.wait_training()
                rank1 = job.worker_pid(1)
                node = next((a for a in agents if rank1 in descendants(a.popen.pid)), None)
                if node is None:
                    raise ScenarioError(f"worker {rank1} (rank 1) runs under neither agent")
                leaders = [e["node"] for e in job.events.poll() if e.get("event") == Event.LEADER_ELECTED]
                fault_t, what = inject(job, fault, node)
                out.steady_step_s = steady_step_s(job.metrics.poll(), fault_t)
                if fault == "node_loss":
                    what += " (the leader)" if leaders and leaders[-1] == node.name else " (not the leader)"
                out.notes.append(what)
                job.wait_recovered(fault_t, settings.cap_s, live=live)
                if live:
                    marks = live_marks(fault_t, job.events.poll(), job.metrics.poll())
                    out.marks = Marks(**marks) if marks else None
                else:
                    round_logs = read_glog_lines(workdir.glob("run-n*/round-*.log"))
                    out.marks = recovery_marks(fault_t, job.events.poll(), job.metrics.poll(), round_logs, agents=True)
            finally:
                job.close()
    except (ScenarioError, WaitTimeout) as e:
        out.error = str(e)
    return out


class SessionJob(Job):
    """A user's loop (examples/own_loop/train.py through :mod:`bench.lib.session_loop`, DDP or FSDP) under
    two live agents: its marks are the loop's probe lines, not ``ftrain train``'s events and metrics."""

    def __init__(self, workdir: Path, settings: Settings):
        super().__init__(workdir, settings)
        self.probe = JsonlTail(workdir / "probe.jsonl")

    def script_args(self) -> list[str]:
        s = self.settings
        return [
            f"--probe-log={self.probe.path}",
            f"--step-sleep-s={s.step_sleep_s:g}",
            f"--parallel={s.parallel}",
            f"--steps={s.steps}",
            f"--save-every={s.ckpt_interval}",
            f"--ckpt={self.ckpt}",
        ]

    def wait_training(self) -> None:
        fault_step = self.settings.fault_step

        def ready() -> bool:
            steps = [p for p in self.probe.poll() if p.get("probe") == "step" and p["rank"] == 0]
            committed = any(self.ckpt.glob("step-*/manifest.json"))
            return committed and bool(steps) and steps[-1]["world_size"] == 2 and steps[-1]["step"] >= fault_step

        wait_for(
            ready,
            self.settings.startup_timeout_s,
            f"the loop at world size 2 past step {fault_step}",
            poll_s=POLL_S,
            alive=self.any_alive,
        )

    def worker_pid(self, rank: int) -> int:
        marks = [p for p in self.probe.poll() if p.get("rank") == rank and p.get("world_size") == 2]
        if not marks:
            raise ScenarioError(f"no probe line of rank {rank} at world size 2")
        return marks[-1]["pid"]

    def wait_recovered(self, fault: float, timeout_s: float, *, live: bool = False) -> None:
        wait_for(
            lambda: first_live_step_after(fault, self.events.poll(), step_lines(self.probe.poll())),
            timeout_s,
            "first step after the restore",
            poll_s=POLL_S,
            alive=self.any_alive,
        )

    def close(self) -> None:
        super().close()
        for pid in {p["pid"] for p in self.probe.poll()}:  # the agents' processes die with them; in case
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as fh:
                    cmdline = fh.read()
            except OSError:
                continue
            if SESSION_LOOP.name.encode() in cmdline:
                sigkill_now([pid])


def run_session_live(fault: str, workdir: Path, settings: Settings) -> Outcome:
    """Two live agents serving a user's loop (``--script``), the job and faults as ``run_ftrain``'s."""
    out = Outcome("session_live", fault)
    job = SessionJob(workdir, settings)
    try:
        with EtcdServer() as etcd:
            try:
                tail = ["--script", str(SESSION_LOOP), "--", *job.script_args()]
                agents = [
                    job.start(f"n{i}", agent_command(etcd.endpoint, f"n{i}", "live", job, tail)) for i in range(2)
                ]
                job.wait_training()
                rank1 = job.worker_pid(1)
                node = next((a for a in agents if rank1 in descendants(a.popen.pid)), None)
                if node is None:
                    raise ScenarioError(f"process {rank1} (rank 1) runs under neither agent")
                leaders = [e["node"] for e in job.events.poll() if e.get("event") == Event.LEADER_ELECTED]
                fault_t, what = inject(job, fault, node)
                out.steady_step_s = session_steady_step_s(job.probe.poll(), fault_t)
                if fault == "node_loss":
                    what += " (the leader)" if leaders and leaders[-1] == node.name else " (not the leader)"
                out.notes.append(what)
                job.wait_recovered(fault_t, settings.cap_s)
                marks = live_marks(fault_t, job.events.poll(), step_lines(job.probe.poll()))
                out.marks = Marks(**marks) if marks else None
            finally:
                job.close()
    except (ScenarioError, WaitTimeout) as e:
        out.error = str(e)
    return out


def run_torchrun(fault: str, workdir: Path, settings: Settings, rdzv_conf: str) -> Outcome:
    out = Outcome("torchrun_tuned" if rdzv_conf else "torchrun_default", fault)
    job = Job(workdir, settings)
    port = free_ports(1)[0]
    try:
        try:
            nodes = []
            for i, is_host in enumerate((1, 0)):  # node A hosts the c10d store: pinned, not raced for
                conf = ",".join(c for c in (f"is_host={is_host}", rdzv_conf) if c)
                nodes.append(
                    job.start(
                        f"torchrun{'AB'[i]}",
                        [
                            sys.executable,
                            "-m",
                            "torch.distributed.run",
                            "--nnodes=1:2",
                            "--nproc-per-node=1",
                            "--rdzv-backend=c10d",
                            f"--rdzv-endpoint=127.0.0.1:{port}",
                            "--rdzv-id=recovery",
                            f"--rdzv-conf={conf}",
                            "--max-restarts=3",
                            "--local-addr=127.0.0.1",
                            "-m",
                            "ftrain",
                            "train",
                            *job.train_args(),
                        ],
                    )
                )
            job.wait_training()
            fault_t, what = inject(job, fault, nodes[1])
            out.steady_step_s = steady_step_s(job.metrics.poll(), fault_t)
            out.notes.append(what)
            job.wait_recovered(fault_t, settings.cap_s)
            out.marks = recovery_marks(fault_t, job.events.poll(), job.metrics.poll(), job.lines(), agents=False)
        finally:
            job.close()
    except (ScenarioError, WaitTimeout) as e:
        out.error = str(e)
    return out


def run_floor(ckpt_source: Path, workdir: Path, settings: Settings) -> Outcome:
    """Two static-rendezvous torchruns (the agent's launcher command), fresh, from a checkpoint copy."""
    out = Outcome("floor", "none")
    job = Job(workdir, settings)
    job.env[WORKER_JOB] = JOB_ID  # the agent's launch environment: its manifests name the job
    try:
        shutil.copytree(ckpt_source, job.ckpt)
        port = free_ports(1)[0]
        try:
            launched_at = time.time()
            for rank in range(2):
                launch = Launch(
                    round=0,
                    nnodes=2,
                    node_rank=rank,
                    nproc_per_node=1,
                    master_addr="127.0.0.1",
                    master_port=port,
                    worker_args=tuple(job.train_args()),
                )
                job.start(f"static{rank}", launch.command())
            job.wait_recovered(launched_at, settings.startup_timeout_s)
            out.marks = recovery_marks(
                launched_at, job.events.poll(), job.metrics.poll(), job.lines(), agents=False, launched_at=launched_at
            )
        finally:
            job.close()
    except Exception as e:  # noqa: BLE001 - reported in the table, the scenarios' numbers stand
        out.error = str(e) if isinstance(e, (ScenarioError, WaitTimeout)) else f"{type(e).__name__}: {e}"
    return out


def run_scenario(system: str, fault: str, workdir: Path, settings: Settings) -> Outcome:
    """One scenario; an unexpected error is reported as its outcome (its processes are gone by then)."""
    start = time.monotonic()
    try:
        if system.startswith("ftrain"):
            out = run_ftrain(fault, workdir, settings, live=system == "ftrain_live")
        elif system == "session_live":
            out = run_session_live(fault, workdir, settings)
        else:
            out = run_torchrun(fault, workdir, settings, TUNED_RDZV_CONF if system == "torchrun_tuned" else "")
    except Exception as e:  # noqa: BLE001 - one broken scenario must not lose the others' numbers
        out = Outcome(system, fault, error=f"{type(e).__name__}: {e}")
    out.wall_s = time.monotonic() - start
    return out
