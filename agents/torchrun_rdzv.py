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
- ``alive/<node>``: one key per node on that node's liveness lease (TTL
  ``keep_alive_interval * keep_alive_max_attempt``), gone when the node stops renewing it.

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
- Heartbeats stamped from ``alive/`` keys never reach etcd: a state written by a node carries
  its own heartbeat and every other node's as stored before (:func:`state_to_store`), so a
  dead node's stored heartbeat is never younger than its last keep-alive and torch's own
  ``_sanitize`` drops it once its lease has expired. Only the names of ``alive/`` keys are
  read, never their values.

**Cost at N nodes.** torch's dynamic rendezvous keeps the whole job in the one ``state`` key
(about 70 bytes per node pickled), reads it about once a second on every node (torchrun's monitor
loop asks for waiting nodes; torch caches a read for 1 s) and, left alone, compare-and-swaps it
every ``keep_alive_interval`` on every node only to record a heartbeat: O(N) bytes per node per
second, O(N²) per job into one key. Here liveness lives beside the state instead
(:class:`EtcdRendezvousBackend`): each node holds a lease with an ``alive/<node>`` key on it, a
keep-alive renews the lease, a read is one small transaction that fetches the state only when its
revision moved (or the ``alive/`` listing only when its count did), and readers stamp every live
node's heartbeat themselves. Steady state is then about one small read a second and one lease
renewal per ``keep_alive_interval`` per node, whatever N; a rendezvous still costs each node a
few O(N) swaps and reads of the state. The store is O(1) requests per node per rendezvous,
O(N/64) for the rank-0 agent (:meth:`EtcdStore.multi_get`, :meth:`EtcdStore.multi_set`); but
torch's exit barrier is an :meth:`EtcdStore.add` to one key, which N agents finishing at once
retry about N/4 times each. (``python -m bench.lib.torchrun_rdzv_cost`` measures it.)

This module may import torch (it is its own layer in the import-boundary test: it runs in the
torchrun launcher); the rest of ``agents`` must not.

