"""An in-memory :class:`ftrain.agents.jobstore.JobStore` on a fake clock, for the agent's unit tests.

It keeps what the agent relies on from etcd (see :mod:`ftrain.agents.jobstore`): one store-wide
revision raised by every write, ``create_revision``/``mod_revision``/``version`` per key,
transactions that apply all of their operations or none, leases whose keys go with them, and a
write on a gone lease refused with :class:`LeaseExpiredError`. The same contract suite runs
against it and against a real etcd (tests/integration/test_jobstore_contract.py).

Leases are kept alive while their holder lives: :meth:`MemorySession.halt` is the holder dying
(SIGKILL), after which the lease runs out ``ttl_s`` later on the clock; nothing happens between
calls, so a test advances the clock and the next call of any agent sees the expiry.
"""

from __future__ import annotations

import operator
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ftrain.agents.errors import LeaseExpiredError
from ftrain.agents.etcd import Compare, KeyValue, Listing, Op, OpResult, TxnResult, encode_value
from ftrain.agents.etcd_watch import WatchEvent

_COMPARE: dict[str, Callable[[Any, Any], bool]] = {
    "==": operator.eq,
    "!=": operator.ne,
    "<": operator.lt,
    ">": operator.gt,
}


class FakeClock:
    """Wall and monotonic time that move only when the test says so."""

    def __init__(self, wall_s: float = 1_700_000_000.0, monotonic_s: float = 1000.0):
        self._wall_s, self._monotonic_s = wall_s, monotonic_s

    def time(self) -> float:
        return self._wall_s

    def monotonic(self) -> float:
        return self._monotonic_s

    def advance(self, seconds: float) -> None:
        self._wall_s += seconds
        self._monotonic_s += seconds


@dataclass
class _Lease:
    ttl_s: int
    expires_at: float | None = None  #: None while kept alive
    keys: set[str] = field(default_factory=set)
    sessions: list[MemorySession] = field(default_factory=list)


class MemorySession:
    """A lease kept alive until :meth:`halt` (its holder died) or :meth:`close`."""

    def __init__(self, store: MemoryJobStore, lease_id: int, ttl_s: int, on_lost: Callable[[str], None] | None):
        self._store, self._on_lost = store, on_lost
        self.lease_id, self.ttl_s = lease_id, ttl_s
        self.done = threading.Event()
        self.lost_reason: str | None = None

    def halt(self) -> None:
        """The holder died: no keepalive from now on; the lease ends ``ttl_s`` later."""
        self._store._stop_keepalive(self.lease_id)

    def close(self, *, revoke: bool = True) -> None:
        if revoke and not self.done.is_set():
            self._store.revoke(self.lease_id)
        self._lose("closed")

    def _lose(self, reason: str) -> None:
        if self.done.is_set():
            return
        self.lost_reason = reason
        self.done.set()
        if reason != "closed" and self._on_lost is not None:
            self._on_lost(reason)


class _Watch:
    """Events of ``[start, end)`` delivered as the writes happen (on the writer's thread)."""

    def __init__(self, store: MemoryJobStore, start: str, end: str, on_event: Callable[[WatchEvent], None]):
        self._store, self.start, self.end, self.on_event = store, start, end, on_event

    def down_s(self) -> float:
        return 0.0

    def close(self) -> None:
        self._store._watches.discard(self)


