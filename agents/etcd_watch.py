"""etcd watches: :class:`Watcher` (our own loop over the gateway's ``/v3/watch`` stream),
the events it delivers (:class:`WatchEvent`) and the parsing of stream messages
(:class:`WatchResponse`).

What must stay true: events arrive in revision order, each at most once; unless the watcher
reports :class:`~ftrain.agents.errors.WatchCompactedError` it delivers every event from its start
revision, across reconnects, hung servers and member loss (a stream with no event or progress
notification within ``progress_timeout_s`` is dropped and resumed on the next endpoint). The
KV client lives in :mod:`ftrain.agents.etcd`; the endpoints, token, TLS and backoff it shares with this
watch in :mod:`ftrain.agents.etcd_endpoints`.
"""

from __future__ import annotations

import http.client
import json
import logging
import queue
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

from ftrain.agents.errors import EtcdError, EtcdUnavailableError, WatchCompactedError
from ftrain.agents.etcd import EtcdClient, KeyValue, b64, encode_key, header_revision, key_range
from ftrain.agents.etcd_endpoints import error_from_reply, error_from_stream, is_token_error

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class WatchEvent:
    type: Literal["put", "delete"]
    key: str
    value: bytes  #: b"" for deletes
    mod_revision: int  #: the revision of this change (for deletes: the deletion's revision)
    create_revision: int  #: 0 for deletes
    version: int = 0  #: 0 for deletes
    lease: int = 0  #: the lease the key is on (0: none, and for deletes)


@dataclass(frozen=True, slots=True)
class WatchResponse:
    """One decoded message of the watch stream."""

    created: bool = False
    canceled: bool = False
    cancel_reason: str = ""
    compact_revision: int = 0
    header_revision: int = 0
    events: tuple[WatchEvent, ...] = ()

    @classmethod
    def from_line(cls, line: bytes) -> WatchResponse:
        """Parse one line of ``/v3/watch``'s stream; raises the error an error message carries."""
        msg = json.loads(line)
        if "error" in msg:
            raise error_from_stream(msg["error"], "watch stream")
        r = msg.get("result", {})
        events = []
        for e in r.get("events", []):
            kv = KeyValue.from_json(e["kv"])
            kind: Literal["put", "delete"] = "delete" if e.get("type") == "DELETE" else "put"
            events.append(WatchEvent(kind, kv.key, kv.value, kv.mod_revision, kv.create_revision, kv.version, kv.lease))
        return cls(
            bool(r.get("created")),
            bool(r.get("canceled")),
            str(r.get("cancel_reason", "")),
            int(r.get("compact_revision", 0)),
            header_revision(r),
            tuple(events),
        )


_CLOSED = object()


class _CallbackFailed(Exception):
    """``on_event`` raised (the cause): the watcher stops with that error."""


