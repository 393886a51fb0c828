"""A local etcd and SeaweedFS S3 on loopback (or another address of this host), as one context manager.

The demo, the benchmarks, the chaos runner, the tests and ``ftrain local up`` use it: free ports,
fast etcd elections, random S3 credentials handed to children only through the environment.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from ftrain.testbed.etcd import HOST, EtcdServer
from ftrain.testbed.seaweed import SeaweedS3


class LocalStack:
    def __init__(self, base_dir: str | os.PathLike[str] | None = None, *, with_s3: bool = True, host: str = HOST):
        """``host``: the address both servers listen on (127.0.0.1: this machine only; an address
        of an interface that other hosts or network namespaces reach, for a trial across them)."""
        self.base_dir = Path(base_dir or tempfile.mkdtemp(prefix="ftrain-local-"))
        self.base_dir.mkdir(parents=True, exist_ok=True)
        self.host = host
        self.etcd = EtcdServer(self.base_dir / "etcd", host=host)
        self.s3 = SeaweedS3(self.base_dir / "s3", host=host) if with_s3 else None

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

    def s3_server(self) -> SeaweedS3:
        """The S3 server; RuntimeError for a stack built with ``with_s3=False``."""
        if self.s3 is None:
            raise RuntimeError(f"the local stack in {self.base_dir} was built without S3 (with_s3=False)")
        return self.s3

    @property
    def etcd_url(self) -> str:
        return self.etcd.endpoint

    def env(self) -> dict[str, str]:
        """Variables that point a child process at this stack's S3 (credentials included)."""
        return self.s3.env() if self.s3 is not None else {}

    def close(self) -> None:
        if self.s3 is not None:
            self.s3.close()
        self.etcd.close()

    def __enter__(self) -> LocalStack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
