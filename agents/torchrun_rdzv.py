"""torchrun rendezvous backend ``etcd-v3``: torch's dynamic rendezvous on etcd's v3 API.

``torchrun --rdzv-backend=etcd-v3 --rdzv-endpoint=HOST:PORT[,HOST:PORT...] --rdzv-id=RUN``
(registered through the entry-point group ``torchrun.handlers`` by the tiny
:mod:`ftrain.torchrun_plugin`, which imports this module only when torchrun creates a
handler). torch's own ``etcd`` and ``etcd-v2`` backends need etcd's v2 API, which etcd >= 3.4
does not serve by default and 3.6 removed; this one speaks v3 through :class:`~ftrain.agents.etcd.EtcdClient`.

What it owns, under ``<key_prefix>/<run_id>/`` (``key_prefix`` defaults to ``/ftrain/torchrun``):

- ``state``: the pickled rendezvous state of :class:`EtcdRendezvousBackend`. Every write is a
  compare-and-swap on the key's ``mod_revision``, which is the fencing token torch passes back.
- ``store/...``: :class:`EtcdStore`, the c10d ``Store`` the agents use after each round
  (rank assignment, MASTER_ADDR/PORT, exit barrier). It lives in etcd rather than in a
  TCPStore hosted by one agent because etcd is already the part that must survive node loss:
  a TCPStore dies with its host (any node may be lost, rank 0 too) and needs its own port
  chosen before anyone knows who rank 0 is; the etcd store needs neither, and the agents use
  it for a handful of small operations per round, so a round trip to etcd each costs nothing.
  (Workers do not use it: with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` they bootstrap their
  own TCPStore; without it the rank-0 agent hosts one for them, as with every torch backend.)
- ``adds/...``: one short-lived marker per :meth:`EtcdStore.add`, so that an increment whose
  reply was lost is counted exactly once.

What must stay true:

- A transaction is resent after an ambiguous failure (the request reached etcd, the reply was
  lost) only when it is a compare-and-swap against a revision: at most one copy can apply.
- Every key is written with a lease of ``state_ttl`` seconds (rolled over every ``ttl / 2``),
  so a finished run's keys expire: a later run reusing the run id (torchrun's default is
  ``none``) starts fresh once they have. Within that time a reused run id sees the old,
  closed rendezvous: give each job its own ``--rdzv-id``.
- The state is a pickle (torch's format, which torch unpickles with plain ``pickle.loads``).
  Nothing read from etcd reaches it unchecked: :func:`check_state` runs the bytes through an
  allow-list unpickler first (torch's rendezvous state classes and ``datetime`` only) and
  refuses anything else, so a writer of these keys can disrupt a rendezvous but not run code
  in the agents. Protect the prefix with etcd auth/TLS in shared clusters all the same.

**Cost at N nodes** (torch's dynamic rendezvous keeps the whole job in the one ``state`` key,
about 70 bytes per node pickled): each node reads the state about once a second (torchrun's
monitor loop asks for waiting nodes; torch caches a read for 1 s) and compare-and-swaps it every
``keep_alive_interval`` to record its heartbeat, retried when another node's write won; a
rendezvous is a few such swaps per node, more as N grows. So per node per second O(N) bytes and,
per job, O(N²) bytes per second into one key: fine at tens of nodes, not at thousands (use
``ftrain agent`` there; its workers use no etcd per step). The store is O(1) requests per node per
rendezvous, O(N/64) for the rank-0 agent (:meth:`EtcdStore.multi_get`, :meth:`EtcdStore.multi_set`);
but torch's exit barrier is an :meth:`EtcdStore.add` to one key, which N agents finishing at once
retry about N/4 times each.

This module may import torch (it is its own layer in the import-boundary test: it runs in the
torchrun launcher); the rest of ``agents`` must not.

**Size.** Over 600 lines: one implementation of torch's ``RendezvousHandler`` interface, whose
methods share one etcd protocol (join, barrier, keep-alive, shutdown) read best in one place.
"""

from __future__ import annotations

