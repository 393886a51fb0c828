"""ftrain.agents.etcd, etcd_session and etcd_watch without a server: encoding, endpoint failover,
retry policy, session deadlines, watch resumption.

A fake transport scripts each endpoint's replies; a fake clock advances only when the client
sleeps, so no test waits for real time.
"""

from __future__ import annotations

import base64
import http.client
import json
from collections.abc import Callable
from typing import Any

import pytest

from ftrain.agents.errors import EtcdError, EtcdUnavailableError, LeaseExpiredError, WatchCompactedError
from ftrain.agents.etcd import (
    Compare,
    EtcdClient,
    KeyValue,
    Op,
    TxnResult,
    b64,
    decode_key,
    encode_key,
    prefix_range_end,
    unb64,
)
from ftrain.agents.etcd_endpoints import Backoff, Endpoints, error_from_reply
from ftrain.agents.etcd_session import KeepaliveSchedule, Session
from ftrain.agents.etcd_watch import WatchResponse

A, B, C = "http://127.0.0.1:1", "http://127.0.0.1:2", "http://127.0.0.1:3"
REFUSED = EtcdUnavailableError("connection refused", ambiguous=False)
LOST_REPLY = EtcdUnavailableError("no reply", ambiguous=True)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


class FakeTransport:
    """Each endpoint gets a handler ``(path, payload) -> reply``; it may raise instead."""

    def __init__(self, handlers: dict[str, Callable[[str, dict[str, Any]], dict[str, Any]]]):
        self.handlers = handlers
        self.calls: list[tuple[str, str, float, str | None]] = []

    def post(self, endpoint: str, path: str, payload: Any, *, timeout_s: float, token: str | None) -> dict[str, Any]:
        self.calls.append((endpoint, path, timeout_s, token))
        return self.handlers[endpoint](path, dict(payload))

    def endpoints_called(self) -> list[str]:
        return [c[0] for c in self.calls]


def fail(exc: Exception) -> Callable[[str, dict[str, Any]], dict[str, Any]]:
    def handler(path: str, payload: dict[str, Any]) -> dict[str, Any]:
        raise exc

    return handler


def ok(reply: dict[str, Any] | None = None) -> Callable[[str, dict[str, Any]], dict[str, Any]]:
    return lambda path, payload: reply if reply is not None else {"header": {"revision": "42"}}


def scripted(*outcomes: Exception | dict[str, Any]) -> Callable[[str, dict[str, Any]], dict[str, Any]]:
    """Successive calls get successive outcomes (the last one repeats)."""
    remaining = list(outcomes)

    def handler(path: str, payload: dict[str, Any]) -> dict[str, Any]:
        outcome = remaining.pop(0) if len(remaining) > 1 else remaining[0]
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    return handler


def make_client(transport: FakeTransport, endpoints: list[str], clock: FakeClock, **kwargs: Any) -> EtcdClient:
    return EtcdClient(endpoints, transport=transport, sleep=clock.sleep, clock=clock, **kwargs)


# -- encoding ---------------------------------------------------------------------------------
@pytest.mark.parametrize("key", ["jobs/j1/nodes/n0", "ключ/ü/🙂", ""])
def test_key_round_trip(key):
    assert decode_key(unb64(b64(encode_key(key)))) == key


def test_foreign_non_utf8_key_round_trips_through_surrogateescape():
    raw = b"jobs/\xff\xfe"
    assert encode_key(decode_key(raw)) == raw


def test_every_byte_value_round_trips():
    value = bytes(range(256))
    assert unb64(b64(value)) == value
    kv = KeyValue.from_json({"key": b64(b"k"), "value": b64(value), "mod_revision": "9"})
    assert kv.value == value and kv.mod_revision == 9 and kv.create_revision == 0 and kv.lease == 0


@pytest.mark.parametrize(
    "prefix, end", [(b"a", b"b"), (b"jobs/", b"jobs0"), (b"a\xff", b"b"), (b"\xff\xff", b"\0"), (b"", b"\0")]
)
def test_prefix_range_end(prefix, end):
    assert prefix_range_end(prefix) == end


