"""What a reader trusts (issue #8): real DCP checkpoints on local disk, loaded by the real
CheckpointManager (and by real ``ftrain train`` runs where the trainer is involved).

- a signed step copied from another job's root is refused (the HMAC binds the job);
- steps exist but none loads: the load fails naming every step and why, unless
  ``on_no_loadable_step=fresh``, which starts over and is not blocked by the old directories;
- hostile manifests (deep nesting, huge numbers, no ``.metadata``, no trainer cursor) make a step
  corrupt, never crash the load;
- a storage error during a load fails the attempt and marks nothing.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import fsspec.implementations.local as fsspec_local
import pytest
import torch

from ftrain.agent_link.fence import EtcdRoundFence
from ftrain.agents.job_keys import JobKeys
from ftrain.checkpoint.catalog import list_steps
from ftrain.checkpoint.errors import CheckpointError, StaleRoundError
from ftrain.checkpoint.loading import NoLoadableStepError
from ftrain.checkpoint.manager import CheckpointManager
from ftrain.checkpoint.manifest import (
    CORRUPT_NAME,
    MANIFEST_NAME,
    Manifest,
    manifest_hmac,
    step_dir_name,
)
from ftrain.checkpoint.storage import Storage, StorageOptions
from ftrain.checkpointing import validate_trainer_state
from ftrain.contract.events import Record, read_events
from ftrain.testbed.jobs import train_job

KEY_ENV = "FTRAIN_TRUST_TEST_KEY"
FAST_RETRIES = StorageOptions(max_attempts=2, retry_timeout_s=5.0)
STEP4, STEP8 = step_dir_name(4), step_dir_name(8)


class Events:
    """The manager's event sink, kept for assertions."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, dict[str, Any]]] = []

    def __call__(self, record: Record) -> None:
        self.seen.append((record.EVENT.value, record.fields()))

    def named(self, name: str) -> list[dict[str, Any]]:
        return [fields for n, fields in self.seen if n == name]


def cursor_state(step: int) -> dict[str, int]:
    return {"epoch": 0, "next_index": 8 * step, "step": step, "num_samples": 1000, "seed": 0, "global_batch_size": 8}


def state(value: float) -> dict[str, Any]:
    return {"model": {"w": torch.full((256,), float(value)), "b": torch.arange(7, dtype=torch.float32) * value}}


def fields(step: int, round_: int = 2) -> dict[str, Any]:
    return {
        "round": round_,
        "world_size": 1,
        "layout": {"strategy": "ddp"},
        "config": {"train": {"steps": 8}},
        "config_hash": "h",
        "trainer": {"cursor": cursor_state(step)},
    }


def manager(root: Path, job: str = "job-a", **kwargs: Any) -> CheckpointManager:
    kwargs.setdefault("on_event", Events())
    return CheckpointManager(url=str(root), job=job, async_mode="off", options=FAST_RETRIES, **kwargs)


def save(mgr: CheckpointManager, *steps: int) -> None:
    for step in steps:
        assert mgr.save(step, state(step), fields(step), sync=True), mgr.status.last_error


def load(mgr: CheckpointManager, **kwargs: Any) -> tuple[Manifest | None, dict[str, Any]]:
    target = state(-1)
    manifest = mgr.load(lambda m: target, validate=validate_trainer_state, **kwargs)
    return manifest, target


def loaded_step(target: dict[str, Any]) -> float:
    return float(target["model"]["w"][0])


def rewrite_manifest(root: Path, dirname: str, edit, *, key: str | None = None) -> None:
    path = root / dirname / MANIFEST_NAME
    obj = json.loads(path.read_text())
    obj.pop("hmac", None)
    edit(obj)
    if key is not None:
        obj["hmac"] = manifest_hmac(key.encode(), obj)
    path.write_text(json.dumps(obj))


@pytest.fixture
def signed(monkeypatch):
    monkeypatch.setenv(KEY_ENV, "key-one")
    return {"hmac_key_env": KEY_ENV}


