"""Recovery time after a fault: ftrain's agents against plain torchrun (c10d), phase by phase.

    python bench/recovery.py [--repeats N] [--quick] [--smoke] [--faults worker_kill,node_loss,hang]
                             [--systems ftrain_live,ftrain_restart,torchrun_default,torchrun_tuned]

One job everywhere: ``ftrain.testbed.jobs.TINY_CONFIG`` with more steps, DDP over gloo, two "nodes" on
this host with one worker each, a checkpoint every ``--ckpt-interval`` steps to a local
directory; every (re)start resumes from the newest committed checkpoint. Each step sleeps
``FTRAIN_FAULT_STEP_SLEEP_S`` longer, so the job is still running when the fault comes. The
fault is injected once training passed ``--fault-step`` at world size 2 with a checkpoint
committed:

- ``worker_kill``: SIGKILL the rank-1 worker.
- ``node_loss``: SIGKILL a whole node at once. ftrain: the agent, its torchrun and its worker
  (the node of the rank-1 worker). torchrun: the torchrun that does not host the c10d store
  (``is_host=0``; losing the host's store is fatal to every torchrun) and its worker.
- ``hang``: SIGSTOP the rank-1 worker. ftrain's agents detect missing heartbeats
  (``--hang-timeout-s``); torchrun has no hang detection, so it waits for the gloo collective
  timeout (``--parallel.timeout_s``, the same value for every system).

Systems: ``ftrain_live`` and ``ftrain_restart`` (an etcd and two ``ftrain agent`` with
``--recovery live`` or ``restart``; the live rows' phases are explained in ``bench/lib/live_marks.py``),
``torchrun_default`` (two
``torchrun --rdzv-backend=c10d --nnodes=1:2 --max-restarts=3``) and ``torchrun_tuned`` (the same
with ``--rdzv-conf`` short timeouts). The floor is the bare cost of a start from a checkpoint:
two static-rendezvous torchruns (the command the ftrain agent launches) started fresh, from a
copy of a checkpoint, no fault.

A recovery ends at the first step completed after the resume; its phases, each mark taken when
the last participant reached it:

- detect: fault -> first reaction (ftrain: an agent's workers_exited/hang/round_formed/
  workers_stopped event; torchrun: its "... will restart worker group" log line).
- rendezvous: -> the new round is launched (ftrain: the agents' workers_started event, which
  starts a new torchrun; torchrun: its "Starting worker group" line, its launcher lives on).
- launcher: ftrain and the floor only: torchrun's own start (interpreter, torch import, static
  rendezvous) -> its "Starting worker group" line.
- worker start: -> every worker began its checkpoint load (``resume_started``; interpreter,
  imports, process group, model). Workers that predate that event: ``worker_started``, which
  they emit right before the load (``load_start_by`` in the JSON says which).
- checkpoint load: -> every worker emitted ``resumed`` (agree on the step, verify, DCP read).
- first step: -> rank 0's first metrics line with a step past the resumed one.

Events and metrics carry their own wall-clock times; torchrun's log lines (``LOGLEVEL=INFO``) carry
glog timestamps (lines without one are stamped here on arrival). Prints a table and one final
JSON line with every number.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench import steady_state
from bench.lib.live_marks import first_live_step_after, live_marks  # noqa: E402 - after the path setup
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

FAULTS = ("worker_kill", "node_loss", "hang")
SYSTEMS = ("ftrain_live", "ftrain_restart", "torchrun_default", "torchrun_tuned")
PHASES = ("detect", "rendezvous", "launcher", "worker_start", "ckpt_load", "first_step")
#: FACTS.md: a node loss took 42.7 s with c10d defaults and 2.4 s with these.
TUNED_RDZV_CONF = "join_timeout=60,last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=2"
LEASE_TTL_S, HANG_TIMEOUT_S = 2, 4.0
AGENT_OPTIONS = agent_flags({"lease_ttl_s": LEASE_TTL_S, "settle_s": 1.0, "hang_timeout_s": HANG_TIMEOUT_S})
AGENT_REACTIONS = (Event.WORKERS_EXITED, Event.HANG, Event.ROUND_FORMED, Event.WORKERS_STOPPED)
TORCHRUN_REACTION = "will restart worker group"
TORCHRUN_LAUNCH = "Starting worker group"
TARGET_NODE_LOSS_SPEEDUP = 3.0
TARGET_WORKER_CRASH_OVER_FLOOR = 1.5
TARGET_LIVE_WORKER_KILL_S = 1.0
POLL_S = 0.05
#: the agents' job id: their workers' manifests carry it, so the floor's workers (started from a
#: copy of an ftrain run's checkpoint, as an agent would) must have it too
JOB_ID = "recovery"


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


# -- the analysis: pure functions of what was written -------------------------------------------
_GLOG = re.compile(r"^[IWEF](\d\d)(\d\d) (\d\d):(\d\d):(\d\d)(\.\d+) ")


def glog_time(text: str, year: int) -> float | None:
    """Unix time of a glog-prefixed line (``I1129 20:02:15.820000 PID file:line] ...``, local time)."""
    m = _GLOG.match(text)
    if m is None:
        return None
    month, day, hour, minute, second = (int(g) for g in m.groups()[:5])
    return time.mktime((year, month, day, hour, minute, second, 0, 0, -1)) + float(m.group(6))


def stamped(lines: Iterable[tuple[float, str]]) -> list[tuple[float, str]]:
    """(time, text) with each line's own glog time where it has one, else its arrival time."""
    out = []
    for arrived, text in lines:
        own = glog_time(text, time.localtime(arrived).tm_year)
        out.append((arrived if own is None else own, text))
    return out