def test_compare_and_op_json():
    assert Compare.absent("k").to_json() == {
        "key": b64(b"k"),
        "target": "CREATE",
        "result": "EQUAL",
        "create_revision": "0",
    }
    assert Compare("k", "value", "!=", b"v").to_json()["value"] == b64(b"v")
    assert Op.put("k", "v", lease=7).to_json() == {"request_put": {"key": b64(b"k"), "value": b64(b"v"), "lease": "7"}}
    assert Op.delete("p/", prefix=True).to_json() == {
        "request_delete_range": {"key": b64(b"p/"), "range_end": b64(b"p0")}
    }
    with pytest.raises(ValueError, match="target"):
        Compare("k", "size", "==", 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="bytes"):
        Compare("k", "value", "==", 3)


def test_txn_result_parses_each_response_kind():
    reply = {
        "header": {"revision": "12"},
        "responses": [
            {"response_put": {"header": {"revision": "12"}}},
            {"response_delete_range": {"deleted": "2"}},
            {"response_range": {"kvs": [{"key": b64(b"k"), "value": b64(b"v"), "mod_revision": "5"}]}},
        ],
    }
    result = TxnResult.from_json(reply)
    assert result.succeeded is False and result.revision == 12  # proto3 JSON omits false
    assert result.responses[:2] == (None, 2) and result.responses[2][0].value == b"v"


def test_watch_response_parsing():
    line = json.dumps(
        {
            "result": {
                "header": {"revision": "9"},
                "events": [
                    {"kv": {"key": b64(b"a"), "value": b64(b"1"), "create_revision": "8", "mod_revision": "8"}},
                    {"type": "DELETE", "kv": {"key": b64(b"b"), "mod_revision": "9"}},
                ],
            }
        }
    ).encode()
    r = WatchResponse.from_line(line)
    assert [(e.type, e.key, e.value, e.mod_revision) for e in r.events] == [
        ("put", "a", b"1", 8),
        ("delete", "b", b"", 9),
    ]
    compacted = WatchResponse.from_line(b'{"result":{"canceled":true,"compact_revision":"4"}}')
    assert compacted.canceled and compacted.compact_revision == 4
    progress = WatchResponse.from_line(b'{"result":{"header":{"revision":"9"}}}')
    assert not progress.events and not progress.created and progress.header_revision == 9
    with pytest.raises(EtcdUnavailableError):
        WatchResponse.from_line(b'{"error":{"grpc_code":14,"http_code":503,"message":"transport is closing"}}')


@pytest.mark.parametrize(
    "status, body, kind, ambiguous",
    [
        (503, '{"code":14,"message":"etcdserver: no leader"}', EtcdUnavailableError, False),
        (503, '{"code":14,"message":"etcdserver: request timed out"}', EtcdUnavailableError, True),
        (504, '{"code":4,"message":"context deadline exceeded"}', EtcdUnavailableError, True),
        (429, '{"code":8,"message":"etcdserver: too many requests"}', EtcdUnavailableError, False),
        (502, "Bad Gateway", EtcdUnavailableError, True),
        (404, '{"code":5,"message":"etcdserver: requested lease not found"}', LeaseExpiredError, None),
        (400, '{"code":3,"message":"etcdserver: key is not provided"}', EtcdError, None),
        (401, '{"code":16,"message":"etcdserver: invalid auth token"}', EtcdError, None),
    ],
)
def test_error_replies_are_classified(status, body, kind, ambiguous):
    error = error_from_reply(status, body, "x")
    assert type(error) is kind
    if ambiguous is not None:
        assert error.ambiguous is ambiguous


# -- failover and retries ---------------------------------------------------------------------
def test_rotates_to_the_next_endpoint_and_remembers_it():
    clock = FakeClock()
    transport = FakeTransport({A: fail(REFUSED), B: ok(), C: ok()})
    client = make_client(transport, [A, B, C], clock)
    assert client.put("k", b"v") == 42
    assert client.endpoint == B
    client.get("k")
    assert transport.endpoints_called() == [A, B, B]
    assert clock.sleeps == []  # failover within one pass needs no backoff


