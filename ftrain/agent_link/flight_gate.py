"""Who may ask a worker for its flight record, and how often: the gate in front of
:class:`ftrain.agent_link.flight_recorder.FlightServer`.

The worker listens on an abstract Unix datagram socket (``ftrain.contract.flight.socket_name``), a name
that any local process can send to, or bind first. So:

- :func:`listen` sets ``SO_PASSCRED`` before binding: the kernel then attaches the sender's real
  pid, uid and gid (``SCM_CREDENTIALS``) to every datagram, whatever the sender claims (only a
  privileged sender can state other ones). :func:`judge` accepts a request only from this user's
  uid and, when the worker knows its agent (``FTRAIN_AGENT_PID``), only from that pid; the body
  must be a plain nonce (letters, digits, ``-`` and ``_``, at most :data:`MAX_NONCE_CHARS`).
  The agent's sender (``ftrain.agents.flight.collect``) needs no change for this: the kernel adds the
  credentials itself.
- :class:`Budget` (a token bucket on an injectable clock) bounds the work anybody can cause:
  the server takes at most :data:`DATAGRAMS_PER_S` datagrams a second off the socket (what is
  beyond waits in the kernel's short queue and then fails at the sender), answers at most
  :data:`ANSWERS_PER_S` accepted requests a second, and takes a new snapshot at most once per
  :data:`MIN_SNAPSHOT_INTERVAL_S` (a request in between gets the last one re-stamped with its
  nonce: a byte splice, no dump).
- :class:`Refusals` logs the first refused request at WARNING and then one summary per
  :data:`REFUSAL_LOG_INTERVAL_S`, so a flood cannot fill the worker's log either.

What must stay true: nothing a datagram says is trusted except what the kernel attached; a
refused request costs one ``recvmsg`` and a comparison, never a dump or a file.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

MAX_REQUEST_BYTES = 256  #: a longer datagram is cut by the kernel and refused
MAX_NONCE_CHARS = 64
DATAGRAMS_PER_S = 50.0  #: taken off the socket per second, refused ones included (burst: as many)
ANSWERS_PER_S = 5.0  #: accepted requests answered per second (burst: as many)
MIN_SNAPSHOT_INTERVAL_S = 1.0  #: a new snapshot at most this often; in between the last one is re-stamped
REFUSAL_LOG_INTERVAL_S = 60.0

_CREDENTIALS = struct.Struct("iII")  #: struct ucred: pid_t pid, uid_t uid, gid_t gid
_NONCE = re.compile(rf"[0-9A-Za-z_-]{{1,{MAX_NONCE_CHARS}}}")


@dataclass(frozen=True, slots=True)
class Request:
    """An accepted request: its nonce, and who sent it (as the kernel says)."""

    nonce: str
    pid: int
    uid: int


def listen(name: bytes) -> socket.socket:
    """A datagram socket bound to ``name`` that receives its senders' credentials; OSError if
    the name is taken (``EADDRINUSE``) or credentials cannot be had (then nobody could be told
    apart from the agent: no socket rather than an open one)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        sock.bind(name)
    except BaseException:
        sock.close()
        raise
    return sock


def receive(sock: socket.socket) -> tuple[bytes, tuple[int, int] | None, bool]:
    """One datagram: its bytes, the sender's (pid, uid) if the kernel attached them, and whether
    it was cut (longer than :data:`MAX_REQUEST_BYTES`)."""
    data, ancillary, flags, _ = sock.recvmsg(MAX_REQUEST_BYTES, socket.CMSG_SPACE(_CREDENTIALS.size))
    sender = None
    for level, kind, raw in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS and len(raw) >= _CREDENTIALS.size:
            pid, uid, _gid = _CREDENTIALS.unpack_from(raw)
            sender = (pid, uid)
    return data, sender, bool(flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC))


def judge(data: bytes, sender: tuple[int, int] | None, cut: bool, *, agent_pid: int) -> Request | str:
    """The request in a datagram, or why it is refused (see the module doc)."""
    if sender is None:
        return "no sender credentials"
    pid, uid = sender
    if uid != os.geteuid():
        return f"sent by uid {uid}, not this user (uid {os.geteuid()})"
    if agent_pid and pid != agent_pid:
        return f"sent by pid {pid}, not this worker's agent (pid {agent_pid})"
    if cut:
        return f"longer than {MAX_REQUEST_BYTES} bytes"
    nonce = data.decode("ascii", errors="replace").strip()
    if not _NONCE.fullmatch(nonce):
        return f"not a nonce ({data[:40]!r})"
    return Request(nonce, pid, uid)


class Budget:
    """A token bucket: :meth:`take` succeeds at most ``burst`` times at once and ``rate_per_s``
    times a second on average."""

    def __init__(self, rate_per_s: float, burst: float, clock: Callable[[], float] = time.monotonic):
        self.rate_per_s, self.burst, self._clock = rate_per_s, burst, clock
        self._tokens, self._at = burst, clock()

    def _refill(self) -> None:
        now = self._clock()
        self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate_per_s)
        self._at = now

    def take(self) -> bool:
        self._refill()
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return True
        return False

    def wait_s(self) -> float:
        """How long until :meth:`take` can succeed."""
        self._refill()
        return max(0.0, (1.0 - self._tokens) / self.rate_per_s)


class Refusals:
    """Counts refused requests; logs the first, then a summary at most every
    :data:`REFUSAL_LOG_INTERVAL_S`."""

    def __init__(self, where: str, clock: Callable[[], float] = time.monotonic):
        self.where, self._clock = where, clock
        self.total = 0
        self._unlogged = 0
        self._logged_at: float | None = None
        self._last = ""

    def note(self, why: str) -> None:
        self.total += 1
        self._unlogged += 1
        self._last = why
        now = self._clock()
        if self._logged_at is None:
            log.warning(
                "flight recorder %s: refused a request (%s); only this worker's agent may ask. Later refusals "
                "are summed up at most every %.0f s",
                self.where,
                why,
                REFUSAL_LOG_INTERVAL_S,
            )
        elif now - self._logged_at >= REFUSAL_LOG_INTERVAL_S:
            log.warning(
                "flight recorder %s: refused %d more requests in %.0f s (the last: %s)",
                self.where,
                self._unlogged,
                now - self._logged_at,
                why,
            )
        else:
            return
        self._logged_at, self._unlogged = now, 0


def restamp(encoded: bytes, placeholder: str, nonce: str) -> bytes:
    """A record encoded with ``placeholder`` as its nonce, now carrying ``nonce`` (both plain
    nonces, so nothing in the JSON needs escaping). The nonce is the last string field of the
    record, so the last occurrence is the field itself."""
    field = f'"nonce":"{placeholder}"'.encode()
    head, found, tail = encoded.rpartition(field)
    if not found:
        raise ValueError("the record carries no placeholder nonce")
    return head + f'"nonce":"{nonce}"'.encode() + tail


__all__ = ["Budget", "Refusals", "Request", "judge", "listen", "receive", "restamp"]
