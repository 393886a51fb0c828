"""The agent's end of the worker heartbeat channel: a Unix datagram socket.

Each worker sends one small JSON datagram per step (``ftrain.heartbeat`` is the sender):
``{"kind": "beat", "phase", "round", "rank", "local_rank", "pid", "step", "step_time_s",
"committed_step", "ckpt_duration_s", "ckpt_failures", "ckpt_failures_total", "ckpt_error", "time"}``
(``phase`` is ``training`` between steps, or ``starting``, ``loading``, ``saving`` while a longer
pause is expected; ``ckpt_failures`` counts failed commits since the last one that succeeded),
``{"kind": "exit", "finished": bool, "error": str, "fatal": bool, ...}`` just before it
leaves (``error``: why it failed; ``fatal``: a restart cannot help), and every
``ALIVE_INTERVAL_S`` from a background thread ``{"kind": "alive", ...}``: it proves the process
runs (a SIGSTOPped or frozen worker sends nothing), not that it makes progress, and only
refreshes :attr:`Beat.alive_at` of the beat it follows.

Every datagram is checked field by field and dropped whole if one is wrong: integers must be
ints (not bools, floats or strings), ``pid`` a possible process id (2 .. 2**22: never 0, 1 or
negative, which ``kill`` reads as process groups or everything), ``local_rank`` 0 .. 4095,
times finite and non-negative, strings bounded. A PID is still only a claim: the agent signals
it only while it is a descendant of its torchrun (:class:`agents.workers.WorkerGroup`). Datagrams on a local socket are never torn and a full buffer drops the newest ones, so a
slow agent costs workers nothing. The agent keeps the newest beat of each local rank of the
round it is running; beats of other rounds are ignored (a zombie of an old round cannot make a
new round look alive).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import socket
import threading
import time
from dataclasses import dataclass

log = logging.getLogger(__name__)

MAX_DATAGRAM_BYTES = 4096
PID_MAX = 2**22  #: the kernel's largest possible pid_max
MAX_LOCAL_RANK = 4095
MAX_TEXT_CHARS = 1000
PHASES = frozenset({"training", "starting", "loading", "saving", "exiting"})


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
    alive_at: float = 0.0  #: time.monotonic() of the newest datagram of any kind (beats and "alive")
    ckpt_duration_s: float = 0.0  #: how long the newest committed save took, staging to commit
    finished: bool | None = None  #: set by the worker's exit message
    ckpt_failures: int = 0  #: checkpoint commits failed in a row (0 after a commit)
    ckpt_failures_total: int = 0  #: failed commits of this worker process
    ckpt_error: str = ""  #: the last failed commit's error
    error: str = ""  #: from the exit message: why the worker failed
    fatal: bool = False  #: from the exit message: a restart cannot help


def _int(msg: dict, name: str, default: int | None, low: int, high: int) -> int:
    value = msg.get(name, default)
    if value is None or not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ValueError(f"{name}={value!r}: need an int in [{low}, {high}]")
    return value


def _float(msg: dict, name: str) -> float:
    value = msg.get(name, 0.0)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name}={value!r}: need a finite number >= 0")
    return float(value)


def _text(msg: dict, name: str, default: str = "") -> str:
    value = msg.get(name, default)
    if not isinstance(value, str):
        raise ValueError(f"{name}={value!r}: need a string")
    return value[:MAX_TEXT_CHARS]


def parse_beat(data: bytes, received_at: float) -> tuple[int, str, Beat]:
    """(round, kind, beat) of one datagram; ValueError if any field is missing or wrong."""
    msg = json.loads(data)
    if not isinstance(msg, dict):
        raise ValueError("not a JSON object")
    kind = _text(msg, "kind", "beat")
    if kind not in ("beat", "exit", "alive"):
        raise ValueError(f"kind={kind!r}")
    phase = _text(msg, "phase", "training")
    if phase not in PHASES:
        raise ValueError(f"phase={phase!r}")
    big = 2**62
    beat = Beat(local_rank=_int(msg, "local_rank", None, 0, MAX_LOCAL_RANK), rank=_int(msg, "rank", -1, -1, big),
                pid=_int(msg, "pid", None, 2, PID_MAX), step=_int(msg, "step", -1, -1, big),
                step_time_s=_float(msg, "step_time_s"), committed_step=_int(msg, "committed_step", -1, -1, big),
                received_at=received_at, phase=phase, ckpt_duration_s=_float(msg, "ckpt_duration_s"),
                ckpt_failures=_int(msg, "ckpt_failures", 0, 0, big),
                ckpt_failures_total=_int(msg, "ckpt_failures_total", 0, 0, big),
                ckpt_error=_text(msg, "ckpt_error"), error=_text(msg, "error"))
    fatal, finished = msg.get("fatal", False), msg.get("finished", False)
    if not isinstance(fatal, bool) or not isinstance(finished, bool):
        raise ValueError("fatal and finished must be booleans")
    beat.fatal = fatal
    beat.alive_at = received_at
    if kind == "exit":
        beat.finished = finished
    return _int(msg, "round", None, 0, big), kind, beat


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
            round_, kind, beat = parse_beat(data, time.monotonic())
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
            log.warning("ignoring a malformed heartbeat (%s): %r", e, data[:200])
            return
        with self._lock:
            if round_ != self._round:
                return
            prev = self._beats.get(beat.local_rank)
            if kind == "alive":  # liveness only: the step beat it follows stays as it is
                if prev is not None and prev.pid == beat.pid:  # a new object: readers hold the old one
                    self._beats[beat.local_rank] = dataclasses.replace(prev, alive_at=beat.alive_at)
                return
            if kind != "exit" and prev is not None and prev.finished is not None:
                beat.finished, beat.error, beat.fatal = prev.finished, prev.error, prev.fatal
            self._beats[beat.local_rank] = beat
