"""Fixtures shared by every suite: golden runs, and the real servers (one SeaweedFS S3 server
for the whole session; a throwaway etcd per test).

Tests share the S3 server and isolate themselves by key prefix (``s3_prefix``). A test that
kills or pauses the server must bring it back in its own ``finally``; ``s3_prefix`` also
restarts a dead server so one failure cannot cascade."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator

import pytest

from ftrain.agents.etcd import EtcdClient
from ftrain.checkpoint.storage import Storage
from ftrain.testbed.etcd import EtcdServer
from ftrain.testbed.jobs import RunResult, train_job
from ftrain.testbed.seaweed import SeaweedNotInstalledError, SeaweedS3

#: every process a test starts dies with the run, even on SIGTERM (tests/process_guard.py)
pytest_plugins = ["tests.process_guard"]


@pytest.fixture(scope="session")
def golden(tmp_path_factory) -> Callable[..., RunResult]:
    """``golden(nproc, *overrides)``: an uninterrupted run of the tiny config, run once per
    session and shared by every test that compares against it. Each records a ledger in
    ``<workdir>/ledger``."""
    cache: dict[tuple, RunResult] = {}

    def get(nproc: int, *overrides: str) -> RunResult:
        key = (nproc, tuple(sorted(overrides)))
        if key not in cache:
            workdir = tmp_path_factory.mktemp(f"golden-{nproc}")
            cache[key] = train_job(workdir, nproc, f"--data.ledger_dir={workdir / 'ledger'}", *overrides)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def seaweed() -> Iterator[SeaweedS3]:
    try:
        server = SeaweedS3(bucket="ftrain-it")
    except SeaweedNotInstalledError as e:  # part of the dev extra: a broken install, not a skip
        pytest.fail(str(e))
    try:
        server.start()
        server.wait_ready(timeout_s=60)
        yield server
    finally:
        server.close()


@pytest.fixture
def s3_prefix(seaweed: SeaweedS3) -> str:
    """A fresh key prefix for one test (the server is restarted first if a test left it dead)."""
    if not seaweed.running:
        seaweed.restart(timeout_s=60)
    return f"t-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def s3_storage(seaweed: SeaweedS3, s3_prefix: str) -> Storage:
    return Storage(seaweed.url(s3_prefix), seaweed.storage_options())


@pytest.fixture
def etcd() -> Iterator[EtcdServer]:
    """A throwaway etcd per test (tests stop, pause and restart it)."""
    server = EtcdServer()
    try:
        server.start()
        server.wait_ready(timeout_s=20)
        yield server
    finally:
        server.close()


@pytest.fixture
def client(etcd: EtcdServer) -> Iterator[EtcdClient]:
    with EtcdClient([etcd.endpoint], timeout_s=1.0, retry_timeout_s=5.0) as c:
        yield c
