"""Retention: the pure plan (property-tested), applying it, file ages, and ``ftrain ckpt gc``."""

from __future__ import annotations

import datetime as dt
import os
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ftrain.checkpoint.catalog import StepInfo, list_steps
from ftrain.checkpoint.manifest import MANIFEST_NAME, step_dir_name
from ftrain.checkpoint.retention import (
    GcGuard,
    GcPlan,
    GcStop,
    Judged,
    Retention,
    _entry_time,
    apply_gc,
    collect_garbage,
    modified_times,
    plan_gc,
)
from ftrain.checkpoint.storage import Storage
from tests.unit.test_verify_catalog import run_cli, write_step

NOW = 1_000_000.0
GRACE = 100.0


def info(step: int, state: str = "committed") -> StepInfo:
    return StepInfo(step, step_dir_name(step), state, None, None if state != "corrupt" else "bad")


def plan(steps, *, keep_last=3, keep_every=0, in_flight=(), ages=None, grace_s=GRACE) -> GcPlan:
    ages = ages or {}
    return plan_gc(
        steps,
        keep_last=keep_last,
        keep_every=keep_every,
        in_flight=set(in_flight),
        now_s=NOW,
        modified_s={step_dir_name(s): NOW - a for s, a in ages.items()},
        grace_s=grace_s,
    )


def deleted(p: GcPlan) -> list[int]:
    return [int(d.split("-")[1]) for d in p.delete]


# -- examples --------------------------------------------------------------------------------
def test_keep_last_and_keep_every():
    steps = [info(s) for s in range(100, 1100, 100)]
    assert deleted(plan(steps, keep_last=3)) == [100, 200, 300, 400, 500, 600, 700]
    assert deleted(plan(steps, keep_last=2, keep_every=500)) == [100, 200, 300, 400, 600, 700, 800]
    p = plan(steps, keep_last=0)
    assert deleted(p) == list(range(100, 1000, 100)) and p.keep == [step_dir_name(1000)]
    assert p.reasons[step_dir_name(1000)] == "newest committed"


def test_in_flight_is_never_deleted():
    steps = [info(100), info(200), info(300, "uncommitted")]
    assert deleted(plan(steps, keep_last=0, in_flight={100, 300}, ages={300: 10 * GRACE})) == []


def test_uncommitted_deleted_only_after_grace():
    steps = [info(100), info(200, "uncommitted"), info(300, "uncommitted"), info(400, "uncommitted")]
    p = plan(steps, ages={200: GRACE + 1, 300: GRACE - 1})
    assert deleted(p) == [200]
    assert "age unknown" in p.reasons[step_dir_name(400)]


def test_corrupt_kept_as_evidence_until_older_than_newest_committed_and_grace():
    steps = [info(100, "corrupt"), info(200, "corrupt"), info(300), info(400, "corrupt")]
    p = plan(steps, ages={100: GRACE + 1, 200: GRACE - 1, 400: 10 * GRACE})
    assert deleted(p) == [100]
    assert "no newer committed" in p.reasons[step_dir_name(400)]
    assert deleted(plan([info(100, "corrupt")], ages={100: 10 * GRACE})) == []


def test_every_directory_has_a_reason():
    steps = [info(1), info(2, "uncommitted"), info(3, "corrupt"), info(4)]
    p = plan(steps, keep_last=1, ages={2: 0, 3: 0})
    assert sorted(p.delete + p.keep) == sorted(s.dirname for s in steps) and set(p.reasons) == set(p.delete + p.keep)


@pytest.mark.parametrize("kwargs", [dict(keep_last=-1), dict(keep_every=-1), dict(grace_s=-1.0)])
def test_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        plan([info(1)], **kwargs)


# -- property --------------------------------------------------------------------------------
steps_strategy = st.dictionaries(
    st.integers(0, 60), st.sampled_from(["committed", "uncommitted", "corrupt"]), max_size=25
)


