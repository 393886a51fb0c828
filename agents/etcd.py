"""etcd v3 client layer for the node agent: the KV/transaction/lease client and its value types.
How a cluster is reached (endpoint rotation, auth token, TLS, backoff, the HTTP transport) lives
in :mod:`ftrain.agents.etcd_endpoints`; sessions (kept-alive leases) in :mod:`ftrain.agents.etcd_session`,
watches in :mod:`ftrain.agents.etcd_watch`. Both build on :class:`EtcdClient` and its public
``endpoints`` object (they import this module, so this module never imports them).

Speaks etcd's HTTP/JSON gRPC gateway (``POST /v3/...`` on the client port; every etcd >= 3.4
serves it). etcd3gw speaks the same protocol, but its client has one fixed timeout per client
(a :class:`~ftrain.agents.etcd_session.Session` needs per-call deadlines), no auth header, maps
transport errors to types that lose whether the request was sent (we must tell "never sent"
from "maybe applied" to retry transactions safely), and its watch thread hangs silently on a
dead server. So requests go through ``requests`` here and the watch stream is our own loop over
``http.client``.

Conventions (the same in every call):

- **keys are ``str``** (UTF-8 on the wire; a non-UTF-8 key written by someone else comes back
  through ``surrogateescape`` and round-trips); **values are ``bytes``** (``str`` accepted on
  input, encoded UTF-8; always ``bytes`` out). Revisions and lease ids are ``int``.
- Every method retries :class:`~ftrain.agents.errors.EtcdUnavailableError` with jittered exponential
  backoff for at most ``retry_timeout_s``, trying each endpoint in turn, starting from the last
  one that answered. A request that may already have been applied (the reply was lost) is
  retried only if repeating it is harmless: reads, plain ``put``/``delete``, lease calls. A
  transaction is never repeated after an ambiguous failure (the same rule as etcd's Go client):
  the caller gets ``EtcdUnavailableError(ambiguous=True)`` and must re-read.
"""

from __future__ import annotations

import base64
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import tenacity

from ftrain.agents.errors import EtcdUnavailableError, LeaseExpiredError
from ftrain.agents.etcd_endpoints import Backoff, Endpoints, TlsFiles, Transport, error_from_stream

logger = logging.getLogger(__name__)


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


def key_range(key: str, prefix: bool) -> dict[str, str]:
    """The ``key`` (and ``range_end``) fields selecting ``key``, or every key under it if ``prefix``."""
    raw = encode_key(key)
    if not prefix:
        return {"key": b64(raw)}
    return {"key": b64(raw or b"\0"), "range_end": b64(prefix_range_end(raw))}


def header_revision(d: Mapping[str, Any]) -> int:
    """The store revision in a reply's (or a watch message's) header; 0 if absent."""
    return int(d.get("header", {}).get("revision", 0))


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
        return cls(
            key=decode_key(unb64(d["key"])),
            value=unb64(d.get("value", "")),
            create_revision=int(d.get("create_revision", 0)),
            mod_revision=int(d.get("mod_revision", 0)),
            version=int(d.get("version", 0)),
            lease=int(d.get("lease", 0)),
        )


@dataclass(frozen=True, slots=True)
class Listing:
    """Keys under a prefix and the store revision they were read at (watch from ``revision + 1``)."""

    kvs: list[KeyValue]
    revision: int


@dataclass(frozen=True, slots=True)
class Lease:
    id: int
    ttl_s: int


_TARGETS = {
    "create_revision": "CREATE",
    "mod_revision": "MOD",
    "version": "VERSION",
    "value": "VALUE",
    "lease": "LEASE",
}
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
        return {
            "key": b64(encode_key(self.key)),
            "target": _TARGETS[self.target],
            "result": _RESULTS[self.op],
            self.target: value,
        }


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
        return {name: key_range(self.key, self.prefix)}


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
        return cls(bool(d.get("succeeded", False)), header_revision(d), tuple(out))