def test_retries_with_bounded_jittered_backoff_then_gives_up():
    clock = FakeClock()
    transport = FakeTransport({A: fail(REFUSED), B: fail(REFUSED)})
    client = make_client(transport, [A, B], clock, retry_timeout_s=5.0, backoff_max_s=1.0)
    with pytest.raises(EtcdUnavailableError, match="no etcd endpoint answered"):
        client.get("k")
    assert len(clock.sleeps) >= 5
    assert all(0.0 <= s <= 1.0 for s in clock.sleeps)
    assert sum(clock.sleeps) <= 5.0 + 1e-9  # never sleeps past the retry deadline
    assert len(set(clock.sleeps)) > 1  # jitter
    assert len(transport.calls) == 2 * (len(clock.sleeps) + 1)  # every attempt tries both endpoints


def test_recovers_when_an_endpoint_comes_back():
    clock = FakeClock()
    transport = FakeTransport({A: scripted(REFUSED, REFUSED, {"header": {"revision": "7"}})})
    client = make_client(transport, [A], clock)
    assert client.put("k", "v") == 7
    assert len(clock.sleeps) == 2


def test_retry_timeout_zero_means_one_pass():
    clock = FakeClock()
    transport = FakeTransport({A: fail(REFUSED), B: fail(REFUSED)})
    client = make_client(transport, [A, B], clock, retry_timeout_s=0.0)
    with pytest.raises(EtcdUnavailableError):
        client.get("k")
    assert transport.endpoints_called() == [A, B] and clock.sleeps == []


def test_txn_is_not_repeated_after_an_ambiguous_failure():
    clock = FakeClock()
    transport = FakeTransport({A: fail(LOST_REPLY), B: ok({"succeeded": True})})
    client = make_client(transport, [A, B], clock)
    with pytest.raises(EtcdUnavailableError) as info:
        client.put_if_absent("k", "v")
    assert info.value.ambiguous
    assert transport.endpoints_called() == [A]  # not B either: the first may have applied it


def test_txn_is_retried_when_it_never_reached_etcd():
    clock = FakeClock()
    transport = FakeTransport({A: fail(REFUSED), B: ok({"succeeded": True, "header": {"revision": "3"}})})
    client = make_client(transport, [A, B], clock)
    assert client.put_if_absent("k", "v") is True


def test_idempotent_put_is_retried_after_an_ambiguous_failure():
    clock = FakeClock()
    transport = FakeTransport({A: scripted(LOST_REPLY, {"header": {"revision": "5"}})})
    client = make_client(transport, [A], clock)
    assert client.put("k", "v") == 5


def test_fatal_errors_are_neither_retried_nor_rotated():
    clock = FakeClock()
    transport = FakeTransport({A: fail(EtcdError("permission denied", code=7)), B: ok()})
    client = make_client(transport, [A, B], clock)
    with pytest.raises(EtcdError, match="permission denied"):
        client.get("k")
    assert transport.endpoints_called() == [A] and clock.sleeps == []


def test_lease_not_found_is_lease_expired_and_keepalive_zero_means_gone():
    clock = FakeClock()
    transport = FakeTransport({A: scripted(LeaseExpiredError("gone"), {"result": {"ID": "1"}})})
    client = make_client(transport, [A], clock)
    with pytest.raises(LeaseExpiredError):
        client.put("k", "v", lease=1)
    assert client.keepalive_once(1) == 0


def test_auth_token_is_fetched_once_and_refreshed_when_rejected():
    clock = FakeClock()
    tokens = iter(["t1", "t2"])
    seen: list[str | None] = []

    def handler(path: str, payload: dict[str, Any]) -> dict[str, Any]:
        if path == "/v3/auth/authenticate":
            assert payload == {"name": "u", "password": "p"}
            return {"token": next(tokens)}
        seen.append(transport.calls[-1][3])
        if transport.calls[-1][3] == "t1" and len(seen) == 2:
            raise EtcdError("etcdserver: invalid auth token", code=16)
        return {"header": {"revision": "1"}}

    transport = FakeTransport({A: handler})
    client = make_client(transport, [A], clock, username="u", password="p")
    client.get("a")
    client.get("b")  # rejected with t1, re-authenticates, succeeds with t2
    client.get("c")
    assert seen == ["t1", "t1", "t2", "t2"]
    assert [c[1] for c in transport.calls].count("/v3/auth/authenticate") == 2