import datetime
import io
import logging
import os
import pickle
import random
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar
from urllib.parse import urlsplit

import torch.distributed as dist
from torch.distributed.elastic.rendezvous.api import (
    RendezvousConnectionError,
    RendezvousParameters,
    RendezvousStateError,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousBackend,
    RendezvousTimeout,
    Token,
    _NodeDesc,
    _RendezvousState,
)

from ftrain.agents.errors import AgentError, EtcdUnavailableError, LeaseExpiredError, WatchCompactedError
from ftrain.agents.etcd import Compare, EtcdClient, KeyValue, Op, TxnResult
from ftrain.agents.etcd_watch import Watcher

#: The backend name torchrun users pass as ``--rdzv-backend``.
BACKEND_NAME = "etcd-v3"

logger = logging.getLogger(__name__)
_T = TypeVar("_T")

#: Where the password for etcd auth comes from (never the rdzv conf: torchrun logs it).
PASSWORD_ENV = "FTRAIN_ETCD_PASSWORD"
DEFAULT_PORT = 2379


#: Puts per transaction of :meth:`EtcdStore.multi_set` (etcd refuses more than 128 by default).
PUTS_PER_TXN = 64

#: A rendezvous state is a few hundred bytes per node; anything far larger is not one.
MAX_STATE_BYTES = 1 << 20
_STATE_GLOBALS = {
    ("torch.distributed.elastic.rendezvous.dynamic_rendezvous", "_RendezvousState"): _RendezvousState,
    ("torch.distributed.elastic.rendezvous.dynamic_rendezvous", "_NodeDesc"): _NodeDesc,
    ("datetime", "datetime"): datetime.datetime,
    ("datetime", "timezone"): datetime.timezone,
    ("datetime", "timedelta"): datetime.timedelta,
}


class _StateUnpickler(pickle.Unpickler):
    """Resolves only the classes a pickled ``_RendezvousState`` refers to."""

    def find_class(self, module: str, name: str) -> type:
        cls = _STATE_GLOBALS.get((module, name))
        if cls is None:
            raise RendezvousStateError(f"it refers to {module}.{name}, which a rendezvous state never contains")
        return cls


def check_state(key: str, data: bytes) -> bytes:
    """``data`` if it is a pickled rendezvous state and nothing else; RendezvousStateError
    naming the key otherwise. torch unpickles the state with plain ``pickle.loads``: this check
    is what keeps a value written into etcd from running code in every agent."""
    if len(data) > MAX_STATE_BYTES:
        raise RendezvousStateError(
            f"etcd-v3: the rendezvous state under {key} is {len(data)} bytes, more than "
            f"{MAX_STATE_BYTES}: refusing to unpickle it"
        )
    try:
        state = _StateUnpickler(io.BytesIO(data)).load()
    except RendezvousStateError as e:
        raise RendezvousStateError(f"etcd-v3: refusing the rendezvous state under {key}: {e}") from None
    except Exception as e:  # noqa: BLE001 - any bytes that do not unpickle are not a state
        raise RendezvousStateError(
            f"etcd-v3: the rendezvous state under {key} does not unpickle ({type(e).__name__}: {e})"
        ) from None
    if not isinstance(state, _RendezvousState):
        raise RendezvousStateError(
            f"etcd-v3: the value under {key} is a {type(state).__name__}, not a rendezvous state"
        )
    return data


