"""Storage against a real S3 server (SeaweedFS): listing caches, errors, credentials, outages,
multipart cleanup. Round trips and what every backend must do are in test_storage_contract.py.

One server for the session (``seaweed``); each test works under its own prefix. Tests that
kill or pause the server restore it in ``finally``. No sleeps: threads wait on events set by
log records, with deadlines.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from ftrain.checkpoint.errors import FatalStorageError, TransientStorageError
from ftrain.checkpoint.storage import Storage, StorageOptions
from ftrain.testbed.procs import REPO
from ftrain.testbed.seaweed import SeaweedS3

pytestmark = pytest.mark.timeout(120)


class RecordingSleep:
    """An injected tenacity sleep that records waits (and really waits, briefly, if asked)."""

    def __init__(self, real: bool = False) -> None:
        self.calls: list[float] = []
        self.real = real

    def __call__(self, seconds: float) -> None:
        self.calls.append(seconds)
        if self.real:
            time.sleep(seconds)  # the retry backoff under test, not synchronisation


class EventOnRecord(logging.Handler):
    """Sets ``event`` when a record passing ``match`` is logged on any of ``loggers``."""

    def __init__(
        self,
        event: threading.Event,
        match: Callable[[logging.LogRecord], bool],
        *loggers: str,
        level: int = logging.DEBUG,
    ) -> None:
        super().__init__(level)
        self.event, self.match, self.names = event, match, loggers
        self.saved_levels: dict[str, int] = {}

    def emit(self, record: logging.LogRecord) -> None:
        if self.match(record):
            self.event.set()

    def __enter__(self) -> EventOnRecord:
        for name in self.names:
            logger = logging.getLogger(name)
            self.saved_levels[name] = logger.level
            if logger.getEffectiveLevel() > self.level:
                logger.setLevel(self.level)
            logger.addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        for name in self.names:
            logger = logging.getLogger(name)
            logger.removeHandler(self)
            logger.setLevel(self.saved_levels[name])


def is_retry_record(record: logging.LogRecord) -> bool:
    return record.name == "ftrain.checkpoint.storage" and "retrying" in record.getMessage()


# -- S3 specifics (the shared contract is tests/integration/test_storage_contract.py) -------
def test_metadata_is_not_answered_from_a_stale_listing(seaweed, s3_prefix, s3_storage):
    """Another client's write must be visible to exists/size after this client listed."""
    other = Storage(seaweed.url(s3_prefix), seaweed.storage_options(read_timeout_s=14.0))
    assert other.fs is not s3_storage.fs  # a separate s3fs instance: its own cache
    s3_storage.write_bytes("step-1/shard-0", b"a")
    assert s3_storage.listdir("step-1") == ["shard-0"]  # s3fs caches this listing
    other.write_bytes("step-1/manifest.json", b"{}")
    assert s3_storage.exists("step-1/manifest.json")
    assert s3_storage.size_bytes("step-1/manifest.json") == 2
    other.remove("step-1/shard-0")
    assert not s3_storage.exists("step-1/shard-0")


def test_missing_bucket_is_fatal_not_empty(seaweed):
    storage = Storage("s3://no-such-bucket-ftrain/p", seaweed.storage_options())
    for op in (lambda: storage.listdir(), lambda: storage.read_bytes("k"), lambda: storage.write_bytes("k", b"v")):
        with pytest.raises(FatalStorageError, match="NoSuchBucket"):
            op()


# -- credentials ----------------------------------------------------------------------------
@pytest.mark.parametrize("field", ["secret_access_key", "access_key_id"])
def test_wrong_credentials_fail_fast_and_fatal(seaweed, s3_prefix, field):
    options = seaweed.storage_options()
    setattr(options, field, "WRONG" + getattr(options, field)[5:])
    sleep = RecordingSleep()
    storage = Storage(seaweed.url(s3_prefix), options, sleep=sleep)
    start = time.monotonic()
    for op in (
        lambda: storage.write_bytes("k", b"v"),
        lambda: storage.read_bytes("k"),
        lambda: storage.exists("k"),
        lambda: storage.listdir(),
    ):
        with pytest.raises(FatalStorageError):
            op()
    assert sleep.calls == []  # never retried
    assert time.monotonic() - start < 10