def read_glog_lines(paths: Iterable[Path]) -> list[tuple[float, str]]:
    year = time.localtime().tm_year
    out = []
    for path in paths:
        with open(path, errors="replace") as fh:
            for text in fh:
                t = glog_time(text, year)
                if t is not None:
                    out.append((t, text.rstrip("\n")))
    return out


@dataclass(frozen=True, slots=True)
class Marks:
    """Wall-clock times (unix s) of one recovery; None where the run gives no such mark."""

    fault: float
    detected: float | None
    launched: float | None
    spawned: float | None
    started: float | None
    resumed: float | None
    first_step: float
    detected_by: str = ""
    resumed_step: int = -1
    world_size: int = 0
    load_start_by: str = ""  #: the event that marked the load's start (resume_started or worker_started)

    def phases(self) -> dict[str, float | None]:
        """Seconds per phase (see PHASES); a missing mark folds its phase into the next one."""
        points = (self.detected, self.launched, self.spawned, self.started, self.resumed, self.first_step)
        out: dict[str, float | None] = {}
        last = self.fault
        for name, point in zip(PHASES, points, strict=True):
            out[name] = None if point is None else round(point - last, 3)
            last = last if point is None else point
        return out

    @property
    def total_s(self) -> float:
        return round(self.first_step - self.fault, 3)


def first_step_after(
    since: float, events: list[dict[str, Any]], metrics: list[dict[str, Any]]
) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """(rank 0's ``resumed`` event, metrics line) of the first step completed after a resume that
    came after ``since``; None if there is none yet."""
    resumed = sorted(
        (e for e in events if e.get("event") == Event.RESUMED and e.get("rank") == 0 and e["time"] > since),
        key=lambda e: e["time"],
    )
    if not resumed:
        return None
    for line in sorted((m for m in metrics if m["time"] > resumed[0]["time"]), key=lambda m: m["time"]):
        latest = [e for e in resumed if e["time"] < line["time"]][-1]
        if line["step"] > latest["step"]:
            return latest, line
    return None