# -- the HMAC binds the job ------------------------------------------------------------------
def test_a_signed_step_copied_from_another_job_is_refused(tmp_path, signed):
    root_a, root_b = tmp_path / "job-a", tmp_path / "job-b"
    save(manager(root_a, **signed), 4)
    save(manager(root_b, "job-b", **signed), 8)
    shutil.copytree(root_b / STEP8, root_a / STEP8)  # same key, so the HMAC alone would pass

    events = Events()
    manifest, target = load(manager(root_a, on_event=events, **signed))
    assert manifest.step == 4 and loaded_step(target) == 4.0
    (info,) = [s for s in list_steps(Storage(str(root_a)), b"key-one", job="job-a") if s.step == 8]
    assert info.state == "corrupt" and "'job-b'" in info.error and "'job-a'" in info.error
    (ev,) = events.named("ckpt_loaded")
    assert ev["ckpt_round"] == manifest.round == 2 and ev["created_time"] == manifest.created_time
    assert any("job-b" in r for r in ev["refused_newer"])


def test_editing_the_job_field_breaks_the_signature(tmp_path, signed):
    root = tmp_path / "job-a"
    save(manager(root, "job-b", **signed), 8)
    path = root / STEP8 / MANIFEST_NAME
    path.write_text(path.read_text().replace('"job":"job-b"', '"job":"job-a"'))
    with pytest.raises(NoLoadableStepError, match="HMAC mismatch"):
        load(manager(root, **signed))


def test_retention_does_not_count_another_jobs_step_as_this_jobs_newest(tmp_path, signed):
    root_a, root_b = tmp_path / "a", tmp_path / "b"
    save(manager(root_a, keep_last=3, **signed), 1, 2, 3)
    save(manager(root_b, "job-b", **signed), 100)
    shutil.copytree(root_b / step_dir_name(100), root_a / step_dir_name(100))
    assert manager(root_a, keep_last=3, **signed).collect_garbage() == []
    assert {s.step for s in list_steps(Storage(str(root_a)), b"key-one", job="job-a") if s.state == "committed"} == {
        1,
        2,
        3,
    }


def test_retention_runs_after_each_commit_beside_training_and_a_save_stops_it(tmp_path, monkeypatch):
    """A commit's retention runs in the background: the save returns first; the next save stops
    it between two directories without waiting for it (a retention stuck on a storage that hangs
    must not stall training), and wait() lets it finish."""
    import ftrain.checkpoint.retention as retention_module

    real_apply_gc, entered, hung, returned = retention_module.apply_gc, *(threading.Event() for _ in range(3))

    def stalled_apply_gc(storage, plan, clear_multipart=True, stop=None):
        entered.set()
        assert stop is not None and stop.requested.wait(60), "the next save did not stop the retention"
        hung.wait(60)  # a storage call that does not return until the test lets it
        try:
            return real_apply_gc(storage, plan, clear_multipart, stop=stop)
        finally:
            returned.set()

    root = tmp_path / "ck"
    mgr = manager(root, keep_last=1)
    monkeypatch.setattr(retention_module, "apply_gc", stalled_apply_gc)
    save(mgr, 1, 2)  # the commit of step 2 starts a retention that would delete step 1
    assert entered.wait(30), "no retention ran after the commit"
    save(mgr, 3)  # asks it to stop and goes on while it hangs
    assert not returned.is_set(), "the save waited for a retention stuck on storage"
    hung.set()
    assert returned.wait(30)
    assert {s.step for s in list_steps(Storage(str(root)))} == {1, 2, 3}  # stopped before any deletion
    monkeypatch.setattr(retention_module, "apply_gc", real_apply_gc)
    save(mgr, 4)
    mgr.wait()
    assert {s.step for s in list_steps(Storage(str(root)))} == {4}


def test_a_signing_manager_needs_a_job_id(tmp_path, signed):
    with pytest.raises(CheckpointError, match="bound to a job id"):
        manager(tmp_path, job="", **signed)


# -- nothing loadable: fail loudly, or start fresh without being blocked ---------------------
def test_a_rotated_key_fails_the_load_naming_every_step(tmp_path, signed, monkeypatch):
    root = tmp_path / "ck"
    save(manager(root, **signed), 4, 8)
    monkeypatch.setenv(KEY_ENV, "key-two")
    with pytest.raises(NoLoadableStepError) as err:
        load(manager(root, **signed))
    text = str(err.value)
    assert "step 8: manifest HMAC mismatch" in text and "step 4: manifest HMAC mismatch" in text
    assert "checkpoint.on_no_loadable_step=fresh" in text and "hmac_key_env" in text
    assert [r.step for r in err.value.refusals] == [8, 4]
    assert not list(root.glob(f"*/{CORRUPT_NAME}"))  # a wrong key is not evidence of corruption


