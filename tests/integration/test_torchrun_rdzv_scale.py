"""The ``etcd-v3`` rendezvous backend at scale: liveness in per-node leases instead of the shared
state, reads as a revision check. In steady state the ``state`` key is not rewritten and a node
reads O(1) bytes a second whatever the job size; a node that stops renewing its lease is still
dropped by torch's own ``_sanitize`` and the others rendezvous again without it."""

from __future__ import annotations

import datetime
import pickle
import threading
import time
from typing import Any

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

from bench.lib.control_plane_probe import scrape
from ftrain.agents.torchrun_rdzv import EtcdRendezvousBackend, create_handler
from ftrain.agents.torchrun_store import RollingLease

pytestmark = pytest.mark.timeout(120)
UTC = datetime.UTC


def state_of(nodes: dict[_NodeDesc, datetime.datetime], *, round: int = 0) -> bytes:
    state = _RendezvousState()
    state.round = round
    for node, beat in nodes.items():
        state.participants[node] = 0
        state.last_heartbeats[node] = beat
    return pickle.dumps(state)


def handlers(etcd: Any, run_id: str, n: int, *, min_nodes: int | None = None) -> list[Any]:
    params = RendezvousParameters(
        "etcd-v3",
        etcd.endpoint.removeprefix("http://"),
        run_id,
        min_nodes or n,
        n,
        local_addr="127.0.0.1",
        keep_alive_interval=1,
        keep_alive_max_attempt=2,
        last_call_timeout=1,
        join_timeout=60,
    )
    return [create_handler(params) for _ in range(n)]


def rendezvous(hs: list[Any]) -> list[Any]:
    infos: list[Any] = [None] * len(hs)

    def join(i: int) -> None:
        infos[i] = hs[i].next_rendezvous()

    threads = [threading.Thread(target=join, args=(i,), daemon=True) for i in range(len(hs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=90)
    assert all(info is not None for info in infos), "a handler did not finish its rendezvous"
    return infos


def test_a_heartbeat_renews_a_lease_and_leaves_the_state_key_alone(client):
    me, other = _NodeDesc("a", 1, 0), _NodeDesc("b", 2, 0)
    backend = EtcdRendezvousBackend(client, "run", lease=RollingLease(client, 60))
    backend.bind(me, liveness_ttl_s=5)
    t0 = datetime.datetime(2026, 1, 1, tzinfo=UTC)
    state, token, ok = backend.set_state(state_of({me: t0, other: t0}))
    assert ok and client.get(backend.alive_prefix + repr(me)) is not None

    # a keep-alive (only this node's heartbeat moved): no write of the state key, same token
    beat = datetime.datetime.now(UTC)
    assert backend.set_state(state_of({me: beat, other: t0}), token)[1:] == (token, True)
    assert client.get(backend.key).mod_revision == token

    # torch sees this node at its last keep-alive; a node without a liveness key at its stored beat
    seen = pickle.loads(backend.get_state()[0])
    assert seen.last_heartbeats == {me: beat, other: t0}

    # other's liveness key appears: it is seen beating now; it never reaches the stored state
    client.put(backend.alive_prefix + repr(other), b"")
    seen = pickle.loads(backend.get_state()[0])
    assert seen.last_heartbeats[other] > beat
    third = _NodeDesc("c", 3, 0)
    new = pickle.loads(backend.get_state()[0])
    new.participants[third] = 0
    new.last_heartbeats[me] = datetime.datetime.now(UTC)
    assert backend.set_state(pickle.dumps(new), token)[2]
    stored = pickle.loads(client.get(backend.key).value)
    assert stored.last_heartbeats[other] == t0 and third in stored.participants


def test_liveness_keys_are_names_never_values(client, tmp_path):
    """An etcd writer can add keys under ``alive/``: their values are never read, so a pickle
    there runs nothing; a name that is no node changes nothing."""
    me = _NodeDesc("a", 1, 0)
    backend = EtcdRendezvousBackend(client, "run")
    backend.bind(me, liveness_ttl_s=5)
    t0 = datetime.datetime(2026, 1, 1, tzinfo=UTC)
    backend.set_state(state_of({me: t0}))
    sentinel = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (open, (str(sentinel), "w"))

    client.put(backend.alive_prefix + "not-a-node", pickle.dumps(Payload()))
    assert pickle.loads(backend.get_state()[0]).participants == {me: 0}
    assert not sentinel.exists()


def test_steady_state_rewrites_no_state_and_reads_a_constant_number_of_bytes(etcd, client, monkeypatch):
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")  # no TCPStore server per handler
    n = 16
    hs = handlers(etcd, "steady", n)
    stop, errors = threading.Event(), []

    def monitor(h: Any) -> None:  # torchrun's agent between rounds (monitor interval 0.1 s)
        while not stop.wait(0.1):
            try:
                h.num_nodes_waiting()
            except Exception as e:  # noqa: BLE001 - asserted below
                errors.append(e)

    try:
        rendezvous(hs)
        threads = [threading.Thread(target=monitor, args=(h,), daemon=True) for h in hs]
        for t in threads:
            t.start()
        key = "/ftrain/torchrun/steady/state"
        time.sleep(1.0)  # a warm-up, then a window whose traffic is measured (not a wait for a condition)
        before, revision = scrape(etcd.endpoint), client.get(key).mod_revision
        time.sleep(4.0)  # four keep-alive intervals, twice the liveness TTL
        after = scrape(etcd.endpoint)
        stop.set()
        for t in threads:
            t.join(timeout=10)
        assert not errors, errors
        stored = client.get(key)
        assert stored.mod_revision == revision  # no heartbeat was swapped into the state
        seen = pickle.loads(hs[0]._state_holder._backend.get_state()[0])  # noqa: SLF001
        assert len(seen.participants) == n and seen.complete
        oldest = min(seen.last_heartbeats.values())
        assert datetime.datetime.now(UTC) - oldest < datetime.timedelta(seconds=2)  # nobody about to be dropped
        sent_per_node_s = (after.tx_bytes - before.tx_bytes) / (after.at - before.at) / n
        # before: every node read the whole state (here about 1.2 KB) once a second
        assert sent_per_node_s < len(stored.value) / 4, (sent_per_node_s, len(stored.value))
    finally:
        stop.set()
        for h in hs:
            h._stop_heartbeats()  # noqa: SLF001


def test_a_node_that_stops_heartbeating_is_dropped_and_the_rest_rendezvous_again(etcd, monkeypatch):
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    hs = handlers(etcd, "loss", 3, min_nodes=2)
    try:
        first = rendezvous(hs)
        assert sorted(i.world_size for i in first) == [3, 3, 3]
        lost, *rest = hs
        lost._stop_heartbeats()  # noqa: SLF001 - its agent died: its lease is no longer renewed
        started = time.monotonic()
        again = rendezvous(rest)  # what torchrun's agents do once their workers fail
        assert sorted((i.rank, i.world_size) for i in again) == [(0, 2), (1, 2)]
        print(f"\n[lost node dropped, world of 2 formed in {time.monotonic() - started:.2f} s]")
    finally:
        for h in hs:
            h._stop_heartbeats()  # noqa: SLF001
