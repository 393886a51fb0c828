"""``ftrain local up``: a local etcd and SeaweedFS S3 on loopback, for trying ftrain on one machine.

:class:`LocalStack` is the same pair as a context manager (the demo, the benchmarks and the
tests use it): free ports, fast etcd elections, random S3 credentials handed to children only
through the environment.
"""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
from pathlib import Path

from agents.etcd_server import EtcdServer
from checkpoint.seaweed import SeaweedS3


class LocalStack:
    def __init__(self, base_dir: str | None = None, *, with_s3: bool = True):
        self.base_dir = Path(base_dir or tempfile.mkdtemp(prefix="ftrain-local-"))
        self.base_dir.mkdir(parents=True, exist_ok=True)
        self.etcd = EtcdServer(self.base_dir / "etcd")
        self.s3 = SeaweedS3(self.base_dir / "s3") if with_s3 else None

    def start(self, timeout_s: float = 60.0) -> LocalStack:
        try:
            self.etcd.start()
            if self.s3 is not None:
                self.s3.start()
            self.etcd.wait_ready(timeout_s)
            if self.s3 is not None:
                self.s3.wait_ready(timeout_s)
        except BaseException:
            self.close()
            raise
        return self

    @property
    def etcd_url(self) -> str:
        return self.etcd.endpoint

    def env(self) -> dict[str, str]:
        """Variables that point a child process at this stack (S3 credentials included)."""
        env = {"FTRAIN_ETCD_ENDPOINTS": self.etcd.endpoint}
        if self.s3 is not None:
            env.update(self.s3.env())
        return env

    def close(self) -> None:
        if self.s3 is not None:
            self.s3.close()
        self.etcd.close()

    def __enter__(self) -> LocalStack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("local", help="local infrastructure for trying ftrain on one machine")
    local = p.add_subparsers(dest="local_command", required=True)
    up = local.add_parser("up", help="start etcd and SeaweedFS S3 on 127.0.0.1 until Ctrl-C")
    up.add_argument("--dir", default=None, help="data directory (default: a new temporary directory)")
    up.add_argument("--no-s3", action="store_true", help="etcd only")
    up.set_defaults(func=_up)


def _up(args: argparse.Namespace, overrides: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    stack = LocalStack(args.dir, with_s3=not args.no_s3)
    try:
        stack.start()
        print(f"etcd: {stack.etcd_url}")
        if stack.s3 is not None:
            print(f"s3:   {stack.s3.endpoint_url} (bucket {stack.s3.url()})")
        print(f"data: {stack.base_dir}")
        print("# point agents and workers at it:")
        for key, value in stack.env().items():
            print(f"export {key}={value}")
        print(f"# e.g. ftrain agent --etcd {stack.etcd_url} --job demo --nnodes 1:2 --nproc-per-node 1 "
              f"-- configs/demo.toml --checkpoint.uri={stack.s3.url('demo') if stack.s3 else '/tmp/ckpt'}")
        print("Ctrl-C to stop.", flush=True)
        code = stack.etcd.wait()
        print(f"etcd exited with code {code}; log {stack.etcd.log_path}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        stack.close()