@pytest.mark.parametrize("endpoints", [[], "http://127.0.0.1:2379", ["127.0.0.1:2379"], ["ftp://h:1"]])
def test_bad_endpoints_are_rejected(endpoints):
    with pytest.raises(ValueError, match="endpoint"):
        EtcdClient(endpoints)


# -- the shared endpoints object --------------------------------------------------------------
def test_endpoints_rotation_starts_at_the_member_that_answered_last():
    clock = FakeClock()
    transport = FakeTransport({A: fail(REFUSED), B: fail(REFUSED), C: ok()})
    client = make_client(transport, [A, B, C], clock)
    endpoints = client.endpoints
    assert endpoints.rotation() == [A, B, C] and endpoints.current == A
    client.get("k")
    assert endpoints.current == C == client.endpoint
    assert endpoints.rotation() == [C, A, B]  # what a Watcher on this client tries, in order


def test_the_auth_token_is_one_per_endpoints_object():
    """The client's calls and anything else on ``client.endpoints`` (a Watcher's streams) use one token."""
    clock = FakeClock()
    tokens = iter(["t1", "t2"])

    def handler(path: str, payload: dict[str, Any]) -> dict[str, Any]:
        return {"token": next(tokens)} if path == "/v3/auth/authenticate" else {"header": {"revision": "1"}}

    transport = FakeTransport({A: handler})
    client = make_client(transport, [A], clock, username="u", password="p")
    client.get("k")
    assert client.endpoints.has_credentials and client.endpoints.token(A, 1.0) == "t1"
    assert client.endpoints.token(A, 1.0, refresh=True) == "t2"
    client.get("k")
    assert transport.calls[-1][3] == "t2"
    assert not make_client(transport, [A], clock).endpoints.has_credentials


@pytest.mark.parametrize("failures, ceiling_s", [(1, 0.1), (2, 0.2), (4, 0.8), (5, 1.0), (5000, 1.0)])
def test_backoff_is_full_jitter_doubling_up_to_its_cap(failures, ceiling_s):
    backoff = Backoff(initial_s=0.1, max_s=1.0)
    delays = [backoff.delay_s(failures) for _ in range(200)]
    assert all(0.0 <= d <= ceiling_s for d in delays) and max(delays) > ceiling_s / 2


def test_backoff_rejects_bad_settings_and_a_delay_before_any_failure():
    with pytest.raises(ValueError, match="initial_s"):
        Backoff(initial_s=2.0, max_s=1.0)
    with pytest.raises(ValueError, match="failure"):
        Backoff().delay_s(0)


def test_one_pass_lease_calls_never_retry():
    """What a Session relies on: with a deadline (keepalive) or ``retry=False`` (revoke), one pass
    over the endpoints and no backoff, so it can decide by its own deadline."""
    clock = FakeClock()
    transport = FakeTransport({A: fail(REFUSED), B: fail(REFUSED)})
    client = make_client(transport, [A, B], clock)
    with pytest.raises(EtcdUnavailableError):
        client.keepalive_once(7, deadline=clock.now + 5.0)
    with pytest.raises(EtcdUnavailableError):
        client.revoke(7, retry=False)
    assert transport.endpoints_called() == [A, B, A, B] and clock.sleeps == []


def test_stream_connections_follow_the_url_scheme():
    endpoints = Endpoints([A, "https://127.0.0.1:4"], transport=FakeTransport({}))
    plain = endpoints.connection(A, 1.5)
    secure = endpoints.connection("https://127.0.0.1:4", 1.5)
    assert type(plain) is http.client.HTTPConnection and plain.timeout == 1.5
    assert isinstance(secure, http.client.HTTPSConnection) and (secure.host, secure.port) == ("127.0.0.1", 4)