def test_fresh_start_emits_an_event_and_is_not_blocked_by_old_steps(tmp_path, signed, monkeypatch):
    root = tmp_path / "ck"
    save(manager(root, **signed), 4, 8)
    monkeypatch.setenv(KEY_ENV, "key-two")
    events = Events()
    mgr = manager(root, on_no_loadable_step="fresh", on_event=events, **signed)
    manifest, _ = load(mgr)
    assert manifest is None
    (fresh,) = events.named("ckpt_fresh_start")
    assert [r.split(":")[0] for r in fresh["refused"]] == ["step 8", "step 4"]
    save(mgr, 4)  # the old step-4 directory is cleared, not "already committed"
    assert mgr.status.saves_failed == 0 and mgr.status.last_committed_step == 4
    manifest, target = load(manager(root, **signed))
    assert manifest.step == 4 and loaded_step(target) == 4.0


def test_a_fresh_start_never_clears_another_jobs_step(tmp_path):
    """Two jobs pointed at one root by mistake: the new run's save of a step the other job holds
    fails, saying so, and deletes nothing."""
    root = tmp_path / "ck"
    save(manager(root, "job-b"), 4)
    before = sorted(p.name for p in (root / STEP4).iterdir())
    mgr = manager(root, on_no_loadable_step="fresh")
    assert load(mgr)[0] is None  # job-b's step is refused: not this job's
    assert not mgr.save(4, state(4), fields(4), sync=True)
    assert "job 'job-b'" in mgr.status.last_error and "give each job its own" in mgr.status.last_error
    assert sorted(p.name for p in (root / STEP4).iterdir()) == before
    save(mgr, 8)  # other steps are saved as usual
    assert mgr.status.last_committed_step == 8


def test_a_committed_step_is_still_never_overwritten(tmp_path, signed):
    root = tmp_path / "ck"
    mgr = manager(root, **signed)
    save(mgr, 4)
    assert not mgr.save(4, state(99), fields(4), sync=True)
    assert "already committed" in mgr.status.last_error


def test_every_step_corrupt_fails_with_the_digest_problems(tmp_path):
    root = tmp_path / "ck"
    save(manager(root), 4, 8)
    for dirname in (STEP4, STEP8):
        shard = next((root / dirname).glob("*.distcp"))
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0x01
        shard.write_bytes(bytes(data))
    with pytest.raises(NoLoadableStepError) as err:
        load(manager(root))
    assert [r.step for r in err.value.refusals] == [8, 4]
    assert all("digest" in r.reason for r in err.value.refusals)
    assert (root / STEP8 / CORRUPT_NAME).exists() and (root / STEP4 / CORRUPT_NAME).exists()
    with pytest.raises(NoLoadableStepError, match="marked corrupt"):  # the next start says so too
        load(manager(root))


def test_a_pinned_step_that_cannot_load_names_itself(tmp_path):
    root = tmp_path / "ck"
    save(manager(root), 4, 8)
    rewrite_manifest(root, STEP8, lambda o: o["trainer"].pop("cursor"))
    with pytest.raises(NoLoadableStepError, match=r"load_step=8 cannot be loaded(.|\n)*trainer.cursor"):
        load(manager(root, on_no_loadable_step="fresh"), load_step=8)
    with pytest.raises(NoLoadableStepError, match="no directory step-000000009"):
        load(manager(root), load_step=9)


def test_an_empty_root_or_torn_saves_start_fresh_silently(tmp_path):
    events = Events()
    assert load(manager(tmp_path / "none", on_event=events))[0] is None
    (tmp_path / "torn" / STEP4).mkdir(parents=True)
    (tmp_path / "torn" / STEP4 / "__0_0.distcp").write_bytes(b"half")
    assert load(manager(tmp_path / "torn", on_event=events))[0] is None
    assert events.named("ckpt_fresh_start") == []


