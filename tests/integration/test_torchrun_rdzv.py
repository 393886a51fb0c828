"""The ``etcd-v3`` torchrun rendezvous backend against a real etcd and real torchrun processes.

Backend and store semantics (CAS races, lost replies, blocking waits), the handler torchrun
loads from the ``torchrun.handlers`` entry point, two torchrun "nodes" forming one job, and a
node SIGKILLed mid-run while the other re-rendezvous alone (recovery time printed).
"""

from __future__ import annotations

import datetime
import json
import pickle
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import IO, Any

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousParameters, RendezvousStateError, rendezvous_handler_registry
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

from ftrain.agents.errors import EtcdUnavailableError
from ftrain.agents.etcd import EtcdClient
from ftrain.agents.torchrun_rdzv import EtcdRdzvConfig, EtcdRendezvousBackend, parse_endpoints
from ftrain.agents.torchrun_store import EtcdStore, RollingLease
from ftrain.testbed.etcd import EtcdServer
from ftrain.testbed.jobs import worker_env
from ftrain.testbed.procs import REPO, kill_tree
from ftrain.testbed.wait import wait_for
from ftrain.torchrun_plugin import handler

pytestmark = pytest.mark.timeout(90)
WORKER = Path(__file__).with_name("rdzv_worker.py")
#: Fast failure detection: a dead node is dropped after 1 s x 2 heartbeats + 1 s last call.
FAST_CONF = "keep_alive_interval=1,keep_alive_max_attempt=2,last_call_timeout=1,join_timeout=60,read_timeout=30"


class LostReplies:
    """An EtcdClient whose next ``lose`` transactions reach etcd but lose their reply (applied
    first if ``apply``): what a connection reset after the request was sent looks like."""

    def __init__(self, client: EtcdClient, *, lose: int, apply: bool):
        self._client, self.lose, self.apply, self.txns = client, lose, apply, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def txn(self, *args: Any, **kwargs: Any) -> Any:
        self.txns += 1
        if self.lose > 0:
            self.lose -= 1
            if self.apply:
                self._client.txn(*args, **kwargs)
            raise EtcdUnavailableError("reply lost", ambiguous=True)
        return self._client.txn(*args, **kwargs)


# -- backend --------------------------------------------------------------------------------------
def S(tag: str) -> bytes:
    """A real pickled rendezvous state (the backend refuses anything else), told apart by ``tag``."""
    state, node = _RendezvousState(), _NodeDesc(tag, 1, 0)
    state.participants[node] = 0
    state.last_heartbeats[node] = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)  # as torch writes it
    return pickle.dumps(state)


def race(calls: list[Callable[[], Any]]) -> list[Any]:
    """Run the calls on threads released together; their results in order."""
    start, results = threading.Barrier(len(calls)), [None] * len(calls)

    def run(i: int) -> None:
        start.wait()
        results[i] = calls[i]()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return results


def test_backend_cas_exactly_one_racer_wins_and_a_stale_token_gets_the_current_state(etcd):
    with etcd.client() as c1, etcd.client() as c2:
        a, b = EtcdRendezvousBackend(c1, "run"), EtcdRendezvousBackend(c2, "run")
        assert a.name == "etcd-v3" and a.get_state() is None

        # both create (token None): one wins, the other is told what is there
        first = race([lambda: a.set_state(S("from-a")), lambda: b.set_state(S("from-b"))])
        assert sorted(r[2] for r in first) == [False, True]
        winner = next(r for r in first if r[2])
        assert all(r[:2] == winner[:2] for r in first)
        assert a.get_state() == winner[:2] and isinstance(winner[1], int)

        # both update from the same token: one wins, the loser gets the winner's state and token
        token = winner[1]
        second = race([lambda: a.set_state(S("a2"), token), lambda: b.set_state(S("b2"), token)])
        assert sorted(r[2] for r in second) == [False, True]
        won = next(r for r in second if r[2])
        assert won[1] > token and all(r[:2] == won[:2] for r in second)

        # a stale token (or one that is not ours) never writes
        assert a.set_state(S("stale"), token) == (*won[:2], False)
        assert a.set_state(b"foreign", b"not-a-revision") == (*won[:2], False)
        assert a.set_state(S("create"), None) == (*won[:2], False)
        assert b.get_state() == won[:2]


