"""etcd v3 client layer for the node agent: the KV/transaction/lease client, its value types
and its transport. Sessions (kept-alive leases) live in :mod:`agents.etcd_session`, watches in
:mod:`agents.etcd_watch`; both build on :class:`EtcdClient` (they import this module, so this
module never imports them).

Speaks etcd's HTTP/JSON gRPC gateway (``POST /v3/...`` on the client port; every etcd >= 3.4
serves it). etcd3gw speaks the same protocol, but its client has one fixed timeout per client
(a :class:`~agents.etcd_session.Session` needs per-call deadlines), no auth header, maps
transport errors to types that lose whether the request was sent (we must tell "never sent"
from "maybe applied" to retry transactions safely), and its watch thread hangs silently on a
dead server. So requests go through ``requests`` here and the watch stream is our own loop over
``http.client``.

Conventions (the same in every call):

- **keys are ``str``** (UTF-8 on the wire; a non-UTF-8 key written by someone else comes back
  through ``surrogateescape`` and round-trips); **values are ``bytes``** (``str`` accepted on
  input, encoded UTF-8; always ``bytes`` out). Revisions and lease ids are ``int``.
- Every method retries :class:`~agents.errors.EtcdUnavailableError` with jittered exponential
  backoff for at most ``retry_timeout_s``, trying each endpoint in turn, starting from the last
  one that answered. A request that may already have been applied (the reply was lost) is
  retried only if repeating it is harmless: reads, plain ``put``/``delete``, lease calls. A
  transaction is never repeated after an ambiguous failure (the same rule as etcd's Go client):
  the caller gets ``EtcdUnavailableError(ambiguous=True)`` and must re-read.
- Names with a leading underscore used by the session and watch modules (``_call``,
  ``_keepalive``, ``_auth_token``, ``_range``, ...) are internal to this package.
"""

from __future__ import annotations

import base64
import json
import logging
import ssl
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol
from urllib.parse import urlsplit

import requests
import tenacity
from urllib3.exceptions import NewConnectionError

from agents.errors import EtcdError, EtcdUnavailableError, LeaseExpiredError

logger = logging.getLogger(__name__)

# gRPC status codes etcd returns through the gateway
_DEADLINE_EXCEEDED, _NOT_FOUND, _RESOURCE_EXHAUSTED, _UNAVAILABLE, _UNAUTHENTICATED = 4, 5, 8, 14, 16
#: UNAVAILABLE replies that guarantee the request was not applied.
_NOT_APPLIED = ("etcdserver: no leader", "etcdserver: not capable", "etcdserver: too many requests")


# -- encoding ---------------------------------------------------------------------------------
def encode_key(key: str | bytes) -> bytes:
    """A key's bytes on the wire (UTF-8; ``surrogateescape`` keeps foreign bytes intact)."""
    return key if isinstance(key, bytes) else key.encode("utf-8", "surrogateescape")


def decode_key(raw: bytes) -> str:
    return raw.decode("utf-8", "surrogateescape")


def encode_value(value: bytes | str) -> bytes:
    return value.encode("utf-8") if isinstance(value, str) else bytes(value)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def unb64(text: str) -> bytes:
    return base64.b64decode(text)


def prefix_range_end(prefix: bytes) -> bytes:
    """etcd's ``range_end`` selecting every key that starts with ``prefix`` (``b"\\0"`` = all keys)."""
    stripped = prefix.rstrip(b"\xff")
    if not stripped:
        return b"\0"
    return stripped[:-1] + bytes([stripped[-1] + 1])


def _range(key: str, prefix: bool) -> dict[str, str]:
    raw = encode_key(key)
    if not prefix:
        return {"key": b64(raw)}
    return {"key": b64(raw or b"\0"), "range_end": b64(prefix_range_end(raw))}


# -- values -----------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class KeyValue:
    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int  #: 0 if the key has no lease

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> KeyValue:
        return cls(key=decode_key(unb64(d["key"])), value=unb64(d.get("value", "")),
                   create_revision=int(d.get("create_revision", 0)),
                   mod_revision=int(d.get("mod_revision", 0)), version=int(d.get("version", 0)),
                   lease=int(d.get("lease", 0)))