@settings(max_examples=200, deadline=None)
@given(
    states=steps_strategy,
    keep_last=st.integers(0, 5),
    keep_every=st.integers(0, 12),
    in_flight=st.sets(st.integers(0, 60), max_size=4),
    ages=st.dictionaries(st.integers(0, 60), st.floats(0, 3 * GRACE)),
)
def test_plan_gc_properties(states, keep_last, keep_every, in_flight, ages):
    steps = [info(s, state) for s, state in states.items()]
    p = plan(steps, keep_last=keep_last, keep_every=keep_every, in_flight=in_flight, ages=ages)
    gone = set(deleted(p))
    committed = sorted((s for s, state in states.items() if state == "committed"), reverse=True)

    assert sorted(p.delete + p.keep) == sorted(s.dirname for s in steps)
    assert not set(p.delete) & set(p.keep)
    assert not gone & in_flight
    if committed:
        assert committed[0] not in gone
    assert not gone & set(committed[:keep_last])
    if keep_every:
        assert not {s for s in committed if s % keep_every == 0} & gone
    for s, state in states.items():
        age = ages.get(s)
        if (
            state == "committed"
            and s not in in_flight
            and s not in committed[: max(keep_last, 1)]
            and not (keep_every and s % keep_every == 0)
        ):
            assert s in gone  # older committed steps outside every keep rule do go
        if state == "uncommitted":
            assert (s in gone) == (s not in in_flight and age is not None and age > GRACE)
        if state == "corrupt":
            assert (s in gone) == (
                s not in in_flight and bool(committed) and s < committed[0] and age is not None and age > GRACE
            )
    assert p.delete == sorted(p.delete) and p.keep == sorted(p.keep)  # ascending by step (fixed width)


# -- applying it -----------------------------------------------------------------------------
@pytest.fixture
def storage(tmp_path) -> Storage:
    return Storage(f"file://{tmp_path}/ckpt")


def test_apply_gc_deletes_only_planned_dirs(storage):
    for s in (1, 2, 3):
        write_step(storage, s)
    write_step(storage, 4, commit=False)
    apply_gc(storage, GcPlan(delete=[step_dir_name(1), step_dir_name(4)], keep=[step_dir_name(2), step_dir_name(3)]))
    assert storage.listdir("") == [step_dir_name(2), step_dir_name(3)]
    assert MANIFEST_NAME in storage.listdir(step_dir_name(2))
    apply_gc(storage, GcPlan(delete=[step_dir_name(1)]))  # already gone: no error


def test_apply_gc_stops_between_directories(storage):
    for s in (1, 2, 3, 4):
        write_step(storage, s)
    stop = GcStop()
    real_remove = storage.remove

    def remove_then_stop(path: str, recursive: bool = False) -> None:
        real_remove(path, recursive=recursive)
        if recursive:
            stop.stop()  # a save wants the storage: it asked the GC to stop

    storage.remove = remove_then_stop  # type: ignore[method-assign]
    done = apply_gc(storage, GcPlan(delete=[step_dir_name(1), step_dir_name(2), step_dir_name(3)]), stop=stop)
    assert done == [step_dir_name(1)]
    assert storage.listdir("") == [step_dir_name(s) for s in (2, 3, 4)]
    assert MANIFEST_NAME in storage.listdir(step_dir_name(2))  # not touched at all


def test_a_save_waits_for_the_gc_only_while_it_deletes_the_directory_the_save_writes(storage):
    """A save asks a running GC to stop without waiting, unless the GC is deleting the very
    directory the save is about to write (a torn step saved again)."""
    for s in (1, 2):
        write_step(storage, s)
    stop, deleting, release = GcStop(), threading.Event(), threading.Event()
    real_remove = storage.remove

    def remove_slowly(path: str, recursive: bool = False) -> None:
        deleting.set()
        assert release.wait(30)
        real_remove(path, recursive=recursive)

    storage.remove = remove_slowly  # type: ignore[method-assign]
    gc = threading.Thread(target=apply_gc, args=(storage, GcPlan(delete=[step_dir_name(1), step_dir_name(2)])),
                          kwargs={"stop": stop})  # fmt: skip
    gc.start()
    try:
        assert deleting.wait(30)
        stop.stop(writing=step_dir_name(7))  # another directory: returns at once
        assert stop.requested.is_set() and gc.is_alive()
        saver = threading.Thread(target=stop.stop, kwargs={"writing": step_dir_name(1)})
        saver.start()
        saver.join(0.2)
        assert saver.is_alive(), "the save did not wait for the deletion of its own directory"
        release.set()
        saver.join(30)
        assert not saver.is_alive()
    finally:
        release.set()
        gc.join(30)
    assert storage.listdir("") == [step_dir_name(2)]  # stopped before the next directory


def test_a_guarded_gc_leaves_alone_a_directory_that_changed_since_it_was_planned(storage):
    """Planned while torn, committed since (a newer save of the step), or re-saved with another
    manifest: judged again immediately before the deletion, left alone. Unchanged ones go."""
    for s in (1, 2, 3):
        write_step(storage, s)
    write_step(storage, 4, commit=False)  # torn
    write_step(storage, 5, commit=False)  # torn
    steps = list_steps(storage)
    p = plan(steps, keep_last=1, ages={4: 10 * GRACE, 5: 10 * GRACE})
    assert deleted(p) == [1, 2, 4, 5]
    assert p.judged[step_dir_name(1)] == Judged("committed", steps[0].digest, False) and steps[0].digest
    assert p.judged[step_dir_name(4)] == Judged("uncommitted", "", False)
    seen: list[int] = []
    p.guard = GcGuard(None, None, before_gc=seen.append)
    write_step(storage, 4)  # the step is saved again and committed after the plan
    write_step(storage, 2, created_time=2e9)  # another manifest of the same step
    assert apply_gc(storage, p) == [step_dir_name(1), step_dir_name(5)]
    assert seen == [1, 2, 4, 5]  # the hook runs before each directory's check
    assert [(s.step, s.state) for s in list_steps(storage)] == [(2, "committed"), (3, "committed"), (4, "committed")]