def test_credentials_never_appear_in_repr_or_logs(seaweed, s3_prefix, caplog):
    secret, key_id = seaweed.secret_access_key, seaweed.access_key_id
    options = seaweed.storage_options()
    texts: list[str] = []
    with caplog.at_level(logging.DEBUG):
        storage = Storage(seaweed.url(s3_prefix), options)
        storage.write_bytes("k", b"v")
        assert storage.read_bytes("k") == b"v"
        storage.listdir()
        with pytest.raises(FileNotFoundError) as missing:
            storage.read_bytes("missing")
        texts.append(str(missing.value))
        wrong = ("y" if secret.startswith("x") else "x") + secret[1:]  # never the secret itself
        bad = Storage(seaweed.url(s3_prefix), seaweed.storage_options(secret_access_key=wrong))
        with pytest.raises(FatalStorageError) as fatal:
            bad.read_bytes("k")
        texts.append(str(fatal.value))
        # a retried failure (nobody listens on the endpoint): the retry warnings are logged
        dead = StorageOptions(
            endpoint_url="http://127.0.0.1:9",
            access_key_id=key_id,
            secret_access_key=secret,
            region="us-east-1",
            max_attempts=2,
        )
        with pytest.raises(TransientStorageError) as transient:
            Storage(seaweed.url(s3_prefix), dead, sleep=RecordingSleep()).read_bytes("k")
        texts.append(str(transient.value))
    assert any(is_retry_record(r) for r in caplog.records)
    texts += [caplog.text, repr(storage), repr(options), repr(seaweed), str(storage.__dict__.get("url"))]
    assert not [t for t in texts if secret in t]
    ours = [r.getMessage() for r in caplog.records if r.name.startswith("checkpoint")]
    assert not [m for m in ours if key_id in m or secret in m]
    assert secret not in seaweed.log_path.read_text(errors="replace")


