"""The agent's end of the worker heartbeat channel: a Unix datagram socket.

The messages are :class:`ftrain.contract.heartbeat.Message` (``beat`` per step, ``exit`` at the end,
``alive`` every second); every datagram is checked field by field there and dropped whole if one
is wrong: counted (:attr:`HeartbeatServer.dropped`) and logged with why (at most one line a
second, with the count of the others), and the receiver goes on with the next datagram, whatever
a datagram holds. A PID is still only a claim: the agent signals it only while it is a descendant of its
torchrun (:class:`ftrain.agents.workers.WorkerGroup`). Datagrams on a local socket are never torn and a
full buffer drops the newest ones, so a slow agent costs workers nothing. The agent keeps the
newest beat of each local rank of the round it is running; beats of other rounds are ignored (a
zombie of an old round cannot make a new round look alive), and an ``alive`` only refreshes
:attr:`Beat.alive_at` of the beat it follows, and what it says is in flight (:attr:`Beat.in_flight_since`
keeps the earliest sighting of one collective: an age measured later can only be too short).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import os
import socket
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from ftrain.contract.bounded_json import VALUE_ERRORS
from ftrain.contract.heartbeat import BUSY_PHASES, MAX_DATAGRAM_BYTES, Message

log = logging.getLogger(__name__)


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
    corruptions: int = 0  #: times the consistency check found this process's rank corrupt
    phases_s: dict[str, float] = field(default_factory=dict)  #: the step's time by phase (ftrain.contract.heartbeat)
    error: str = ""  #: from the exit message: why the worker failed
    fatal: bool = False  #: from the exit message: a restart cannot help
    recording: bool = False  #: its "alive" datagrams say what is in flight (its flight recorder is on)
    in_flight_since: float = 0.0  #: time.monotonic() on the agent when its oldest collective in flight was entered
    in_flight_seq: int = -1  #: that collective's sequence number in its group (-1: none in flight)
    in_flight_group: str = ""
    in_flight: str = ""  #: what it is (op, shapes, dtypes)
    carried: bool = False  #: not received: a kept process's beat of the round before (:func:`carried`)

    def in_flight_key(self) -> tuple[str, int] | None:
        return (self.in_flight_group, self.in_flight_seq) if self.in_flight_seq >= 0 else None


def parse_beat(data: bytes, received_at: float) -> tuple[int, str, Beat]:
    """(round, kind, beat) of one datagram; ValueError if any field is missing or wrong."""
    msg = Message.decode(data)
    beat = Beat(
        local_rank=msg.local_rank,
        rank=msg.rank,
        pid=msg.pid,
        step=msg.step,
        step_time_s=msg.step_time_s,
        committed_step=msg.committed_step,
        received_at=received_at,
        phase=msg.phase,
        alive_at=received_at,
        ckpt_duration_s=msg.ckpt_duration_s,
        ckpt_failures=msg.ckpt_failures,
        ckpt_failures_total=msg.ckpt_failures_total,
        ckpt_error=msg.ckpt_error,
        corruptions=msg.corruptions,
        phases_s=msg.phases_s,
        error=msg.error,
        fatal=msg.fatal,
        finished=msg.finished if msg.kind == "exit" else None,
        recording=msg.recording,
        in_flight_since=received_at - msg.in_flight_s if msg.in_flight_seq >= 0 else 0.0,
        in_flight_seq=msg.in_flight_seq,
        in_flight_group=msg.in_flight_group,
        in_flight=msg.in_flight,
    )
    return msg.round, msg.kind, beat


#: the first training beats of a rank in a round do not count for its busy time (the first steps
#: of a round build caches and buckets: slow on every rank, and not what a straggler is)
WARMUP_BEATS = 5


@dataclass(slots=True)
class RankTotals:
    """One local rank's training beats since they were last taken."""

    rank: int
    seconds: dict[str, float] = field(default_factory=dict)  #: phase -> seconds, every beat
    judged_beats: int = 0  #: beats past the round's warm-up
    judged_busy_s: float = 0.0  #: their busy seconds (every phase but comm_wait)

    def add(self, phases_s: dict[str, float], *, judged: bool) -> None:
        for phase, value in phases_s.items():
            self.seconds[phase] = self.seconds.get(phase, 0.0) + value
        if judged:
            self.judged_beats += 1
            self.judged_busy_s += sum(phases_s.get(p, 0.0) for p in BUSY_PHASES)


class BusyWindow:
    """Each rank's busy time per step over its last ``intervals`` takes of :class:`RankTotals`
    (about a second each): one interval is noisy — a slow rank stopped while inside a collective
    looks like its peers, waiting — a few smooth it."""

    def __init__(self, intervals: int = 2):
        self._intervals = intervals
        self._by_rank: dict[int, collections.deque[tuple[float, int]]] = {}

    def add(self, totals: Iterable[RankTotals]) -> None:
        for t in totals:
            window = self._by_rank.setdefault(t.rank, collections.deque(maxlen=self._intervals))
            window.append((t.judged_busy_s, t.judged_beats))

    def clear(self) -> None:
        self._by_rank.clear()

    def busiest(self) -> tuple[int, float] | None:
        """(rank, its mean busy seconds per step over the window) of the busiest rank; None: no beats."""
        means = {}
        for rank, window in self._by_rank.items():
            beats = sum(n for _, n in window)
            if beats:
                means[rank] = sum(s for s, _ in window) / beats
        return max(means.items(), key=lambda rank_busy: rank_busy[1]) if means else None


DROP_LOG_INTERVAL_S = 1.0  #: malformed datagrams are logged at most this often (a sender may flood)