# -- configuration ----------------------------------------------------------------------------
def parse_endpoints(endpoint: str, *, protocol: str = "http") -> tuple[str, ...]:
    """``HOST[:PORT][,HOST[:PORT]...]`` (each may carry its own ``http(s)://``) -> client URLs.
    The port defaults to 2379, the scheme to ``protocol``."""
    if protocol not in ("http", "https"):
        raise ValueError(f"rdzv conf 'protocol' must be http or https, got {protocol!r}")
    urls = []
    for part in (endpoint or "").split(","):
        part = part.strip().rstrip("/")
        if not part:
            continue
        url = part if "://" in part else f"{protocol}://{part}"
        parts = urlsplit(url)
        try:
            port = parts.port or DEFAULT_PORT
        except ValueError as e:
            raise ValueError(f"bad etcd endpoint {part!r} in --rdzv-endpoint: {e}") from e
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.path:
            raise ValueError(f"bad etcd endpoint {part!r} in --rdzv-endpoint: expected [http(s)://]HOST[:PORT]")
        host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
        urls.append(f"{parts.scheme}://{host}:{port}")
    if not urls:
        raise ValueError("--rdzv-endpoint must list the etcd endpoints: HOST:PORT[,HOST:PORT...]")
    return tuple(urls)


def _conf_number(params: RendezvousParameters, key: str, default: float, *, minimum: float) -> float:
    raw = params.get(key)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except (TypeError, ValueError):
        raise ValueError(f"rdzv conf '{key}' must be a number of seconds, got {raw!r}") from None
    if value < minimum:
        raise ValueError(f"rdzv conf '{key}' must be >= {minimum:g}, got {raw!r}")
    return value


@dataclass(kw_only=True, slots=True)
class EtcdRdzvConfig:
    """What ``--rdzv-endpoint`` and ``--rdzv-conf`` configure for ``etcd-v3`` (besides torch's own
    ``join_timeout``, ``last_call_timeout``, ``close_timeout``, ``heartbeat_timeout``,
    ``keep_alive_interval``, ``keep_alive_max_attempt``). Durations are seconds."""

    endpoints: tuple[str, ...]
    """etcd client URLs (``--rdzv-endpoint``; rdzv conf ``protocol`` sets the default scheme)."""
    key_prefix: str = "/ftrain/torchrun"
    """rdzv conf ``key_prefix``: keys live under ``<key_prefix>/<run_id>/``."""
    request_timeout_s: float = 5.0
    """rdzv conf ``request_timeout``: one etcd request to one endpoint."""
    retry_timeout_s: float = 10.0
    """rdzv conf ``retry_timeout``: how long one operation keeps retrying an unavailable etcd."""
    read_timeout_s: float = 60.0
    """rdzv conf ``read_timeout``: the store's default wait for a key (torch's name and default)."""
    state_ttl_s: int = 7200
    """rdzv conf ``state_ttl``: keys expire this long (at least half of it) after their last
    write; 0 keeps them forever. torch's etcd-v2 backend uses the same 2 h."""
    ca_cert: str | None = None
    """rdzv conf ``ca_cert``: CA bundle for https endpoints."""
    ssl_cert: str | None = None
    """rdzv conf ``ssl_cert``: client certificate (TLS client auth)."""
    ssl_cert_key: str | None = None
    """rdzv conf ``ssl_cert_key``: its private key."""
    username: str | None = None
    """rdzv conf ``username``: etcd auth user; the password comes from ``$FTRAIN_ETCD_PASSWORD``."""
    password: str | None = None
    """Never from the rdzv conf (torchrun logs it): from the environment."""

    def __post_init__(self) -> None:
        if not self.endpoints:
            raise ValueError("etcd-v3 needs at least one endpoint")
        if not self.key_prefix.startswith("/") or self.key_prefix.endswith("/"):
            raise ValueError(f"rdzv conf 'key_prefix' must start and not end with '/', got {self.key_prefix!r}")
        if self.request_timeout_s <= 0:
            raise ValueError(f"rdzv conf 'request_timeout' must be > 0, got {self.request_timeout_s}")
        if self.read_timeout_s <= 0:
            raise ValueError(f"rdzv conf 'read_timeout' must be > 0, got {self.read_timeout_s}")
        if self.state_ttl_s != 0 and self.state_ttl_s < 10:
            raise ValueError(f"rdzv conf 'state_ttl' must be 0 (no expiry) or >= 10 s, got {self.state_ttl_s}")
        if (self.username is None) != (self.password is None):
            raise ValueError(f"rdzv conf 'username' needs the password in ${PASSWORD_ENV} (and vice versa)")
        if self.ssl_cert_key and not self.ssl_cert:
            raise ValueError("rdzv conf 'ssl_cert_key' needs 'ssl_cert'")

    @classmethod
    def from_params(cls, params: RendezvousParameters, environ: Mapping[str, str] = os.environ) -> EtcdRdzvConfig:
        protocol = str(params.get("protocol", "http")).strip().lower()
        username = params.get("username") or None
        password = environ.get(PASSWORD_ENV) or None
        if password is not None and username is None:
            password = None  # set for another tool: auth here is opted into with 'username'
        ttl = _conf_number(params, "state_ttl", 7200, minimum=0)
        if ttl != int(ttl):
            raise ValueError(f"rdzv conf 'state_ttl' must be whole seconds, got {params.get('state_ttl')!r}")
        return cls(
            endpoints=parse_endpoints(params.endpoint, protocol=protocol),
            key_prefix=str(params.get("key_prefix", "/ftrain/torchrun")).rstrip("/") or "/",
            request_timeout_s=_conf_number(params, "request_timeout", 5.0, minimum=0.001),
            retry_timeout_s=_conf_number(params, "retry_timeout", 10.0, minimum=0),
            read_timeout_s=_conf_number(params, "read_timeout", 60.0, minimum=0.001),
            state_ttl_s=int(ttl),
            ca_cert=params.get("ca_cert") or None,
            ssl_cert=params.get("ssl_cert") or None,
            ssl_cert_key=params.get("ssl_cert_key") or None,
            username=username,
            password=password,
        )

    def client(self) -> EtcdClient:
        return EtcdClient(
            list(self.endpoints),
            timeout_s=self.request_timeout_s,
            retry_timeout_s=self.retry_timeout_s,
            username=self.username,
            password=self.password,
            ca_cert=self.ca_cert,
            cert=self.ssl_cert,
            key=self.ssl_cert_key,
        )


