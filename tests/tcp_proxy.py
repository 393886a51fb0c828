"""A TCP proxy on 127.0.0.1 that a test can cut and restore: the network between one client and a
server failing (every connection dropped, new ones refused) while the server stays up for others.

What must stay true: after :meth:`TcpProxy.cut` returns, no byte passes until :meth:`restore`;
:meth:`close` ends its thread and every connection it made.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading


class TcpProxy:
    def __init__(self, target_port: int, host: str = "127.0.0.1"):
        self._target = (host, target_port)
        self._listener = socket.create_server((host, 0))
        self._listener.setblocking(False)
        self.port = self._listener.getsockname()[1]
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._peers: dict[socket.socket, socket.socket] = {}
        self._lock = threading.Lock()
        self._cut = False
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="tcp-proxy", daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://{self._target[0]}:{self.port}"

    def cut(self) -> None:
        """Drop every connection and refuse new ones."""
        with self._lock:
            self._cut = True
            for sock in list(self._peers):
                self._drop(sock)

    def restore(self) -> None:
        with self._lock:
            self._cut = False

    def close(self) -> None:
        self._closing = True
        self.cut()
        self._thread.join(timeout=5)
        self._listener.close()
        self._selector.close()

    def _run(self) -> None:
        while not self._closing:
            for key, _ in self._selector.select(timeout=0.05):
                with self._lock:
                    if key.fileobj is self._listener:
                        self._accept()
                    elif key.fileobj in self._peers:
                        self._pump(key.fileobj)  # type: ignore[arg-type]

    def _accept(self) -> None:
        client, _ = self._listener.accept()
        if self._cut:
            client.close()
            return
        try:
            server = socket.create_connection(self._target, timeout=2)
        except OSError:
            client.close()
            return
        for sock in (client, server):
            sock.setblocking(False)
            self._selector.register(sock, selectors.EVENT_READ)
        self._peers[client], self._peers[server] = server, client

    def _pump(self, sock: socket.socket) -> None:
        try:
            data = sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(sock)
            return
        try:
            self._peers[sock].setblocking(True)
            self._peers[sock].sendall(data)
            self._peers[sock].setblocking(False)
        except OSError:
            self._drop(sock)

    def _drop(self, sock: socket.socket) -> None:
        other = self._peers.pop(sock, None)
        for s in (sock, other):
            if s is None:
                continue
            self._peers.pop(s, None)
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(s)
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()


__all__ = ["TcpProxy"]