class MemoryJobStore:
    def __init__(self, clock: FakeClock):
        self.clock = clock
        self.revision = 1  # etcd starts at 1
        self._kvs: dict[str, KeyValue] = {}
        self._leases: dict[int, _Lease] = {}
        self._next_lease = 0x1000
        self._watches: set[_Watch] = set()
        self.closed = False

    # -- reads ------------------------------------------------------------------------------
    def list_prefix(self, prefix: str) -> Listing:
        self._expire()
        return Listing([kv for key, kv in sorted(self._kvs.items()) if key.startswith(prefix)], self.revision)

    def list_range(self, start: str, end: str) -> Listing:
        self._expire()
        return Listing([kv for key, kv in sorted(self._kvs.items()) if start <= key < end], self.revision)

    def get(self, key: str) -> KeyValue | None:
        self._expire()
        return self._kvs.get(key)

    # -- writes -----------------------------------------------------------------------------
    def put(self, key: str, value: bytes | str, lease: int | None = None) -> int:
        return self.txn([], [Op.put(key, value, lease)]).revision

    def put_if_absent(self, key: str, value: bytes | str, lease: int | None = None) -> bool:
        return self.txn([Compare.absent(key)], [Op.put(key, value, lease)]).succeeded

    def put_if_mod_revision(self, key: str, value: bytes | str, mod_revision: int, lease: int | None = None) -> bool:
        return self.txn([Compare(key, "mod_revision", "==", mod_revision)], [Op.put(key, value, lease)]).succeeded

    def txn(self, compare: Sequence[Compare], success: Sequence[Op], failure: Sequence[Op] = ()) -> TxnResult:
        """Guards and operations at one revision: all of the chosen branch, or (on an error) nothing."""
        self._expire()
        succeeded = all(self._holds(c) for c in compare)
        ops = success if succeeded else failure
        for op in ops:
            if op.kind == "put" and op.lease and op.lease not in self._leases:
                raise LeaseExpiredError(f"lease {op.lease:x} not found")
        writes = any(op.kind == "put" or (op.kind == "delete" and self._matching(op)) for op in ops)
        revision = self.revision + 1 if writes else self.revision
        events: list[WatchEvent] = []
        responses: list[OpResult] = [self._apply(op, revision, events) for op in ops]
        if writes:
            self.revision = revision
            self._notify(events)
        return TxnResult(succeeded, self.revision, tuple(responses))

    # -- leases -----------------------------------------------------------------------------
    def session(self, ttl_s: int, *, on_lost: Callable[[str], None]) -> MemorySession:
        self._expire()
        self._next_lease += 1
        lease = _Lease(ttl_s)
        self._leases[self._next_lease] = lease
        session = MemorySession(self, self._next_lease, ttl_s, on_lost)
        lease.sessions.append(session)
        return session

    def revoke(self, lease_id: int) -> None:
        self._expire()
        self._end_lease(lease_id, "lease expired or was revoked")

    def watch_range(
        self,
        start: str,
        end: str,
        *,
        start_revision: int,
        on_event: Callable[[WatchEvent], None],
        on_error: Callable[[Exception], None],
        progress_timeout_s: float,
    ) -> _Watch:
        """Events from now on (``start_revision`` must be the next revision: no history is kept)."""
        if start_revision != self.revision + 1:
            raise ValueError(f"the memory store keeps no history: watch from {self.revision + 1}, not {start_revision}")
        watch = _Watch(self, start, end, on_event)
        self._watches.add(watch)
        return watch

    def close(self) -> None:
        self.closed = True

    # -- internals --------------------------------------------------------------------------
    def _holds(self, c: Compare) -> bool:
        """As etcd compares: a missing key has every revision (and its lease) 0, and no value."""
        kv = self._kvs.get(c.key)
        if c.target == "value":
            return kv is not None and _COMPARE[c.op](kv.value, encode_value(c.value))  # type: ignore[arg-type]
        return _COMPARE[c.op](getattr(kv, c.target) if kv is not None else 0, c.value)

    def _matching(self, op: Op) -> list[str]:
        return sorted(k for k in self._kvs if (k.startswith(op.key) if op.prefix else k == op.key))

    def _apply(self, op: Op, revision: int, events: list[WatchEvent]) -> OpResult:
        if op.kind == "get":
            return [self._kvs[k] for k in self._matching(op)]
        if op.kind == "delete":
            keys = self._matching(op)
            for key in keys:
                self._delete(key)
                events.append(WatchEvent("delete", key, b"", revision, 0))
            return len(keys)
        prev = self._kvs.get(op.key)
        if prev is not None and prev.lease in self._leases:
            self._leases[prev.lease].keys.discard(op.key)
        if op.lease:
            self._leases[op.lease].keys.add(op.key)
        kv = KeyValue(
            op.key,
            op.value,
            prev.create_revision if prev else revision,
            revision,
            prev.version + 1 if prev else 1,
            op.lease or 0,
        )
        self._kvs[op.key] = kv
        events.append(WatchEvent("put", kv.key, kv.value, revision, kv.create_revision, kv.version, kv.lease))
        return None

    def _delete(self, key: str) -> None:
        kv = self._kvs.pop(key)
        if kv.lease in self._leases:
            self._leases[kv.lease].keys.discard(key)

    def _stop_keepalive(self, lease_id: int) -> None:
        lease = self._leases.get(lease_id)
        if lease is not None and lease.expires_at is None:
            lease.expires_at = self.clock.monotonic() + lease.ttl_s

    def expire_leases(self) -> None:
        """End the leases whose time ran out on the clock (every call does it first; a test
        whose agents make no call in a tick calls this, as etcd expires them by itself)."""
        self._expire()

    def _expire(self) -> None:
        now = self.clock.monotonic()
        for lease_id, lease in list(self._leases.items()):
            if lease.expires_at is not None and now >= lease.expires_at:
                self._end_lease(lease_id, f"no keepalive succeeded within the {lease.ttl_s} s TTL")

    def _end_lease(self, lease_id: int, reason: str) -> None:
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            return
        if lease.keys:  # one revision for all of the lease's keys, as etcd deletes them
            self.revision += 1
            for key in sorted(lease.keys):
                del self._kvs[key]
            self._notify([WatchEvent("delete", key, b"", self.revision, 0) for key in sorted(lease.keys)])
        for session in lease.sessions:
            session._lose(reason)

    def _notify(self, events: list[WatchEvent]) -> None:
        for watch in list(self._watches):
            for event in events:
                if watch.start <= event.key < watch.end:
                    watch.on_event(event)


__all__ = ["FakeClock", "MemoryJobStore", "MemorySession"]