def test_a_guard_needs_the_round_of_a_fenced_writer_and_a_retention_without_one_deletes_nothing(storage):
    from ftrain.agent_link.fence import EtcdRoundFence  # a real fence object; nothing is asked of etcd here

    fence = EtcdRoundFence(["http://127.0.0.1:9"], "/ftrain/jobs/j/round")
    with pytest.raises(ValueError, match="needs the writer's round"):
        GcGuard(None, None, fence)
    for s in (1, 2, 3):
        write_step(storage, s)
    assert collect_garbage(storage, Retention(keep_last=1), in_flight=set(), hmac_key=None, fence=fence) == []
    assert [s.step for s in list_steps(storage)] == [1, 2, 3]


def test_modified_times(storage, tmp_path):
    write_step(storage, 1)
    write_step(storage, 2, commit=False)
    (tmp_path / "ckpt" / "step-000000003").mkdir()
    os.utime(tmp_path / "ckpt" / step_dir_name(1) / ".metadata", (5000.0, 5000.0))
    for name in storage.listdir(step_dir_name(2)):
        os.utime(tmp_path / "ckpt" / step_dir_name(2) / name, (1000.0, 1000.0))
    times = modified_times(storage, [step_dir_name(1), step_dir_name(2), step_dir_name(3), "step-000000009"])
    assert times[step_dir_name(2)] == 1000.0
    assert times[step_dir_name(1)] > 5000.0  # the newest file counts, not the oldest
    assert step_dir_name(3) in times  # an empty local directory has its own mtime
    assert "step-000000009" not in times


def test_modified_times_memory_backend():
    import uuid

    s = Storage(f"memory://ftrain-gc-{uuid.uuid4().hex}")
    try:
        write_step(s, 1)
        t = modified_times(s, [step_dir_name(1)])[step_dir_name(1)]
        assert abs(t - dt.datetime.now(dt.UTC).timestamp()) < 60
    finally:
        s.remove("", recursive=True)


def test_entry_time_formats():
    utc = dt.datetime(2024, 1, 1, tzinfo=dt.UTC)
    assert _entry_time({"LastModified": utc}) == utc.timestamp()  # S3
    assert _entry_time({"LastModified": utc.replace(tzinfo=None)}) == utc.timestamp()
    assert _entry_time({"mtime": 12.5, "created": 1.0}) == 12.5  # local
    assert _entry_time({"created": utc}) == utc.timestamp()  # memory
    assert _entry_time({"last_modified": "2024-01-01T00:00:00Z"}) == utc.timestamp()
    assert _entry_time({"size": 3}) is None


# -- CLI -------------------------------------------------------------------------------------
def test_cli_gc_dry_run_deletes_nothing_then_gc_deletes(storage, capsys, tmp_path):
    for s in range(1, 7):
        write_step(storage, s)
    write_step(storage, 7, commit=False)
    old = 1_000.0  # epoch + 1000 s: far older than any grace
    for name in storage.listdir(step_dir_name(7)):
        os.utime(tmp_path / "ckpt" / step_dir_name(7) / name, (old, old))
    before = {d: storage.listdir(d) for d in storage.listdir("")}

    assert run_cli(["ckpt", "gc", storage.url, "--dry-run", "--keep-last", "2", "--keep-every", "3"]) == 0
    out = capsys.readouterr().out
    assert {d: storage.listdir(d) for d in storage.listdir("")} == before
    assert "would delete  step-000000001" in out and "would delete  step-000000007" in out
    assert "keep          step-000000003" in out and "4 to delete, 3 kept" in out

    assert run_cli(["ckpt", "gc", storage.url, "--keep-last", "2", "--keep-every", "3"]) == 0
    assert "4 deleted" in capsys.readouterr().out
    assert [(s.step, s.state) for s in list_steps(storage)] == [(3, "committed"), (5, "committed"), (6, "committed")]


def test_cli_gc_keeps_fresh_uncommitted(storage, capsys):
    write_step(storage, 1)
    write_step(storage, 2, commit=False)  # just written: within the default grace of an hour
    assert run_cli(["ckpt", "gc", storage.url, "--keep-last", "0"]) == 0
    assert [s.step for s in list_steps(storage)] == [1, 2]
