"""The agent's job view (:mod:`ftrain.agents.job_view`) on a real etcd: after any sequence of
writes it equals a fresh read of the same keys, through a compacted watch, an etcd restart, lost
leases and a cut network; and it says when it cannot be trusted."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import random
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from ftrain.agents.errors import EtcdUnavailableError
from ftrain.agents.etcd import EtcdClient, Op
from ftrain.agents.job_keys import JobKeys
from ftrain.agents.job_view import JobView
from ftrain.agents.jobstore import EtcdJobStore
from ftrain.agents.records import (
    DumpRequest,
    FinalStatus,
    JobState,
    Member,
    NodeRecord,
    NodeStatus,
    RankStall,
    Report,
    RoundRecord,
)
from ftrain.testbed.etcd import EtcdServer
from ftrain.testbed.wait import wait_for
from tests.tcp_proxy import TcpProxy

KEYS = JobKeys("viewjob")
NODES = ["a", "b", "c", "d"]
#: a key of each range that no record kind claims: written last, it tells when a feed caught up
MEMBER_MARK, LEADER_MARK = KEYS.prefix + "mark", KEYS.prefix + "status0"


@contextlib.contextmanager
def _following(endpoint: str, **options: Any) -> Iterator[JobView]:
    """A view of the job through its own client of ``endpoint``, closed with it afterwards."""
    store = EtcdJobStore(EtcdClient([endpoint], timeout_s=1.0, retry_timeout_s=2.0))
    view = JobView(store, KEYS, **{"wake": lambda: None, "progress_timeout_s": 5.0, **options})
    try:
        yield view
    finally:
        view.close()
        store.close()


def _record(rng: random.Random) -> tuple[str, str]:
    """A random key of the job and a value for it: mostly well formed, sometimes garbage."""
    node, g = rng.choice(NODES), rng.randint(1, 4)
    choices = [
        (KEYS.node(node), NodeRecord(node, f"uid-{node}", "10.0.0.1", 7, 2, 1.0).to_json()),
        (
            KEYS.status(node),
            NodeStatus(round=g, step=rng.randint(0, 99), stalled=[RankStall(0, "waiting", 1.0)]).to_json(),
        ),
        (KEYS.round, str(g)),
        (KEYS.round_record(g), RoundRecord(g, [Member(n, f"uid-{n}") for n in NODES[:2]], 2, "start", 1.0).to_json()),
        (KEYS.master(g), f"10.0.0.1:{rng.randint(1000, 2000)}"),
        (KEYS.hang(g), node),
        (KEYS.stragglers(g), json.dumps([node])),
        (KEYS.started(g, node), f"uid-{node}"),
        (KEYS.report(g, node), Report("failed", "hang", agent_uid=f"uid-{node}").to_json()),
        (KEYS.commits + str(rng.randint(1, 50)), "{}"),
        (KEYS.dump, DumpRequest("ab12", 1.0).to_json()),
        (KEYS.final, FinalStatus("succeeded", "done", g, 1.0).to_json()),
        (KEYS.leader, node),
        (KEYS.prefix + "unknown/key", "x"),
    ]
    key, value = rng.choice(choices)
    garbage = ["{", '{"round": "x"}', "[]", "", "999:99999", "bad id!"]
    return key, rng.choice(garbage) if rng.random() < 0.15 else value


def _random_writes(client: EtcdClient, rng: random.Random, count: int, leases: list[int]) -> None:
    for _ in range(count):
        roll = rng.random()
        key, value = _record(rng)
        if roll < 0.55:
            lease = rng.choice(leases) if leases and rng.random() < 0.4 else None
            client.put(key, value, lease)
        elif roll < 0.7:
            client.delete(key)
        elif roll < 0.8:
            other, other_value = _record(rng)
            gone = _record(rng)[0]
            if len({key, other, gone}) == 3:  # etcd refuses a key twice in one transaction
                client.txn([], [Op.put(key, value), Op.put(other, other_value), Op.delete(gone)])
        elif roll < 0.85:
            client.delete_prefix(KEYS.tally(rng.randint(1, 4)))
        elif roll < 0.92:
            leases.append(client.grant(30).id)
        elif leases:
            client.revoke(leases.pop(rng.randrange(len(leases))))  # its keys go, as deletes


def _caught_up(view: JobView, client: EtcdClient) -> JobState:
    """Write a mark in each range the view follows and wait until its snapshot holds both."""
    member, leader = (client.put(key, "mark") for key in (MEMBER_MARK, LEADER_MARK))

    def holds() -> JobState | None:
        try:
            state = view.snapshot()
        except EtcdUnavailableError:  # a watch that is reconnecting
            return None
        seen_member, seen_leader = view.revisions()
        return state if seen_member >= member and (seen_leader >= leader or not view.following_leader_keys) else None

    return wait_for(holds, 15, "the view to catch up with the writes")


def _fresh(client: EtcdClient, view: JobView) -> JobState:
    """A fresh parse of the keys the view follows, now."""
    start, end = KEYS.member_range
    if view.following_leader_keys:
        end = KEYS.leader_range[1]
    return JobState.parse(KEYS, client.list_range(start, end).kvs, 0)


def _same(view_state: JobState, fresh: JobState) -> None:
    assert dataclasses.replace(view_state, revision=0) == fresh


@pytest.fixture
def client(etcd: EtcdServer) -> Iterator[EtcdClient]:
    c = EtcdClient([etcd.endpoint], timeout_s=1.0, retry_timeout_s=5.0)
    try:
        yield c
    finally:
        c.close()


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_after_random_writes_the_view_equals_a_fresh_read_of_its_keys(etcd, client, seed: int) -> None:
    rng = random.Random(seed)
    leases: list[int] = []
    _random_writes(client, rng, 40, leases)  # some state before the first listing
    with _following(etcd.endpoint) as view:
        for batch in range(6):
            view.follow_leader_keys(batch % 3 != 2)  # the leader's keys come and go
            _random_writes(client, rng, 40, leases)
            _same(_caught_up(view, client), _fresh(client, view))
        assert view.lists() <= 1 + 4  # the member range once; the leader's each time it was taken up again


def test_a_compacted_watch_lists_again_and_a_cut_network_is_unreachable_until_it_heals(etcd, client) -> None:
    proxy = TcpProxy(int(etcd.endpoint.rsplit(":", 1)[1]))
    rng = random.Random(7)
    try:
        with _following(proxy.endpoint, progress_timeout_s=1.0, down_after_s=0.5) as view:
            _cut_compacted_and_healed(view, client, proxy, rng)
    finally:
        proxy.close()


def _cut_compacted_and_healed(view: JobView, client: EtcdClient, proxy: TcpProxy, rng: random.Random) -> None:
    """Follow, cut the network, write and compact past the view, heal: it lists again."""
    view.follow_leader_keys(True)
    _random_writes(client, rng, 30, [])
    _same(_caught_up(view, client), _fresh(client, view))
    lists = view.lists()
    proxy.cut()
    _random_writes(client, rng, 60, [])  # missed by the view...
    client.compact(client.current_revision())  # ...and gone from etcd's history
    wait_for(lambda: _raises(view), 10, "the view to say it cannot be trusted while cut off")
    proxy.restore()
    _same(_caught_up(view, client), _fresh(client, view))
    assert view.lists() > lists, "the compacted watch must have listed again"


def test_the_view_follows_through_an_etcd_restart(etcd, client) -> None:
    woken = threading.Event()
    rng = random.Random(11)
    with _following(etcd.endpoint, wake=woken.set, progress_timeout_s=1.0) as view:
        _random_writes(client, rng, 30, [])
        _same(_caught_up(view, client), _fresh(client, view))
        lists = view.lists()
        etcd.restart()
        woken.clear()
        _random_writes(client, rng, 30, [])
        assert woken.wait(10), "a change in the member range wakes the agent"
        _same(_caught_up(view, client), _fresh(client, view))
        assert view.lists() == lists, "a restart with the same data resumes the watch, no listing again"


def test_a_status_change_alone_does_not_wake_the_agent_but_is_in_the_next_snapshot(etcd, client) -> None:
    woken = threading.Event()
    with _following(etcd.endpoint, wake=woken.set) as view:
        view.follow_leader_keys(True)
        _caught_up(view, client)
        woken.clear()
        client.put(KEYS.status("a"), NodeStatus(round=3).to_json())
        wait_for(lambda: "a" in view.snapshot().status, 10, "the status in the view")
        assert not woken.is_set()
        client.put(KEYS.report(3, "a"), Report("failed", "worker_exit").to_json())
        assert woken.wait(10), "a report wakes the leader"


def _raises(view: JobView) -> bool:
    try:
        view.snapshot()
    except EtcdUnavailableError:
        return True
    return False
