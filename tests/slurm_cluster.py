"""A real Slurm cluster on this one machine, for the tests of the shipped Slurm recipe.

Debian's ``slurm-wlm`` (22.05) cannot run several ``slurmd`` on one host, so each node is a
network namespace of :class:`ftrain.chaos.netns.NetnsCluster` (its own address on a bridge)
with its own UTS namespace (its own hostname): ``slurmd -N <node>`` runs there, and so does every
process of a job step on that node. ``slurmctld`` runs in the root network namespace on the
bridge's address (in a UTS namespace named ``ctl``, the controller's host name). A private
``munged`` (its own key and socket) authenticates them. Everything lives in one directory: the
configuration (``SLURM_CONF`` points every Slurm command at it), state, spool, logs; nothing under
``/etc``, ``/var`` or ``/run`` other than the namespaces is written.

:meth:`SlurmCluster.close` SIGKILLs every process in every node's namespace (slurmd, slurmstepd
and the jobs' processes), then the controller and munged, and removes the namespaces.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ftrain.chaos.netns import NetnsCluster
from ftrain.chaos.netns import unavailable_reason as netns_unavailable
from ftrain.testbed.etcd import free_ports
from ftrain.testbed.wait import wait_for

DAEMONS = ("slurmctld", "slurmd", "munged")
COMMANDS = ("sbatch", "srun", "scontrol", "scancel", "squeue", "sinfo")
CONTROLLER = "ctl"


def unavailable_reason() -> str | None:
    """Why a Slurm cluster cannot be brought up here, or None if it can."""
    if os.geteuid() != 0:
        return "not root: slurmd and network namespaces need root (CI runs as root)"
    why = netns_unavailable()
    if why is not None:
        return f"network namespaces: {why}"
    missing = [b for b in (*DAEMONS, *COMMANDS, "nsenter", "unshare") if _which(b) is None]
    if missing:
        return f"not installed: {', '.join(missing)} (apt-get install slurm-wlm munge; .ci/run does, as root)"
    return None


def _which(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")


class SlurmCluster:
    """slurmctld + one slurmd per node name, each node in namespaces of its own; a context manager."""

    def __init__(
        self,
        base_dir: Path,
        nodes: Sequence[str] = ("n1", "n2", "n3"),
        *,
        slurmd_timeout_s: int = 10,
        kill_wait_s: int = 30,
    ):
        self.base_dir = Path(base_dir)
        self.nodes = list(nodes)
        self.conf = self.base_dir / "slurm.conf"
        self.slurmd_timeout_s = slurmd_timeout_s
        self.kill_wait_s = kill_wait_s
        self.net: NetnsCluster | None = None
        self._daemons: list[subprocess.Popen[bytes]] = []

    # -- lifecycle -------------------------------------------------------------------------
    def __enter__(self) -> SlurmCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self, timeout_s: float = 60.0) -> SlurmCluster:
        """Bring the cluster up and wait until every node is idle."""
        try:
            self.net = NetnsCluster(self.nodes)
            for sub in ("state", "spool", "log", "munge"):
                (self.base_dir / sub).mkdir(parents=True, exist_ok=True)
            self._start_munged()
            self._write_conf()
            self._daemons.append(
                self._spawn(
                    ["unshare", "--uts", "sh", "-c", f"hostname {CONTROLLER} && exec slurmctld -D -i"],
                    "slurmctld",
                )
            )
            for node in self.nodes:
                netns = self.net.hosts[node].netns
                argv = ["nsenter", f"--net=/run/netns/{netns}", "unshare", "--uts", "sh", "-c"]
                self._daemons.append(self._spawn([*argv, f"hostname {node} && exec slurmd -D -N {node}"], node))
            wait_for(
                lambda: self.node_states() == {n: "idle" for n in self.nodes},
                timeout_s,
                "every slurmd registered and idle",
                poll_s=0.2,
                alive=lambda: all(d.poll() is None for d in self._daemons),
                context=self.log_tail,
            )
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """SIGKILL everything in the nodes' namespaces, then the daemons; remove the namespaces."""
        if self.net is not None:
            for node in self.nodes:
                self.kill_node_processes(node)
        for proc in self._daemons:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self._daemons.clear()
        if self.net is not None:
            self.net.close()
            self.net = None

    # -- parts -----------------------------------------------------------------------------
    def _spawn(self, argv: list[str], name: str) -> subprocess.Popen[bytes]:
        log = open(self.base_dir / "log" / f"{name}.out", "ab")  # noqa: SIM115 - the child keeps it
        try:
            return subprocess.Popen(argv, env=self.env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            log.close()

    def _start_munged(self) -> None:
        munge = self.base_dir / "munge"
        key = munge / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))
        key.chmod(0o400)
        self.munge_socket = munge / "munge.socket"
        argv = [
            _which("munged") or "munged",
            "-F",
            "--force",
            f"--key-file={key}",
            f"--socket={self.munge_socket}",
            f"--pid-file={munge / 'munged.pid'}",
            f"--log-file={munge / 'munged.log'}",
            f"--seed-file={munge / 'munged.seed'}",
        ]
        self._daemons.append(self._spawn(argv, "munged"))
        wait_for(self.munge_socket.exists, 20, "munged's socket", alive=lambda: self._daemons[-1].poll() is None)

    def _write_conf(self) -> None:
        assert self.net is not None
        ctl_port, node_port = free_ports(2, self.net.root_address)
        b = self.base_dir
        lines = [
            "ClusterName=ftraintest",
            f"SlurmctldHost={CONTROLLER}({self.net.root_address})",
            f"SlurmctldPort={ctl_port}",
            f"SlurmdPort={node_port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "MpiDefault=none",
            "SchedulerType=sched/backfill",
            "SelectType=select/linear",
            "JobCompType=jobcomp/none",
            "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none",
            "ReturnToService=2",
            f"SlurmdTimeout={self.slurmd_timeout_s}",
            f"KillWait={self.kill_wait_s}",
            "MinJobAge=300",
            f"StateSaveLocation={b / 'state'}",
            f"SlurmdSpoolDir={b / 'spool'}/%n",
            f"SlurmctldPidFile={b / 'state' / 'slurmctld.pid'}",
            f"SlurmdPidFile={b / 'spool'}/slurmd.%n.pid",
            f"SlurmctldLogFile={b / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={b / 'log'}/slurmd.%n.log",
            f"PlugStackConfig={b / 'plugstack.conf'}",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
        ]
        for node in self.nodes:
            lines.append(f"NodeName={node} NodeAddr={self.net.address(node)} NodeHostname={node} CPUs=1 State=UNKNOWN")
        lines.append(f"PartitionName=main Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP")
        (b / "plugstack.conf").write_text("")
        self.conf.write_text("\n".join(lines) + "\n")

    # -- using it --------------------------------------------------------------------------
    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """The environment for Slurm commands (``SLURM_CONF``) with ``extra`` over ``os.environ``."""
        env = {**os.environ, "SLURM_CONF": str(self.conf), **(extra or {})}
        env["PATH"] = env.get("PATH", "") + ":/usr/sbin:/sbin"
        return env

    def run(self, argv: Sequence[str], *, check: bool = True, **kwargs: Any) -> subprocess.CompletedProcess[str]:
        """A Slurm command (``sbatch``, ``scontrol`` ...) from the root namespace."""
        env = self.env(kwargs.pop("env", None))
        out = subprocess.run(list(argv), env=env, capture_output=True, text=True, timeout=60, **kwargs)
        if check and out.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed ({out.returncode}): {out.stderr.strip()}\n{self.log_tail()}")
        return out

    def sbatch(self, *args: str, env: Mapping[str, str] | None = None, cwd: Path | None = None) -> int:
        """Submit (``sbatch --parsable ARGS``); the job id."""
        out = self.run(["sbatch", "--parsable", *args], env=env, cwd=cwd)
        return int(out.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job``'s fields (``JobState``, ``NodeList``, ``ExitCode``, ``Restarts``...);
        empty once the controller forgot the job."""
        out = self.run(["scontrol", "-o", "show", "job", str(job_id)], check=False)
        if out.returncode != 0:
            return {}
        return dict(word.split("=", 1) for word in out.stdout.split() if "=" in word)

    def job_state(self, job_id: int) -> str:
        return self.job(job_id).get("JobState", "")

    def node_states(self) -> dict[str, str]:
        """Each node's state as ``sinfo`` names it (``idle``, ``alloc``, ``down*`` ...)."""
        out = self.run(["sinfo", "-h", "-N", "-o", "%N %T"], check=False)
        if out.returncode != 0:
            return {}
        return dict(line.split() for line in out.stdout.splitlines() if len(line.split()) == 2)

    def node_pids(self, node: str) -> list[int]:
        """Every process in ``node``'s network namespace."""
        assert self.net is not None
        out = subprocess.run(["ip", "netns", "pids", self.net.hosts[node].netns], capture_output=True, text=True)
        return [int(p) for p in out.stdout.split()]

    def kill_node_processes(self, node: str) -> list[int]:
        """SIGKILL every process in ``node``'s namespace until none is left; their PIDs."""
        killed: list[int] = []
        deadline = time.monotonic() + 20
        while (pids := self.node_pids(node)) and time.monotonic() < deadline:
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            killed += [p for p in pids if p not in killed]
            wait_for(lambda: not set(self.node_pids(node)) & set(pids), 10, f"{node}'s processes gone", poll_s=0.05)
        return killed

    def crash(self, node: str) -> list[int]:
        """A node's crash: its link goes down (nothing it sent arrives anywhere) and every process
        on it is SIGKILLed, slurmd included; the PIDs."""
        assert self.net is not None
        self.net.isolate(node)
        return self.kill_node_processes(node)

    def log_tail(self, max_bytes: int = 3000) -> str:
        parts = []
        for path in sorted((self.base_dir / "log").glob("*")):
            text = path.read_bytes()[-max_bytes:].decode(errors="replace")
            parts.append(f"--- {path.name}\n{text}")
        return "\n".join(parts)


__all__ = ["SlurmCluster", "unavailable_reason"]
