"""The etcd-v3 store's batched calls against a real etcd: after each rendezvous the rank-0 agent
reads every agent's role info (``multi_get``) and writes every agent's assigned ranks
(``multi_set``); at N nodes that is one read and N/64 transactions, not N requests each."""

from __future__ import annotations

import threading
from collections import Counter
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist

from ftrain.agents.etcd import EtcdClient
from ftrain.agents.torchrun_store import PUTS_PER_TXN, EtcdStore, RollingLease

pytestmark = pytest.mark.timeout(60)
NODES = 300


class Counting:
    """An EtcdClient that counts the requests made through it, by method."""

    def __init__(self, client: EtcdClient):
        self._client, self.calls = client, Counter()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._client, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] += 1
            return attr(*args, **kwargs)

        return call


def test_rank_zero_reads_and_writes_every_agents_keys_in_a_few_requests(client):
    counting = Counting(client)
    store = EtcdStore(counting, "/p/run/store/", timeout=timedelta(seconds=10), lease=RollingLease(client, 60))  # type: ignore[arg-type]
    p = dist.PrefixStore("torchelastic", store)  # as torchrun hands it over
    keys = [f"assigned_ranks/{i}" for i in range(NODES)]
    p.multi_set(keys, [f"[{i}]" for i in range(NODES)])
    assert counting.calls["txn"] == -(-NODES // PUTS_PER_TXN)
    counting.calls.clear()
    assert p.multi_get(keys) == [f"[{i}]".encode() for i in range(NODES)]
    assert dict(counting.calls) == {"list_prefix": 1}
    assert all(kv.lease for kv in client.get_prefix("/p/run/store/torchelastic/"))  # expire with the run


def test_multi_get_waits_for_the_last_agent_and_multi_set_takes_the_last_value_of_a_key(client):
    store = EtcdStore(client, "/p/run/store/", timeout=timedelta(seconds=10))
    store.multi_set(["role/0", "role/1", "role/0"], [b"a", b"b", b"a2"])
    late = threading.Timer(0.3, lambda: store.set("role/2", b"c"))
    late.start()
    try:
        assert store.multi_get(["role/0", "role/1", "role/2"]) == [b"a2", b"b", b"c"]
    finally:
        late.cancel()
    assert store.multi_get([]) == []
    with pytest.raises(dist.DistStoreError, match="multi_set of 2 keys and 1 values"):
        store.multi_set(["x", "y"], [b"1"])