@pytest.mark.parametrize("applied", [True, False], ids=["applied", "not-applied"])
def test_backend_resends_a_cas_whose_reply_was_lost(client, applied):
    lossy = LostReplies(client, lose=2, apply=applied)
    backend = EtcdRendezvousBackend(lossy, "run", sleep=lambda s: None)  # type: ignore[arg-type]
    state, token, ok = backend.set_state(S("mine"))
    assert (state, ok) == (S("mine"), True) and lossy.txns == 3
    assert client.get(backend.key).mod_revision == token
    # the same under a guard on a revision
    lossy.lose = 1
    assert backend.set_state(S("next"), token)[::2] == (S("next"), True)
    assert client.get(backend.key).value == S("next")


def test_backend_keys_carry_a_rolling_lease(client):
    backend = EtcdRendezvousBackend(client, "run", key_prefix="/p", lease=RollingLease(client, 60))
    backend.set_state(S("s"))
    kv = client.get("/p/run/state")
    assert kv is not None and kv.lease != 0 and 0 < client.time_to_live(kv.lease) <= 60
    with pytest.raises(ValueError, match="run id"):
        EtcdRendezvousBackend(client, "a/b")


def test_backend_never_hands_torch_a_value_that_is_not_a_rendezvous_state(client, tmp_path):
    """torch unpickles the state with plain pickle: a value written into etcd by anyone else must
    not run code in the agents. Refused before torch sees it: a pickle calling anything but the
    state's classes, a non-state object, garbage, an oversized value."""
    backend = EtcdRendezvousBackend(client, "run")
    sentinel = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (open, (str(sentinel), "w"))

    for value, why in [
        (pickle.dumps(Payload()), "io.open"),
        (pickle.dumps({"round": 1}), "dict"),
        (b"not a pickle", "does not unpickle"),
        (b"x" * ((1 << 20) + 1), "more than"),
    ]:
        client.put(backend.key, value)
        with pytest.raises(RendezvousStateError, match=why):
            backend.get_state()
        with pytest.raises(RendezvousStateError, match=why):  # the state found by a lost CAS too
            backend.set_state(S("mine"), 1)
    assert not sentinel.exists()
    client.put(backend.key, S("good"))
    assert backend.get_state()[0] == S("good")


# -- store ----------------------------------------------------------------------------------------
def test_store_through_a_prefix_store_like_torchrun_uses_it(client):
    store = EtcdStore(client, "/p/run/store/", timeout=timedelta(seconds=5), lease=RollingLease(client, 60))
    p = dist.PrefixStore("torch.rendezvous.run.1", store)
    p.set("MASTER_ADDR", "127.0.0.1")
    assert p.get("MASTER_ADDR") == b"127.0.0.1"
    assert [p.add("n", 1), p.add("n", 2)] == [1, 3] and p.get("n") == b"3"
    assert p.compare_set("cs", "", "v1") == b"v1"  # absent + empty expected: set
    assert p.compare_set("cs", "other", "v2") == b"v1"  # mismatch: current value
    assert p.compare_set("cs", "v1", "v2") == b"v2"
    assert p.compare_set("absent", "x", "y") == b"x"  # TCPStore's answer for an absent key
    p.multi_set(["r0", "r1"], ["a", "b"])
    assert p.multi_get(["r0", "r1"]) == [b"a", b"b"]
    assert p.check(["r0", "r1"]) and not p.check(["r0", "nope"])
    keys = client.get_prefix("/p/run/")
    assert keys and all(kv.lease for kv in keys)  # expire with the run
    assert not any("adds/" in kv.key or ".adds" in kv.key for kv in keys)  # add markers cleaned up