# -- session deadlines ------------------------------------------------------------------------
def test_keepalive_schedule_deadline_and_delays():
    schedule = KeepaliveSchedule(interval_s=1.0, retry_interval_s=0.25, deadline=103.0)
    schedule.renewed(sent_at=101.0, ttl_s=3)
    assert schedule.deadline == 104.0 and not schedule.expired(103.9) and schedule.expired(104.0)
    assert schedule.next_delay_s(101.5, failed=False) == 1.0
    assert schedule.next_delay_s(101.5, failed=True) == 0.25
    assert schedule.next_delay_s(103.9, failed=False) == pytest.approx(0.1)  # never past the deadline
    schedule.renewed(sent_at=99.0, ttl_s=3)  # a late reply to an old keepalive never shortens it
    assert schedule.deadline == 104.0


def lease_transport(keepalive: Callable[[str, dict[str, Any]], dict[str, Any]]) -> FakeTransport:
    def handler(path: str, payload: dict[str, Any]) -> dict[str, Any]:
        if path == "/v3/lease/grant":
            return {"ID": "77", "TTL": payload["TTL"]}
        if path == "/v3/lease/keepalive":
            return keepalive(path, payload)
        return {}

    return FakeTransport({A: handler})


def test_session_lost_only_once_renewals_fail_past_the_ttl():
    clock = FakeClock()
    outcomes: list[Exception | dict[str, Any]] = [{"result": {"TTL": "3"}}]

    def keepalive(path: str, payload: dict[str, Any]) -> dict[str, Any]:
        outcome = outcomes[0]
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    transport = lease_transport(keepalive)
    session = Session(make_client(transport, [A], clock), ttl_s=3, clock=clock, start=False)
    assert session.lease_id == 77 and session.schedule.deadline == 1003.0
    clock.now += 1.0
    assert session.keepalive_step() == 1.0  # renewed at t=1001: deadline 1004
    assert session.renewals == 1 and session.schedule.deadline == 1004.0

    outcomes[0] = REFUSED  # etcd goes away
    lost_at = None
    for _ in range(100):
        clock.now += 0.01  # each failed attempt takes a little time
        delay = session.keepalive_step()
        if delay is None:
            lost_at = clock.now
            break
        assert not session.done.is_set() and clock.now < 1004.0
        assert transport.calls[-1][2] <= 1004.0 - (clock.now - 0.01) + 1e-9  # request timeout capped
        clock.now += delay
    assert lost_at is not None and 1004.0 <= lost_at < 1004.0 + 0.02
    assert session.done.is_set() and "TTL" in (session.lost_reason or "")


def test_session_lost_at_once_when_etcd_says_the_lease_is_gone():
    clock = FakeClock()
    reasons: list[str] = []
    session = Session(
        make_client(lease_transport(ok({"result": {"ID": "77"}})), [A], clock),
        ttl_s=5,
        clock=clock,
        start=False,
        on_lost=reasons.append,
    )
    assert session.keepalive_step() is None
    assert session.done.is_set() and reasons == ["lease expired or was revoked"]


def test_session_close_revokes_and_sets_done():
    clock = FakeClock()
    transport = lease_transport(ok({"result": {"TTL": "5"}}))
    session = Session(make_client(transport, [A], clock), ttl_s=5, clock=clock, start=False)
    session.close()
    assert session.done.is_set() and session.lost_reason == "closed"
    assert transport.calls[-1][1] == "/v3/lease/revoke"


def test_session_rejects_an_interval_not_below_the_ttl():
    clock = FakeClock()
    with pytest.raises(ValueError, match="interval"):
        Session(make_client(lease_transport(ok()), [A], clock), ttl_s=2, keepalive_interval_s=2, start=False)


def test_watch_compacted_error_carries_the_revision():
    error = WatchCompactedError("compacted", compact_revision=17)
    assert isinstance(error, EtcdError) and error.compact_revision == 17


def test_b64_matches_base64():
    assert b64(b"\x00\xff") == base64.b64encode(b"\x00\xff").decode()


# -- the watch loop against a scripted gateway ------------------------------------------------
def _event(key: str, rev: int) -> dict[str, Any]:
    return {"kv": {"key": b64(key.encode()), "value": b64(b"v"), "create_revision": str(rev), "mod_revision": str(rev)}}


