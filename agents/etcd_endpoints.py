"""How the etcd client layer reaches a cluster: :class:`Endpoints` (the members' URLs and their
rotation, the auth token and its refresh, TLS files, retry backoff) and the transport that
posts JSON to etcd's HTTP gateway. An :class:`~ftrain.agents.etcd.EtcdClient` builds one and exposes it
as ``client.endpoints``; its :class:`~ftrain.agents.etcd_session.Session` and
:class:`~ftrain.agents.etcd_watch.Watcher` objects use that same object, so all three share one token,
one TLS configuration and one backoff policy.

What must stay true:

- A rotation tries every member once, starting with the one that answered last.
- The token is fetched on first use and replaced only when etcd rejects it; without
  credentials no token is fetched or sent.
- TLS files apply alike to pooled requests and to the watch's own streaming connections.
- Transport errors say whether the request may have reached etcd
  (``EtcdUnavailableError.ambiguous``): a refused connection is never ambiguous.
"""

from __future__ import annotations

import http.client
import json
import logging
import random
import ssl
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import urlsplit

import requests
from urllib3.exceptions import NewConnectionError

from ftrain.agents.errors import EtcdError, EtcdUnavailableError, LeaseExpiredError

logger = logging.getLogger(__name__)

# gRPC status codes etcd returns through the gateway
_DEADLINE_EXCEEDED, _NOT_FOUND, _RESOURCE_EXHAUSTED, _UNAVAILABLE, _UNAUTHENTICATED = 4, 5, 8, 14, 16
#: UNAVAILABLE replies that guarantee the request was not applied.
_NOT_APPLIED = ("etcdserver: no leader", "etcdserver: not capable", "etcdserver: too many requests")


# -- errors from replies ----------------------------------------------------------------------
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


def is_token_error(e: EtcdError) -> bool:
    """Whether etcd rejected the auth token itself (expired, or issued before a restart)."""
    return e.code == _UNAUTHENTICATED or "auth store is old" in str(e) or "invalid auth token" in str(e)


# -- settings ---------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class TlsFiles:
    """TLS for ``https`` endpoints: ``ca_cert`` (None: the system's CAs), and a client
    certificate ``cert`` with its ``key`` (None: the key is in ``cert``) for etcd's
    ``--client-cert-auth``."""

    ca_cert: str | None = None
    cert: str | None = None
    key: str | None = None

    def ssl_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=self.ca_cert)
        if self.cert:
            context.load_cert_chain(self.cert, self.key)
        return context


@dataclass(frozen=True, slots=True)
class Backoff:
    """Jittered exponential backoff between attempts: after ``failures`` failed attempts in a
    row, wait a uniform random time in ``[0, min(max_s, initial_s * 2 ** (failures - 1))]``."""

    initial_s: float = 0.05
    max_s: float = 1.0

    def __post_init__(self) -> None:
        if not 0 < self.initial_s <= self.max_s:
            raise ValueError(f"backoff needs 0 < initial_s <= max_s, got {self.initial_s} and {self.max_s}")

    def delay_s(self, failures: int) -> float:
        if failures < 1:
            raise ValueError(f"backoff is for after a failure, got failures={failures}")
        exponent = min(failures - 1, 64)  # 2 ** 64 exceeds any max_s; a larger power overflows a float
        return random.uniform(0.0, min(self.max_s, self.initial_s * 2.0**exponent))


# -- transport --------------------------------------------------------------------------------
class Transport(Protocol):
    """POSTs one JSON request to one endpoint. The seam unit tests replace."""

    def post(
        self, endpoint: str, path: str, payload: Mapping[str, Any], *, timeout_s: float, token: str | None
    ) -> dict[str, Any]:
        """The decoded JSON reply. Raises :class:`EtcdUnavailableError` (``ambiguous`` if the
        request may have reached etcd), :class:`LeaseExpiredError`, or :class:`EtcdError`."""
        ...


def _never_sent(exc: requests.exceptions.ConnectionError) -> bool:
    """True if the connection itself failed (refused, unreachable), so nothing reached etcd."""
    reason = getattr(exc.args[0], "reason", None) if exc.args else None
    return isinstance(reason, NewConnectionError)