def run_prefix(key_prefix: str, run_id: str) -> str:
    """``<key_prefix>/<run_id>/``: every key of one rendezvous."""
    if not run_id or "/" in run_id:
        raise ValueError(f"the run id must be non-empty and contain no '/', got {run_id!r}")
    return f"{key_prefix.rstrip('/')}/{run_id}/"


# -- shared plumbing --------------------------------------------------------------------------
class RollingLease:
    """The lease this process attaches to the keys it writes (None with ``ttl_s == 0``).

    A lease is granted on first use and replaced once it is ``ttl_s / 2`` old, so each key
    lives at least ``ttl_s / 2`` after its last write; nothing keeps leases alive (a key
    rewritten regularly, like the rendezvous state, moves to the newest lease each time).
    """

    def __init__(self, client: EtcdClient, ttl_s: int, *, clock: Callable[[], float] = time.monotonic):
        self._client, self.ttl_s, self._clock = client, ttl_s, clock
        self._lock = threading.Lock()
        self._id: int | None = None
        self._granted_at = 0.0

    def current(self) -> int | None:
        if self.ttl_s == 0:
            return None
        with self._lock:
            now = self._clock()
            if self._id is None or now - self._granted_at >= self.ttl_s / 2:
                self._id = self._client.grant(self.ttl_s).id
                self._granted_at = now
            return self._id

    def run(self, write: Callable[[int | None], _T]) -> _T:
        """``write(lease_id)``; if etcd says the lease is gone (expired while this process was
        stopped, or revoked), once more with a fresh one."""
        lease = self.current()
        try:
            return write(lease)
        except LeaseExpiredError:
            with self._lock:
                if self._id == lease:
                    self._id = None
            return write(self.current())


Transaction = tuple[list[Compare], list[Op], list[Op]]