# -- hostile manifests are corrupt steps, not crashes ----------------------------------------
HOSTILE = {
    "deeply-nested": lambda o: o.update(layout="@DEEP@"),
    "400-digit-number": lambda o: o.update(created_time="@HUGE@"),
    "no-metadata-file": lambda o: o.update(files={}),
    "no-trainer-cursor": lambda o: o["trainer"].pop("cursor"),
    "cursor-of-another-step": lambda o: o["trainer"].update(cursor=cursor_state(4)),
}
RAW = {'"@DEEP@"': "[" * 50_000 + "]" * 50_000, '"@HUGE@"': "9" * 400}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_manifest_falls_back_to_the_previous_step(case, tmp_path, signed):
    root = tmp_path / "ck"
    save(manager(root, **signed), 4, 8)
    rewrite_manifest(root, STEP8, HOSTILE[case], key="key-one")  # even correctly signed
    path = root / STEP8 / MANIFEST_NAME
    text = path.read_text()
    for placeholder, raw in RAW.items():
        text = text.replace(placeholder, raw)
    path.write_text(text)

    events = Events()
    manifest, target = load(manager(root, on_event=events, **signed))
    assert manifest.step == 4 and loaded_step(target) == 4.0
    refused = events.named("ckpt_loaded")[0]["refused_newer"]
    assert refused and refused[0].startswith("step 8:")


def test_the_trainer_refuses_a_manifest_without_a_cursor_and_resumes_the_previous_step(tmp_path):
    """Through a real ``ftrain train`` run: no KeyError in resume, step 8 marked, step 4 resumed."""
    root = tmp_path / "ck"
    train_job(
        tmp_path / "first",
        1,
        "--train.steps=8",
        f"--checkpoint.uri={root}",
        "--checkpoint.interval=4",
        "--checkpoint.async_mode=off",
        save_final=False,
    )
    rewrite_manifest(root, STEP8, lambda o: o["trainer"].pop("cursor"))
    events = tmp_path / "events.jsonl"
    run = train_job(
        tmp_path / "again",
        1,
        "--train.steps=9",
        "--train.on_schedule_change=rescale",  # one step past the saved run's end
        f"--checkpoint.uri={root}",
        "--checkpoint.interval=0",
        "--checkpoint.final_save=false",
        f"--logging.events_path={events}",
        save_final=False,
    )
    assert "resumed from checkpoint step 4" in run.output
    assert run.metrics[0]["step"] == 5
    corrupt = [e for e in read_events(str(events)) if e["event"] == "ckpt_corrupt"]
    assert corrupt and corrupt[0]["step"] == 8 and "trainer.cursor" in corrupt[0]["problems"][0]
    assert (root / STEP8 / CORRUPT_NAME).exists()


# -- a storage error is not corruption -------------------------------------------------------
@contextlib.contextmanager
def failing_open(name: str, from_open: int, error: type[OSError]) -> Iterator[dict[str, int]]:
    """Local opens of files called ``name`` fail with ``error`` from the ``from_open``-th on."""
    real_open = fsspec_local.LocalFileSystem._open
    counts = {"opens": 0}

    def _open(self, path, mode="rb", *args, **kwargs):
        if "r" in mode and str(path).endswith("/" + name):
            counts["opens"] += 1
            if counts["opens"] >= from_open:
                raise error(f"injected storage failure reading {name}")
        return real_open(self, path, mode, *args, **kwargs)

    fsspec_local.LocalFileSystem._open = _open
    try:
        yield counts
    finally:
        fsspec_local.LocalFileSystem._open = real_open


@pytest.mark.parametrize(
    ("name", "from_open", "error"),
    [
        ("__0_0.distcp", 1, ConnectionResetError),  # the fetch before the load (transient, retried)
        ("__0_0.distcp", 1, PermissionError),  # the same, a fatal storage error
        (".metadata", 1, PermissionError),  # the fetch of .metadata, read once and parsed once
    ],
)
def test_a_storage_error_during_load_fails_the_attempt_and_marks_nothing(name, from_open, error, tmp_path):
    root = tmp_path / "ck"
    save(manager(root), 4, 8)
    events = Events()
    with failing_open(name, from_open, error) as counts:
        with pytest.raises(CheckpointError, match="not corruption|not proof of corruption") as err:
            load(manager(root, on_event=events))
    assert counts["opens"] >= from_open  # the fault was hit
    assert not isinstance(err.value, NoLoadableStepError)
    assert not list(root.glob(f"*/{CORRUPT_NAME}")), "a storage error marked a step corrupt"
    assert events.named("ckpt_corrupt") == [] and events.named("ckpt_loaded") == []  # no silent fallback
    manifest, target = load(manager(root))  # storage back: the newest step loads
    assert manifest.step == 8 and loaded_step(target) == 8.0


