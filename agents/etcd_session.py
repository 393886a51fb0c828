"""etcd sessions: a lease kept alive from a daemon thread (:class:`Session`) and the pure
renewal policy it follows (:class:`KeepaliveSchedule`).

What must stay true: ``Session.done`` is set no later than the lease's deadline as computed
locally (send time of the last successful keepalive + the TTL it returned), even when etcd
never answers; a lost session never comes back (make a new one); when the local deadline
passes the session tries once to revoke the lease, so a late keepalive cannot keep this node's
keys alive after it gave them up. It renews and revokes through the public lease calls of
:class:`~ftrain.agents.etcd.EtcdClient`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from ftrain.agents.errors import EtcdError, EtcdUnavailableError, LeaseExpiredError
from ftrain.agents.etcd import EtcdClient

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class KeepaliveSchedule:
    """When to renew a lease and when to give it up: pure, driven by the caller's clock.

    ``deadline``: until then the lease is known to live. A keepalive sent at ``t`` whose reply
    says TTL ``r`` was processed after ``t``, so the lease lives at least until ``t + r``.
    """

    interval_s: float  #: between successful renewals
    retry_interval_s: float  #: between attempts after a failed one
    deadline: float

    def renewed(self, sent_at: float, ttl_s: float) -> None:
        self.deadline = max(self.deadline, sent_at + ttl_s)

    def expired(self, now: float) -> bool:
        return now >= self.deadline

    def remaining_s(self, now: float) -> float:
        return max(0.0, self.deadline - now)

    def next_delay_s(self, now: float, *, failed: bool) -> float:
        """Seconds to wait before the next attempt (never past the deadline)."""
        return min(self.retry_interval_s if failed else self.interval_s, self.remaining_s(now))


class Session:
    """A lease kept alive from a daemon thread, like etcd's Go ``concurrency.Session``.

    Attach keys with ``client.put(key, value, lease=session.lease_id)``. ``done`` is set when
    the lease is lost: etcd says it expired or was revoked, or no keepalive succeeded before the
    local deadline (so a dead or paused etcd is noticed on time even if no call returns), or
    :meth:`close` was called. ``lost_reason`` says which. A lost session never comes back:
    make a new one (new lease id) and re-register. When the local deadline passes, the session
    also tries once to revoke the lease, so a keepalive that etcd processes late cannot keep
    this node's keys alive after the node has given them up.

    ``keepalive_interval_s`` defaults to ``ttl_s / 3``; after a failed keepalive it retries
    every quarter of that. ``on_lost(reason)`` runs on the keepalive thread. ``start=False``
    leaves the thread unstarted (call :meth:`start`; tests drive :meth:`keepalive_step`).
    """

    def __init__(
        self,
        client: EtcdClient,
        ttl_s: int = 10,
        *,
        keepalive_interval_s: float | None = None,
        on_lost: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        start: bool = True,
    ):
        interval_s = keepalive_interval_s if keepalive_interval_s is not None else ttl_s / 3
        if not 0 < interval_s < ttl_s:
            raise ValueError(f"keepalive interval must be in (0, ttl_s={ttl_s}), got {interval_s}")
        self._client, self._clock, self._on_lost = client, clock, on_lost
        sent_at = clock()
        lease = client.grant(ttl_s)
        self.lease_id: int = lease.id
        self.ttl_s: int = lease.ttl_s
        self.schedule = KeepaliveSchedule(interval_s, max(0.05, interval_s / 4), sent_at + lease.ttl_s)
        self.done = threading.Event()
        self.lost_reason: str | None = None
        self.renewals = 0
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"etcd-session-{self.lease_id:x}", daemon=True)
        if start:
            self.start()

    def __repr__(self) -> str:
        return f"Session(lease={self.lease_id:x}, ttl={self.ttl_s}s, done={self.done.is_set()})"

    def start(self) -> None:
        self._thread.start()

    def remaining_s(self) -> float:
        """Seconds until the local deadline (0 once lost)."""
        return 0.0 if self.done.is_set() else self.schedule.remaining_s(self._clock())

    def close(self, *, revoke: bool = True) -> None:
        """Stop renewing and (by default) revoke the lease, deleting its keys. Idempotent."""
        self._closing.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=self._client.timeout_s + 1.0)
        if revoke and not self.done.is_set():
            self._try_revoke()
        self._lose("closed")

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _try_revoke(self) -> None:
        try:  # one pass over the endpoints: if etcd is down the lease expires by itself
            self._client.revoke(self.lease_id, retry=False)
        except (EtcdUnavailableError, EtcdError) as e:
            logger.info("etcd session %x: revoke failed (%s); the lease expires by itself", self.lease_id, e)

    def _lose(self, reason: str, *, revoke: bool = False) -> None:
        if self.done.is_set():
            return
        self.lost_reason = reason
        self.done.set()
        if reason == "closed":
            return
        logger.warning("etcd session %x lost: %s", self.lease_id, reason)
        if self._on_lost is not None:
            try:
                self._on_lost(reason)
            except Exception:  # noqa: BLE001 - a broken callback must not hide the loss
                logger.exception("etcd session on_lost callback raised")
        if revoke:
            self._try_revoke()

    def _run(self) -> None:
        delay = self.schedule.interval_s
        try:
            while not self._closing.wait(delay):
                step = self.keepalive_step()
                if step is None:
                    return
                delay = step
        except Exception as e:  # noqa: BLE001 - never die silently with ``done`` unset
            logger.exception("etcd session %x: keepalive thread crashed", self.lease_id)
            self._lose(f"keepalive thread crashed: {type(e).__name__}: {e}", revoke=True)

    def keepalive_step(self) -> float | None:
        """One renewal attempt; seconds until the next one, or None once the lease is lost.
        The keepalive thread calls this; tests drive it directly with a fake clock."""
        sent_at = self._clock()
        if self.schedule.expired(sent_at):
            self._lose(f"no keepalive succeeded within the {self.ttl_s} s TTL", revoke=True)
            return None
        failed = False
        try:
            ttl_s = self._client.keepalive_once(self.lease_id, deadline=self.schedule.deadline)
        except LeaseExpiredError:
            ttl_s = 0
        except (EtcdUnavailableError, EtcdError) as e:
            logger.info(
                "etcd session %x: keepalive failed (%.2f s left): %s",
                self.lease_id,
                self.schedule.remaining_s(self._clock()),
                e,
            )
            failed = True
        if not failed:
            if ttl_s <= 0:
                self._lose("lease expired or was revoked")
                return None
            self.schedule.renewed(sent_at, ttl_s)
            self.renewals += 1
        now = self._clock()
        if self.schedule.expired(now):
            self._lose(f"no keepalive succeeded within the {self.ttl_s} s TTL", revoke=True)
            return None
        return self.schedule.next_delay_s(now, failed=failed)
