"""The job store contract (:mod:`ftrain.agents.jobstore`), run against a real etcd (:class:`EtcdJobStore`)
and against the in-memory store the agent's unit tests use (tests/memory_jobstore.py), so that
what the unit tests prove on the fake holds on etcd."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ftrain.agents.errors import LeaseExpiredError
from ftrain.agents.etcd import Compare, EtcdClient, Op
from ftrain.agents.jobstore import EtcdJobStore, JobStore
from ftrain.testbed.wait import wait_for
from tests.memory_jobstore import FakeClock, MemoryJobStore

P = "/ftrain/jobs/contract/"


@pytest.fixture(params=["memory", "etcd"])
def store(request) -> Iterator[JobStore]:
    if request.param == "memory":
        yield MemoryJobStore(FakeClock())
        return
    etcd = request.getfixturevalue("etcd")
    s = EtcdJobStore(EtcdClient([etcd.endpoint], timeout_s=1.0, retry_timeout_s=5.0))
    try:
        yield s
    finally:
        s.close()


def test_revisions_count_every_write_and_keys_keep_their_create_revision(store: JobStore) -> None:
    first = store.put(P + "b", "1")
    second = store.put(P + "a", "2")
    third = store.put(P + "b", "3")
    assert first < second < third
    store.put("/elsewhere", "x")
    listing = store.list_prefix(P)
    assert [kv.key for kv in listing.kvs] == [P + "a", P + "b"]  # sorted by key, only the prefix
    b = store.get(P + "b")
    assert b is not None and (b.value, b.create_revision, b.mod_revision, b.version) == (b"3", first, third, 2)
    assert listing.revision >= third and store.get(P + "missing") is None


def test_compare_and_swap(store: JobStore) -> None:
    assert store.put_if_absent(P + "k", "v1") and not store.put_if_absent(P + "k", "v2")
    kv = store.get(P + "k")
    assert kv is not None and kv.value == b"v1"
    assert not store.put_if_mod_revision(P + "k", "v3", kv.mod_revision + 100)
    assert store.put_if_mod_revision(P + "k", "v3", kv.mod_revision)
    assert store.put_if_mod_revision(P + "new", "v", 0)  # 0: only if absent


def test_a_transaction_applies_all_of_its_branch_or_nothing(store: JobStore) -> None:
    store.put(P + "round", "1")
    store.put(P + "rounds/1", "r1")
    store.put(P + "rounds/1/reports/a", "ok")
    round_kv = store.get(P + "round")
    assert round_kv is not None
    guard = [Compare(P + "round", "mod_revision", "==", round_kv.mod_revision)]
    ops = [
        Op.put(P + "round", "2"),
        Op.put(P + "rounds/2", "r2"),
        Op.delete(P + "rounds/1"),
        Op.delete(P + "rounds/1/", prefix=True),
    ]
    result = store.txn(guard, ops)
    assert result.succeeded
    assert [kv.key for kv in store.list_prefix(P).kvs] == [P + "round", P + "rounds/2"]
    both = [store.get(P + "round"), store.get(P + "rounds/2")]
    assert {kv.mod_revision for kv in both if kv} == {result.revision}  # one revision for the whole branch
    assert not store.txn(guard, [Op.put(P + "round", "3")]).succeeded  # the guard is stale now
    assert not store.txn([Compare(P + "absent", "value", "==", b"")], [Op.put(P + "x", "y")]).succeeded


def test_a_lease_takes_its_keys_with_it_and_refuses_writes_once_gone(store: JobStore) -> None:
    lost: list[str] = []
    session = store.session(5, on_lost=lost.append)
    try:
        assert store.put_if_absent(P + "leader", "a", lease=session.lease_id)
        store.put(P + "nodes/a", "a", lease=session.lease_id)
        store.put(P + "plain", "p")
        kv = store.get(P + "leader")
        assert kv is not None and kv.lease == session.lease_id
        assert store.txn([Compare(P + "leader", "lease", "==", session.lease_id)], [Op.put(P + "ok", "1")]).succeeded
        store.revoke(session.lease_id)
        assert [kv.key for kv in store.list_prefix(P).kvs] == [P + "ok", P + "plain"]
        with pytest.raises(LeaseExpiredError):
            store.put(P + "nodes/a", "again", lease=session.lease_id)
        with pytest.raises(LeaseExpiredError):
            store.put_if_absent(P + "leader", "a", lease=session.lease_id)
        assert session.done.wait(10), "the session must notice its lease is gone"
        store.revoke(session.lease_id)  # gone already: no error
    finally:
        session.close(revoke=True)


def test_closing_a_session_revokes_its_lease(store: JobStore) -> None:
    session = store.session(5, on_lost=lambda _reason: None)
    store.put(P + "status/a", "s", lease=session.lease_id)
    session.close(revoke=True)
    assert session.done.is_set() and store.get(P + "status/a") is None


def test_a_range_watch_delivers_every_change_in_its_range_from_its_start_revision(store: JobStore) -> None:
    """What the job view relies on: one listing at a revision, then each change in the range after
    it, in order, once (puts with their lease, deletes, a lease's end as deletes), nothing outside."""
    start, end = P + "b", P + "d"
    store.put(P + "b/old", "before")
    listing = store.list_range(start, end)
    assert [kv.key for kv in listing.kvs] == [P + "b/old"]
    events: list = []
    errors: list = []
    watch = store.watch_range(
        start,
        end,
        start_revision=listing.revision + 1,
        on_event=events.append,
        on_error=errors.append,
        progress_timeout_s=5.0,
    )
    session = store.session(5, on_lost=lambda _reason: None)
    try:
        store.put(P + "a", "outside")
        store.put(P + "b/1", "one", lease=session.lease_id)
        store.put(P + "c", "two")
        store.put(P + "d", "outside (the end is excluded)")
        store.txn([], [Op.delete(P + "b/old"), Op.put(P + "c", "three")])
        session.close(revoke=True)  # its key goes as a delete
        wanted = [
            ("put", P + "b/1", b"one", session.lease_id),
            ("put", P + "c", b"two", 0),
            ("delete", P + "b/old", b"", 0),
            ("put", P + "c", b"three", 0),
            ("delete", P + "b/1", b"", 0),
        ]
        wait_for(lambda: len(events) >= len(wanted), 10, "the watch's events")
        assert [(e.type, e.key, e.value, e.lease) for e in events] == wanted
        revisions = [e.mod_revision for e in events]
        assert revisions == sorted(revisions) and revisions[2] == revisions[3]  # one transaction, one revision
        assert not errors
    finally:
        session.close(revoke=True)
        watch.close()