def test_env_points_a_child_process_at_the_server(seaweed, s3_prefix, s3_storage):
    s3_storage.write_bytes("hello", b"from the parent")
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(seaweed.env(), PYTHONPATH=str(REPO))
    code = (
        "import sys\nfrom ftrain.checkpoint.storage import Storage\n"
        "sys.stdout.write(Storage(sys.argv[1]).read_bytes('hello').decode())\n"
    )
    # subprocess.run kills the child if it times out
    proc = subprocess.run(
        [sys.executable, "-c", code, seaweed.url(s3_prefix)],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout == "from the parent"


# -- outages --------------------------------------------------------------------------------
def test_write_retried_across_kill_and_restart(seaweed, s3_prefix):
    """SIGKILL the server; a write starts, fails, and is retried; the first retry starts the
    server again (same ports and data); the write succeeds and old data is still there."""
    storage = Storage(seaweed.url(s3_prefix), seaweed.storage_options(max_attempts=12, retry_timeout_s=60))
    storage.write_bytes("before", b"kept")
    payload = os.urandom(1 << 20)
    first_retry = threading.Event()
    restarted = threading.Event()
    errors: list[BaseException | str] = []

    def restart_on_first_retry() -> None:
        try:
            if not first_retry.wait(timeout=30):
                errors.append("no retry was logged within 30 s")
                return
            seaweed.start()
            restarted.set()
        except BaseException as e:  # noqa: BLE001 - reported by the test thread
            errors.append(e)

    thread = threading.Thread(target=restart_on_first_retry, daemon=True)
    with EventOnRecord(first_retry, is_retry_record, "ftrain.checkpoint.storage", level=logging.WARNING):
        seaweed.stop()
        thread.start()
        try:
            start = time.monotonic()
            storage.write_bytes("during", payload)
            elapsed_s = time.monotonic() - start
        finally:
            first_retry.set()  # never leave the thread waiting
            thread.join(timeout=60)
            if not seaweed.running:
                seaweed.restart(timeout_s=60)
    assert errors == []
    assert restarted.is_set()
    assert storage.read_bytes("during") == payload
    assert storage.read_bytes("before") == b"kept"
    assert elapsed_s < 45


def test_hung_server_times_out_and_recovers_after_resume(seaweed, s3_prefix):
    """SIGSTOP: connections are accepted but never answered. With a 1 s read timeout the read
    fails as transient; the first timeout resumes the server; the read then succeeds."""
    storage = Storage(seaweed.url(s3_prefix), seaweed.storage_options(read_timeout_s=1.0, connect_timeout_s=1.0))
    storage.write_bytes("k", b"v")
    timed_out = threading.Event()

    def is_timeout(record: logging.LogRecord) -> bool:  # s3fs's own retry, or ours
        return is_retry_record(record) or (record.name == "s3fs" and "Retryable error" in record.getMessage())

    def resume_on_timeout() -> None:
        if timed_out.wait(timeout=30):
            seaweed.resume()

    thread = threading.Thread(target=resume_on_timeout, daemon=True)
    with EventOnRecord(timed_out, is_timeout, "ftrain.checkpoint.storage", "s3fs"):
        seaweed.pause()
        thread.start()
        try:
            assert storage.read_bytes("k") == b"v"
        finally:
            timed_out.set()
            thread.join(timeout=30)
            seaweed.resume()
    assert timed_out.is_set()


# -- multipart uploads ----------------------------------------------------------------------
def test_clear_multipart_uploads(seaweed, s3_prefix, s3_storage):
    fs, bucket = s3_storage.fs, seaweed.bucket
    mine = f"{s3_prefix}/step-1/shard-0"
    sibling = f"{s3_prefix}0/step-1/shard-0"  # shares the string prefix, not the "directory"

    def create(key: str) -> str:
        upload_id = fs.call_s3("create_multipart_upload", Bucket=bucket, Key=key)["UploadId"]
        fs.call_s3("upload_part", Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=1, Body=b"x" * 1024)
        return upload_id

    def pending(prefix: str) -> list[str]:
        page = fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix)
        return [u["Key"] for u in page.get("Uploads", [])]

    sibling_id = create(sibling)
    try:
        create(mine)
        assert pending(f"{s3_prefix}/") == [mine]
        assert s3_storage.listdir("step-1") == []  # an unfinished upload is invisible
        assert s3_storage.clear_multipart_uploads() == 1
        assert pending(f"{s3_prefix}/") == []
        assert pending(f"{s3_prefix}0/") == [sibling]
        assert s3_storage.clear_multipart_uploads() == 0
    finally:
        fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=sibling, UploadId=sibling_id)


# -- the server helper itself ---------------------------------------------------------------
def _listening_sockets(pid: int) -> list[tuple[str, int]]:
    """(ip hex, port) of every TCP socket in LISTEN state owned by ``pid`` (Linux /proc)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and inode in inodes:
                ip, port = local.rsplit(":", 1)
                found.append((ip, int(port, 16)))
    return found


def test_server_listens_on_loopback_and_picked_ports_only(seaweed):
    if not seaweed.running:
        seaweed.restart(timeout_s=60)
    listening = _listening_sockets(seaweed.pid)
    assert listening, "no listening sockets found"
    assert {ip for ip, _ in listening} == {"0100007F"}  # 127.0.0.1, no IPv6, no 0.0.0.0
    picked = {port for pair in seaweed.ports.values() for port in pair}
    assert {port for _, port in listening} <= picked


def test_server_lifecycle_cleans_up():
    server = SeaweedS3(bucket="lifecycle")
    sockets: list[Path] = []
    try:
        server.start()
        ready_s = server.wait_ready(timeout_s=60)
        pid = server.pid
        sockets = server.created_sockets
        assert sockets and all(p.exists() for p in sockets)
        assert ready_s < 60 and server.rss_bytes() > 0
        storage = Storage(server.url("x"), server.storage_options())
        storage.write_bytes("k", b"v")
    finally:
        server.close()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # reaped, not a zombie
    assert not [p for p in sockets if p.exists()]
    assert not server.data_dir.exists()
    assert not server.running