def test_watcher_resumes_after_the_last_delivered_revision_and_drops_replays():
    """A fake gateway: stream 1 breaks after two events, stream 2 replays one of them then hangs
    (progress timeout), stream 3 reports compaction. The watcher must ask for revisions 5, 7, 8,
    deliver each event once, and end with WatchCompactedError."""
    import http.server
    import threading

    from ftrain.agents.etcd_watch import Watcher

    release = threading.Event()
    requests_seen: list[dict[str, Any]] = []
    scripts = [
        [{"created": True}, {"events": [_event("a", 5), _event("b", 6)]}],
        [{"created": True}, {"events": [_event("b", 6), _event("c", 7)]}, "hang"],
        [{"created": True}, {"canceled": True, "compact_revision": "9"}],
    ]

    class Gateway(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's naming
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            requests_seen.append(body["create_request"])
            script = scripts[min(len(requests_seen), len(scripts)) - 1]
            self.send_response(200)
            self.send_header("Connection", "close")
            self.end_headers()
            for step in script:
                if step == "hang":
                    release.wait(10)
                    return
                self.wfile.write(json.dumps({"result": {"header": {"revision": "7"}, **step}}).encode() + b"\n")
                self.wfile.flush()

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Gateway)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    client = EtcdClient([f"http://127.0.0.1:{server.server_address[1]}"], timeout_s=2.0)
    errors: list[Exception] = []
    watcher = Watcher(client, "", start_revision=5, progress_timeout_s=0.3, on_error=errors.append)
    try:
        events = []
        with pytest.raises(WatchCompactedError) as info:
            while (event := watcher.get(timeout_s=5)) is not None:
                events.append(event)
        assert [(e.key, e.mod_revision) for e in events] == [("a", 5), ("b", 6), ("c", 7)]
        assert info.value.compact_revision == 9
        assert [int(r["start_revision"]) for r in requests_seen] == [5, 7, 8]
        assert all(r["progress_notify"] for r in requests_seen)
        assert watcher.reconnects == 2 and watcher.stalls == 1 and watcher.revision == 7
        assert [type(e) for e in errors] == [EtcdUnavailableError, EtcdUnavailableError, WatchCompactedError]
    finally:
        release.set()
        watcher.close()
        server.shutdown()
        server.server_close()
        client.close()


def test_http_transport_tells_never_sent_from_maybe_applied():
    """Connection refused: nothing reached etcd (safe to retry a txn). Connected but no reply
    (a hung server): the request may be applied later, so it is ambiguous."""
    import socket

    from ftrain.agents.etcd_endpoints import HttpTransport

    transport = HttpTransport()
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        refused_port = closed.getsockname()[1]  # bound, not listening: connections are refused
        with pytest.raises(EtcdUnavailableError) as refused:
            transport.post(f"http://127.0.0.1:{refused_port}", "/v3/kv/put", {}, timeout_s=1.0, token=None)
    assert refused.value.ambiguous is False
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)  # the kernel accepts; nobody answers
        with pytest.raises(EtcdUnavailableError) as hung:
            transport.post(f"http://127.0.0.1:{silent.getsockname()[1]}", "/v3/kv/put", {}, timeout_s=0.2, token=None)
    assert hung.value.ambiguous is True
    transport.close()


def test_a_reply_cut_short_is_etcd_unavailable_not_a_fatal_error():
    """etcd restarting mid-reply (seen in a soak: IncompleteRead, the agent exited 1): the request
    reached etcd, so it is an ambiguous unavailability the caller retries, never fatal."""
    from ftrain.agents.etcd_endpoints import HttpTransport
    from ftrain.testbed.fake_http import TruncatingServer

    transport = HttpTransport()
    try:
        with TruncatingServer() as server:
            with pytest.raises(EtcdUnavailableError) as cut:
                transport.post(server.endpoint, "/v3/kv/range", {}, timeout_s=2.0, token=None)
        assert cut.value.ambiguous is True and "cut short" in str(cut.value)
    finally:
        transport.close()
