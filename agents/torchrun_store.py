"""The etcd side of the torchrun ``etcd-v3`` backend that is not the rendezvous state
(:mod:`ftrain.agents.torchrun_rdzv`): the lease its keys live on (:class:`RollingLease`), the
compare-and-swap it may repeat (:func:`cas`), and :class:`EtcdStore`, the c10d ``Store`` the
torchrun agents use after each round.

What must stay true: a transaction is sent again after an ambiguous failure only when a guard on
a revision (or an absence) lets at most one copy apply; every key is written on a lease of the
store's TTL so that a finished run's keys expire; :meth:`EtcdStore.add` counts an increment whose
reply was lost exactly once; :meth:`EtcdStore.multi_get` is one read and
:meth:`EtcdStore.multi_set` one transaction per :data:`PUTS_PER_TXN` keys.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TypeVar

import torch.distributed as dist

from ftrain.agents.errors import AgentError, EtcdUnavailableError, LeaseExpiredError, WatchCompactedError
from ftrain.agents.etcd import Compare, EtcdClient, KeyValue, Op, TxnResult
from ftrain.agents.etcd_watch import Watcher

logger = logging.getLogger(__name__)
_T = TypeVar("_T")

#: Puts per transaction of :meth:`EtcdStore.multi_set` (etcd refuses more than 128 by default).
PUTS_PER_TXN = 64


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


__all__ = ["PUTS_PER_TXN", "EtcdStore", "RollingLease", "Transaction", "cas"]