**Size.** Over 600 lines: torch's ``RendezvousBackend`` and the handler built on it, whose
state, liveness leases and their reads share one etcd protocol and read best together; the c10d
store, the rolling lease and the repeatable compare-and-swap are :mod:`ftrain.agents.torchrun_store`.
"""

from __future__ import annotations

import datetime
import io
import logging
import os
import pickle
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar
from urllib.parse import urlsplit

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

from ftrain.agents.errors import AgentError, LeaseExpiredError
from ftrain.agents.etcd import Compare, EtcdClient, KeyValue, Op, header_revision, key_range
from ftrain.agents.torchrun_store import EtcdStore, RollingLease, Transaction, cas

#: The backend name torchrun users pass as ``--rdzv-backend``.
BACKEND_NAME = "etcd-v3"

logger = logging.getLogger(__name__)
_T = TypeVar("_T")

#: Where the password for etcd auth comes from (never the rdzv conf: torchrun logs it).
PASSWORD_ENV = "FTRAIN_ETCD_PASSWORD"
DEFAULT_PORT = 2379


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
    decode_state(key, data)
    return data


def decode_state(key: str, data: bytes) -> _RendezvousState:
    """The rendezvous state pickled in ``data``, through the allow-list unpickler (never plain
    ``pickle``); RendezvousStateError naming ``key`` for anything else."""
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
    return state


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


# -- the rendezvous state ---------------------------------------------------------------------
def _membership(state: _RendezvousState) -> tuple[object, ...]:
    """Everything in a state but the heartbeats."""
    return (
        state.round,
        state.complete,
        state.deadline,
        state.closed,
        state.participants,
        state.wait_list,
        state.redundancy_list,
        state.last_heartbeats.keys(),
    )


def heartbeat_only(new: _RendezvousState, stored: _RendezvousState) -> bool:
    """Whether ``new`` differs from ``stored`` in heartbeat times only (torch's keep-alive)."""
    return _membership(new) == _membership(stored)


def state_to_store(new: _RendezvousState, stored: _RendezvousState | None, node: _NodeDesc) -> _RendezvousState:
    """``new`` as it goes into etcd: ``node``'s own heartbeat as torch set it, every other node's
    as it was stored (what a reader stamped from the liveness keys never reaches etcd, so a
    stored heartbeat is always its owner's own and a dead node's is never younger than its death)."""
    if stored is None:
        return new
    out = _RendezvousState()
    out.round, out.complete, out.deadline, out.closed = new.round, new.complete, new.deadline, new.closed
    out.participants, out.wait_list, out.redundancy_list = new.participants, new.wait_list, new.redundancy_list
    out.last_heartbeats = {
        n: t if n == node or n not in stored.last_heartbeats else stored.last_heartbeats[n]
        for n, t in new.last_heartbeats.items()
    }
    return out


def with_heartbeats(
    stored: _RendezvousState,
    alive: frozenset[str],
    node: _NodeDesc | None,
    own: datetime.datetime | None,
    now: datetime.datetime,
) -> _RendezvousState:
    """``stored`` as torch should see it: a node whose liveness key exists beat ``now`` (this node:
    at ``own``, which the backend keeps due for a keep-alive every interval); every other node
    keeps its stored heartbeat, which torch's ``_sanitize`` drops once it is
    ``keep_alive_interval * keep_alive_max_attempt`` old. Only nodes already in
    ``last_heartbeats`` are touched: membership is never changed here."""
    out = _RendezvousState()
    out.__dict__.update(stored.__dict__)
    beats = dict(stored.last_heartbeats)
    for n in beats:
        if n == node:
            if own is not None:
                beats[n] = own
        elif repr(n) in alive:
            beats[n] = now
    out.last_heartbeats = beats
    return out


class _Liveness:
    """This node's liveness: a lease of ``ttl_s`` (``keep_alive_interval * keep_alive_max_attempt``)
    carrying the key ``alive/<node>``; torch's keep-alive renews the lease instead of rewriting
    the whole state. If this process stops, the lease and the key go, and every reader falls
    back to the node's stored heartbeat, which torch then finds too old. (Putting a key on a
    lease does not renew it: a state write that carries this node's heartbeat renews it too.)"""

    def __init__(self, client: EtcdClient, key: str, ttl_s: int, clock: Callable[[], float] = time.monotonic):
        self._client, self.key, self.ttl_s, self._clock = client, key, ttl_s, clock
        self.lease_id: int | None = None
        self._renewed_at = 0.0
        self.beat: datetime.datetime | None = None  #: the heartbeat time of the last renewal

    def lease(self) -> int:
        if self.lease_id is None:
            self.lease_id = self._client.grant(self.ttl_s).id
            self._renewed_at = self._clock()
        return self.lease_id

    def renew(self, *, unless_younger_s: float = 0.0) -> None:
        """Keep the lease alive (not if renewed less than ``unless_younger_s`` ago); if it has
        gone (this process stalled past its TTL), a new one with the key again (created anew:
        readers see it among the keys created since their last look)."""
        if self.lease_id is not None:
            if self._clock() - self._renewed_at < unless_younger_s:
                return
            started = self._clock()
            if self._client.keepalive_once(self.lease_id) > 0:
                self._renewed_at = started
                return
        self.lease_id = None
        live = self.lease()
        self._client.put(self.key, b"", lease=live)


class EtcdRendezvousBackend(RendezvousBackend):
    """torch's :class:`RendezvousBackend` on etcd v3: the state under ``<prefix>state``, its
    fencing token the key's ``mod_revision`` (an ``int``).

    Reads are a revision check: one small transaction that compares the state key's
    ``mod_revision`` with the one last read and fetches the state only if it moved. Once
    :meth:`bind` tells it whose handler it serves (``create_handler`` does), liveness moves out
    of the state: a ``set_state`` that changes only heartbeats (torch's keep-alive) renews this
    node's lease instead of swapping the state, and ``get_state`` stamps every node whose
    ``alive/`` key exists as having beaten now. Steady state is then O(1) requests and bytes per
    node per second whatever the job size; the state is rewritten only when membership changes.
    Every node of a job must run this version (an older one would see the stored heartbeats age).
    Unbound (a backend built on its own), heartbeats are swapped into the state like any change
    and ``get_state`` returns the stored bytes as they are.
    """

    def __init__(
        self,
        client: EtcdClient,
        run_id: str,
        *,
        key_prefix: str = "/ftrain/torchrun",
        lease: RollingLease | None = None,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], datetime.datetime] = lambda: datetime.datetime.now(datetime.UTC),
    ):
        self._client = client
        prefix = run_prefix(key_prefix, run_id)
        self.key = prefix + "state"
        self.alive_prefix = prefix + "alive/"
        self._lease = lease or RollingLease(client, 0)
        self._sleep, self._now = sleep, clock
        self._lock = threading.RLock()
        self._node: _NodeDesc | None = None
        self._interval = datetime.timedelta(seconds=5)
        self._live: _Liveness | None = None
        # the state last read or written: its revision (0: absent), bytes and decoded form
        self._rev: int | None = None
        self._bytes: bytes | None = None
        self._stored: _RendezvousState | None = None
        # the alive/ keys (their node names) as of revision _alive_rev
        self._alive: frozenset[str] = frozenset()
        self._alive_rev = 0

    def __repr__(self) -> str:
        return f"EtcdRendezvousBackend({self.key!r}, {self._client!r})"

    @property
    def name(self) -> str:
        return BACKEND_NAME

    def bind(self, node: _NodeDesc, *, liveness_ttl_s: int, keep_alive_interval_s: float | None = None) -> None:
        """Serve ``node``'s handler: keep its liveness in a lease of ``liveness_ttl_s`` seconds,
        renewed every ``keep_alive_interval_s`` (default: a third of the TTL) by torch's keep-alive."""
        with self._lock:
            self._node = node
            self._interval = datetime.timedelta(seconds=keep_alive_interval_s or max(1, int(liveness_ttl_s)) / 3)
            self._live = _Liveness(self._client, self.alive_prefix + repr(node), max(1, int(liveness_ttl_s)))

    # -- reads --------------------------------------------------------------------------------
    def get_state(self) -> tuple[bytes, Token] | None:
        with self._lock:
            try:
                self._refresh()
                if self._live is not None and self._live.lease_id is not None:
                    # a node that runs keeps its lease, renewed at least every interval, even
                    # while torch's keep-alive timer is not running (a join waiting for others)
                    self._live.renew(unless_younger_s=self._interval.total_seconds())
            except AgentError as e:
                raise RendezvousConnectionError(f"etcd-v3: reading {self.key} failed: {e}") from e
            return self._answer()

    def _refresh(self) -> None:
        """Bring the cached state (and, when bound, the alive set) up to date in one small
        transaction: the state only if its revision moved; of ``alive/`` its count and the keys
        created since the last look. Every key alive now existed then (and so is cached) or was
        created since, so the cache plus the new keys hold every live key, and equal counts
        mean they hold no dead one; otherwise (a node's lease expired) one listing follows."""
        alive_ops = []
        if self._node is not None:
            where = key_range(self.alive_prefix, True)
            alive_ops = [
                {"request_range": {**where, "count_only": True}},
                {"request_range": {**where, "keys_only": True, "min_create_revision": str(self._alive_rev + 1)}},
            ]
        fetch = [Op.get(self.key).to_json(), *alive_ops]
        if self._rev is None:
            payload = {"compare": [], "success": fetch, "failure": []}
        else:
            compare = [Compare(self.key, "mod_revision", "==", self._rev).to_json()]
            payload = {"compare": compare, "success": alive_ops, "failure": fetch}
        # count_only/keys_only ranges, which Op cannot express; a read, so safe to resend
        reply = self._client._call("/v3/kv/txn", payload)  # noqa: SLF001
        responses = [r.get("response_range", {}) for r in reply.get("responses", [])]
        if self._rev is None or not reply.get("succeeded"):
            state_kvs = responses.pop(0).get("kvs", [])
            kv = KeyValue.from_json(state_kvs[0]) if state_kvs else None
            if kv is None:
                self._rev, self._bytes, self._stored = 0, None, None
            else:
                stored = decode_state(self.key, kv.value)  # raises before anything is cached
                self._rev, self._bytes, self._stored = kv.mod_revision, kv.value, stored
        if self._node is not None:
            count = int(responses[0].get("count", 0))
            created = {KeyValue.from_json(k).key[len(self.alive_prefix) :] for k in responses[1].get("kvs", [])}
            alive = self._alive | created
            if len(alive) == count:
                self._alive, self._alive_rev = alive, header_revision(reply)
            else:
                listing = self._client.list_prefix(self.alive_prefix)  # values are empty
                self._set_alive([kv.key for kv in listing.kvs])
                self._alive_rev = listing.revision

    def _set_alive(self, keys: list[str]) -> None:
        self._alive = frozenset(k[len(self.alive_prefix) :] for k in keys)

    def _answer(self) -> tuple[bytes, Token] | None:
        """The cached state as torch should see it."""
        if self._rev is None or self._bytes is None or self._stored is None:
            return None
        if self._node is None or not self._stored.last_heartbeats:
            return self._bytes, self._rev
        now, own = self._now(), self._live.beat if self._live is not None else None
        if own is not None:
            # never older than one interval in this node's own eyes (so torch, which drops nodes
            # whose heartbeat is keep_alive_max_attempt intervals old, never drops itself while it
            # runs), and always due for a keep-alive once an interval has passed: torch renews
            # the lease every interval, as it would have rewritten the heartbeat
            own = max(own, now - self._interval)
        seen = with_heartbeats(self._stored, self._alive, self._node, own, now)
        if seen.last_heartbeats == self._stored.last_heartbeats:
            return self._bytes, self._rev
        return pickle.dumps(seen), self._rev

    # -- writes -------------------------------------------------------------------------------
    def set_state(self, state: bytes, token: Token | None = None) -> tuple[bytes, Token, bool] | None:
        """Write ``state`` if the key is still at revision ``token`` (absent, for ``None``):
        ``(state, new token, True)``; otherwise ``(current state, its token, False)``, or None
        if there is no state at all. After a lost reply the same CAS is sent again; if a copy
        had applied, the state found is ours and the answer is True (as with torch's c10d
        backend, "the state now stored equals what we wrote" is what success means).

        Bound to a node (:meth:`bind`), a write whose only change is this node's heartbeat is
        a lease keep-alive, answered True with the same token; other writes store the other
        nodes' heartbeats as they were stored (:func:`state_to_store`)."""
        if token is not None and (not isinstance(token, int) or isinstance(token, bool) or token < 0):
            current = self.get_state()  # not one of our tokens: it cannot match
            return None if current is None else (*current, False)
        with self._lock:
            try:
                return self._set_state(state, token)
            except AgentError as e:
                raise RendezvousConnectionError(f"etcd-v3: writing {self.key} failed: {e}") from e

    def _set_state(self, state: bytes, token: int | None) -> tuple[bytes, Token, bool] | None:
        expected = token or 0  # an absent key has mod_revision 0
        node, live = self._node, self._live
        to_store, new, stored_form = state, None, None
        base = self._stored if self._rev == expected and expected else None
        if node is not None and live is not None:
            try:
                new = decode_state(self.key, state)  # torch's own bytes, still never plain pickle
            except RendezvousStateError:
                new = None  # a state this version cannot read: swap it as it is
        if new is not None and live is not None and node is not None:
            if base is not None and heartbeat_only(new, base) and node in new.last_heartbeats:
                beat = new.last_heartbeats[node]
                if self._live_lease_held():
                    live.renew(unless_younger_s=self._interval.total_seconds() / 2)
                    live.beat = beat
                    return state, expected, True
            stored_form = state_to_store(new, base, node)
            if stored_form is not new:
                to_store = pickle.dumps(stored_form)
            else:
                stored_form = None  # decoded again from the bytes stored
        extra: list[Op] = []
        if new is not None and live is not None and node is not None:
            if node in new.last_heartbeats:
                if live.lease_id is not None and new.last_heartbeats[node] != live.beat:
                    live.renew(unless_younger_s=self._interval.total_seconds() / 2)
                extra.append(Op.put(live.key, b"", live.lease()))
            elif base is not None and node in base.last_heartbeats:
                extra.append(Op.delete(live.key))

        # alive/ is not read here: a node that joined since carries its own fresh heartbeat in
        # the state found, and the next read brings the alive set up to date
        def build(lease_id: int | None) -> Transaction:
            return (
                [Compare(self.key, "mod_revision", "==", expected)],
                [Op.put(self.key, to_store, lease_id), *extra],
                [Op.get(self.key)],
            )

        try:
            result = cas(self._client, self._lease, build, sleep=self._sleep)
        except LeaseExpiredError:
            if live is None or not extra or extra[0].kind != "put":
                raise
            live.lease_id = None  # the liveness lease expired: once more with a new one
            extra[0] = Op.put(live.key, b"", live.lease())
            result = cas(self._client, self._lease, build, sleep=self._sleep)
        if result.succeeded:
            if live is not None and extra:
                own_name = live.key[len(self.alive_prefix) :]
                alive = self._alive | {own_name} if extra[0].kind == "put" else self._alive - {own_name}
                self._alive = alive
            self._remember(to_store, result.revision, stored_form)
            if live is not None and new is not None and node is not None:
                live.beat = new.last_heartbeats.get(node)
            return state, result.revision, True
        found = result.responses[0]
        if not found:
            self._rev, self._bytes, self._stored = 0, None, None
            return None
        kv = found[0]  # type: ignore[index]
        stored = decode_state(self.key, kv.value)
        mine = kv.value == to_store
        self._remember(kv.value, kv.mod_revision, stored)
        if mine:
            if live is not None and new is not None and node is not None:
                live.beat = new.last_heartbeats.get(node)
            return state, kv.mod_revision, True
        answer = self._answer()
        return None if answer is None else (*answer, False)

    def _remember(self, data: bytes, rev: int, stored: _RendezvousState | None) -> None:
        self._rev, self._bytes = rev, data
        self._stored = stored if stored is not None else decode_state(self.key, data)

    def _live_lease_held(self) -> bool:
        return self._live is not None and self._live.lease_id is not None


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
    handler = DynamicRendezvousHandler.from_backend(
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
    # torch keeps the node it generated private; without it the backend swaps every heartbeat
    # into the state, as torch's own backends do
    node = getattr(handler, "_this_node", None)
    if isinstance(node, _NodeDesc):
        backend.bind(
            node,
            liveness_ttl_s=int(interval.total_seconds()) * max_attempt,
            keep_alive_interval_s=interval.total_seconds(),
        )
    return handler
