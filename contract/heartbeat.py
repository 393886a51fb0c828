"""The datagrams a worker sends its node agent, one JSON object each (the wire format).

Three kinds share one schema, :class:`Message`:

- ``beat``: one per step (``phase`` is ``training`` between steps, or ``starting``, ``loading``,
  ``saving`` while a longer pause is expected; ``recovering``: a live worker whose round ended waits
  for the next one), with the step, its duration and the checkpoint
  health (``ckpt_failures``: commits failed since the last one that succeeded).
- ``exit``: the last message (``finished``; ``error``: why it failed; ``fatal``: a restart
  cannot help).
- ``alive``: every second from a background thread: the process runs (a SIGSTOPped or frozen
  worker sends nothing), which is not the same as making progress. It also says what this rank
  waits in: its oldest collective in flight (``in_flight_seq`` in group ``in_flight_group``,
  ``in_flight`` what it is, ``in_flight_s`` how long it has been in flight), when its flight
  recorder is on (``recording``; off, the in-flight fields say nothing).

What must stay true: :meth:`Message.decode` checks every field and refuses the whole datagram
if one is wrong: integers are ints (not bools, floats or strings), ``pid`` a possible process
id (2 .. :data:`PID_MAX`: never 0, 1 or negative, which ``kill`` reads as process groups or
everything), ``local_rank`` 0 .. :data:`MAX_LOCAL_RANK`, times finite and non-negative, strings
cut to :data:`MAX_TEXT_CHARS` (the in-flight description and group to :data:`MAX_IN_FLIGHT_CHARS`),
an in-flight age at most :data:`MAX_IN_FLIGHT_S`, and the in-flight fields consistent (set only
by a recording worker, and all together). Whatever a datagram holds (a 400-digit number, a list
nested 10,000 deep, invalid UTF-8), :meth:`Message.decode` raises ValueError and nothing else, so
one hostile datagram never ends the receiver's thread; text is kept printable (a lone surrogate
is written as its escape). A decoded pid is still only a claim.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from ftrain.contract.bounded_json import VALUE_ERRORS, is_finite_number, loads, printable, short

KINDS = frozenset({"beat", "exit", "alive"})
#: where a step's time goes on a rank (ftrain.observability.step_phases), in the order they are shown
STEP_PHASES = ("data", "forward", "backward", "comm_wait", "optimizer", "ckpt_staging", "other")
#: a rank's time not spent waiting for its peers: a straggler has more of it (its peers wait for
#: it in comm_wait instead)
BUSY_PHASES = tuple(p for p in STEP_PHASES if p != "comm_wait")
PHASES = frozenset({"training", "starting", "loading", "saving", "recovering", "exiting"})
MAX_DATAGRAM_BYTES = 4096
PID_MAX = 2**22  #: the kernel's largest possible pid_max
MAX_LOCAL_RANK = 4095
MAX_TEXT_CHARS = 1000  #: longest string kept by the receiver
MAX_ERROR_CHARS = 500  #: errors are cut to this by the sender, so that a datagram stays well under 4 KiB
MAX_IN_FLIGHT_CHARS = 200  #: the in-flight collective's description and group name, cut by both ends
MAX_IN_FLIGHT_S = 1e9  #: an in-flight age beyond this (30 years) is not a measurement
_BIG = 2**62


@dataclass(frozen=True, slots=True)
class Message:
    kind: str  #: beat | exit | alive
    round: int  #: the round the worker was started in (its agent ignores other rounds)
    rank: int
    local_rank: int
    pid: int
    time: float = 0.0  #: the sender's wall clock (informational)
    phase: str = "training"
    step: int = -1
    step_time_s: float = 0.0
    committed_step: int = -1
    ckpt_duration_s: float = 0.0  #: how long the newest committed save took, staging to commit
    ckpt_failures: int = 0  #: commits failed in a row (0 after a commit)
    ckpt_failures_total: int = 0  #: failed commits of this worker process
    ckpt_error: str = ""  #: the last failed commit's error
    #: times the consistency check found this worker process's rank corrupt (its replicas'
    #: majority held other values): silent data corruption, counted by the agent per node
    corruptions: int = 0
    #: this rank's time since its previous beat by phase (STEP_PHASES; beats of the training phase)
    phases_s: dict[str, float] = dataclasses.field(default_factory=dict)
    finished: bool = False  #: exit: the worker completed training
    error: str = ""  #: exit: why the worker failed
    fatal: bool = False  #: exit: a restart cannot help
    recording: bool = False  #: alive: the worker's flight recorder tells what is in flight (else nothing is known)
    in_flight_seq: int = -1  #: alive: the sequence number of its oldest collective in flight (-1: none)
    in_flight_group: str = ""  #: that collective's process group
    in_flight: str = ""  #: what it is (op, shapes, dtypes: ``gloo:all_reduce [1000] Float``; may be empty)
    in_flight_s: float = 0.0  #: how long it had been in flight when this datagram was sent

    def encode(self) -> bytes:
        fields = dataclasses.asdict(self)
        for name in ("error", "ckpt_error"):
            fields[name] = fields[name][:MAX_ERROR_CHARS]
        for name in ("in_flight", "in_flight_group"):
            fields[name] = fields[name][:MAX_IN_FLIGHT_CHARS]
        return json.dumps(fields).encode()

    @classmethod
    def decode(cls, data: bytes) -> Message:
        """The message in ``data``; ValueError, and nothing else, if it is not one (see the module doc)."""
        try:
            return cls._decode(data)
        except ValueError:
            raise
        except VALUE_ERRORS as e:  # whatever a value raises is a bad datagram, never a dead receiver
            raise ValueError(f"{type(e).__name__}: {e}") from e

    @classmethod
    def _decode(cls, data: bytes) -> Message:
        # the receiver reads at most MAX_DATAGRAM_BYTES; this bound is for bytes handed in otherwise
        msg = loads(data, max_bytes=16 * MAX_DATAGRAM_BYTES, what="heartbeat datagram")
        if not isinstance(msg, dict):
            raise ValueError("not a JSON object")
        kind = _text(msg, "kind", "beat")
        if kind not in KINDS:
            raise ValueError(f"kind={short(kind)}")
        phase = _text(msg, "phase", "training")
        if phase not in PHASES:
            raise ValueError(f"phase={short(phase)}")
        return cls(
            kind=kind,
            round=_int(msg, "round", None, 0, _BIG),
            rank=_int(msg, "rank", -1, -1, _BIG),
            local_rank=_int(msg, "local_rank", None, 0, MAX_LOCAL_RANK),
            pid=_int(msg, "pid", None, 2, PID_MAX),
            time=_float(msg, "time"),
            phase=phase,
            step=_int(msg, "step", -1, -1, _BIG),
            step_time_s=_float(msg, "step_time_s"),
            committed_step=_int(msg, "committed_step", -1, -1, _BIG),
            ckpt_duration_s=_float(msg, "ckpt_duration_s"),
            ckpt_failures=_int(msg, "ckpt_failures", 0, 0, _BIG),
            ckpt_failures_total=_int(msg, "ckpt_failures_total", 0, 0, _BIG),
            ckpt_error=_text(msg, "ckpt_error"),
            corruptions=_int(msg, "corruptions", 0, 0, _BIG),
            phases_s=_phases(msg),
            finished=_bool(msg, "finished"),
            error=_text(msg, "error"),
            fatal=_bool(msg, "fatal"),
            **_in_flight(msg),
        )


def _in_flight(msg: dict[str, Any]) -> dict[str, Any]:
    """The in-flight fields, checked together: none without ``recording``, and a collective
    (``in_flight_seq`` >= 0) for any of the others."""
    recording = _bool(msg, "recording")
    seq = _int(msg, "in_flight_seq", -1, -1, _BIG)
    group = _text(msg, "in_flight_group")[:MAX_IN_FLIGHT_CHARS]
    what = _text(msg, "in_flight")[:MAX_IN_FLIGHT_CHARS]
    age_s = _float(msg, "in_flight_s")
    if age_s > MAX_IN_FLIGHT_S:
        raise ValueError(f"in_flight_s={age_s}: need at most {MAX_IN_FLIGHT_S:g}")
    if seq < 0 and (group or what or age_s):
        raise ValueError("in_flight_group, in_flight and in_flight_s need a collective (in_flight_seq >= 0)")
    if seq >= 0 and not recording:
        raise ValueError("an in-flight collective from a worker whose flight recorder is off (recording=false)")
    return {
        "recording": recording,
        "in_flight_seq": seq,
        "in_flight_group": group,
        "in_flight": what,
        "in_flight_s": age_s,
    }


def _int(msg: dict[str, Any], name: str, default: int | None, low: int, high: int) -> int:
    value = msg.get(name, default)
    if value is None or not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ValueError(f"{name}={short(value)}: need an int in [{low}, {high}]")
    return value


def _float(msg: dict[str, Any], name: str) -> float:
    value = msg.get(name, 0.0)
    if not is_finite_number(value) or value < 0:
        raise ValueError(f"{name}={short(value)}: need a finite number >= 0")
    return float(value)


def _text(msg: dict[str, Any], name: str, default: str = "") -> str:
    value = msg.get(name, default)
    if not isinstance(value, str):
        raise ValueError(f"{name}={short(value)}: need a string")
    return printable(value[:MAX_TEXT_CHARS])


def _phases(msg: dict[str, Any]) -> dict[str, float]:
    value = msg.get("phases_s", {})
    if not isinstance(value, dict) or not set(value) <= set(STEP_PHASES):
        raise ValueError(f"phases_s={short(value)}: need an object with keys among {STEP_PHASES}")
    return {name: _float(value, name) for name in value}


def _bool(msg: dict[str, Any], name: str) -> bool:
    value = msg.get(name, False)
    if not isinstance(value, bool):
        raise ValueError(f"{name}={short(value)}: need a boolean")
    return value