def test_a_load_reads_every_byte_once(tmp_path):
    """Fetched once, verified, then served to DCP from memory: no second read of a data file."""
    root = tmp_path / "ck"
    save(manager(root), 4, 8)
    for name in ("__0_0.distcp", ".metadata"):
        with failing_open(name, 10**9, OSError) as counts:
            manifest, target = load(manager(root))
        assert manifest.step == 8 and loaded_step(target) == 8.0
        assert counts["opens"] == 1, name


# -- save status ----------------------------------------------------------------------------
class GatedFence:
    """Raises StaleRoundError while ``stale``; the n-th check (1-based) waits for ``gate``."""

    def __init__(self) -> None:
        self.stale = False
        self.checks = 0
        self.block_at = -1
        self.gate = threading.Event()
        self.blocked = threading.Event()

    def check(self, round_: int) -> None:
        self.checks += 1
        if self.stale:
            raise StaleRoundError(f"round {round_} is no longer current")
        if self.checks == self.block_at:
            self.blocked.set()
            assert self.gate.wait(60), "test gate never opened"

    def record(self, round_: int, step: int, manifest_digest: str) -> None:
        return None  # keeps no records: the manifest is the commit point

    def recorded(self) -> dict[int, str] | None:
        return None

    def forget(self, round_: int, expected: Mapping[int, str]) -> list[int]:
        return []


def test_consecutive_failures_count_failed_saves_not_skipped_ones(tmp_path):
    fence = GatedFence()
    mgr = CheckpointManager(
        url=str(tmp_path / "ck"), job="job-a", async_mode="thread", when_busy="skip", fence=fence, options=FAST_RETRIES
    )
    try:
        fence.stale = True
        assert not mgr.save(1, state(1), fields(1), sync=True)
        assert not mgr.save(2, state(2), fields(2), sync=True)
        assert mgr.status.consecutive_failures == 2 and mgr.status.saves_failed == 2
        fence.stale = False
        fence.block_at = fence.checks + 2  # prepare passes, the commit's fence check waits
        assert mgr.save(3, state(3), fields(3))
        assert fence.blocked.wait(60)
        assert not mgr.save(4, state(4), fields(4))  # step 3 still in flight: skipped
        assert mgr.status.saves_skipped == 1 and mgr.status.consecutive_failures == 2
        fence.gate.set()
        status = mgr.wait()
        assert status.last_committed_step == 3 and status.consecutive_failures == 0
    finally:
        fence.gate.set()
        mgr.close()


def test_closing_after_a_broken_round_abandons_a_save_blocked_in_flight(tmp_path):
    """A live worker leaving a broken round does not wait for a save blocked in flight (here:
    its commit's fence check never returns, as a collective with a peer across a partition
    would not): the save counts as failed at once. (With an agent's fence, what it does later
    cannot commit: its round is over; this test's fence keeps no records.)"""
    fence = GatedFence()
    events = Events()
    mgr = CheckpointManager(
        url=str(tmp_path / "ck"), job="job-a", async_mode="thread", fence=fence, options=FAST_RETRIES, on_event=events
    )
    try:
        fence.block_at = 2  # prepare passes, the commit's check blocks
        assert mgr.save(3, state(3), fields(3))
        assert fence.blocked.wait(60)
        blocked = mgr._in_flight
        mgr.close(abandon=True)  # returns although the save is still blocked
        assert mgr.status.saves_failed == 1 and mgr.status.last_committed_step == -1
        assert [e["step"] for e in events.named("ckpt_failed")] == [3]
        assert "abandoned in flight" in events.named("ckpt_failed")[0]["error"]
    finally:
        fence.gate.set()
    assert blocked is not None
    blocked.future.result(timeout=60)  # the abandoned save's thread ends (it would fail at the fence in a job)