@dataclass(frozen=True, slots=True)
class Listing:
    """Keys under a prefix and the store revision they were read at (watch from ``revision + 1``)."""
    kvs: list[KeyValue]
    revision: int


@dataclass(frozen=True, slots=True)
class Lease:
    id: int
    ttl_s: int


_TARGETS = {"create_revision": "CREATE", "mod_revision": "MOD", "version": "VERSION",
            "value": "VALUE", "lease": "LEASE"}
_RESULTS = {"==": "EQUAL", "!=": "NOT_EQUAL", "<": "LESS", ">": "GREATER"}


@dataclass(frozen=True, slots=True)
class Compare:
    """One transaction guard: ``<target of key> <op> <value>``, e.g.
    ``Compare("round", "mod_revision", "==", 17)``. A missing key has every revision 0."""
    key: str
    target: Literal["create_revision", "mod_revision", "version", "value", "lease"]
    op: Literal["==", "!=", "<", ">"]
    value: int | bytes

    def __post_init__(self) -> None:
        if self.target not in _TARGETS:
            raise ValueError(f"Compare.target must be one of {sorted(_TARGETS)}, got {self.target!r}")
        if self.op not in _RESULTS:
            raise ValueError(f"Compare.op must be one of {sorted(_RESULTS)}, got {self.op!r}")
        if (self.target == "value") != isinstance(self.value, (bytes, str)):
            raise ValueError(f"Compare on {self.target} needs {'bytes' if self.target == 'value' else 'an int'}")

    @classmethod
    def absent(cls, key: str) -> Compare:
        return cls(key, "create_revision", "==", 0)

    def to_json(self) -> dict[str, Any]:
        value = b64(encode_value(self.value)) if self.target == "value" else str(self.value)  # type: ignore[arg-type]
        return {"key": b64(encode_key(self.key)), "target": _TARGETS[self.target],
                "result": _RESULTS[self.op], self.target: value}


@dataclass(frozen=True, slots=True)
class Op:
    """One transaction operation; build with :meth:`put`, :meth:`delete` or :meth:`get`."""
    kind: Literal["put", "delete", "get"]
    key: str
    value: bytes = b""
    lease: int | None = None
    prefix: bool = False

    @classmethod
    def put(cls, key: str, value: bytes | str, lease: int | None = None) -> Op:
        return cls("put", key, encode_value(value), lease)

    @classmethod
    def delete(cls, key: str, *, prefix: bool = False) -> Op:
        return cls("delete", key, prefix=prefix)

    @classmethod
    def get(cls, key: str, *, prefix: bool = False) -> Op:
        return cls("get", key, prefix=prefix)

    def to_json(self) -> dict[str, Any]:
        if self.kind == "put":
            body: dict[str, Any] = {"key": b64(encode_key(self.key)), "value": b64(self.value)}
            if self.lease:
                body["lease"] = str(self.lease)
            return {"request_put": body}
        name = "request_range" if self.kind == "get" else "request_delete_range"
        return {name: _range(self.key, self.prefix)}


#: Per-op result of a transaction: ``list[KeyValue]`` for get, deleted count for delete, None for put.
OpResult = list[KeyValue] | int | None


@dataclass(frozen=True, slots=True)
class TxnResult:
    succeeded: bool
    revision: int  #: the store revision after the transaction
    responses: tuple[OpResult, ...]  #: one per op of the branch that ran

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> TxnResult:
        out: list[OpResult] = []
        for r in d.get("responses", []):
            if "response_range" in r:
                out.append([KeyValue.from_json(kv) for kv in r["response_range"].get("kvs", [])])
            elif "response_delete_range" in r:
                out.append(int(r["response_delete_range"].get("deleted", 0)))
            else:
                out.append(None)
        return cls(bool(d.get("succeeded", False)), _header_revision(d), tuple(out))


def _header_revision(d: Mapping[str, Any]) -> int:
    return int(d.get("header", {}).get("revision", 0))