def _generation(
    since: float, resumed0: dict[str, Any], step_line: dict[str, Any], events: list[dict[str, Any]]
) -> tuple[float | None, float | None, str, float | None]:
    """Over the ranks of the generation that resumed (same round and world size as rank 0's
    resume, after ``since``; per rank its latest worker): (first ``worker_started``, last load
    start, the event that gave it, last ``resumed``). The load start is ``resume_started``, or
    ``worker_started`` (emitted just before the load) where workers predate that event."""

    def latest_per_rank(name: str, until: float) -> dict[int, dict[str, Any]]:
        last: dict[int, dict[str, Any]] = {}
        for e in sorted(events, key=lambda e: e["time"]):
            if (
                e.get("event") == name
                and e.get("round") == resumed0.get("round")
                and since < e["time"] <= until
                and e.get("world_size") == resumed0["world_size"]
            ):
                last[e["rank"]] = e
        return last

    started = latest_per_rank(Event.WORKER_STARTED, resumed0["time"])
    resumed = latest_per_rank(Event.RESUMED, step_line["time"])
    pids = {e["pid"] for e in started.values()}
    load_starts = [
        e["time"]
        for e in events
        if e.get("event") == Event.RESUME_STARTED and e.get("pid") in pids and since < e["time"] <= step_line["time"]
    ]
    if load_starts:
        load_start, load_start_by = max(load_starts), Event.RESUME_STARTED
    else:
        load_start, load_start_by = max((e["time"] for e in started.values()), default=None), Event.WORKER_STARTED
    return (
        min((e["time"] for e in started.values()), default=None),
        load_start,
        load_start_by,
        max((e["time"] for e in resumed.values()), default=None),
    )


def recovery_marks(
    fault: float,
    events: list[dict[str, Any]],
    metrics: list[dict[str, Any]],
    launcher_lines: list[tuple[float, str]],
    *,
    agents: bool,
    launched_at: float | None = None,
) -> Marks | None:
    """The marks of the first recovery after ``fault``, or None if it has not completed.

    ``agents``: ftrain, whose agents' events give the reaction and the launch. Otherwise torchrun,
    whose reaction is a log line; ``launched_at`` given: the floor, started here, no reaction.
    ``launcher_lines``: (time, text) of torchrun's log lines (ftrain: the rounds' logs)."""
    found = first_step_after(fault, events, metrics)
    if found is None:
        return None
    resumed0, line = found
    first_start, started, load_start_by, resumed = _generation(fault, resumed0, line, events)
    detected, detected_by, launched = None, "", launched_at
    if agents:
        reactions = sorted(
            (e for e in events if e.get("rank") == -1 and e.get("event") in AGENT_REACTIONS and e["time"] >= fault),
            key=lambda e: e["time"],
        )
        if reactions:
            detected = reactions[0]["time"]
            detected_by = reactions[0]["event"] + (f" ({reactions[0]['reason']})" if reactions[0].get("reason") else "")
        launched = max(
            (
                e["time"]
                for e in events
                if e.get("event") == Event.WORKERS_STARTED and e.get("worker_round") == resumed0.get("round")
            ),
            default=None,
        )
    elif launched_at is None:
        reactions = sorted((t, text) for t, text in launcher_lines if t >= fault and TORCHRUN_REACTION in text)
        if reactions:
            message = reactions[0][1].split("] ", 1)[-1]  # after the glog prefix
            detected, detected_by = reactions[0][0], re.sub(r"^\[\w+\] ", "", message).split(";")[0]
    until = first_start if first_start is not None else resumed0["time"]
    spawned = max((t for t, text in launcher_lines if fault < t <= until and TORCHRUN_LAUNCH in text), default=None)
    if not agents and launched_at is None:
        launched = spawned  # torchrun's launcher lives on: its rendezvous ends where it spawns workers
    return Marks(
        fault,
        detected,
        launched,
        spawned,
        started,
        resumed,
        line["time"],
        detected_by,
        resumed0["step"],
        resumed0["world_size"],
        load_start_by,
    )


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
        self.config.write_text(TINY_CONFIG.replace("steps = 10", f"steps = {settings.steps}"))
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