# -- the commit point is the etcd record ------------------------------------------------------
def test_a_save_fenced_out_after_its_check_stores_a_manifest_that_nothing_counts_as_committed(tmp_path, etcd, client):
    """The worker is frozen between its fence check and its manifest PUT (``after_fence``) while
    a newer round forms; it then stores its manifest, but the commit record (one etcd
    transaction with the round check) is refused: no reader with the records counts the step,
    a load falls back, the newer round saves the step again over it, and retention drops the
    records of the steps it deletes. Without the records (a reader that knows no etcd) the
    zombie's step would look committed: what the record closes."""
    keys = JobKeys("fencejob")
    client.put(keys.round, "2")
    fence = EtcdRoundFence([etcd.endpoint], keys.round, commits_key=keys.commits)

    def frozen_while_round_3_forms(step: int) -> None:
        if step == 8:
            client.put(keys.round, "3")

    zombie = manager(tmp_path, fence=fence, after_fence=frozen_while_round_3_forms)
    save(zombie, 4)
    zombie.wait()
    assert not zombie.save(8, state(8), fields(8), sync=True)
    assert "round 2 is no longer current" in zombie.status.last_error and zombie.status.last_committed_step == 4
    assert (tmp_path / STEP8 / MANIFEST_NAME).exists(), "the zombie's manifest was not even stored"
    assert [s.step for s in zombie.committed_steps()] == [4]
    blind = [s.step for s in list_steps(Storage(str(tmp_path)), job="job-a") if s.state == "committed"]
    assert blind == [4, 8], blind
    assert set(fence.recorded() or {}) == {4}

    current = manager(tmp_path, fence=fence, keep_last=1)
    manifest, target = load(current)
    assert manifest is not None and manifest.step == 4 and loaded_step(target) == 4.0
    assert current.save(8, state(80), fields(8, round_=3), sync=True), current.status.last_error
    current.wait()  # the retention after the commit (keep_last=1) ran
    assert [(s.step, s.manifest.round) for s in current.committed_steps() if s.manifest] == [(8, 3)]
    assert set(fence.recorded() or {}) == {8}, "retention left the record of the step it deleted"
    manifest, target = load(current)
    assert manifest is not None and manifest.round == 3 and loaded_step(target) == 80.0


# -- real jobs: the worker ends with a clear message, or starts fresh when told -------------
def test_a_real_job_refuses_to_start_over_unloadable_steps_unless_told(tmp_path):
    root = tmp_path / "ck"
    one = {KEY_ENV: "key-one", "FTRAIN_JOB": "job-a"}
    two = {KEY_ENV: "key-two", "FTRAIN_JOB": "job-a"}
    common = (
        f"--checkpoint.uri={root}",
        "--checkpoint.interval=4",
        "--checkpoint.async_mode=off",
        f"--checkpoint.hmac_key_env={KEY_ENV}",
    )
    train_job(tmp_path / "first", 1, "--train.steps=8", *common, save_final=False, env=one)

    refused = train_job(tmp_path / "rotated", 1, "--train.steps=8", *common, save_final=False, env=two, check=False)
    assert refused.returncode != 0
    assert "cannot resume" in refused.output and "on_no_loadable_step=fresh" in refused.output
    assert "step 8: manifest HMAC mismatch" in refused.output and "step 4: manifest HMAC mismatch" in refused.output
    assert refused.metrics == []  # not a single step trained over the old checkpoints

    events = tmp_path / "events.jsonl"
    fresh = train_job(
        tmp_path / "fresh",
        1,
        "--train.steps=8",
        *common,
        "--checkpoint.on_no_loadable_step=fresh",
        f"--logging.events_path={events}",
        save_final=False,
        env=two,
    )
    assert fresh.metrics[0]["step"] == 1 and fresh.metrics[-1]["ckpt_saves_failed"] == 0
    (start,) = [e for e in read_events(str(events)) if e["event"] == "ckpt_fresh_start"]
    assert len(start["refused"]) == 2
    states = {s.step: s.state for s in list_steps(Storage(str(root)), b"key-two", job="job-a")}
    assert states == {4: "committed", 8: "committed"}  # the old directories were replaced


def test_signed_checkpoints_without_a_job_id_are_a_config_error(tmp_path):
    run = train_job(
        tmp_path / "job",
        1,
        f"--checkpoint.uri={tmp_path / 'ck'}",
        f"--checkpoint.hmac_key_env={KEY_ENV}",
        save_final=False,
        env={KEY_ENV: "k"},
        check=False,
    )
    assert run.returncode != 0
    assert "config error: checkpoint.hmac_key_env" in run.output and "agent.job=" in run.output


@pytest.mark.parametrize("raw", ["-1", "1.5", "two", "9" * 30])
def test_a_garbled_round_from_the_environment_is_a_config_error(raw, monkeypatch):
    from ftrain.checkpointing import current_round
    from ftrain.config import ConfigError

    monkeypatch.setenv("FTRAIN_ROUND", raw)
    with pytest.raises(ConfigError, match="FTRAIN_ROUND"):
        current_round()
    monkeypatch.setenv("FTRAIN_ROUND", "12")
    assert current_round() == 12