class WriteAfterRead:
    """An EtcdClient that runs ``hook`` once, right after its first ``list_prefix`` returned:
    another agent's write landing between a store's read and the watch it starts next."""

    def __init__(self, client: EtcdClient, hook: Callable[[], object]):
        self._client, self._hook = client, hook

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def list_prefix(self, prefix: str) -> Any:
        listing = self._client.list_prefix(prefix)
        hook, self._hook = self._hook, None
        if hook is not None:
            hook()
        return listing


def test_store_get_blocks_until_another_agent_sets_the_key_and_times_out_otherwise(etcd, client):
    other = EtcdStore(client, "/p/run/store/")
    spy = WriteAfterRead(client, lambda: other.set("round.3/late", b"L"))
    store = EtcdStore(spy, "/p/run/store/", timeout=timedelta(seconds=20))  # type: ignore[arg-type]
    p = dist.PrefixStore("round.3", store)  # holds the C++ side only: keep ``store`` referenced
    started = time.monotonic()
    assert p.get("late") == b"L"  # read: absent; the write lands; the watch from the read's revision sees it
    assert time.monotonic() - started < 10  # woken by the watch, not by the 20 s timeout
    started = time.monotonic()
    with pytest.raises(dist.DistStoreError, match="timed out waiting for keys"):
        p.wait(["never"], timedelta(seconds=0.5))
    assert 0.5 <= time.monotonic() - started < 3
    p.wait([])  # nothing to wait for


@pytest.mark.parametrize("applied", [True, False], ids=["applied", "not-applied"])
def test_store_add_counts_once_when_a_reply_is_lost(client, applied):
    lossy = LostReplies(client, lose=1, apply=applied)
    store = EtcdStore(lossy, "/p/run/store/")  # type: ignore[arg-type]
    store.set("n", b"5")
    assert store.add("n", 2) == 7
    assert client.get("/p/run/store/n").value == b"7"
    lossy.lose = 1
    assert store.compare_set("n", b"7", b"x") == b"x"


# -- configuration and the entry point ------------------------------------------------------------
def test_endpoint_parsing_and_config_errors_name_the_key():
    assert parse_endpoints("h1:2000,https://h2:3000,h3") == ("http://h1:2000", "https://h2:3000", "http://h3:2379")
    assert parse_endpoints("[::1]:2379", protocol="https") == ("https://[::1]:2379",)
    with pytest.raises(ValueError, match="rdzv-endpoint"):
        parse_endpoints("")
    with pytest.raises(ValueError, match="rdzv-endpoint"):
        parse_endpoints("h:notaport")
    params = RendezvousParameters("etcd-v3", "h:1", "run", 1, 1, request_timeout="soon")
    with pytest.raises(ValueError, match="'request_timeout'"):
        EtcdRdzvConfig.from_params(params)
    params = RendezvousParameters("etcd-v3", "h:1", "run", 1, 1, username="u")
    with pytest.raises(ValueError, match="FTRAIN_ETCD_PASSWORD"):
        EtcdRdzvConfig.from_params(params, environ={})
    config = EtcdRdzvConfig.from_params(params, environ={"FTRAIN_ETCD_PASSWORD": "pw"})
    assert (config.username, config.password, config.state_ttl_s) == ("u", "pw", 7200)


def test_entry_point_handler_runs_a_one_node_rendezvous(etcd, client, monkeypatch):
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")  # no TCPStore server in this process
    from importlib.metadata import entry_points

    (ep,) = [e for e in entry_points(group="torchrun.handlers") if e.name == "etcd-v3"]
    assert ep.load() is handler, "pip install -e . so that torchrun finds the entry point"

    params = RendezvousParameters(
        "etcd-v3",
        etcd.endpoint.removeprefix("http://"),
        "solo",
        1,
        1,
        local_addr="127.0.0.1",
        keep_alive_interval=1,
        last_call_timeout=1,
    )
    rdzv = rendezvous_handler_registry.create_handler(params)
    try:
        assert rdzv.get_backend() == "etcd-v3"
        info = rdzv.next_rendezvous()
        assert (info.rank, info.world_size) == (0, 1)
        assert info.bootstrap_store_info.master_addr == "127.0.0.1"
        assert client.get("/ftrain/torchrun/solo/state") is not None
    finally:
        rdzv.shutdown()
    assert rdzv.is_closed()


