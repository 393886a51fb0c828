"""The agent's end of the worker heartbeat channel: a Unix datagram socket.

Each worker sends one small JSON datagram per step (``ftrain.heartbeat`` is the sender):
``{"kind": "beat", "phase", "round", "rank", "local_rank", "pid", "step", "step_time_s",
"committed_step", "ckpt_duration_s", "time"}`` (``phase`` is ``training`` between steps, or ``starting``,
``loading``, ``saving`` while a longer pause is expected), and ``{"kind": "exit", "finished": bool, ...}`` just before it
leaves. Datagrams on a local socket are never torn and a full buffer drops the newest ones, so a
slow agent costs workers nothing. The agent keeps the newest beat of each local rank of the
round it is running; beats of other rounds are ignored (a zombie of an old round cannot make a
new round look alive).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass

log = logging.getLogger(__name__)

MAX_DATAGRAM_BYTES = 4096


@dataclass(slots=True)
class Beat:
    local_rank: int
    rank: int
    pid: int
    step: int
    step_time_s: float
    committed_step: int
    received_at: float  #: time.monotonic() on the agent
    phase: str = "training"
    ckpt_duration_s: float = 0.0  #: how long the newest committed save took, staging to commit
    finished: bool | None = None  #: set by the worker's exit message


class HeartbeatServer:
    """Receives beats on ``path`` from a daemon thread; :meth:`reset` starts a new round."""

    def __init__(self, path: str):
        self.path = path
        if os.path.exists(path):
            os.unlink(path)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(path)
        self._sock.settimeout(0.5)
        self._lock = threading.Lock()
        self._round = -1
        self._beats: dict[int, Beat] = {}
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat-server", daemon=True)
        self._thread.start()

    def reset(self, round_: int) -> None:
        """Forget the beats of earlier rounds; accept only ``round_`` from now on."""
        with self._lock:
            self._round, self._beats = round_, {}

    def beats(self) -> dict[int, Beat]:
        with self._lock:
            return dict(self._beats)

    def close(self) -> None:
        self._closing.set()
        self._sock.close()
        self._thread.join(timeout=2)
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def _run(self) -> None:
        while not self._closing.is_set():
            try:
                data = self._sock.recv(MAX_DATAGRAM_BYTES)
            except TimeoutError:
                continue
            except OSError:
                return  # closed
            self._handle(data)

    def _handle(self, data: bytes) -> None:
        try:
            msg = json.loads(data)
            round_, local_rank = int(msg["round"]), int(msg["local_rank"])
            beat = Beat(local_rank, int(msg.get("rank", -1)), int(msg.get("pid", 0)), int(msg.get("step", -1)),
                        float(msg.get("step_time_s", 0.0)), int(msg.get("committed_step", -1)), time.monotonic(),
                        str(msg.get("phase", "training")), float(msg.get("ckpt_duration_s", 0.0)))
        except (ValueError, KeyError, TypeError, AttributeError):
            log.warning("ignoring a malformed heartbeat: %r", data[:200])
            return
        with self._lock:
            if round_ != self._round:
                return
            prev = self._beats.get(local_rank)
            if msg.get("kind") == "exit":
                beat.finished = bool(msg.get("finished"))
            elif prev is not None and prev.finished is not None:
                beat.finished = prev.finished
            self._beats[local_rank] = beat