def _after_alive(prev: Beat, alive: Beat) -> Beat:
    """``prev`` (a new object: readers hold the old one) with what an "alive" says: the time, and
    what is in flight; the same collective keeps its earliest sighting (a datagram's delay makes
    an age measured later too short, never too long)."""
    same = alive.in_flight_key() is not None and alive.in_flight_key() == prev.in_flight_key()
    return dataclasses.replace(
        prev,
        alive_at=alive.alive_at,
        recording=alive.recording,
        in_flight_since=min(alive.in_flight_since, prev.in_flight_since)
        if same and prev.in_flight_since
        else alive.in_flight_since,
        in_flight_seq=alive.in_flight_seq,
        in_flight_group=alive.in_flight_group,
        in_flight=alive.in_flight or (prev.in_flight if same else ""),
    )


def carried(beat: Beat, now: float) -> Beat:
    """A kept process's last beat of the round before, standing for it in the new round until
    its first beat there: liveness as it was, progress counted from ``now`` (``recovering``,
    judged with the start timeout) and nothing in flight."""
    return dataclasses.replace(
        beat,
        phase="recovering",
        carried=True,
        received_at=now,
        recording=False,
        in_flight_since=0.0,
        in_flight_seq=-1,
        in_flight_group="",
        in_flight="",
    )


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
        self._totals: dict[int, RankTotals] = {}  #: local rank -> since the last take_totals()
        self._training_beats: dict[int, int] = {}  #: local rank -> training beats this round
        self._carried: dict[int, int] = {}  #: local rank -> pid of a kept process not yet heard in this round
        self.dropped = 0  #: malformed datagrams received so far (each dropped whole)
        self._drops_unlogged = 0  #: dropped since the last one logged
        self._drop_logged_at = -math.inf  #: time.monotonic() of the last one logged
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat-server", daemon=True)
        self._thread.start()

    def reset(self, round_: int) -> None:
        """Forget the beats of earlier rounds; accept only ``round_`` from now on."""
        with self._lock:
            self._round, self._beats, self._totals, self._training_beats = round_, {}, {}, {}
            self._carried = {}

    def carry(self, beats: Mapping[int, Beat], now: float) -> None:
        """After :meth:`reset`: ``beats`` (local rank -> its last beat of the round before, with
        its rank in the new round) are of processes that go on serving that local rank (live
        workers kept). Until a process's first beat of the new round, its last beat stands
        (:func:`carried`), and any "alive" it sends renews its liveness, whatever round it still
        names (it may not have switched yet): a kept process that froze as the round changed is
        then found by its silence within ``hang_timeout_s``, not after the start timeout."""
        with self._lock:
            for local_rank, beat in beats.items():
                if local_rank not in self._beats and beat.finished is None:
                    self._beats[local_rank] = carried(beat, now)
                    self._carried[local_rank] = beat.pid

    def take_totals(self) -> dict[int, RankTotals]:
        """Local rank -> what its training beats since the last call add up to (every beat, not
        only the newest: the straggler signal and the accounting of lost time)."""
        with self._lock:
            taken, self._totals = self._totals, {}
        return taken

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
            try:
                self._handle(data)
            except Exception:  # noqa: BLE001 - one datagram must never end the receiver (later beats would be lost)
                log.exception("heartbeat receiver: a datagram could not be handled; going on")

    def _dropped(self, data: bytes, why: Exception, now: float) -> None:
        self.dropped += 1
        self._drops_unlogged += 1
        if now - self._drop_logged_at < DROP_LOG_INTERVAL_S:
            return
        others = self._drops_unlogged - 1
        self._drop_logged_at, self._drops_unlogged = now, 0
        log.warning(
            "ignoring a malformed heartbeat (%s): %r%s",
            str(why)[:300],
            data[:200],
            f" ({others} more dropped since the last one logged)" if others else "",
        )

    def _handle(self, data: bytes) -> None:
        now = time.monotonic()
        try:
            round_, kind, beat = parse_beat(data, now)
        except VALUE_ERRORS as e:
            self._dropped(data, e, now)
            return
        with self._lock:
            prev = self._beats.get(beat.local_rank)
            if round_ != self._round:
                if kind == "alive" and prev is not None and self._carried.get(beat.local_rank) == beat.pid:
                    self._beats[beat.local_rank] = dataclasses.replace(prev, alive_at=beat.alive_at)
                return
            if kind != "alive":
                self._carried.pop(beat.local_rank, None)
            if kind == "alive":  # liveness and what is in flight: the step beat it follows stays as it is
                if prev is not None and prev.pid == beat.pid:  # a new object: readers hold the old one
                    self._beats[beat.local_rank] = _after_alive(prev, beat)
                return
            if prev is not None and prev.pid == beat.pid:  # a step beat: the last "alive" says what is in flight
                beat.recording, beat.in_flight_since = prev.recording, prev.in_flight_since
                beat.in_flight_seq, beat.in_flight_group, beat.in_flight = (
                    prev.in_flight_seq,
                    prev.in_flight_group,
                    prev.in_flight,
                )
            if prev is not None and not beat.phases_s:  # a beat outside training keeps the last breakdown
                beat.phases_s = prev.phases_s
            elif beat.phases_s and kind == "beat" and beat.phase == "training":
                seen = self._training_beats[beat.local_rank] = self._training_beats.get(beat.local_rank, 0) + 1
                totals = self._totals.setdefault(beat.local_rank, RankTotals(beat.rank))
                totals.add(beat.phases_s, judged=seen > WARMUP_BEATS)
            if kind != "exit" and prev is not None and prev.finished is not None:
                beat.finished, beat.error, beat.fatal = prev.finished, prev.error, prev.fatal
            self._beats[beat.local_rank] = beat
