"""A loopback HTTP server whose every reply breaks off mid-body: what a client sees when etcd
restarts while answering (the request reached it; the reply never completes)."""

from __future__ import annotations

import socket
import threading
from types import TracebackType


class TruncatingServer:
    """Accepts connections on 127.0.0.1 and answers each request with a 200 whose body stops
    after ``sent_bytes`` of the announced ``length_bytes``, then closes the connection."""

    def __init__(self, *, length_bytes: int = 1000, sent_bytes: int = 10):
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(8)
        self.endpoint = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._reply = (
            f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {length_bytes}\r\n\r\n"
        ).encode() + b'{"header": {"revision": "1"}, "kvs": ['[:sent_bytes]
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="truncating-http", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:  # closed
                return
            with conn:
                conn.settimeout(2.0)
                try:
                    _read_request(conn)  # all of it: closing with unread bytes would send a reset instead
                    conn.sendall(self._reply)
                    conn.shutdown(socket.SHUT_WR)
                except OSError:
                    pass

    def close(self) -> None:
        self._closed.set()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the accept() blocked in the thread
        except OSError:
            pass
        self._sock.close()
        self._thread.join(timeout=5)

    def __enter__(self) -> TruncatingServer:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def _read_request(conn: socket.socket) -> bytes:
    """One HTTP request: the headers, then as many body bytes as its Content-Length says."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value.strip())
    while len(body) < length:
        chunk = conn.recv(65536)
        if not chunk:
            break
        body += chunk
    return head + b"\r\n\r\n" + body