# -- transport --------------------------------------------------------------------------------
class Transport(Protocol):
    """POSTs one JSON request to one endpoint. The seam unit tests replace."""

    def post(self, endpoint: str, path: str, payload: Mapping[str, Any], *, timeout_s: float,
             token: str | None) -> dict[str, Any]:
        """The decoded JSON reply. Raises :class:`EtcdUnavailableError` (``ambiguous`` if the
        request may have reached etcd), :class:`LeaseExpiredError`, or :class:`EtcdError`."""
        ...


def error_from_reply(http_status: int, body: bytes | str, where: str) -> Exception:
    """Map an etcd gateway error reply (``{"error", "code", "message"}``) to our errors."""
    try:
        data = json.loads(body)
    except ValueError:
        data = None
    code = data.get("code") if isinstance(data, dict) else None
    message = (data.get("message") or data.get("error")) if isinstance(data, dict) else None
    message = str(message or (body[:200] if body else f"HTTP {http_status}"))
    text = f"{where}: {message}"
    if code == _UNAVAILABLE:
        return EtcdUnavailableError(text, ambiguous=not any(m in message for m in _NOT_APPLIED))
    if code == _RESOURCE_EXHAUSTED:
        return EtcdUnavailableError(text, ambiguous=False)
    if code == _DEADLINE_EXCEEDED or (code is None and http_status in (502, 503, 504)):
        return EtcdUnavailableError(text, ambiguous=True)
    if code == _NOT_FOUND and "lease not found" in message:
        return LeaseExpiredError(text)
    return EtcdError(text, code=code)


def error_from_stream(err: Mapping[str, Any], where: str) -> Exception:
    """Map the ``{"error": {...}}`` message a streaming gateway endpoint sends inside a 200 reply."""
    body = json.dumps({"code": err.get("grpc_code"), "message": err.get("message")})
    return error_from_reply(int(err.get("http_code") or 500), body, where)


def _never_sent(exc: requests.exceptions.ConnectionError) -> bool:
    """True if the connection itself failed (refused, unreachable), so nothing reached etcd."""
    reason = getattr(exc.args[0], "reason", None) if exc.args else None
    return isinstance(reason, NewConnectionError)


class HttpTransport:
    """:class:`Transport` over ``requests`` (one pooled session, TLS options applied)."""

    def __init__(self, *, ca_cert: str | None = None, cert: str | None = None, key: str | None = None):
        self._session = requests.Session()
        # per request, not on the session: REQUESTS_CA_BUNDLE would override a session's verify
        self._verify: str | bool = ca_cert or True
        self._cert = ((cert, key) if key else cert) if cert else None

    def post(self, endpoint: str, path: str, payload: Mapping[str, Any], *, timeout_s: float,
             token: str | None) -> dict[str, Any]:
        where = f"{endpoint}{path}"
        try:
            resp = self._session.post(where, json=payload, timeout=timeout_s, verify=self._verify, cert=self._cert,
                                      headers={"Authorization": token} if token else None)
        except requests.exceptions.SSLError as e:
            raise EtcdError(f"{where}: TLS error: {e}") from e
        except requests.exceptions.ConnectTimeout as e:
            raise EtcdUnavailableError(f"{where}: connect timed out", ambiguous=False) from e
        except requests.exceptions.ConnectionError as e:
            raise EtcdUnavailableError(f"{where}: {type(e).__name__}: {e}", ambiguous=not _never_sent(e)) from e
        except requests.exceptions.Timeout as e:
            raise EtcdUnavailableError(f"{where}: no reply in {timeout_s:.2f} s", ambiguous=True) from e
        except requests.exceptions.RequestException as e:
            raise EtcdError(f"{where}: {type(e).__name__}: {e}") from e
        if resp.status_code != 200:
            raise error_from_reply(resp.status_code, resp.content, where)
        try:
            return resp.json()
        except ValueError as e:
            raise EtcdError(f"{where}: reply is not JSON: {resp.text[:200]!r}") from e

    def close(self) -> None:
        self._session.close()


def _is_token_error(e: EtcdError) -> bool:
    return e.code == _UNAUTHENTICATED or "auth store is old" in str(e) or "invalid auth token" in str(e)


