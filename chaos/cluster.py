"""A job of real node agents on one machine: start and kill "nodes", read the shared event log
and the metrics, wait on conditions with deadlines. The chaos runner and the agent tests use it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ftrain.agents.config import AgentConfig, agent_flags
from ftrain.agents.launch import agent_command
from ftrain.agents.workers import descendants
from ftrain.contract.events import Event, parse_line
from ftrain.contract.local_files import open_append
from ftrain.faults import REQUESTS_DIR
from ftrain.testbed.procs import REPO, kill_tree, quiet_env
from ftrain.testbed.wait import WaitTimeout, wait_for

#: Where runs on one machine differ from the defaults (agents/config.py): failures are found fast.
FAST_AGENT_SETTINGS: dict[str, Any] = {
    "lease_ttl_s": 2,
    "settle_s": 1.0,
    "hang_timeout_s": 5.0,
    "start_timeout_s": 60.0,
    "backoff_initial_s": 0.2,
}
FAST_AGENT_OPTIONS = agent_flags(FAST_AGENT_SETTINGS)


class JsonlTail:
    """The records of an append-only JSON-lines file, read incrementally: each call parses only
    the complete lines appended since the last (a line still being written waits for its newline;
    a torn line left by a killed writer is skipped, as :func:`ftrain.contract.events.read_jsonl` does).
    The soak polls the job's files many times a second for half an hour: re-reading them whole
    each time cost the machine more CPU than the job it watched."""

    def __init__(self, path: Path):
        self.path = path
        self._offset = 0
        self._records: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    def records(self) -> list[dict[str, Any]]:
        with self._lock:
            try:
                with open(self.path, "rb") as fh:
                    fh.seek(self._offset)
                    chunk = fh.read()
            except FileNotFoundError:
                return []
            complete = chunk[: chunk.rfind(b"\n") + 1]
            self._offset += len(complete)
            for line in complete.splitlines():
                record = parse_line(line)  # torn, hostile or not an object: skipped
                if record is not None:
                    self._records.append(record)
            return self._records


class Cluster:
    """Agents of one job sharing an events file, a metrics file and a checkpoint location."""

    def __init__(
        self,
        workdir: Path,
        etcd_endpoint: str,
        config_path: Path,
        *,
        job: str = "job",
        steps: int | None = None,
        ckpt_uri: str | None = None,
        ckpt_interval: int | None = None,
        step_sleep_s: float = 0.0,
        overrides: Sequence[str] = (),
        env: dict[str, str] | None = None,
        agent_options: Sequence[str] = FAST_AGENT_OPTIONS,
        script: Path | None = None,
        progress: Callable[[], list[dict[str, Any]]] | None = None,
    ):
        """``script``: the agents run this training script of a user's (``ftrain agent --script``)
        with ``overrides`` as its arguments, instead of ``ftrain train`` with ``config_path``;
        ``progress``: where :meth:`metrics` reads the steps from (a script writes no metrics file)."""
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.etcd = etcd_endpoint
        self.job = job
        self.events_path = self.workdir / "events.jsonl"
        self.metrics_path = self.workdir / "metrics.jsonl"
        self._events = JsonlTail(self.events_path)
        self._metrics = JsonlTail(self.metrics_path)
        self.ckpt_uri = ckpt_uri or str(self.workdir / "ckpt")
        self.worker_args = [
            str(config_path),
            f"--checkpoint.uri={self.ckpt_uri}",
            f"--logging.metrics_path={self.metrics_path}",
            f"--logging.events_path={self.events_path}",
            "--logging.log_every=1000",
        ]
        if steps is not None:
            self.worker_args.append(f"--train.steps={steps}")
        if ckpt_interval is not None:
            self.worker_args.append(f"--checkpoint.interval={ckpt_interval}")
        self.worker_args += list(overrides)
        self.script = script
        if script is not None:
            if not overrides:
                raise ValueError("a script job needs its arguments (at least where it saves)")
            self.worker_args = list(overrides)  # the script reads its own; the config's are ftrain train's
        self._progress = progress
        self.env = dict(env or {})
        # where the bit_flip fault asks a worker for a flip (ftrain/faults.py): nothing happens without a request
        self.requests_dir = self.workdir / "fault-requests"  #: ftrain.faults: faults asked of one worker
        self.env.setdefault(REQUESTS_DIR, str(self.requests_dir))
        if step_sleep_s:
            self.env["FTRAIN_FAULT_STEP_SLEEP_S"] = str(step_sleep_s)
        self.agent_options = tuple(agent_options)
        self.agents: dict[str, subprocess.Popen] = {}
        self._launches: dict[str, tuple[tuple[str, ...], str, int, dict[str, str] | None, str, tuple[str, ...]]] = {}
        self._retired: list[subprocess.Popen] = []

    def start(
        self,
        node_id: str,
        *agent_args: str,
        nnodes: str = "1:2",
        nproc: int = 1,
        env: dict[str, str] | None = None,
        host: str = "",
        launcher: Sequence[str] = (),
    ) -> subprocess.Popen:
        """Start (or restart) the agent of ``node_id``; ``host``: the address the other nodes reach
        it at (``--host``), ``launcher``: what runs it there (``ip netns exec NS``, :mod:`ftrain.chaos.netns`)."""
        self._launches[node_id] = (agent_args, nnodes, nproc, env, host, tuple(launcher))
        old = self.agents.get(node_id)
        if old is not None:
            self._retired.append(old)
        cmd = [
            *launcher,
            sys.executable,
            "-m",
            *self.command(node_id, *agent_args, nnodes=nnodes, nproc=nproc, host=host),
        ]
        with os.fdopen(open_append(self.workdir / f"agent-{node_id}.log"), "ab") as log:  # never through a link
            proc = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=REPO if self.script is None else self.workdir,  # a script's relative paths land in the run's
                start_new_session=True,
                env=quiet_env(FTRAIN_LOG_LEVEL="INFO", **self.env, **(env or {})),
            )
        self.agents[node_id] = proc
        return proc

    def command(self, node_id: str, *agent_args: str, nnodes: str = "1:2", nproc: int = 1, host: str = "") -> list[str]:
        """The ``ftrain agent`` command line of ``node_id`` (:func:`ftrain.agents.launch.agent_command`):
        the node's keys, then the events file, :attr:`agent_options` and ``agent_args``."""
        node = {
            "etcd": self.etcd,
            "job": self.job,
            "nnodes": nnodes,
            "nproc_per_node": nproc,
            "node_id": node_id,
            "run_dir": str(self.workdir / node_id),
            "host": host or AgentConfig().host,  # the agents' default: loopback
        }
        config, *overrides = self.worker_args  # a script job: the script's own arguments after --
        script = ["--script", str(self.script)] if self.script is not None else []
        options = ["--events", str(self.events_path), *self.agent_options, *agent_args, *script]
        return agent_command(node, config, options=options, overrides=overrides)

    def restart(self, node_id: str) -> subprocess.Popen:
        """Start ``node_id``'s agent again with the options it was first started with."""
        agent_args, nnodes, nproc, env, host, launcher = self._launches[node_id]
        return self.start(node_id, *agent_args, nnodes=nnodes, nproc=nproc, env=env, host=host, launcher=launcher)

    @property
    def etcd_endpoints(self) -> list[str]:
        """The etcd endpoints the agents were given (``--etcd`` takes them comma-separated)."""
        return self.etcd.split(",")

    # -- reading ---------------------------------------------------------------------------
    def events(self, name: str | None = None, **match: Any) -> list[dict[str, Any]]:
        return [
            e
            for e in self._events.records()
            if (name is None or e["event"] == name) and all(e.get(k) == v for k, v in match.items())
        ]

    def wait_event(self, name: str, timeout_s: float = 60, **match: Any) -> dict[str, Any]:
        return wait_for(
            lambda: next(reversed(self.events(name, **match)), None),
            timeout_s,
            f"event {name} {match or ''} (log: {self.log_tail()})",
        )

    def metrics(self) -> list[dict[str, Any]]:
        """Each step's metrics line (a script job: what its ``progress`` source says)."""
        if self._progress is not None:
            return list(self._progress())
        return list(self._metrics.records())

    def step(self) -> int:
        return max((m["step"] for m in self.metrics()), default=0)

    def wait_step(self, step: int, timeout_s: float = 90) -> int:
        return wait_for(lambda: self.step() >= step and self.step(), timeout_s, f"training step {step}")

    def worker_pids(self, node_id: str, worker_round: int | None = None) -> list[int]:
        """PIDs of the workers of ``node_id`` in ``worker_round`` (default: its newest round); a
        script job's: those running now (:meth:`script_pids`)."""
        if self.script is not None:
            return self.script_pids(node_id)
        started = self.events(Event.WORKER_STARTED, node=node_id)
        if worker_round is None:
            worker_round = max((e["round"] for e in started), default=None)
        return [e["pid"] for e in started if e["round"] == worker_round]

    def script_pids(self, node_id: str) -> list[int]:
        """The script's processes under ``node_id``'s live agent (torchrun's children, not torchrun):
        a script logs no ``worker_started``, so its workers are found in ``/proc``."""
        agent = self.agents.get(node_id)
        if self.script is None or agent is None or agent.poll() is not None:
            return []
        script, out = str(self.script).encode(), []
        for pid in descendants(agent.pid):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as fh:
                    words = fh.read().split(b"\0")
            except OSError:
                continue  # gone meanwhile
            launcher = any(w == b"torch.distributed.run" or w.endswith(b"torchrun") for w in words)
            if script in words and not launcher:
                out.append(pid)
        return sorted(out)

    def committed_steps(self) -> list[int]:
        return sorted({e["step"] for e in self.events(Event.CKPT_COMMITTED)})

    def live_nodes(self) -> list[str]:
        return [n for n, p in self.agents.items() if p.poll() is None]

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
            raise WaitTimeout(f"agent {node_id} still running after {timeout_s:.0f}s:\n{self.log_tail()}") from None

    def close(self) -> None:
        for proc in [*self.agents.values(), *self._retired]:
            if proc.poll() is None:
                kill_tree(proc)
            else:
                proc.wait()
