"""Checkpoint files stream to storage (``Storage.open_upload``, DCP's writer on top) against a
real S3 server (SeaweedFS): parts go up while DCP is still writing, the stored bytes are the
digested ones, and no failure leaves an object: an error in the writer, a part refused for good
(the fault proxy), a process SIGKILLed mid-upload (then ``ftrain ckpt gc`` clears what it left).
Transient part errors are retried part by part and the save still commits.

Parts are 5 MiB here (S3's smallest), so a 32 MiB tensor is seven parts. No sleeps as
synchronisation: conditions are waited on with deadlines (``ftrain.testbed.wait.wait_for``), and the
overlap is read from what the uploader had stored when DCP closed the stream.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ftrain.chaos.s3proxy import FaultRates, S3FaultProxy, send_s3_error
from ftrain.checkpoint.backends import registered_backends
from ftrain.checkpoint.backends.s3 import S3Upload
from ftrain.checkpoint.dcp_read import VerifiedReader
from ftrain.checkpoint.dcp_write import DigestingWriter
from ftrain.checkpoint.digest import digest_bytes
from ftrain.checkpoint.manifest import FileEntry
from ftrain.checkpoint.publish import StepPublisher
from ftrain.checkpoint.safe_pickle import METADATA_NAME
from ftrain.checkpoint.storage import Storage, StorageOptions
from ftrain.testbed.procs import kill_tree, quiet_env
from ftrain.testbed.seaweed import SeaweedS3
from ftrain.testbed.wait import wait_for
from tests.integration.test_storage_contract import ROOTS

pytestmark = pytest.mark.timeout(180)

MiB = 1 << 20
PART_BYTES = 5 * MiB
ALGORITHM = "xxh3_128"


class RecordingPublisher:
    def __init__(self) -> None:
        self.files: dict[str, FileEntry] = {}

    def prepare(self) -> None:
        pass

    def commit(self, files: dict[str, FileEntry]) -> None:
        self.files = files


def options(seaweed_or_url: SeaweedS3 | str, **overrides: Any) -> StorageOptions:
    fields: dict[str, Any] = {"upload_part_size_bytes": PART_BYTES, "upload_parts_in_flight": 2, **overrides}
    if isinstance(seaweed_or_url, SeaweedS3):
        return seaweed_or_url.storage_options(**fields)
    return StorageOptions(**fields)


def save(url: str, opts: StorageOptions, state: dict[str, Any]) -> dict[str, FileEntry]:
    publisher = RecordingPublisher()
    writer = DigestingWriter(url, options=opts, algorithm=ALGORITHM, publisher=publisher)
    dcp.save(state, storage_writer=writer, no_dist=True)
    return publisher.files


def pending(seaweed: SeaweedS3, prefix: str) -> list[tuple[str, str]]:
    """(key, upload id) of every unfinished multipart upload under ``prefix/``."""
    fs = Storage(seaweed.url(), seaweed.storage_options()).fs
    page = fs.call_s3("list_multipart_uploads", Bucket=seaweed.bucket, Prefix=prefix.rstrip("/") + "/")
    return [(u["Key"], u["UploadId"]) for u in page.get("Uploads", [])]


def parts_stored(seaweed: SeaweedS3, key: str) -> int:
    """Parts the server holds for the unfinished upload of ``key`` (0 if there is none)."""
    fs = Storage(seaweed.url(), seaweed.storage_options()).fs
    uploads = [u for u in pending(seaweed, key.rpartition("/")[0]) if u[0] == key]
    if not uploads:
        return 0
    page = fs.call_s3("list_parts", Bucket=seaweed.bucket, Key=key, UploadId=uploads[0][1])
    return len(page.get("Parts", []))


def assert_stored_as_digested(storage: Storage, files: dict[str, FileEntry]) -> None:
    for name, entry in files.items():
        data = storage.read_bytes(name)
        assert (len(data), digest_bytes(data, ALGORITHM)) == (entry.size_bytes, entry.digest), name


@pytest.fixture
def uploads(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[dict[str, Any]]]:
    """What each S3Upload had done when its writer closed it (before the last part was sent)."""
    seen: list[dict[str, Any]] = []
    original = S3Upload.commit

    def commit(self: S3Upload) -> None:
        seen.append(
            {
                "name": self._name,
                "parts_handed_over": len(self._futures),
                "parts_uploaded": self.parts_uploaded,
                "multipart": self._upload_id is not None,
                "upload": self,
            }
        )
        original(self)

    monkeypatch.setattr(S3Upload, "commit", commit)
    yield seen


def big_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {"w": torch.randn(8 * MiB, dtype=torch.float32), "b": torch.arange(10.0)}  # 32 MiB of float32


# -- a large file -----------------------------------------------------------------------------
def test_a_large_file_uploads_in_parts_while_dcp_is_still_writing(seaweed, s3_prefix, uploads):
    url = seaweed.url(f"{s3_prefix}/step-000000001")
    state = big_state()
    files = save(url, options(seaweed), state)

    storage = Storage(url, seaweed.storage_options())
    assert sorted(files) == [METADATA_NAME, "__0_0.distcp", "__0_0.distcp.blocks"]  # its block digests beside it
    assert files["__0_0.distcp"].size_bytes > 6 * PART_BYTES
    assert_stored_as_digested(storage, files)
    shard = next(u for u in uploads if u["name"] == "__0_0.distcp")
    assert shard["multipart"] and shard["parts_handed_over"] >= 6
    # when DCP closed the stream, all but the parts in flight (2) were stored: the upload ran
    # beside the serialisation, and no more than 2 parts were ever held for upload
    assert shard["parts_uploaded"] >= shard["parts_handed_over"] - 2
    assert shard["upload"].peak_parts_in_flight <= 2
    assert [u["name"] for u in uploads] == ["__0_0.distcp"]  # .metadata: one PUT from memory (below)
    assert pending(seaweed, s3_prefix) == []

    target = {"w": torch.zeros_like(state["w"]), "b": torch.zeros(10)}
    reader = VerifiedReader(url, options=seaweed.storage_options(), files=files, algorithm=ALGORITHM)
    dcp.load(target, storage_reader=reader, no_dist=True)
    assert torch.equal(target["w"], state["w"]) and torch.equal(target["b"], state["b"])


# -- failures leave no object -----------------------------------------------------------------
def test_an_error_in_the_writer_midway_leaves_no_object_and_no_pending_upload(seaweed, s3_prefix):
    storage = Storage(seaweed.url(s3_prefix), options(seaweed))
    key = f"{s3_prefix}/step-000000001/__0_0.distcp"
    chunk = memoryview(os.urandom(MiB))
    with pytest.raises(RuntimeError, match="serialisation failed"):
        with storage.open_upload("step-000000001/__0_0.distcp") as upload:
            for _ in range(4 * PART_BYTES // MiB):
                upload.write(chunk)
            wait_for(lambda: parts_stored(seaweed, key) >= 2, 30, "two parts stored on the server")
            raise RuntimeError("serialisation failed")
    assert not storage.exists("step-000000001/__0_0.distcp")
    assert storage.listdir("step-000000001") == []
    assert pending(seaweed, s3_prefix) == []


def test_a_multipart_upload_logs_no_credentials(seaweed, s3_prefix, caplog):
    storage = Storage(seaweed.url(s3_prefix), options(seaweed))
    with caplog.at_level(logging.DEBUG):
        with storage.open_upload("step-000000001/__0_0.distcp") as upload:
            upload.write(memoryview(os.urandom(2 * PART_BYTES + 1)))
    assert upload.parts_uploaded == 3
    assert seaweed.secret_access_key not in caplog.text
    ours = [r.getMessage() for r in caplog.records if r.name.startswith("checkpoint")]
    assert not [m for m in ours if seaweed.access_key_id in m]


class PartRefusingProxy(S3FaultProxy):
    """Answers 403 AccessDenied to uploads of one part number (a fault no retry can fix)."""

    def __init__(self, upstream_url: str, part_number: int) -> None:
        super().__init__(upstream_url)
        self.part_query = f"partNumber={part_number}"
        self.refused = 0

    def _serve(self, h: BaseHTTPRequestHandler) -> None:
        if h.command == "PUT" and self.part_query in h.path.split("?", 1)[-1].split("&"):
            h.rfile.read(int(h.headers.get("Content-Length") or 0))
            self.refused += 1
            send_s3_error(h, 403, "AccessDenied")
            return
        super()._serve(h)


def test_a_part_refused_for_good_fails_the_save_and_leaves_nothing(seaweed, s3_prefix):
    url = seaweed.url(f"{s3_prefix}/step-000000001")
    with PartRefusingProxy(seaweed.endpoint_url, part_number=3) as proxy:
        with pytest.raises(BaseException, match="AccessDenied") as failed:  # DCP's CheckpointException
            save(url, options(seaweed, endpoint_url=proxy.endpoint_url, max_attempts=3), big_state())
        assert proxy.refused == 1  # fatal: not retried
    assert not isinstance(failed.value, AssertionError)
    storage = Storage(url, seaweed.storage_options())
    assert storage.listdir() == []
    assert pending(seaweed, s3_prefix) == []


# -- transient errors -------------------------------------------------------------------------
class FirstTriesFailingProxy(S3FaultProxy):
    """Answers 500 InternalError to the first ``failures`` uploads of every part number."""

    def __init__(self, upstream_url: str, failures: int) -> None:
        super().__init__(upstream_url)
        self.failures = failures
        self.part_puts: dict[str, int] = {}

    def _serve(self, h: BaseHTTPRequestHandler) -> None:
        query = h.path.split("?", 1)[-1].split("&")
        number = next((q for q in query if q.startswith("partNumber=")), None)
        if h.command == "PUT" and number is not None:
            with self._lock:
                self.part_puts[number] = seen = self.part_puts.get(number, 0) + 1
            if seen <= self.failures:
                h.rfile.read(int(h.headers.get("Content-Length") or 0))
                send_s3_error(h, 500, "InternalError")
                return
        super()._serve(h)


#: Attempts botocore makes itself before an error reaches ``Storage.retry``: s3.py configures
#: ``retries={"total_max_attempts": 1}`` (one attempt; the retries are ours).
BOTOCORE_ATTEMPTS = 1


def test_each_part_is_retried_on_its_own(seaweed, s3_prefix, caplog):
    """Every part fails its first attempt (botocore's only one): each part is retried by itself,
    by us (never the whole file), and the save commits the digested bytes."""
    url = seaweed.url(f"{s3_prefix}/step-000000001")
    with FirstTriesFailingProxy(seaweed.endpoint_url, failures=BOTOCORE_ATTEMPTS) as proxy:
        with caplog.at_level(logging.WARNING, logger="ftrain.checkpoint.storage"):
            files = save(url, options(seaweed, endpoint_url=proxy.endpoint_url), big_state())
    assert len(proxy.part_puts) >= 7
    assert set(proxy.part_puts.values()) == {BOTOCORE_ATTEMPTS + 1}  # each part: one retry of ours, no more
    retried = [r.getMessage() for r in caplog.records if "retrying" in r.getMessage()]
    assert len([m for m in retried if "__0_0.distcp part" in m]) == len(proxy.part_puts)
    assert_stored_as_digested(Storage(url, seaweed.storage_options()), files)
    assert pending(seaweed, s3_prefix) == []
    # .metadata: one PUT, and DCP's .metadata.tmp never reached the server
    requests = [(method, path) for _, method, path in proxy.requests_seen]
    assert not [path for _, path in requests if ".metadata.tmp" in path]
    puts = [path.split("?")[0] for method, path in requests if method == "PUT" and ".metadata" in path]
    assert puts == [f"/{seaweed.bucket}/{key_of(url)}/.metadata"]


def key_of(url: str) -> str:
    return url.split("://", 1)[1].partition("/")[2]


def test_a_save_through_random_server_errors_commits_with_correct_digests(seaweed, s3_prefix):
    url = seaweed.url(f"{s3_prefix}/step-000000001")
    with S3FaultProxy(seaweed.endpoint_url, seed=7) as proxy:
        proxy.set_faults(FaultRates(error=0.3))
        files = save(url, options(seaweed, endpoint_url=proxy.endpoint_url, max_attempts=12), big_state())
        proxy.set_faults(None)
        assert proxy.injected["error"] > 0
    assert sorted(files) == [METADATA_NAME, "__0_0.distcp", "__0_0.distcp.blocks"]  # its block digests beside it
    assert_stored_as_digested(Storage(url, seaweed.storage_options()), files)
    assert pending(seaweed, s3_prefix) == []


# -- a process killed mid-upload ----------------------------------------------------------------
CHILD = """
import os, sys
from ftrain.checkpoint.storage import Storage, StorageOptions

storage = Storage(sys.argv[1], StorageOptions(upload_part_size_bytes=5 << 20))  # AWS_* from the env
if sys.argv[2] == "sibling":
    storage.write_bytes("step-000000007/__1_0.distcp", b"another rank's finished file")
chunk = memoryview(os.urandom(1 << 20))
with storage.open_upload("step-000000007/__0_0.distcp") as upload:
    while True:  # a file larger than any test waits for: killed while its parts go up
        upload.write(chunk)
"""


def _killed_mid_upload(seaweed: SeaweedS3, s3_prefix: str, sibling: str) -> Storage:
    """A child process SIGKILLed while the parts of ``step-000000007/__0_0.distcp`` go up
    (beside another rank's finished file, or ``alone`` in its directory)."""
    key = f"{s3_prefix}/step-000000007/__0_0.distcp"
    storage = Storage(seaweed.url(s3_prefix), seaweed.storage_options())
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, seaweed.url(s3_prefix), sibling],
        env=quiet_env(**seaweed.env()),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    output = ""
    try:
        wait_for(
            lambda: parts_stored(seaweed, key) >= 2,
            60,
            "the child to store two parts",
            alive=lambda: proc.poll() is None,
        )
    finally:
        kill_tree(proc)
        if proc.stdout is not None:
            output = proc.stdout.read().decode(errors="replace")
            proc.stdout.close()
    assert proc.returncode == -9, output[-3000:]
    assert not storage.exists("step-000000007/__0_0.distcp")
    if sibling == "sibling":
        assert storage.listdir("step-000000007") == ["__1_0.distcp"]
    else:
        assert storage.listdir("") == []  # the step directory itself is invisible
    assert [k for k, _ in pending(seaweed, s3_prefix)] == [key]  # invisible, but there
    return storage


@pytest.mark.parametrize("sibling", ["sibling", "alone"])
def test_a_process_killed_mid_upload_leaves_no_object_and_gc_clears_its_upload(seaweed, s3_prefix, sibling):
    """Also when the step directory holds nothing else (no listing shows it then)."""
    storage = _killed_mid_upload(seaweed, s3_prefix, sibling)
    gc = subprocess.run(
        [sys.executable, "-m", "ftrain", "ckpt", "gc", seaweed.url(s3_prefix), "--grace-s", "0"],
        env=quiet_env(**seaweed.env()),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert gc.returncode == 0, gc.stdout + gc.stderr
    assert "step-000000007" in gc.stdout
    assert pending(seaweed, s3_prefix) == []
    assert "step-000000007" not in storage.listdir()


def test_saving_a_step_again_first_clears_the_uploads_a_killed_save_left(seaweed, s3_prefix):
    _killed_mid_upload(seaweed, s3_prefix, "alone")
    fields = {"job": "j", "round": 0}
    StepPublisher(seaweed.url(s3_prefix), seaweed.storage_options(), "step-000000007", fields).prepare()
    assert pending(seaweed, s3_prefix) == []


# -- every backend ------------------------------------------------------------------------------
@pytest.fixture(params=sorted(registered_backends()))
def any_storage(request: pytest.FixtureRequest) -> Iterator[Storage]:
    url, opts = ROOTS[request.param](request)
    storage = Storage(url, StorageOptions(**{**_fields(opts), "upload_part_size_bytes": PART_BYTES}))
    try:
        yield storage
    finally:
        storage.remove("", recursive=True)


def _fields(opts: StorageOptions) -> dict[str, Any]:
    return {name: getattr(opts, name) for name in StorageOptions.__dataclass_fields__}


@pytest.mark.parametrize("size_bytes", [0, 1000, PART_BYTES, 2 * PART_BYTES + 1])
def test_open_upload_round_trip_on_every_backend(any_storage, size_bytes):
    data = os.urandom(size_bytes)
    with any_storage.open_upload("step-1/file") as upload:
        for i in range(0, size_bytes, MiB):
            upload.write(memoryview(data)[i : i + MiB])
        assert not any_storage.exists("step-1/file")
    assert any_storage.read_bytes("step-1/file") == data
    assert any_storage.listdir("step-1") == ["file"]


def test_open_upload_failing_leaves_no_object_on_every_backend(any_storage):
    any_storage.write_bytes("step-1/other", b"kept")
    with pytest.raises(RuntimeError):
        with any_storage.open_upload("step-1/file") as upload:
            upload.write(memoryview(os.urandom(2 * PART_BYTES + 1)))
            raise RuntimeError("boom")
    assert any_storage.listdir("step-1") == ["other"]