# -- real torchrun ----------------------------------------------------------------------------------
def start_node(
    etcd: EtcdServer, run_id: str, out: Path, log: IO[bytes], *, nnodes: str, seconds: float
) -> subprocess.Popen:
    out.mkdir(exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={nnodes}",
        "--nproc-per-node=1",
        "--rdzv-backend=etcd-v3",
        f"--rdzv-endpoint={etcd.endpoint.removeprefix('http://')}",
        f"--rdzv-id={run_id}",
        f"--rdzv-conf={FAST_CONF}",
        "--max-restarts=1",
        "--monitor-interval=0.1",
        "--local-addr=127.0.0.1",
        str(WORKER),
        str(out),
        f"--seconds={seconds}",
    ]
    return subprocess.Popen(
        cmd,
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=REPO,
        start_new_session=True,
        env=worker_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1"),
    )


def records(out: Path, kind: str) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(out.glob(f"{kind}-*.json"))]


def logs(paths: list[Path]) -> str:
    return "\n".join(f"--- {p.name} ---\n{p.read_text(errors='replace')[-4000:]}" for p in paths)


def test_two_torchrun_nodes_rendezvous_on_etcd_and_run_collectives(etcd, tmp_path):
    out, log_paths, procs = tmp_path / "out", [tmp_path / "node0.log", tmp_path / "node1.log"], []
    try:
        for path in log_paths:
            with path.open("wb") as log:
                procs.append(start_node(etcd, "pair", out, log, nnodes="2", seconds=2))
        codes = [p.wait(timeout=60) for p in procs]
        assert codes == [0, 0], logs(log_paths)
    finally:
        for p in procs:
            if p.poll() is None:  # never signal a reaped (maybe reused) pid
                kill_tree(p)
    started, done = records(out, "started"), records(out, "done")
    assert sorted((r["rank"], r["world_size"]) for r in started) == [(0, 2), (1, 2)]
    assert sorted(r["group_rank"] for r in done) == [0, 1]
    assert len({r["steps"] for r in done}) == 1  # every rank stopped after the same collective


def test_a_node_sigkilled_mid_run_leaves_the_other_to_finish_alone(etcd, tmp_path):
    out, log_paths, procs = tmp_path / "out", [tmp_path / "survivor.log", tmp_path / "victim.log"], []
    try:
        for path in log_paths:
            with path.open("wb") as log:
                procs.append(start_node(etcd, "elastic", out, log, nnodes="1:2", seconds=120))
        survivor, victim = procs
        # the first round may hold the survivor alone (last call is 1 s); wait for the pair
        wait_for(
            lambda: sorted(r["rank"] for r in records(out, "started") if r["world_size"] == 2) == [0, 1],
            60,
            "both workers in a world of 2",
            alive=lambda: all(p.poll() is None for p in procs),
            context=lambda: logs(log_paths),
        )
        killed_at = time.time()
        kill_tree(victim)
        print(f"\n[killed node {victim.pid} and its worker at {killed_at:.3f}]")

        alone = wait_for(
            lambda: [r for r in records(out, "started") if r["world_size"] == 1 and r["time"] > killed_at],
            60,
            "a restarted worker in a world of 1",
            alive=lambda: survivor.poll() is None,
            context=lambda: logs(log_paths),
        )
        recovery_s = alone[0]["time"] - killed_at
        print(f"[node loss -> first collective of the restarted worker: {recovery_s:.2f} s]")
        (out / "stop").touch()
        assert survivor.wait(timeout=30) == 0, logs(log_paths)
    finally:
        for p in procs:
            if p.poll() is None:  # never signal a reaped (maybe reused) pid
                kill_tree(p)
    (last,) = [r for r in records(out, "done") if r["pid"] == alone[0]["pid"]]
    assert (last["world_size"], last["rank"], last["restart_count"]) == (1, 0, 1)
    # drop (2 x 1 s heartbeats) + last call (1 s) + worker start: well under torch's default 40+ s
    assert recovery_s < 30
