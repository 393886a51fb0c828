"""The job store: the narrow view of etcd the node agent uses, as a protocol, and its etcd
implementation.

The agent lists a key range once and then follows its changes with a watch
(:mod:`ftrain.agents.job_view`), writes with compare-and-swap (``put_if_absent``,
``put_if_mod_revision``, ``txn``), and keeps its keys on a lease kept alive by a session.
:class:`EtcdJobStore` does that on a real etcd (:mod:`ftrain.agents.etcd`,
:mod:`ftrain.agents.etcd_session`, :mod:`ftrain.agents.etcd_watch`); the agent's unit tests use an
in-memory store with the same semantics, and one contract test suite runs against both.

What an implementation must keep (the agent relies on it):

- revisions: one store-wide counter, raised by every write; a key's ``create_revision`` is kept
  until it is deleted (join order), ``mod_revision`` is the revision of its last write; a missing
  key has every revision 0 (``Compare.absent``);
- a transaction applies all of its operations or none, atomically with its guards;
- a lease: a write attached to a lease that is gone raises :class:`LeaseExpiredError`; when the
  lease ends (expired, revoked), its keys are deleted and its session's ``done`` is set;
- transient unavailability raises :class:`EtcdUnavailableError` (callers retry next tick).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Protocol

from ftrain.agents.etcd import Compare, EtcdClient, KeyValue, Listing, Op, TxnResult
from ftrain.agents.etcd_session import Session
from ftrain.agents.etcd_watch import Watcher, WatchEvent


class LeaseSession(Protocol):
    """A lease kept alive until lost or closed (:class:`ftrain.agents.etcd_session.Session`)."""

    lease_id: int
    ttl_s: int
    done: threading.Event  #: set once the lease is lost (or the session closed); never cleared
    lost_reason: str | None

    def close(self, *, revoke: bool = True) -> None: ...


class Closable(Protocol):
    def close(self) -> None: ...


class Feed(Protocol):
    """A running watch (:class:`ftrain.agents.etcd_watch.Watcher`)."""

    def down_s(self) -> float:
        """Seconds since its stream was lost (0 while connected)."""
        ...

    def close(self) -> None: ...


class JobStore(Protocol):
    def list_prefix(self, prefix: str) -> Listing:
        """Every key under ``prefix`` at one revision (sorted by key)."""
        ...

    def get(self, key: str) -> KeyValue | None: ...

    def put(self, key: str, value: bytes | str, lease: int | None = None) -> int: ...

    def put_if_absent(self, key: str, value: bytes | str, lease: int | None = None) -> bool: ...

    def put_if_mod_revision(
        self, key: str, value: bytes | str, mod_revision: int, lease: int | None = None
    ) -> bool: ...

    def txn(self, compare: Sequence[Compare], success: Sequence[Op], failure: Sequence[Op] = ()) -> TxnResult: ...

    def revoke(self, lease_id: int) -> None:
        """End a lease now, deleting its keys (no error if it is gone already)."""
        ...

    def session(self, ttl_s: int, *, on_lost: Callable[[str], None]) -> LeaseSession:
        """A new lease of ``ttl_s`` seconds, kept alive; ``on_lost(reason)`` when it is lost."""
        ...

    def list_range(self, start: str, end: str) -> Listing:
        """Every key in ``[start, end)`` at one revision (sorted by key)."""
        ...

    def watch_range(
        self,
        start: str,
        end: str,
        *,
        start_revision: int,
        on_event: Callable[[WatchEvent], None],
        on_error: Callable[[Exception], None],
        progress_timeout_s: float,
    ) -> Feed:
        """Every change of a key in ``[start, end)`` from ``start_revision`` on, in order, each
        once, to ``on_event`` (lease expiries too, as deletes); ``on_error`` gets
        :class:`EtcdUnavailableError` when the stream is lost (it resumes by itself) and any other
        error once, when it stops (:class:`WatchCompactedError`: list again)."""
        ...

    def close(self) -> None: ...


class EtcdJobStore:
    """:class:`JobStore` on a real etcd through one :class:`EtcdClient`."""

    def __init__(self, client: EtcdClient):
        self.client = client

    def list_prefix(self, prefix: str) -> Listing:
        return self.client.list_prefix(prefix)

    def get(self, key: str) -> KeyValue | None:
        return self.client.get(key)

    def put(self, key: str, value: bytes | str, lease: int | None = None) -> int:
        return self.client.put(key, value, lease)

    def put_if_absent(self, key: str, value: bytes | str, lease: int | None = None) -> bool:
        return self.client.put_if_absent(key, value, lease)

    def put_if_mod_revision(self, key: str, value: bytes | str, mod_revision: int, lease: int | None = None) -> bool:
        return self.client.put_if_mod_revision(key, value, mod_revision, lease)

    def txn(self, compare: Sequence[Compare], success: Sequence[Op], failure: Sequence[Op] = ()) -> TxnResult:
        return self.client.txn(compare, success, failure)

    def revoke(self, lease_id: int) -> None:
        self.client.revoke(lease_id)

    def session(self, ttl_s: int, *, on_lost: Callable[[str], None]) -> Session:
        """Renewed every quarter of the TTL (three chances before it runs out)."""
        return Session(self.client, ttl_s, keepalive_interval_s=ttl_s / 4, on_lost=on_lost)

    def list_range(self, start: str, end: str) -> Listing:
        return self.client.list_range(start, end)

    def watch_range(
        self,
        start: str,
        end: str,
        *,
        start_revision: int,
        on_event: Callable[[WatchEvent], None],
        on_error: Callable[[Exception], None],
        progress_timeout_s: float,
    ) -> Watcher:
        """Lost streams are resumed by the watcher itself, from the next revision."""
        return Watcher(
            self.client,
            start,
            start_revision,
            range_end=end,
            on_event=on_event,
            on_error=on_error,
            progress_timeout_s=progress_timeout_s,
        )

    def close(self) -> None:
        self.client.close()