def cas(
    client: EtcdClient,
    lease: RollingLease,
    build: Callable[[int | None], Transaction],
    *,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> TxnResult:
    """Run the compare-and-swap transaction ``build(lease_id)`` describes.

    The client never repeats a transaction whose reply was lost; this one may, because every
    ``build`` here guards on a revision (or on the key's absence): once one copy has applied,
    the guard fails for every other copy, so the swap happens at most once and the caller
    learns from the failure branch's reads what is there now. (Or it has no guard and only puts
    values: a copy applied twice leaves the same values.) Gives up (raising the
    :class:`EtcdUnavailableError`) after the client's ``retry_timeout_s``.
    """
    deadline = clock() + client.retry_timeout_s
    attempt = 0
    while True:
        try:
            return lease.run(lambda lease_id: client.txn(*build(lease_id)))
        except EtcdUnavailableError as e:
            if not e.ambiguous or clock() >= deadline:
                raise
            attempt += 1
            logger.info("etcd CAS reply lost (%s): sending it again (attempt %d)", e, attempt + 1)
            sleep(min(max(0.0, deadline - clock()), random.uniform(0, min(1.0, 0.05 * 2**attempt))))


# -- the rendezvous state ---------------------------------------------------------------------
class EtcdRendezvousBackend(RendezvousBackend):
    """torch's :class:`RendezvousBackend` on etcd v3: the state under ``<prefix>state``, its
    fencing token the key's ``mod_revision`` (an ``int``)."""

    def __init__(
        self,
        client: EtcdClient,
        run_id: str,
        *,
        key_prefix: str = "/ftrain/torchrun",
        lease: RollingLease | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ):
        self._client = client
        self.key = run_prefix(key_prefix, run_id) + "state"
        self._lease = lease or RollingLease(client, 0)
        self._sleep = sleep

    def __repr__(self) -> str:
        return f"EtcdRendezvousBackend({self.key!r}, {self._client!r})"

    @property
    def name(self) -> str:
        return BACKEND_NAME

    def get_state(self) -> tuple[bytes, Token] | None:
        try:
            kv = self._client.get(self.key)
        except AgentError as e:
            raise RendezvousConnectionError(f"etcd-v3: reading {self.key} failed: {e}") from e
        return None if kv is None else (check_state(self.key, kv.value), kv.mod_revision)

    def set_state(self, state: bytes, token: Token | None = None) -> tuple[bytes, Token, bool] | None:
        """Write ``state`` if the key is still at revision ``token`` (absent, for ``None``):
        ``(state, new token, True)``; otherwise ``(current state, its token, False)``, or None
        if there is no state at all. After a lost reply the same CAS is sent again; if a copy
        had applied, the state found is ours and the answer is True (as with torch's c10d
        backend, "the state now stored equals what we wrote" is what success means)."""
        if token is not None and (not isinstance(token, int) or isinstance(token, bool) or token < 0):
            current = self.get_state()  # not one of our tokens: it cannot match
            return None if current is None else (*current, False)
        expected = token or 0  # an absent key has mod_revision 0

        def build(lease_id: int | None) -> tuple[list[Compare], list[Op], list[Op]]:
            return (
                [Compare(self.key, "mod_revision", "==", expected)],
                [Op.put(self.key, state, lease_id)],
                [Op.get(self.key)],
            )

        try:
            result = cas(self._client, self._lease, build, sleep=self._sleep)
        except AgentError as e:
            raise RendezvousConnectionError(f"etcd-v3: writing {self.key} failed: {e}") from e
        if result.succeeded:
            return state, result.revision, True
        found = result.responses[0]
        if not found:
            return None
        kv = found[0]  # type: ignore[index]
        return check_state(self.key, kv.value), kv.mod_revision, kv.value == state


# -- the store --------------------------------------------------------------------------------
class EtcdStore(dist.Store):
    """A c10d :class:`~torch.distributed.Store` on etcd v3, for the agents of one rendezvous.

    Keys are ``<prefix><key>``; values bytes. ``get``/``wait`` block until the keys exist (a
    watch from the revision they were read at, so no write is missed) or the store's
    ``timeout`` passes (:class:`torch.distributed.DistStoreError`, like a TCPStore's). ``add``
    and ``compare_set`` are compare-and-swap loops with TCPStore's semantics; ``add`` counts
    exactly once even when a reply is lost. Failures of etcd raise ``DistStoreError`` too.

    Through a :class:`~torch.distributed.PrefixStore` (how torch hands it to the agent) only
    set/get/add/compare_set/wait/check and what C++ builds on them (multi_get, multi_set)
    reach Python: torch's Python-store bridge does not forward ``delete_key``/``num_keys``.
    Keep a Python reference to the store as long as a ``PrefixStore`` wraps it: the wrapper
    holds only the C++ side, and once the Python object is collected every call fails with
    "Not implemented" (the handler keeps one, so torchrun is safe).
    """

    def __init__(
        self,
        client: EtcdClient,
        prefix: str,
        *,
        timeout: timedelta = timedelta(seconds=60),
        lease: RollingLease | None = None,
        marker_prefix: str | None = None,
        progress_timeout_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        super().__init__()  # required by the pybind trampoline
        if not prefix.endswith("/"):
            raise ValueError(f"store prefix must end with '/', got {prefix!r}")
        self._client, self._prefix, self._clock = client, prefix, clock
        self._lease = lease or RollingLease(client, 0)
        self._markers = marker_prefix or prefix.rstrip("/") + ".adds/"
        self._progress_timeout_s = progress_timeout_s
        self.set_timeout(timeout)

    def __repr__(self) -> str:
        return f"EtcdStore({self._prefix!r}, {self._client!r})"

    def _key(self, key: str | bytes) -> str:
        return self._prefix + (key.decode("utf-8", "surrogateescape") if isinstance(key, bytes) else key)

    def _fail(self, what: str, e: Exception) -> dist.DistStoreError:
        return dist.DistStoreError(f"etcd store {self._prefix}: {what} failed: {e}")

    # -- c10d Store API ---------------------------------------------------------------------
    def set(self, key: str, value: bytes | str) -> None:
        try:
            self._lease.run(lambda lease_id: self._client.put(self._key(key), value, lease=lease_id))
        except AgentError as e:
            raise self._fail(f"set({key!r})", e) from e

    def get(self, key: str) -> bytes:
        return self._wait([key], self.timeout)[0]  # type: ignore[attr-defined]  # c10d Store's, no stub

    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:
        self._wait(keys, self.timeout if timeout is None else timeout)  # type: ignore[attr-defined]  # as above

    def check(self, keys: Sequence[str]) -> bool:
        try:
            found, _ = self._read([self._key(k) for k in keys])
        except AgentError as e:
            raise self._fail("check", e) from e
        return len(found) == len(set(keys))

    def add(self, key: str, amount: int) -> int:
        """Add ``amount`` to the decimal integer at ``key`` (absent: 0); the new value.

        Each call writes, in the same transaction, a marker key holding the value it wrote: if a
        reply is lost and the guard then fails, the marker says whether a copy had applied."""
        full, marker = self._key(key), f"{self._markers}{uuid.uuid4().hex}"
        try:
            kv = self._client.get(full)
            while True:
                new = self._int(kv) + int(amount)
                revision = kv.mod_revision if kv else 0

                def txn(lease_id: int | None, revision: int = revision, new: int = new) -> Transaction:
                    return (
                        [Compare(full, "mod_revision", "==", revision)],
                        [Op.put(full, str(new), lease_id), Op.put(marker, str(new), lease_id)],
                        [Op.get(full), Op.get(marker)],
                    )

                result = cas(self._client, self._lease, txn)
                if result.succeeded:
                    break
                found, mark = result.responses
                if mark:  # an earlier copy applied (its reply was lost)
                    new = int(mark[0].value)  # type: ignore[index]
                    break
                kv = found[0] if found else None  # type: ignore[index]
            self._forget(marker)
            return new
        except AgentError as e:
            raise self._fail(f"add({key!r})", e) from e

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        """TCPStore's semantics: set ``desired`` if the value is ``expected`` (or the key is absent
        and ``expected`` is empty); return the value now stored (``expected`` if the key is
        absent and ``expected`` is not empty)."""
        full = self._key(key)
        want = expected.encode() if isinstance(expected, str) else bytes(expected)
        new = desired.encode() if isinstance(desired, str) else bytes(desired)
        try:
            kv = self._client.get(full)
            while True:
                if kv is None and want:
                    return want
                if kv is not None and kv.value != want:
                    return kv.value
                guard = Compare.absent(full) if kv is None else Compare(full, "mod_revision", "==", kv.mod_revision)

                def txn(lease_id: int | None, guard: Compare = guard) -> Transaction:
                    return [guard], [Op.put(full, new, lease_id)], [Op.get(full)]

                result = cas(self._client, self._lease, txn)
                if result.succeeded:
                    return new
                found = result.responses[0]
                kv = found[0] if found else None  # type: ignore[index]
        except AgentError as e:
            raise self._fail(f"compare_set({key!r})", e) from e

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        """Like :meth:`get` for each of ``keys`` (blocking until every one exists), from one read
        of their common prefix: the rank-0 agent reads every agent's role info this way after
        each rendezvous, one request for N keys instead of N (torch's default is a ``get`` each)."""
        return self._wait(keys, self.timeout)  # type: ignore[attr-defined]  # c10d Store's, no stub

    def multi_set(self, keys: Sequence[str], values: Sequence[bytes | str]) -> None:
        """Like :meth:`set` for each key and value, :data:`PUTS_PER_TXN` to a transaction: the
        rank-0 agent writes every agent's assigned ranks this way, N/64 requests instead of N."""
        if len(keys) != len(values):
            raise dist.DistStoreError(
                f"etcd store {self._prefix}: multi_set of {len(keys)} keys and {len(values)} values"
            )
        latest = {self._key(k): v for k, v in zip(keys, values, strict=True)}  # one put per key (etcd refuses two)
        items = list(latest.items())
        try:
            for start in range(0, len(items), PUTS_PER_TXN):
                batch = items[start : start + PUTS_PER_TXN]

                def puts(lease_id: int | None, batch: list[tuple[str, bytes | str]] = batch) -> Transaction:
                    return [], [Op.put(k, v, lease_id) for k, v in batch], []

                cas(self._client, self._lease, puts)
        except AgentError as e:
            raise self._fail(f"multi_set of {len(keys)} keys", e) from e

    def delete_key(self, key: str) -> bool:
        try:
            return self._client.delete(self._key(key))
        except AgentError as e:
            raise self._fail(f"delete_key({key!r})", e) from e

    def num_keys(self) -> int:
        try:
            return len(self._client.get_prefix(self._prefix))
        except AgentError as e:
            raise self._fail("num_keys", e) from e

    # -- plumbing ---------------------------------------------------------------------------
    @staticmethod
    def _int(kv: KeyValue | None) -> int:
        if kv is None:
            return 0
        try:
            return int(kv.value)
        except ValueError:
            raise dist.DistStoreError(f"add: {kv.key} holds {kv.value[:40]!r}, not an integer") from None

    def _forget(self, marker: str) -> None:
        try:
            self._client.delete(marker)
        except AgentError as e:  # it expires with its lease (or stays, harmless) if this fails
            logger.debug("etcd store: could not delete add marker %s: %s", marker, e)

    def _read(self, keys: Sequence[str]) -> tuple[dict[str, bytes], int]:
        """The values of those of ``keys`` that exist and the revision they were read at (one
        consistent read: the keys' longest common prefix)."""
        wanted = set(keys)
        if not wanted:  # the common prefix of nothing is "": every key in etcd
            return {}, 0
        listing = self._client.list_prefix(os.path.commonprefix(list(wanted)))
        return {kv.key: kv.value for kv in listing.kvs if kv.key in wanted}, listing.revision

    def _wait(self, keys: Sequence[str], timeout: timedelta) -> list[bytes]:
        full = [self._key(k) for k in keys]
        deadline = self._clock() + timeout.total_seconds()
        try:
            while True:
                found, revision = self._read(full)
                if len(found) == len(set(full)):
                    return [found[k] for k in full]
                try:
                    self._watch_until_present(full, found, revision, deadline)
                    return [found[k] for k in full]
                except WatchCompactedError:
                    continue  # history gone: read again, watch from there
        except AgentError as e:
            raise self._fail(f"waiting for {list(keys)}", e) from e

    def _watch_until_present(self, keys: list[str], found: dict[str, bytes], revision: int, deadline: float) -> None:
        wanted = set(keys)
        with Watcher(
            self._client, os.path.commonprefix(keys), revision + 1, progress_timeout_s=self._progress_timeout_s
        ) as watcher:
            while len(found) < len(wanted):
                remaining = deadline - self._clock()
                if remaining <= 0:
                    missing = sorted(k[len(self._prefix) :] for k in wanted - found.keys())
                    raise dist.DistStoreError(f"etcd store {self._prefix}: timed out waiting for keys {missing}")
                event = watcher.get(timeout_s=remaining)
                if event is None or event.key not in wanted:
                    continue
                if event.type == "put":
                    found[event.key] = event.value
                else:
                    found.pop(event.key, None)


# -- the handler --------------------------------------------------------------------------------
def _timeout(params: RendezvousParameters, key: str) -> timedelta | None:
    raw = params.get(key)
    if raw is None or raw == "":
        return None
    try:
        seconds = int(raw)
    except (TypeError, ValueError):
        raise ValueError(f"rdzv conf '{key}' must be whole seconds, got {raw!r}") from None
    if seconds <= 0:
        raise ValueError(f"rdzv conf '{key}' must be > 0, got {raw!r}")
    return timedelta(seconds=seconds)


def create_backend(params: RendezvousParameters) -> tuple[EtcdRendezvousBackend, EtcdStore]:
    """The backend and the store for ``params`` (sharing one client and one rolling lease)."""
    config = EtcdRdzvConfig.from_params(params)
    prefix = run_prefix(config.key_prefix, params.run_id)
    client = config.client()
    lease = RollingLease(client, config.state_ttl_s)
    backend = EtcdRendezvousBackend(client, params.run_id, key_prefix=config.key_prefix, lease=lease)
    store = EtcdStore(
        client,
        prefix + "store/",
        timeout=timedelta(seconds=config.read_timeout_s),
        lease=lease,
        marker_prefix=prefix + "adds/",
    )
    logger.info("etcd-v3 rendezvous %r on %s under %s", params.run_id, ",".join(config.endpoints), prefix)
    return backend, store


def create_handler(params: RendezvousParameters) -> DynamicRendezvousHandler:
    """torch's dynamic rendezvous on :func:`create_backend`, timeouts and keep-alive settings
    from the rdzv conf (torch's keys and defaults: ``join_timeout`` 600, ``last_call_timeout``
    30, ``close_timeout`` 30, ``heartbeat_timeout`` 5, ``keep_alive_interval`` 5,
    ``keep_alive_max_attempt`` 3). A dead node is dropped after about
    ``keep_alive_interval * keep_alive_max_attempt + last_call_timeout`` seconds."""
    backend, store = create_backend(params)
    timeout = RendezvousTimeout(
        join=_timeout(params, "join_timeout"),
        last_call=_timeout(params, "last_call_timeout"),
        close=_timeout(params, "close_timeout"),
        heartbeat=_timeout(params, "heartbeat_timeout"),
    )
    interval = _timeout(params, "keep_alive_interval") or timedelta(seconds=5)
    max_attempt = params.get_as_int("keep_alive_max_attempt", 3)
    if max_attempt is None or max_attempt < 1:
        raise ValueError(
            f"rdzv conf 'keep_alive_max_attempt' must be >= 1, got {params.get('keep_alive_max_attempt')!r}"
        )
    return DynamicRendezvousHandler.from_backend(
        params.run_id,
        store,
        backend,
        params.min_nodes,
        params.max_nodes,
        params.local_addr,
        timeout,
        keep_alive_interval=int(interval.total_seconds()),
        keep_alive_max_attempt=max_attempt,
    )
