"""An S3 fault proxy on loopback, between s3fs and the real S3 server (SeaweedFS).

Point a job at :attr:`S3FaultProxy.endpoint_url` instead of the server; requests pass through
unchanged (the Host header too, so SigV4 signatures still match) until :meth:`set_faults` turns
on faults. Each request then meets, with the seeded probabilities given:

- ``error``: a 503 ``SlowDown`` or 500 ``InternalError`` S3 error reply (not forwarded);
- ``latency``: ``latency_s`` extra seconds before it is forwarded;
- ``reset``: the connection is closed without a reply (after the request was read, so an
  upload may or may not have been applied — like a real network cut);
- ``truncate``: the real reply's headers, then half its body, then the connection closes;
- ``flip``: the real reply of an object read (a GET of a key, no query, answered 200 or 206) with one bit of its
  body flipped, its length intact: damage in flight that only a digest can see (other requests
  it meets pass unchanged). With ``flip_first`` the first read of each object is flipped,
  every later one passes: damage that a second read does not see. ``flip_keys`` (a suffix,
  e.g. ``.distcp``) limits both to the keys that end with it.

Counts of what was injected are kept per kind (:attr:`injected`), and the newest requests
(time, method, path with query) in :attr:`requests_seen`, so a test can tell which objects a job
read and when.
"""

from __future__ import annotations

import http.client
import logging
import random
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

log = logging.getLogger(__name__)

_ERRORS = (
    (503, "SlowDown", "Please reduce your request rate."),
    (500, "InternalError", "We encountered an internal error. Please try again."),
)
_HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailers",
    "transfer-encoding",
    "upgrade",
}


@dataclass(frozen=True, slots=True)
class FaultRates:
    error: float = 0.0
    latency: float = 0.0
    reset: float = 0.0
    truncate: float = 0.0
    flip: float = 0.0
    flip_first: bool = False
    flip_keys: str = ""
    latency_s: float = 0.5

    def draw(self, rng: random.Random) -> str | None:
        x = rng.random()
        for kind in ("error", "latency", "reset", "truncate", "flip"):
            p = getattr(self, kind)
            if x < p:
                return kind
            x -= p
        return None


def send_s3_error(h: BaseHTTPRequestHandler, status: int, code: str, message: str = "") -> None:
    """Answer the request as S3 answers an error: ``status`` with an XML ``<Error>`` body."""
    text = f"<Message>{message}</Message>" if message else ""  # none: clients name the error by its code
    payload = f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>{text}</Error>'.encode()
    h.send_response(status)
    h.send_header("Content-Type", "application/xml")
    h.send_header("Content-Length", str(len(payload)))
    h.end_headers()
    h.wfile.write(payload)


class S3FaultProxy:
    def __init__(self, upstream_url: str, *, seed: int = 0, host: str = "127.0.0.1"):
        parts = urlsplit(upstream_url)
        if parts.hostname is None:
            raise ValueError(f"S3FaultProxy: upstream URL {upstream_url!r} names no host")
        self.upstream = (parts.hostname, parts.port or 80)
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._rates = FaultRates()
        self.injected: dict[str, int] = {"error": 0, "latency": 0, "reset": 0, "truncate": 0, "flip": 0}
        self.requests = 0
        self._read_keys: set[str] = set()  #: object paths read so far (``flip_first``)
        self.requests_seen: deque[tuple[float, str, str]] = deque(maxlen=100_000)
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, fmt: str, *args: object) -> None:
                log.debug("s3 proxy: " + fmt, *args)

            def _any(self) -> None:
                proxy._serve(self)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any

        class Server(ThreadingHTTPServer):
            def handle_error(self, request: object, client_address: object) -> None:
                log.debug("s3 proxy: connection from %s ended badly", client_address, exc_info=True)

        self._server = Server((host, 0), Handler)
        self._server.daemon_threads = True
        self.endpoint_url = f"http://{host}:{self._server.server_port}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="s3-fault-proxy", daemon=True)
        self._thread.start()

    def set_faults(self, rates: FaultRates | None) -> None:
        with self._lock:
            self._rates = rates or FaultRates()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> S3FaultProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- one request ---------------------------------------------------------------------
    def _decide(self) -> tuple[str | None, FaultRates]:
        with self._lock:
            self.requests += 1
            kind = self._rates.draw(self._rng)
            if kind and kind != "flip":  # a flip is counted where it applies (an object read)
                self.injected[kind] += 1
            return kind, self._rates

    def _serve(self, h: BaseHTTPRequestHandler) -> None:
        length = int(h.headers.get("Content-Length") or 0)
        body = h.rfile.read(length) if length else b""
        self.requests_seen.append((time.time(), h.command, h.path))
        kind, rates = self._decide()
        if kind == "error":
            send_s3_error(h, *_ERRORS[self.injected["error"] % 2])
            return
        if kind == "reset":
            self._reset(h)
            return
        if kind == "latency":
            time.sleep(rates.latency_s)
        headers = {k: v for k, v in h.headers.items() if k.lower() not in _HOP_BY_HOP}
        conn = http.client.HTTPConnection(*self.upstream, timeout=60)
        try:
            conn.request(
                h.command, h.path, body=body if (body or h.command in ("PUT", "POST")) else None, headers=headers
            )
            reply = conn.getresponse()
            data = reply.read()
        except OSError as e:
            log.warning("s3 proxy: upstream failed: %s", e)
            self._reset(h)
            return
        finally:
            conn.close()
        h.send_response(reply.status, reply.reason)
        head = h.command == "HEAD"  # its Content-Length is the object's size: pass it through
        for k, v in reply.getheaders():
            if k.lower() not in _HOP_BY_HOP and (head or k.lower() != "content-length"):
                h.send_header(k, v)
        if not head:
            h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        if head:
            return
        flippable = h.command == "GET" and "?" not in h.path and h.path.endswith(rates.flip_keys)
        if flippable and reply.status in (200, 206) and data:
            with self._lock:
                first = h.path not in self._read_keys
                self._read_keys.add(h.path)
                flip = kind == "flip" or (rates.flip_first and first)
                if flip:
                    self.injected["flip"] += 1
            if flip:
                data = bytes([data[0] ^ 1]) + data[1:]
        if kind == "truncate" and len(data) > 1:
            h.wfile.write(data[: len(data) // 2])
            h.wfile.flush()
            self._reset(h)
            return
        h.wfile.write(data)

    @staticmethod
    def _reset(h: BaseHTTPRequestHandler) -> None:
        h.close_connection = True
        try:
            h.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            h.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