# -- client -----------------------------------------------------------------------------------
class EtcdClient:
    """A thread-safe etcd v3 client over the HTTP gateway, with endpoint failover and retries.

    ``endpoints``: ``http(s)://host:port`` client URLs of the cluster's members. ``timeout_s``:
    per request and endpoint. ``retry_timeout_s``: how long one call keeps retrying transient
    failures. ``username``/``password``: etcd v3 auth (token fetched lazily, refreshed when
    etcd rejects it). ``ca_cert``/``cert``/``key``: TLS for ``https`` endpoints.
    ``backoff_initial_s``/``backoff_max_s``: between retries. These make up the public
    :attr:`endpoints` object (:class:`~ftrain.agents.etcd_endpoints.Endpoints`), which sessions and
    watches on this client share. ``sleep``, ``clock`` and ``transport`` are injectable for tests.
    """

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        timeout_s: float = 2.0,
        retry_timeout_s: float = 10.0,
        username: str | None = None,
        password: str | None = None,
        ca_cert: str | None = None,
        cert: str | None = None,
        key: str | None = None,
        backoff_initial_s: float = 0.05,
        backoff_max_s: float = 1.0,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
        transport: Transport | None = None,
    ):
        if timeout_s <= 0 or retry_timeout_s < 0:
            raise ValueError("timeout_s must be > 0 and retry_timeout_s >= 0")
        #: How this client reaches the cluster; shared with its sessions and watches.
        self.endpoints = Endpoints(
            endpoints,
            username=username,
            password=password,
            tls=TlsFiles(ca_cert, cert, key),
            backoff=Backoff(backoff_initial_s, backoff_max_s),
            transport=transport,
        )
        self.timeout_s = timeout_s
        self.retry_timeout_s = retry_timeout_s
        self._sleep, self._clock = sleep, clock

    def __repr__(self) -> str:
        return f"EtcdClient({list(self.endpoints.urls)}, current={self.endpoint})"

    @property
    def endpoint(self) -> str:
        """The endpoint that answered last (tried first by the next call)."""
        return self.endpoints.current

    def close(self) -> None:
        self.endpoints.close()

    def __enter__(self) -> EtcdClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- KV ---------------------------------------------------------------------------------
    def get(self, key: str) -> KeyValue | None:
        kvs = self._call("/v3/kv/range", key_range(key, False)).get("kvs", [])
        return KeyValue.from_json(kvs[0]) if kvs else None

    def get_prefix(self, prefix: str) -> list[KeyValue]:
        """Every key starting with ``prefix``, sorted by key."""
        return self.list_prefix(prefix).kvs

    def list_prefix(self, prefix: str) -> Listing:
        """Like :meth:`get_prefix`, with the revision it was read at (to watch from ``+ 1``)."""
        reply = self._call("/v3/kv/range", key_range(prefix, True))
        return Listing([KeyValue.from_json(kv) for kv in reply.get("kvs", [])], header_revision(reply))

    def list_range(self, start: str, end: str, *, revision: int = 0) -> Listing:
        """Every key in ``[start, end)``, sorted by key, read at ``revision`` (0: now; a compacted
        revision raises :class:`~ftrain.agents.errors.EtcdError`)."""
        body = {"key": b64(encode_key(start)), "range_end": b64(encode_key(end))}
        if revision:
            body["revision"] = str(revision)
        reply = self._call("/v3/kv/range", body)
        return Listing([KeyValue.from_json(kv) for kv in reply.get("kvs", [])], revision or header_revision(reply))

    def current_revision(self) -> int:
        """The store's current revision."""
        return header_revision(self._call("/v3/kv/range", {"key": b64(b"\0"), "count_only": True}))

    def put(self, key: str, value: bytes | str, lease: int | None = None) -> int:
        """Write ``key`` (at least once: a retry after a lost reply writes it again); the new revision.
        Raises :class:`LeaseExpiredError` if ``lease`` is gone."""
        payload: dict[str, Any] = {"key": b64(encode_key(key)), "value": b64(encode_value(value))}
        if lease:
            payload["lease"] = str(lease)
        return header_revision(self._call("/v3/kv/put", payload))

    def delete(self, key: str) -> bool:
        """Delete ``key``; whether it existed (may say False if a retry followed a lost reply)."""
        return int(self._call("/v3/kv/deleterange", key_range(key, False)).get("deleted", 0)) > 0

    def delete_prefix(self, prefix: str) -> int:
        """Delete every key starting with ``prefix``; how many there were."""
        return int(self._call("/v3/kv/deleterange", key_range(prefix, True)).get("deleted", 0))

    def compact(self, revision: int) -> None:
        """Drop history before ``revision`` (watches starting earlier get WatchCompactedError)."""
        self._call("/v3/kv/compaction", {"revision": str(revision), "physical": True})

    # -- transactions -----------------------------------------------------------------------
    def txn(self, compare: Sequence[Compare], success: Sequence[Op], failure: Sequence[Op] = ()) -> TxnResult:
        """If every ``compare`` holds run ``success``, else ``failure``, atomically.

        Never repeated after an ambiguous failure: then ``EtcdUnavailableError(ambiguous=True)``
        and the outcome is unknown (re-read; fencing with a lease or revision makes that safe).
        """
        payload = {
            "compare": [c.to_json() for c in compare],
            "success": [o.to_json() for o in success],
            "failure": [o.to_json() for o in failure],
        }
        return TxnResult.from_json(self._call("/v3/kv/txn", payload, idempotent=False))

    def put_if_absent(self, key: str, value: bytes | str, lease: int | None = None) -> bool:
        """Create ``key`` unless it exists (``create_revision == 0``); whether this call created it."""
        return self.txn([Compare.absent(key)], [Op.put(key, value, lease)]).succeeded

    def put_if_mod_revision(self, key: str, value: bytes | str, mod_revision: int, lease: int | None = None) -> bool:
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

    def revoke(self, lease_id: int, *, retry: bool = True) -> None:
        """Revoke a lease and delete its keys (no error if it is already gone). ``retry=False``:
        one pass over the endpoints, for a caller that lets the lease expire if etcd is down."""
        try:
            self._call("/v3/lease/revoke", {"ID": str(lease_id)}, retry=retry)
        except LeaseExpiredError:
            pass

    def keepalive_once(self, lease_id: int, *, deadline: float | None = None) -> int:
        """Renew a lease once; its TTL in seconds from now, or 0 if it has expired or was revoked.

        With ``deadline`` (on this client's clock): one pass over the endpoints, no retries, each
        request's timeout cut to the time left (a :class:`~ftrain.agents.etcd_session.Session` retries on
        its own schedule and must know by its deadline)."""
        reply = self._call("/v3/lease/keepalive", {"ID": str(lease_id)}, deadline=deadline, retry=deadline is None)
        if "error" in reply:  # a streaming endpoint reports errors inside a 200 reply
            raise error_from_stream(reply["error"], "/v3/lease/keepalive")
        return int(reply.get("result", {}).get("TTL", 0))

    def time_to_live(self, lease_id: int) -> int | None:
        """Seconds the lease has left (rounded down), or None if it does not exist."""
        # proto3 JSON omits zeros: a missing TTL is 0 s left; etcd says -1 for an unknown lease
        ttl = int(self._call("/v3/lease/timetolive", {"ID": str(lease_id)}).get("TTL", 0))
        return None if ttl < 0 else ttl

    # -- plumbing ---------------------------------------------------------------------------
    def _call(
        self,
        path: str,
        payload: Mapping[str, Any],
        *,
        idempotent: bool = True,
        deadline: float | None = None,
        retry: bool = True,
    ) -> dict[str, Any]:
        """POST ``payload`` to ``path`` under this client's retry rules (module docstring);
        ``retry=False``: one pass over the endpoints."""
        if not retry:
            return self._call_once(path, payload, idempotent=idempotent, deadline=deadline)
        # The first pass over the endpoints always runs; retries stop at ``retry_deadline``.
        # ``deadline`` (if given) is a hard one that also caps each request's timeout.
        retry_deadline = self._clock() + self.retry_timeout_s
        if deadline is not None:
            retry_deadline = min(retry_deadline, deadline)
        backoff = self.endpoints.backoff

        def wait(state: tenacity.RetryCallState) -> float:
            return max(0.0, min(backoff.delay_s(state.attempt_number), retry_deadline - self._clock()))

        def log_retry(state: tenacity.RetryCallState) -> None:
            logger.info(
                "etcd %s failed (attempt %d), retrying in %.2f s: %s",
                path,
                state.attempt_number,
                state.next_action.sleep if state.next_action else 0.0,
                state.outcome.exception() if state.outcome else None,
            )

        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception(
                lambda e: isinstance(e, EtcdUnavailableError) and (idempotent or not e.ambiguous)
            ),
            stop=lambda state: self._clock() >= retry_deadline,
            wait=wait,
            sleep=self._sleep,
            before_sleep=log_retry,
            reraise=True,
        )
        return retrying(self._call_once, path, payload, idempotent=idempotent, deadline=deadline)

    def _call_once(
        self, path: str, payload: Mapping[str, Any], *, idempotent: bool, deadline: float | None
    ) -> dict[str, Any]:
        """Try each endpoint once, starting with the one that answered last."""
        errors: list[str] = []
        ambiguous = False
        for endpoint in self.endpoints.rotation():
            timeout_s = self.timeout_s
            if deadline is not None:
                timeout_s = min(timeout_s, deadline - self._clock())
                if timeout_s <= 0.0:
                    errors.append("deadline passed")
                    break
            try:
                reply = self.endpoints.post(endpoint, path, payload, timeout_s=timeout_s)
            except EtcdUnavailableError as e:
                errors.append(str(e))
                ambiguous = ambiguous or e.ambiguous
                if e.ambiguous and not idempotent:
                    raise
                continue
            self.endpoints.answered(endpoint)
            return reply
        raise EtcdUnavailableError(f"no etcd endpoint answered {path}: " + "; ".join(errors), ambiguous=ambiguous)