# -- client -----------------------------------------------------------------------------------
class EtcdClient:
    """A thread-safe etcd v3 client over the HTTP gateway, with endpoint failover and retries.

    ``endpoints``: ``http(s)://host:port`` client URLs of the cluster's members. ``timeout_s``:
    per request and endpoint. ``retry_timeout_s``: how long one call keeps retrying transient
    failures. ``username``/``password``: etcd v3 auth (token fetched lazily, refreshed when
    etcd rejects it). ``ca_cert``/``cert``/``key``: TLS for ``https`` endpoints. ``sleep``,
    ``clock`` and ``transport`` are injectable for tests.
    """

    def __init__(self, endpoints: Sequence[str], *, timeout_s: float = 2.0, retry_timeout_s: float = 10.0,
                 username: str | None = None, password: str | None = None, ca_cert: str | None = None,
                 cert: str | None = None, key: str | None = None,
                 backoff_initial_s: float = 0.05, backoff_max_s: float = 1.0,
                 sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.monotonic,
                 transport: Transport | None = None):
        if isinstance(endpoints, str) or not endpoints:
            raise ValueError("endpoints must be a non-empty list of http(s)://host:port URLs")
        self._endpoints = tuple(e.rstrip("/") for e in endpoints)
        for e in self._endpoints:
            parts = urlsplit(e)
            if parts.scheme not in ("http", "https") or not parts.hostname or not parts.port:
                raise ValueError(f"bad etcd endpoint {e!r}: expected http(s)://host:port")
        if (username is None) != (password is None):
            raise ValueError("username and password must be given together")
        if timeout_s <= 0 or retry_timeout_s < 0:
            raise ValueError("timeout_s must be > 0 and retry_timeout_s >= 0")
        self.timeout_s = timeout_s
        self.retry_timeout_s = retry_timeout_s
        self._username, self._password = username, password
        self._tls = (ca_cert, cert, key)
        self._backoff = (backoff_initial_s, backoff_max_s)
        self._sleep, self._clock = sleep, clock
        self._transport: Transport = transport or HttpTransport(ca_cert=ca_cert, cert=cert, key=key)
        self._preferred = 0
        self._token: str | None = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"EtcdClient({list(self._endpoints)}, current={self.endpoint})"

    @property
    def endpoints(self) -> tuple[str, ...]:
        return self._endpoints

    @property
    def endpoint(self) -> str:
        """The endpoint that answered last (tried first by the next call)."""
        return self._endpoints[self._preferred]

    def close(self) -> None:
        close = getattr(self._transport, "close", None)
        if close is not None:
            close()

    def __enter__(self) -> EtcdClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- KV ---------------------------------------------------------------------------------
    def get(self, key: str) -> KeyValue | None:
        kvs = self._call("/v3/kv/range", _range(key, False)).get("kvs", [])
        return KeyValue.from_json(kvs[0]) if kvs else None

    def get_prefix(self, prefix: str) -> list[KeyValue]:
        """Every key starting with ``prefix``, sorted by key."""
        return self.list_prefix(prefix).kvs

    def list_prefix(self, prefix: str) -> Listing:
        """Like :meth:`get_prefix`, with the revision it was read at (to watch from ``+ 1``)."""
        reply = self._call("/v3/kv/range", _range(prefix, True))
        return Listing([KeyValue.from_json(kv) for kv in reply.get("kvs", [])], _header_revision(reply))

    def current_revision(self) -> int:
        """The store's current revision."""
        return _header_revision(self._call("/v3/kv/range", {"key": b64(b"\0"), "count_only": True}))

    def put(self, key: str, value: bytes | str, lease: int | None = None) -> int:
        """Write ``key`` (at least once: a retry after a lost reply writes it again); the new revision.
        Raises :class:`LeaseExpiredError` if ``lease`` is gone."""
        payload: dict[str, Any] = {"key": b64(encode_key(key)), "value": b64(encode_value(value))}
        if lease:
            payload["lease"] = str(lease)
        return _header_revision(self._call("/v3/kv/put", payload))

    def delete(self, key: str) -> bool:
        """Delete ``key``; whether it existed (may say False if a retry followed a lost reply)."""
        return int(self._call("/v3/kv/deleterange", _range(key, False)).get("deleted", 0)) > 0

    def delete_prefix(self, prefix: str) -> int:
        """Delete every key starting with ``prefix``; how many there were."""
        return int(self._call("/v3/kv/deleterange", _range(prefix, True)).get("deleted", 0))

    def compact(self, revision: int) -> None:
        """Drop history before ``revision`` (watches starting earlier get WatchCompactedError)."""
        self._call("/v3/kv/compaction", {"revision": str(revision), "physical": True})

    # -- transactions -----------------------------------------------------------------------
    def txn(self, compare: Sequence[Compare], success: Sequence[Op], failure: Sequence[Op] = ()) -> TxnResult:
        """If every ``compare`` holds run ``success``, else ``failure``, atomically.

        Never repeated after an ambiguous failure: then ``EtcdUnavailableError(ambiguous=True)``
        and the outcome is unknown (re-read; fencing with a lease or revision makes that safe).
        """
        payload = {"compare": [c.to_json() for c in compare], "success": [o.to_json() for o in success],
                   "failure": [o.to_json() for o in failure]}
        return TxnResult.from_json(self._call("/v3/kv/txn", payload, idempotent=False))

    def put_if_absent(self, key: str, value: bytes | str, lease: int | None = None) -> bool:
        """Create ``key`` unless it exists (``create_revision == 0``); whether this call created it."""
        return self.txn([Compare.absent(key)], [Op.put(key, value, lease)]).succeeded

    def put_if_mod_revision(self, key: str, value: bytes | str, mod_revision: int,
                            lease: int | None = None) -> bool:
        """Overwrite ``key`` only if it was last written at ``mod_revision`` (0: only if absent)."""
        return self.txn([Compare(key, "mod_revision", "==", mod_revision)], [Op.put(key, value, lease)]).succeeded

    def delete_if_mod_revision(self, key: str, mod_revision: int) -> bool:
        """Delete ``key`` only if it was last written at ``mod_revision``."""
        return self.txn([Compare(key, "mod_revision", "==", mod_revision)], [Op.delete(key)]).succeeded

    # -- leases -----------------------------------------------------------------------------
    def grant(self, ttl_s: int) -> Lease:
        """A new lease of ``ttl_s`` seconds (etcd may round up to its minimum TTL)."""
        if int(ttl_s) != ttl_s or ttl_s < 1:
            raise ValueError(f"lease TTL must be a whole number of seconds >= 1, got {ttl_s!r}")
        reply = self._call("/v3/lease/grant", {"TTL": str(int(ttl_s)), "ID": "0"})
        return Lease(int(reply["ID"]), int(reply["TTL"]))

    def revoke(self, lease_id: int) -> None:
        """Revoke a lease and delete its keys (no error if it is already gone)."""
        try:
            self._call("/v3/lease/revoke", {"ID": str(lease_id)})
        except LeaseExpiredError:
            pass

    def keepalive_once(self, lease_id: int) -> int:
        """Renew a lease once; its TTL in seconds from now, or 0 if it has expired or was revoked."""
        return self._keepalive(lease_id)

    def time_to_live(self, lease_id: int) -> int | None:
        """Seconds the lease has left (rounded down), or None if it does not exist."""
        # proto3 JSON omits zeros: a missing TTL is 0 s left; etcd says -1 for an unknown lease
        ttl = int(self._call("/v3/lease/timetolive", {"ID": str(lease_id)}).get("TTL", 0))
        return None if ttl < 0 else ttl

    def _keepalive(self, lease_id: int, *, deadline: float | None = None) -> int:
        # One pass over the endpoints, no retries, when ``deadline`` is given (Session retries).
        reply = self._call("/v3/lease/keepalive", {"ID": str(lease_id)}, deadline=deadline,
                           retry=deadline is None)
        if "error" in reply:  # a streaming endpoint reports errors inside a 200 reply
            raise error_from_stream(reply["error"], "/v3/lease/keepalive")
        return int(reply.get("result", {}).get("TTL", 0))

    # -- plumbing ---------------------------------------------------------------------------
    def _call(self, path: str, payload: Mapping[str, Any], *, idempotent: bool = True,
              deadline: float | None = None, retry: bool = True) -> dict[str, Any]:
        if not retry:
            return self._call_once(path, payload, idempotent=idempotent, deadline=deadline)
        # The first pass over the endpoints always runs; retries stop at ``retry_deadline``.
        # ``deadline`` (if given) is a hard one that also caps each request's timeout.
        retry_deadline = self._clock() + self.retry_timeout_s
        if deadline is not None:
            retry_deadline = min(retry_deadline, deadline)
        backoff = tenacity.wait_random_exponential(multiplier=self._backoff[0], max=self._backoff[1])

        def wait(state: tenacity.RetryCallState) -> float:
            return max(0.0, min(backoff(state), retry_deadline - self._clock()))

        def log_retry(state: tenacity.RetryCallState) -> None:
            logger.info("etcd %s failed (attempt %d), retrying in %.2f s: %s", path, state.attempt_number,
                           state.next_action.sleep if state.next_action else 0.0,
                           state.outcome.exception() if state.outcome else None)

        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception(
                lambda e: isinstance(e, EtcdUnavailableError) and (idempotent or not e.ambiguous)),
            stop=lambda state: self._clock() >= retry_deadline, wait=wait, sleep=self._sleep,
            before_sleep=log_retry, reraise=True)
        return retrying(self._call_once, path, payload, idempotent=idempotent, deadline=deadline)

    def _call_once(self, path: str, payload: Mapping[str, Any], *, idempotent: bool,
                   deadline: float | None) -> dict[str, Any]:
        """Try each endpoint once, starting with the preferred one."""
        first, errors, ambiguous = self._preferred, [], False
        for i in range(len(self._endpoints)):
            index = (first + i) % len(self._endpoints)
            endpoint = self._endpoints[index]
            timeout_s = self.timeout_s
            if deadline is not None:
                timeout_s = min(timeout_s, deadline - self._clock())
                if timeout_s <= 0.0:
                    errors.append("deadline passed")
                    break
            try:
                reply = self._post(endpoint, path, payload, timeout_s)
            except EtcdUnavailableError as e:
                errors.append(str(e))
                ambiguous = ambiguous or e.ambiguous
                if e.ambiguous and not idempotent:
                    raise
                continue
            if index != self._preferred:
                logger.info("etcd: switching endpoint %s -> %s", self._endpoints[self._preferred], endpoint)
                self._preferred = index
            return reply
        raise EtcdUnavailableError(f"no etcd endpoint answered {path}: " + "; ".join(errors),
                                   ambiguous=ambiguous)

    def _post(self, endpoint: str, path: str, payload: Mapping[str, Any], timeout_s: float) -> dict[str, Any]:
        token = self._auth_token(endpoint, timeout_s)
        try:
            return self._transport.post(endpoint, path, payload, timeout_s=timeout_s, token=token)
        except EtcdError as e:
            if token is None or not _is_token_error(e):
                raise
            logger.info("etcd auth token rejected (%s): authenticating again", e)
            token = self._auth_token(endpoint, timeout_s, refresh=True)
            return self._transport.post(endpoint, path, payload, timeout_s=timeout_s, token=token)

    def _auth_token(self, endpoint: str, timeout_s: float, *, refresh: bool = False) -> str | None:
        """The auth token (None without credentials), fetched from ``endpoint`` if needed."""
        if self._username is None:
            return None
        with self._lock:
            if self._token is not None and not refresh:
                return self._token
        reply = self._transport.post(endpoint, "/v3/auth/authenticate",
                                     {"name": self._username, "password": self._password},
                                     timeout_s=timeout_s, token=None)
        with self._lock:
            self._token = str(reply["token"])
            return self._token

    def _ssl_context(self) -> ssl.SSLContext:
        ca_cert, cert, key = self._tls
        context = ssl.create_default_context(cafile=ca_cert)
        if cert:
            context.load_cert_chain(cert, key)
        return context