class HttpTransport:
    """:class:`Transport` over ``requests`` (one pooled session, TLS files applied)."""

    def __init__(self, tls: TlsFiles = TlsFiles()):
        self._session = requests.Session()
        # no proxies or ~/.netrc from the environment: the watch stream (http.client) never used
        # them, so requests and watches reach etcd the same way; and looking for ~/.netrc on every
        # request was a fifth of an agent's control-plane CPU (bench/control_plane.py)
        self._session.trust_env = False
        # per request, not on the session: REQUESTS_CA_BUNDLE would override a session's verify
        self._verify: str | bool = tls.ca_cert or True
        self._cert = ((tls.cert, tls.key) if tls.key else tls.cert) if tls.cert else None

    def post(
        self, endpoint: str, path: str, payload: Mapping[str, Any], *, timeout_s: float, token: str | None
    ) -> dict[str, Any]:
        where = f"{endpoint}{path}"
        try:
            resp = self._session.post(
                where,
                json=payload,
                timeout=timeout_s,
                verify=self._verify,
                cert=self._cert,
                headers={"Authorization": token} if token else None,
            )
        except requests.exceptions.SSLError as e:
            raise EtcdError(f"{where}: TLS error: {e}") from e
        except requests.exceptions.ConnectTimeout as e:
            raise EtcdUnavailableError(f"{where}: connect timed out", ambiguous=False) from e
        except requests.exceptions.ConnectionError as e:
            raise EtcdUnavailableError(f"{where}: {type(e).__name__}: {e}", ambiguous=not _never_sent(e)) from e
        except requests.exceptions.Timeout as e:
            raise EtcdUnavailableError(f"{where}: no reply in {timeout_s:.2f} s", ambiguous=True) from e
        except (requests.exceptions.ChunkedEncodingError, requests.exceptions.ContentDecodingError) as e:
            # the reply broke off mid-body (etcd restarting): the request reached it
            raise EtcdUnavailableError(f"{where}: reply cut short: {type(e).__name__}: {e}", ambiguous=True) from e
        except requests.exceptions.RequestException as e:
            raise EtcdError(f"{where}: {type(e).__name__}: {e}") from e
        if resp.status_code != 200:
            raise error_from_reply(resp.status_code, resp.content, where)
        try:
            reply: dict[str, Any] = resp.json()
        except ValueError as e:
            raise EtcdError(f"{where}: reply is not JSON: {resp.text[:200]!r}") from e
        return reply

    def close(self) -> None:
        self._session.close()


# -- endpoints --------------------------------------------------------------------------------
class Endpoints:
    """The members of one etcd cluster and how to reach them (see the module docstring).

    ``urls``: ``http(s)://host:port`` client URLs. ``username``/``password``: etcd v3 auth.
    ``tls``: certificate files for ``https`` URLs. ``backoff``: between failed attempts.
    ``transport``: what requests go through (default :class:`HttpTransport` with ``tls``).
    Thread-safe.
    """

    def __init__(
        self,
        urls: Sequence[str],
        *,
        username: str | None = None,
        password: str | None = None,
        tls: TlsFiles = TlsFiles(),
        backoff: Backoff = Backoff(),
        transport: Transport | None = None,
    ):
        if isinstance(urls, str) or not urls:
            raise ValueError("endpoints must be a non-empty list of http(s)://host:port URLs")
        self.urls: tuple[str, ...] = tuple(u.rstrip("/") for u in urls)
        for url in self.urls:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname or not parts.port:
                raise ValueError(f"bad etcd endpoint {url!r}: expected http(s)://host:port")
        if (username is None) != (password is None):
            raise ValueError("username and password must be given together")
        self.tls = tls
        self.backoff = backoff
        self.transport: Transport = transport or HttpTransport(tls)
        self._username, self._password = username, password
        self._current = 0
        self._token: str | None = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"Endpoints({list(self.urls)}, current={self.current})"

    @property
    def current(self) -> str:
        """The member that answered last (first in the next rotation)."""
        return self.urls[self._current]

    @property
    def has_credentials(self) -> bool:
        return self._username is not None

    def rotation(self) -> list[str]:
        """Every member once, starting with :attr:`current`."""
        first = self._current
        return [self.urls[(first + i) % len(self.urls)] for i in range(len(self.urls))]

    def answered(self, url: str) -> None:
        """``url`` answered a request: later rotations start there."""
        index = self.urls.index(url)
        with self._lock:
            previous, self._current = self._current, index
        if previous != index:
            logger.info("etcd: switching endpoint %s -> %s", self.urls[previous], url)

    def token(self, url: str, timeout_s: float, *, refresh: bool = False) -> str | None:
        """The auth token (None without credentials), fetched from ``url`` if there is none yet
        or ``refresh`` says etcd rejected the one we have."""
        if self._username is None:
            return None
        with self._lock:
            if self._token is not None and not refresh:
                return self._token
        reply = self.transport.post(
            url,
            "/v3/auth/authenticate",
            {"name": self._username, "password": self._password},
            timeout_s=timeout_s,
            token=None,
        )
        with self._lock:
            self._token = str(reply["token"])
            return self._token

    def post(self, url: str, path: str, payload: Mapping[str, Any], *, timeout_s: float) -> dict[str, Any]:
        """One request to one member, with the auth token; a rejected token is replaced once and
        the request sent again. Raises what :meth:`Transport.post` raises."""
        token = self.token(url, timeout_s)
        try:
            return self.transport.post(url, path, payload, timeout_s=timeout_s, token=token)
        except EtcdError as e:
            if token is None or not is_token_error(e):
                raise
            logger.info("etcd auth token rejected (%s): authenticating again", e)
            token = self.token(url, timeout_s, refresh=True)
            return self.transport.post(url, path, payload, timeout_s=timeout_s, token=token)

    def connection(self, url: str, timeout_s: float) -> http.client.HTTPConnection:
        """An unopened connection to ``url`` for a streaming request (TLS applied for https)."""
        parts = urlsplit(url)
        if parts.scheme == "https":
            return http.client.HTTPSConnection(
                parts.hostname or "", parts.port, timeout=timeout_s, context=self.tls.ssl_context()
            )
        return http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=timeout_s)

    def close(self) -> None:
        close = getattr(self.transport, "close", None)
        if close is not None:
            close()