class Watcher:
    """Watch the keys under ``prefix`` (the one key, with ``single_key=True``; the keys in
    ``[prefix, range_end)`` with ``range_end``) from
    ``start_revision`` (None: from now), surviving etcd restarts, hangs and member loss.

    Its thread runs its own stream on ``POST /v3/watch`` with ``progress_notify``. When no
    event or progress notification arrives within ``progress_timeout_s`` (a hung server), or
    the stream breaks, it reconnects (next endpoint, backoff) and resumes from the last
    delivered revision + 1: no event lost, none delivered twice. Set etcd's
    ``--experimental-watch-progress-notify-interval`` below ``progress_timeout_s`` (EtcdServer
    does), otherwise an idle watch reconnects every ``progress_timeout_s``, which is harmless.

    Events go to ``on_event`` (called on the watcher thread; if it raises, the watcher stops
    with that error), or else queue up for :meth:`get` / iteration. ``on_error`` gets
    :class:`EtcdUnavailableError` each time the stream is lost (the watcher keeps trying) and a
    fatal error once before it stops:
    :class:`WatchCompactedError` (re-list, then watch from the listing's revision + 1) or
    :class:`EtcdError`. In queue mode a fatal error is raised by :meth:`get` after the events.
    """

    def __init__(
        self,
        client: EtcdClient,
        prefix: str,
        start_revision: int | None = None,
        *,
        on_event: Callable[[WatchEvent], None] | None = None,
        on_error: Callable[[Exception], None] | None = None,
        progress_timeout_s: float = 5.0,
        single_key: bool = False,
        range_end: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        if progress_timeout_s <= 0:
            raise ValueError("progress_timeout_s must be > 0")
        if start_revision is not None and start_revision < 1:
            raise ValueError(f"start_revision must be >= 1 (or None for now), got {start_revision}")
        self._client, self._key, self._single_key = client, prefix, single_key
        self._range_end = range_end
        self._on_event, self._on_error, self._clock = on_event, on_error, clock
        self.progress_timeout_s = progress_timeout_s
        self._next_revision = start_revision  # the lowest revision not yet delivered
        self._queue: queue.Queue[WatchEvent | object] = queue.Queue()  # events, then _CLOSED
        self._closing = threading.Event()
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None  # the live stream's socket, shut down by close()
        #: Set while a stream is established (cleared when it is lost).
        self.connected = threading.Event()
        self.error: Exception | None = None  #: the fatal error that stopped the watcher
        self.reconnects = 0  #: streams lost (and retried) so far
        self.stalls = 0  #: of those, lost to the progress timeout (hung server or network)
        self.last_lost_at: float | None = None  #: clock() when a stream was last lost
        self.last_connected_at: float | None = None  #: clock() when a stream was last established
        self._started_at = clock()
        self._thread = threading.Thread(target=self._run, name=f"etcd-watch-{prefix}", daemon=True)
        self._thread.start()

    def __repr__(self) -> str:
        return f"Watcher({self._key!r}, revision={self.revision}, connected={self.connected.is_set()})"

    @property
    def revision(self) -> int:
        """Every event up to this revision has been delivered (start_revision - 1 before any)."""
        return (self._next_revision or 1) - 1

    def down_s(self) -> float:
        """Seconds since the stream was lost, or since the start if it never connected (0 while
        connected)."""
        if self.connected.is_set():
            return 0.0
        return self._clock() - (self.last_lost_at if self.last_lost_at is not None else self._started_at)

    def wait_connected(self, timeout_s: float) -> bool:
        return self.connected.wait(timeout_s)

    def get(self, timeout_s: float | None = None) -> WatchEvent | None:
        """The next event (queue mode); None on timeout or once closed; raises a fatal error."""
        try:
            item = self._queue.get(timeout=timeout_s)
        except queue.Empty:
            return None
        if isinstance(item, WatchEvent):
            return item
        self._queue.put(_CLOSED)  # the end: keep later get() calls from blocking
        if self.error is not None:
            raise self.error
        return None

    def __iter__(self) -> Iterator[WatchEvent]:
        while (event := self.get()) is not None:
            yield event

    def close(self) -> None:
        """Stop the watcher thread (promptly: its socket is shut down under it). Idempotent."""
        self._closing.set()
        with self._lock:
            sock = self._sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=self._client.timeout_s + 1.0)
        self._queue.put(_CLOSED)

    def __enter__(self) -> Watcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the loop ---------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop()
        except Exception as e:  # noqa: BLE001 - never die silently: report and stop
            logger.exception("watch on %r crashed", self._key)
            self._fail(e)

    def _loop(self) -> None:
        endpoints = self._client.endpoints
        order = endpoints.rotation()
        index, failures, auth_retried = 0, 0, False
        while not self._closing.is_set():
            endpoint = order[index]
            delivered_before = self._next_revision
            try:
                self._stream(endpoint)
                return  # closing
            except _CallbackFailed as e:
                self._fail(e.__cause__ if isinstance(e.__cause__, Exception) else e)
                return
            except EtcdError as e:
                if self._closing.is_set():
                    return
                if (
                    not isinstance(e, WatchCompactedError)
                    and not auth_retried
                    and endpoints.has_credentials
                    and ("permission denied" in str(e) or is_token_error(e))
                ):
                    auth_retried = True  # the token may have expired: fetch a new one, once
                    try:
                        endpoints.token(endpoint, self._client.timeout_s, refresh=True)
                        continue
                    except (EtcdError, EtcdUnavailableError) as auth_error:
                        e = auth_error if isinstance(auth_error, EtcdError) else e
                self._fail(e)
                return
            except ssl.SSLCertVerificationError as e:  # misconfiguration: retrying cannot help
                self._fail(EtcdError(f"watch on {endpoint}: TLS certificate rejected: {e}"))
                return
            except (OSError, http.client.HTTPException, ValueError, EtcdUnavailableError) as e:
                if self._closing.is_set():
                    return
                stalled = isinstance(e, TimeoutError)
                was_connected = self.connected.is_set()
                self.connected.clear()
                self.reconnects += 1
                self.stalls += stalled
                self.last_lost_at = self._clock()
                reason = (
                    f"no event or progress notification in {self.progress_timeout_s:.2f} s"
                    if stalled
                    else f"{type(e).__name__}: {e}"
                )
                lost = EtcdUnavailableError(
                    f"watch on {endpoint} lost ({reason}); resuming at revision {self._next_revision}", ambiguous=False
                )
                logger.warning("%s", lost)
                self._notify_error(lost)
                progressed = was_connected or self._next_revision != delivered_before
                failures = 0 if progressed else failures + 1
                if progressed:
                    auth_retried = False
                index = (index + 1) % len(order)
                self._closing.wait(0.0 if failures == 0 else endpoints.backoff.delay_s(failures))

    def _stream(self, endpoint: str) -> None:
        selected = (
            {"key": b64(encode_key(self._key)), "range_end": b64(encode_key(self._range_end))}
            if self._range_end is not None
            else key_range(self._key, not self._single_key)
        )
        create: dict[str, Any] = {**selected, "progress_notify": True}
        if self._next_revision is not None:
            create["start_revision"] = str(self._next_revision)
        headers = {"Content-Type": "application/json"}
        token = self._client.endpoints.token(endpoint, self._client.timeout_s)
        if token:
            headers["Authorization"] = token
        conn = self._client.endpoints.connection(endpoint, self._client.timeout_s)
        try:
            conn.connect()
            # keep the socket itself: http.client hands it to the response and may drop conn.sock
            sock = conn.sock
            with self._lock:
                if self._closing.is_set():
                    return
                self._sock = sock
            conn.request("POST", "/v3/watch", json.dumps({"create_request": create}), headers)
            resp = conn.getresponse()
            if resp.status != 200:
                raise error_from_reply(resp.status, resp.read(), f"{endpoint}/v3/watch")
            sock.settimeout(self.progress_timeout_s)
            while not self._closing.is_set():
                line = resp.readline()
                if self._closing.is_set():
                    return
                if not line:
                    raise ConnectionError("watch stream closed by the server")
                self._handle(WatchResponse.from_line(line), endpoint)
        finally:
            with self._lock:
                self._sock = None
            conn.close()

    def _handle(self, r: WatchResponse, endpoint: str) -> None:
        if r.canceled:
            if r.compact_revision:
                raise WatchCompactedError(
                    f"watch on {self._key!r} from revision {self._next_revision}: history compacted up to "
                    f"{r.compact_revision}; re-list and watch again",
                    compact_revision=r.compact_revision,
                )
            text = f"watch on {self._key!r} canceled by {endpoint}: {r.cancel_reason or 'no reason'}"
            if "no leader" in r.cancel_reason or "Unavailable" in r.cancel_reason:
                raise EtcdUnavailableError(text)  # that member lost its leader: try another
            raise EtcdError(text)
        if r.created:
            if self._next_revision is None:
                self._next_revision = r.header_revision + 1
            self.connected.set()
            self.last_connected_at = self._clock()
            logger.debug("watch on %r connected to %s at revision %d", self._key, endpoint, self._next_revision)
            return
        # A progress notification (no events) says nothing new up to header_revision. We do
        # not advance on it: etcd < 3.5.8 could send one ahead of pending events (etcd#15220).
        threshold = self._next_revision or 0
        for event in r.events:
            if event.mod_revision < threshold:
                continue  # already delivered before a reconnect
            self._next_revision = event.mod_revision + 1
            if self._on_event is not None:
                try:
                    self._on_event(event)
                except Exception as e:
                    raise _CallbackFailed() from e
            else:
                self._queue.put(event)

    def _notify_error(self, error: Exception) -> None:
        if self._on_error is not None:
            try:
                self._on_error(error)
            except Exception:  # noqa: BLE001 - a broken callback must not kill the watch
                logger.exception("watch on_error callback raised")

    def _fail(self, error: Exception) -> None:
        self.error = error
        self.connected.clear()
        logger.error("watch on %r stopped: %s", self._key, error)
        self._notify_error(error)
        self._queue.put(_CLOSED)
