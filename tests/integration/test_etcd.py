"""ftrain.agents.etcd against real etcd servers: KV, CAS races, sessions, SIGKILLed holders, restarts,
hung (SIGSTOPped) servers, failover.

Every test gets its own throwaway etcd (ready in ~0.2 s), so killing or pausing one cannot
leak into another. Waits are on conditions with deadlines; the only fixed waits are the
outages themselves (a pause of a given length is what is being tested). Measured latencies
are printed (``pytest -s``).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from ftrain.agents.errors import EtcdError, EtcdUnavailableError, WatchCompactedError
from ftrain.agents.etcd import Compare, EtcdClient, Op
from ftrain.agents.etcd_session import Session
from ftrain.agents.etcd_watch import Watcher, WatchEvent
from ftrain.testbed.etcd import EtcdCluster, EtcdServer, free_ports
from ftrain.testbed.procs import REPO
from ftrain.testbed.wait import wait_for

pytestmark = pytest.mark.timeout(60)


def wait_until(predicate: Callable[[], object], timeout_s: float, what: str, poll_s: float = 0.01) -> float:
    """:func:`ftrain.testbed.wait.wait_for`, timed: the seconds it took."""
    start = time.monotonic()
    wait_for(predicate, timeout_s, what, poll_s=poll_s)
    return time.monotonic() - start


def holds_for(predicate: Callable[[], object], duration_s: float, poll_s: float = 0.05) -> bool:
    """True if ``predicate`` stayed true for the whole ``duration_s`` (checked every ``poll_s``)."""
    end = time.monotonic() + duration_s
    while time.monotonic() < end:
        if not predicate():
            return False
        time.sleep(poll_s)
    return bool(predicate())


def next_events(watcher: Watcher, count: int, timeout_s: float = 10.0) -> list[WatchEvent]:
    events = []
    deadline = time.monotonic() + timeout_s
    while len(events) < count:
        event = watcher.get(max(0.0, deadline - time.monotonic()))
        assert event is not None, f"only {len(events)} of {count} events before the deadline: {events}"
        events.append(event)
    return events


# -- KV and transactions ----------------------------------------------------------------------
def test_put_get_delete_and_prefix(client):
    rev = client.put("jobs/j/nodes/a", b"\x00\xffA")
    client.put("jobs/j/nodes/b", "B")
    client.put("jobs/j/nodesX", "not under the prefix")
    kv = client.get("jobs/j/nodes/a")
    assert kv is not None and kv.value == b"\x00\xffA" and kv.mod_revision == kv.create_revision == rev
    assert client.get("jobs/j/nodes/missing") is None
    listing = client.list_prefix("jobs/j/nodes/")
    assert [kv.key for kv in listing.kvs] == ["jobs/j/nodes/a", "jobs/j/nodes/b"]
    assert listing.revision == client.current_revision() == rev + 2
    assert client.delete("jobs/j/nodes/a") is True and client.delete("jobs/j/nodes/a") is False
    assert client.delete_prefix("jobs/j/") == 2
    assert client.get_prefix("jobs/") == []


def test_put_if_absent_race_has_exactly_one_winner(etcd):
    clients = [EtcdClient([etcd.endpoint], timeout_s=2.0) for _ in range(2)]

    def contend(i: int, round_no: int, barrier: threading.Barrier, wins: dict[int, bool]) -> None:
        barrier.wait(timeout=5)
        wins[i] = clients[i].put_if_absent(f"leader/{round_no}", f"node-{i}")

    try:
        for round_no in range(15):
            barrier = threading.Barrier(2)
            wins: dict[int, bool] = {}
            threads = [threading.Thread(target=contend, args=(i, round_no, barrier, wins)) for i in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=10)
            assert sorted(wins.values()) == [False, True], wins
            winner = next(i for i, won in wins.items() if won)
            assert clients[0].get(f"leader/{round_no}").value == f"node-{winner}".encode()
    finally:
        for c in clients:
            c.close()


def test_compare_and_swap_on_mod_revision(client):
    assert client.put_if_mod_revision("round", "g1", 0) is True  # 0 = only if absent
    first = client.get("round")
    assert client.put_if_mod_revision("round", "g2", first.mod_revision) is True
    assert client.put_if_mod_revision("round", "zombie", first.mod_revision) is False  # stale token
    current = client.get("round")
    assert current.value == b"g2" and current.version == 2
    assert client.delete_if_mod_revision("round", first.mod_revision) is False
    assert client.delete_if_mod_revision("round", current.mod_revision) is True
    assert client.get("round") is None


def test_txn_runs_the_failure_branch_with_reads(client):
    client.put("cfg/a", "1")
    result = client.txn(
        [Compare("cfg/a", "value", "==", b"2")],
        [Op.put("cfg/a", "3")],
        [Op.get("cfg/", prefix=True), Op.put("cfg/b", "x")],
    )
    assert result.succeeded is False
    assert [kv.value for kv in result.responses[0]] == [b"1"] and result.responses[1] is None
    assert client.get("cfg/b").mod_revision == result.revision


# -- leases and sessions ----------------------------------------------------------------------
def test_lease_calls(client):
    lease = client.grant(5)
    assert lease.ttl_s == 5 and client.keepalive_once(lease.id) == 5
    assert 3 <= client.time_to_live(lease.id) <= 5
    client.put("leased", "v", lease=lease.id)
    assert client.get("leased").lease == lease.id
    client.revoke(lease.id)
    assert client.get("leased") is None
    assert client.keepalive_once(lease.id) == 0 and client.time_to_live(lease.id) is None
    client.revoke(lease.id)  # already gone: no error


def test_session_keeps_its_key_alive_past_several_ttls(client):
    with Session(client, ttl_s=1, keepalive_interval_s=0.25) as session:
        client.put("alive", "v", lease=session.lease_id)
        assert holds_for(lambda: client.get("alive") is not None, duration_s=3.2), "key lost within 3 TTLs"
        assert not session.done.is_set() and session.renewals >= 8
    assert session.done.is_set() and session.lost_reason == "closed"
    assert client.get("alive") is None  # close() revoked the lease


HOLDER = """
import sys, threading
from ftrain.agents.etcd import EtcdClient
from ftrain.agents.etcd_session import Session
client = EtcdClient([sys.argv[1]], timeout_s=1.0)
session = Session(client, ttl_s=int(sys.argv[3]), keepalive_interval_s=0.5)
client.put(sys.argv[2], b"alive", lease=session.lease_id)
threading.Event().wait()
"""


def test_sigkilled_session_holder_loses_its_key_within_the_ttl(etcd, client):
    ttl_s = 2
    watcher = Watcher(client, "nodes/", client.current_revision() + 1, progress_timeout_s=2.0)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, etcd.endpoint, "nodes/n1", str(ttl_s)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        put = watcher.get(timeout_s=15)
        assert put is not None and (put.type, put.key, put.value) == ("put", "nodes/n1", b"alive")
        os.kill(holder.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        holder.wait(timeout=10)
        gone = watcher.get(timeout_s=ttl_s + 3)
        latency_s = time.monotonic() - killed_at
        assert gone is not None and (gone.type, gone.key) == ("delete", "nodes/n1")
        print(f"\n[lease-loss detection after SIGKILL: {latency_s:.2f} s (TTL {ttl_s} s)]")
        assert 1.0 <= latency_s <= ttl_s + 1.5
    finally:
        if holder.poll() is None:
            os.kill(holder.pid, signal.SIGKILL)
            holder.wait(timeout=10)
        watcher.close()


def test_session_survives_a_pause_shorter_than_its_ttl_and_is_lost_after_a_longer_one(etcd, client):
    session = Session(client, ttl_s=2, keepalive_interval_s=0.5)
    try:
        client.put("s/k", "v", lease=session.lease_id)
        etcd.pause()
        try:
            assert holds_for(lambda: not session.done.is_set(), duration_s=0.8)
        finally:
            etcd.resume()
        renewed = session.renewals
        wait_until(lambda: session.renewals >= renewed + 2, 5, "two keepalives after the short pause")
        assert not session.done.is_set() and client.get("s/k") is not None

        etcd.pause()
        try:
            lost_after_s = wait_until(session.done.is_set, 2 + 2, "the session to notice a long pause")
        finally:
            etcd.resume()
        print(f"\n[session lost {lost_after_s:.2f} s into an etcd pause (TTL 2 s): {session.lost_reason}]")
        assert 1.0 <= lost_after_s <= 2.5 and "TTL" in (session.lost_reason or "")
        # after the resume, the session's revoke (or the server's own expiry) removes the key
        wait_until(lambda: client.get("s/k") is None, 5, "the lease to be gone after resuming")
    finally:
        session.close()


# -- watches ----------------------------------------------------------------------------------
def test_watcher_survives_a_restart_without_losing_or_repeating_events(etcd, client):
    first = client.put("w/a", "1")
    watcher = Watcher(client, "w/", first, progress_timeout_s=1.0)
    try:
        assert [e.key for e in next_events(watcher, 1)] == ["w/a"]
        etcd.stop()
        wait_until(lambda: not watcher.connected.is_set(), 5, "the watcher to see the stream break")
        restarted_at = time.monotonic()
        ready_s = etcd.restart()
        client.put("w/b", "2")  # most likely before the watcher is back: must still arrive
        wait_until(watcher.connected.is_set, 10, "the watcher to reconnect")
        reconnect_s = watcher.last_connected_at - restarted_at
        client.put("w/c", "3")
        client.delete("w/a")
        events = next_events(watcher, 3)
        print(
            f"\n[watch reconnected {reconnect_s:.2f} s after the etcd restart began (ready after "
            f"{ready_s:.2f} s); {watcher.reconnects} reconnect attempt(s)]"
        )
        assert [(e.type, e.key) for e in events] == [("put", "w/b"), ("put", "w/c"), ("delete", "w/a")]
        assert watcher.get(timeout_s=0.5) is None  # nothing repeated
    finally:
        watcher.close()


def test_watcher_notices_a_hung_etcd_and_resumes_after_it(etcd, client):
    errors: list[Exception] = []
    watcher = Watcher(client, "p/", client.current_revision() + 1, progress_timeout_s=1.0, on_error=errors.append)
    try:
        assert watcher.wait_connected(5)
        # idle but healthy: progress notifications (every 0.25 s) keep the stream alive
        assert holds_for(lambda: watcher.reconnects == 0, duration_s=1.5)
        etcd.pause()
        paused_at = time.monotonic()
        try:
            late_put = threading.Thread(target=client.put, args=("p/during-pause", "x"))
            late_put.start()  # blocks inside the hung server until it resumes
            wait_until(lambda: watcher.stalls >= 1, 5, "the watcher to notice the hang")
            detected_s = watcher.last_lost_at - paused_at
        finally:
            etcd.resume()
        late_put.join(timeout=10)
        print(f"\n[hung etcd noticed by the watcher after {detected_s:.2f} s (progress timeout 1.0 s)]")
        assert detected_s <= 1.5
        assert any(isinstance(e, EtcdUnavailableError) for e in errors)
        client.put("p/after", "y")
        events = next_events(watcher, 2)
        assert [e.key for e in events] == ["p/during-pause", "p/after"]
        assert watcher.get(timeout_s=0.5) is None
    finally:
        watcher.close()


def test_watcher_reports_compaction_and_closes_promptly(client):
    start = client.put("c/1", "a")
    client.put("c/1", "b")
    client.compact(client.put("c/1", "c"))
    errors: list[Exception] = []
    compacted = Watcher(client, "c/", start, on_error=errors.append)
    try:
        with pytest.raises(WatchCompactedError) as info:
            compacted.get(timeout_s=5)
        assert info.value.compact_revision > start and errors == [info.value]
    finally:
        compacted.close()

    live = Watcher(client, "c/", client.current_revision() + 1, progress_timeout_s=30)
    assert live.wait_connected(5)
    started = time.monotonic()
    live.close()
    close_s = time.monotonic() - started
    assert close_s < 10 and not live._thread.is_alive()  # not the 30 s progress timeout: the stream was cut
    assert live.get(timeout_s=0) is None


# -- failover and auth ------------------------------------------------------------------------
def test_failover_from_a_dead_endpoint(etcd):
    dead = f"http://127.0.0.1:{free_ports(1)[0]}"
    with EtcdClient([dead, etcd.endpoint], timeout_s=1.0, retry_timeout_s=2.0) as client:
        rev = client.put("f/k", "v")
        assert client.endpoint == etcd.endpoint and client.get("f/k").value == b"v"
        with Session(client, ttl_s=2) as session:
            assert not session.done.is_set()
        watcher = Watcher(client, "f/", rev)
        try:
            assert next_events(watcher, 1)[0].key == "f/k"
        finally:
            watcher.close()
    with EtcdClient([dead], timeout_s=0.5, retry_timeout_s=0.3) as only_dead:
        with pytest.raises(EtcdUnavailableError):
            only_dead.get("f/k")


def test_cluster_member_loss_fails_over_without_losing_watch_events():
    cluster = EtcdCluster(3)
    try:
        cluster.start()
        print(f"\n[3-member cluster ready in {cluster.wait_ready(30):.2f} s]")
        client = cluster.client(timeout_s=1.0, retry_timeout_s=10.0)
        first = client.put("m/a", "1")
        watcher = Watcher(client, "m/", first, progress_timeout_s=1.0)
        assert next_events(watcher, 1)[0].key == "m/a"
        cluster.members[0].stop()  # the member both the client and the watcher use
        client.put("m/b", "2")
        assert client.endpoint != cluster.members[0].endpoint
        assert [e.key for e in next_events(watcher, 1)] == ["m/b"]
        assert watcher.get(timeout_s=0.3) is None
        watcher.close()
        client.close()
    finally:
        cluster.close()


def test_auth_token_use_and_refresh(etcd, client):
    for path, body in [
        ("/v3/auth/role/add", {"name": "root"}),
        ("/v3/auth/user/add", {"name": "root", "password": "pw"}),
        ("/v3/auth/user/grant", {"user": "root", "role": "root"}),
        ("/v3/auth/enable", {}),
    ]:
        client._call(path, body)
    with pytest.raises(EtcdError):
        client.get("a")  # no credentials
    with EtcdClient([etcd.endpoint], username="root", password="bad") as wrong:
        with pytest.raises(EtcdError, match="authentication failed"):
            wrong.get("a")
    with EtcdClient([etcd.endpoint], username="root", password="pw", timeout_s=1.0) as authed:
        rev = authed.put("a", "1")
        etcd.restart()  # simple tokens live in memory: the old token is now invalid
        assert authed.get("a").value == b"1"
        watcher = Watcher(authed, "a", rev, single_key=True)
        try:
            assert next_events(watcher, 1)[0].value == b"1"
        finally:
            watcher.close()


def make_certs(directory) -> dict[str, str]:
    """A throwaway CA, a server cert for 127.0.0.1 and a client cert (openssl CLI)."""

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True, timeout=30)

    openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "1",
        "-subj",
        "/CN=ftrain-test-ca",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
    )
    for name, usage in (("server", "serverAuth,clientAuth"), ("client", "clientAuth")):
        (directory / f"{name}.ext").write_text(f"subjectAltName=IP:127.0.0.1\nextendedKeyUsage={usage}\n")
        openssl(
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-subj",
            f"/CN={name}",
            "-keyout",
            f"{name}.key",
            "-out",
            f"{name}.csr",
        )
        openssl(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "1",
            "-extfile",
            f"{name}.ext",
            "-out",
            f"{name}.pem",
        )
    return {name: str(directory / name) for name in ("ca.pem", "server.pem", "server.key", "client.pem", "client.key")}


def tls_etcd(tmp_path: Path) -> tuple[EtcdServer, dict[str, str]]:
    """A started etcd that serves https only to clients with a certificate of a throwaway CA,
    and the certificate files (the caller closes the server); skips without openssl."""
    if not shutil.which("openssl"):
        pytest.skip("openssl CLI not available to make test certificates")
    certs = make_certs(tmp_path)
    tls = {"ca_cert": certs["ca.pem"], "cert": certs["client.pem"], "key": certs["client.key"]}
    server = EtcdServer(
        cert_file=certs["server.pem"], key_file=certs["server.key"], trusted_ca_file=certs["ca.pem"], client_options=tls
    )
    try:
        server.start()
        server.wait_ready(20)
    except BaseException:
        server.close()
        raise
    return server, certs


def test_tls_with_client_certificates(tmp_path):
    server, _ = tls_etcd(tmp_path)
    try:
        assert server.endpoint.startswith("https://")
        with server.client(timeout_s=1.0) as client:
            rev = client.put("tls/k", "v")
            watcher = Watcher(client, "tls/", rev)
            try:
                assert next_events(watcher, 1)[0].value == b"v"
            finally:
                watcher.close()
            with Session(client, ttl_s=2) as session:
                assert session.keepalive_step() is not None
        with server.client(timeout_s=1.0, retry_timeout_s=0.0, cert=None, key=None) as no_client_cert:
            with pytest.raises((EtcdError, EtcdUnavailableError)):
                no_client_cert.get("tls/k")
    finally:
        server.close()