def run_ftrain(fault: str, workdir: Path, settings: Settings, *, live: bool) -> Outcome:
    out = Outcome("ftrain_live" if live else "ftrain_restart", fault)
    job = Job(workdir, settings)
    try:
        with EtcdServer() as etcd:
            try:
                agents = [
                    job.start(
                        f"n{i}",
                        [
                            sys.executable,
                            "-m",
                            "ftrain",
                            "agent",
                            "--etcd",
                            etcd.endpoint,
                            "--job",
                            JOB_ID,
                            "--nnodes",
                            "1:2",
                            "--nproc-per-node",
                            "1",
                            "--node-id",
                            f"n{i}",
                            *AGENT_OPTIONS,
                            "--recovery",
                            "live" if live else "restart",
                            "--run-dir",
                            str(workdir / f"run-n{i}"),
                            "--events",
                            str(job.events.path),
                            "--",
                            *job.train_args(),
                        ],
                    )
                    for i in range(2)
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
        else:
            out = run_torchrun(fault, workdir, settings, TUNED_RDZV_CONF if system == "torchrun_tuned" else "")
    except Exception as e:  # noqa: BLE001 - one broken scenario must not lose the others' numbers
        out = Outcome(system, fault, error=f"{type(e).__name__}: {e}")
    out.wall_s = time.monotonic() - start
    return out


# -- reporting ----------------------------------------------------------------------------------
def aggregate(outcomes: list[Outcome]) -> dict[str, Any]:
    """Medians over the repeats that recovered (each phase and the total on its own, so the phase
    medians need not add up to the total's)."""
    good = [o.marks for o in outcomes if o.marks is not None]
    result: dict[str, Any] = {
        "runs": len(outcomes),
        "recovered": len(good),
        "errors": [o.error for o in outcomes if o.error],
        "notes": [n for o in outcomes for n in o.notes],
    }
    if not good:
        result["total_s"] = None
        return result
    result["total_s"] = round(statistics.median(m.total_s for m in good), 3)
    steady = [o.steady_step_s for o in outcomes if o.steady_step_s is not None]
    result["steady_step_s"] = round(statistics.median(steady), 5) if steady else None
    for name in PHASES:
        values = [m.phases()[name] for m in good if m.phases()[name] is not None]
        result[f"{name}_s"] = round(statistics.median(values), 3) if values else None
    result["detected_by"] = sorted({m.detected_by for m in good if m.detected_by})
    result["world_size_after"] = sorted({m.world_size for m in good})
    result["load_start_by"] = sorted({m.load_start_by for m in good})
    result["samples"] = [{"fault_time": round(m.fault, 3), "total_s": m.total_s, **m.phases()} for m in good]
    return result


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def format_table(results: dict[str, dict[str, dict[str, Any]]], floor: dict[str, Any], cap_s: float) -> str:
    header = [
        "fault",
        "system",
        "detect",
        "rendezvous",
        "launcher",
        "worker start",
        "ckpt load",
        "first step",
        "total",
        "vs floor",
        "world",
        "first reaction",
    ]
    rows = [header]
    floor_total = floor.get("total_s")
    for fault, by_system in results.items():
        for i, (system, r) in enumerate(by_system.items()):
            name = fault if i == 0 else ""
            if r["total_s"] is None:
                why = (r["errors"] or ["?"])[0]
                text = f"not recovered within {cap_s:.0f} s" if "first step after" in why else f"FAILED: {why}"
                rows.append([name, system, *[""] * len(PHASES), "-", "", "", text[:70]])
                continue
            ratio = f"{r['total_s'] / floor_total:.2f}x" if floor_total else "-"
            rows.append(
                [
                    name,
                    system,
                    *(_cell(r[f"{p}_s"]) for p in PHASES),
                    _cell(r["total_s"]),
                    ratio,
                    ",".join(map(str, r["world_size_after"])),
                    "; ".join(r["detected_by"])[:60],
                ]
            )
    if floor_total is not None:
        rows.append(
            [
                "floor",
                "static torchrun x2",
                "-",
                "-",
                *(_cell(floor[f"{p}_s"]) for p in PHASES[2:]),
                _cell(floor_total),
                "1.00x",
                "2",
                "fresh start from a checkpoint",
            ]
        )
    elif floor.get("runs"):
        rows.append(
            [
                "floor",
                "static torchrun x2",
                *[""] * len(PHASES),
                "-",
                "",
                "",
                f"FAILED: {(floor['errors'] or ['?'])[0]}"[:70],
            ]
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = []
    for j, row in enumerate(rows):
        cells = (
            c.ljust(w) if i in (0, 1, len(header) - 1) else c.rjust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        )
        lines.append("  ".join(cells).rstrip())
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _ratio(num: float | None, den: float | None) -> float | None:
    return round(num / den, 2) if num is not None and den else None


def soak_goodputs(specs: list[str]) -> dict[str, float]:
    """``MODE=PATH`` -> {mode: the goodput in that soak's report.json}."""
    out = {}
    for spec in specs:
        mode, sep, path = spec.partition("=")
        if not sep or mode not in ("live", "restart"):
            raise ValueError(f"{spec!r}: expected live=PATH or restart=PATH")
        out[mode] = float(json.loads(Path(path).read_text())["goodput"]["goodput"])
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=1, help="runs per scenario; medians when > 1 (default 1)")
    p.add_argument("--quick", action="store_true", help="skip torchrun with default rendezvous settings (slow)")
    p.add_argument("--faults", default=",".join(FAULTS), help=f"comma-separated subset of {','.join(FAULTS)}")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {','.join(SYSTEMS)}")
    p.add_argument("--ckpt-interval", type=int, default=20, help="steps between checkpoints (default 20)")
    p.add_argument("--fault-step", type=int, default=50, help="inject once training passed this step (default 50)")
    p.add_argument("--step-sleep-s", type=float, default=0.03, help="FTRAIN_FAULT_STEP_SLEEP_S (default 0.03)")
    p.add_argument(
        "--collective-timeout-s",
        type=float,
        default=30.0,
        help="parallel.timeout_s for every system: torchrun's only hang detection (default 30)",
    )
    p.add_argument("--cap-s", type=float, default=150.0, help="give up on a recovery after this long (default 150)")
    p.add_argument("--startup-timeout-s", type=float, default=120.0, help="limit to reach --fault-step (default 120)")
    p.add_argument("--keep", action="store_true", help="keep the work directory (logs, events, metrics)")
    p.add_argument(
        "--steady-repeats",
        type=int,
        default=3,
        help="pairs of fault-free runs for steady_state_vs_torchrun (bench/steady_state.py; 0: skip; default 3)",
    )
    p.add_argument(
        "--soak-report",
        action="append",
        default=[],
        metavar="MODE=PATH",
        help="report.json of a soak (ftrain chaos run chaos/scenarios/soak.toml --recovery MODE) whose goodput "
        "goes into the JSON line as soak_goodput_MODE (live or restart); repeatable",
    )
    p.add_argument(
        "--smoke",
        action="store_true",
        help="the test suite's run: a worker kill, ftrain_live and ftrain_restart, early, no floor or steady state",
    )
    args = p.parse_args(argv)
    try:
        soaks = soak_goodputs(args.soak_report)
    except (OSError, ValueError, KeyError) as e:
        p.error(f"--soak-report: {e}")
    if args.smoke:
        args.faults, args.systems, args.repeats = "worker_kill", "ftrain_live,ftrain_restart", 1
        args.ckpt_interval, args.fault_step, args.steady_repeats = 10, 40, 0
    faults = [f for f in args.faults.split(",") if f]
    systems = [s for s in args.systems.split(",") if s and not (args.quick and s == "torchrun_default")]
    bad = [x for x in faults if x not in FAULTS] + [x for x in systems if x not in SYSTEMS]
    if bad or not faults or not systems:
        p.error(f"unknown or empty faults/systems: {bad}")
    if args.repeats < 1 or args.fault_step <= args.ckpt_interval:
        p.error("need --repeats >= 1 and --fault-step > --ckpt-interval (a checkpoint must exist)")
    settings = Settings(
        steps=100_000,
        ckpt_interval=args.ckpt_interval,
        fault_step=args.fault_step,
        step_sleep_s=args.step_sleep_s,
        collective_timeout_s=args.collective_timeout_s,
        startup_timeout_s=args.startup_timeout_s,
        cap_s=args.cap_s,
    )

    cores = os.cpu_count() or 1
    load_start = os.getloadavg()[0]
    started = time.monotonic()
    outcomes: dict[tuple[str, str], list[Outcome]] = {}
    floors: list[Outcome] = []
    workdir = Path(tempfile.mkdtemp(prefix="ftrain-recovery-"))
    print(
        f"work dir {workdir}; faults {faults}; systems {systems}; {args.repeats} repeat(s); {cores} cores; "
        f"checkpoint every {args.ckpt_interval} steps, fault after step {args.fault_step}, step sleep "
        f"{args.step_sleep_s}s, parallel.timeout_s={args.collective_timeout_s:g}",
        flush=True,
    )
    try:
        for rep in range(args.repeats):
            for fault in faults:
                for system in systems:
                    out = run_scenario(system, fault, workdir / f"r{rep}-{fault}-{system}", settings)
                    outcomes.setdefault((fault, system), []).append(out)
                    state = (
                        (f"{out.marks.total_s:.2f}s " + json.dumps(out.marks.phases()))
                        if out.marks
                        else f"FAILED: {out.error}"
                    )
                    print(f"  [{rep}] {fault:11s} {system:16s} {state}  ({out.wall_s:.0f}s wall)", flush=True)
                    ckpt = workdir / f"r{rep}-{fault}-{system}" / "ckpt"
                    ours = system.startswith("ftrain")  # its manifests are of job JOB_ID
                    if not args.smoke and ours and len(floors) == rep and (ckpt / "latest").exists():
                        floor = run_floor(ckpt, workdir / f"r{rep}-floor", settings)
                        floors.append(floor)
                        state = f"{floor.marks.total_s:.2f}s" if floor.marks else f"FAILED: {floor.error}"
                        print(f"  [{rep}] floor (static torchrun x2 from a checkpoint): {state}", flush=True)
        steady_summary = (
            steady_state.measure(
                steady_state.DEFAULT_CONFIG, repeats=args.steady_repeats, steps=300, warmup=30, recovery="live"
            )
            if args.steady_repeats > 0
            else None
        )
    except steady_state.RunFailed as e:
        print(f"steady state not measured: {e}", flush=True)
        steady_summary = None
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)

    results = {f: {s: aggregate(outcomes[(f, s)]) for s in systems} for f in faults}
    floor = aggregate(floors)
    print()
    print(
        f"Recovery: seconds from the fault to the first step completed after the resume "
        f"({'median of ' + str(args.repeats) if args.repeats > 1 else 'one run each'})."
    )
    print(format_table(results, floor, args.cap_s))
    for fault in faults:
        for system in systems:
            notes = results[fault][system]["notes"]
            if notes:
                more = f" (+{len(notes) - 1} more in the JSON)" if len(notes) > 1 else ""
                print(f"  {fault}/{system}: {notes[0]}{more}")
    load_end = os.getloadavg()[0]
    print(f"load average (1 min): {load_start:.1f} at the start, {load_end:.1f} at the end, on {cores} cores")
    print(
        f"hang: torchrun has no hang detection; its detect column is the gloo collective timeout "
        f"(parallel.timeout_s={args.collective_timeout_s:g} here, ftrain's default is 120) and its rendezvous column "
        "includes the 30 s torchrun waits after SIGTERM before it SIGKILLs the stopped worker; ftrain detects "
        "by heartbeat (--hang-timeout-s 4)."
    )

    def total(fault: str, system: str) -> float | None:
        return results.get(fault, {}).get(system, {}).get("total_s")

    summary = {
        "bench": "recovery",
        "live_worker_kill_s": total("worker_kill", "ftrain_live"),
        "live_node_loss_s": total("node_loss", "ftrain_live"),
        "live_hang_s": total("hang", "ftrain_live"),
        "live_speedup_vs_torchrun_tuned": _ratio(
            total("worker_kill", "torchrun_tuned"), total("worker_kill", "ftrain_live")
        ),
        "live_speedup_vs_restart": _ratio(total("worker_kill", "ftrain_restart"), total("worker_kill", "ftrain_live")),
        # fault-free runs side by side with torchrun --standalone (bench/steady_state.py)
        "steady_state_vs_torchrun": steady_summary["steady_state_vs_torchrun"] if steady_summary else None,
        # a soak, not this bench (ftrain chaos run chaos/scenarios/soak.toml): given by --soak-report
        "soak_goodput_live": soaks.get("live"),
        "soak_goodput_restart": soaks.get("restart"),
        "node_loss_speedup_vs_torchrun_default": _ratio(
            total("node_loss", "torchrun_default"), total("node_loss", "ftrain_restart")
        ),
        "worker_crash_over_floor": _ratio(total("worker_kill", "ftrain_restart"), floor.get("total_s")),
        "node_loss_speedup_vs_torchrun_tuned": _ratio(
            total("node_loss", "torchrun_tuned"), total("node_loss", "ftrain_restart")
        ),
        "worker_crash_speedup_vs_torchrun_default": _ratio(
            total("worker_kill", "torchrun_default"), total("worker_kill", "ftrain_restart")
        ),
        "worker_crash_speedup_vs_torchrun_tuned": _ratio(
            total("worker_kill", "torchrun_tuned"), total("worker_kill", "ftrain_restart")
        ),
        "hang_speedup_vs_torchrun_default": _ratio(total("hang", "torchrun_default"), total("hang", "ftrain_restart")),
        "hang_speedup_vs_torchrun_tuned": _ratio(total("hang", "torchrun_tuned"), total("hang", "ftrain_restart")),
        "floor_s": floor.get("total_s"),
        "targets": {
            "live_worker_kill_s": f"<= {TARGET_LIVE_WORKER_KILL_S}",
            "live_node_loss_s": f"<= lease TTL + 1 = {LEASE_TTL_S + 1}",
            "live_hang_s": f"<= hang_timeout_s + 1 = {HANG_TIMEOUT_S + 1:g}",
            "steady_state_vs_torchrun": f"<= {steady_state.TARGET_RATIO}",
            "node_loss_speedup_vs_torchrun_default": f">= {TARGET_NODE_LOSS_SPEEDUP}",
            "worker_crash_over_floor": f"<= {TARGET_WORKER_CRASH_OVER_FLOOR}",
        },
        "results": results,
        "floor": floor,
        "steady_state": steady_summary,
        "settings": {
            **asdict(settings),
            "repeats": args.repeats,
            "tuned_rdzv_conf": TUNED_RDZV_CONF,
            "agent_options": " ".join(AGENT_OPTIONS),
            "systems": systems,
            "faults": faults,
        },
        "cores": cores,
        "load_avg_1min": [load_start, load_end],
        "wall_s": round(time.monotonic() - started, 1),
    }
    speedup, over_floor = summary["node_loss_speedup_vs_torchrun_default"], summary["worker_crash_over_floor"]
    limits = {
        "live_worker_kill_s": TARGET_LIVE_WORKER_KILL_S,
        "live_node_loss_s": LEASE_TTL_S + 1,
        "live_hang_s": HANG_TIMEOUT_S + 1,
        "steady_state_vs_torchrun": steady_state.TARGET_RATIO,
    }
    summary["targets_met"] = {
        **{k: None if summary[k] is None else summary[k] <= limit for k, limit in limits.items()},
        "node_loss_speedup_vs_torchrun_default": None if speedup is None else speedup >= TARGET_NODE_LOSS_SPEEDUP,
        "worker_crash_over_floor": None if over_floor is None else over_floor <= TARGET_WORKER_CRASH_OVER_FLOOR,
    }
    print(json.dumps(summary))
    all_ok = all(o.marks is not None for runs in outcomes.values() for o in runs) and all(f.marks for f in floors)
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
