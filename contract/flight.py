"""A worker's flight record: the last collectives it issued, as it writes them for its agent.

The worker turns torch's own recorder (``TORCH_FR_BUFFER_SIZE``; gloo and NCCL both record in
torch 2.13) into a :class:`FlightRecord` and writes it as one JSON file when its agent asks; the
agent reads the files of its workers into the ``hang`` event and ``ftrain analyze`` reads them
back from the event log. One :class:`Collective` per entry, newest last:

- ``seq``: the collective's sequence number in its process group (every member numbers the same
  collective alike: the key of the analysis);
- ``group``: the group's name, with its members' global ranks in :attr:`FlightRecord.groups`;
- ``op``: what torch calls it (``gloo:all_reduce``, ``nccl:reduce_scatter``, ...), ``sizes`` and
  ``dtypes`` of its inputs;
- ``done``: completed (torch "retired" it); ``state``: scheduled | started | completed;
- ``enqueued_s`` / ``started_s`` / ``ended_s``: wall-clock times (0: the backend does not say).

What must stay true: the agent reads these files from a worker directory, so they are untrusted
input: :meth:`FlightRecord.decode` checks every field, bounds every list and string, and
refuses the whole record if one entry is wrong (a record that lies about one collective cannot be
used to blame a rank), with ValueError and nothing else, whatever it holds (a 400-digit time, a
list nested 100,000 deep, invalid UTF-8). Names carry no control characters and no lone
surrogates: they are printed to logs and terminals (``ftrain status``, ``ftrain analyze``), where
an escape sequence would rewrite what is shown and a surrogate cannot be encoded.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from ftrain.contract.bounded_json import VALUE_ERRORS, is_finite_number, loads, short

MAX_ENTRIES = 4096  #: the most collectives a record may hold
BUFFER_ENV = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")  #: torch reads the first one set
#: collectives each rank keeps by default: ``logging.flight_recorder_entries``, and what the agent
#: gives a script's workers (``ftrain agent --script``) unless its environment sets a size
DEFAULT_ENTRIES = 2000
MAX_GROUPS = 1024
MAX_GROUP_SIZE = 1 << 20
MAX_TENSORS = 64  #: inputs per collective kept
MAX_DIMS = 8
MAX_NAME_CHARS = 200
MAX_RECORD_BYTES = 8 << 20  #: a record file larger than this is refused unread
EVENT_TAIL = 32  #: collectives per group and rank kept in an event (the newest: where the ranks are)
UNEVEN_OPS = frozenset({"scatter", "gather", "alltoall", "alltoall_base", "all_to_all", "allgather_uneven"})
STATES = frozenset({"scheduled", "started", "completed"})
_BIG = 2**62
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\ud800-\udfff]")


def socket_name(pid: int) -> bytes:
    """The abstract Unix socket the worker of ``pid`` takes requests on (one nonce per datagram)."""
    return f"\0ftrain-flight-{pid}".encode()


def record_path(stack_dir: str, pid: int) -> str:
    """Where the worker of ``pid`` writes its answer."""
    return os.path.join(stack_dir, f"{pid}.flight.json")


def script_recorder_env(*given: Mapping[str, str]) -> dict[str, str]:
    """What the agent adds to a script's workers' environment: torch's flight recorder, as
    ``ftrain train`` turns it on itself (the hang verdicts' evidence, ``ftrain analyze``'s),
    unless an environment in ``given`` (the agent's, the job's worker_env) sets a size."""
    if any(env.get(name) for env in given for name in BUFFER_ENV):
        return {}
    return {BUFFER_ENV[0]: str(DEFAULT_ENTRIES)}


@dataclass(frozen=True, slots=True)
class Collective:
    seq: int
    group: str
    op: str
    sizes: list[list[int]] = field(default_factory=list)
    dtypes: list[str] = field(default_factory=list)
    state: str = "scheduled"
    done: bool = False
    enqueued_s: float = 0.0
    started_s: float = 0.0
    ended_s: float = 0.0

    def signature(self) -> tuple[str, ...]:
        """What every member of the group must agree on at one sequence number: the op, and the
        inputs' sizes and dtypes where every member passes the same (not in rooted or uneven
        ops, where only the root holds the list, or each rank its own split)."""
        if self.op.rpartition(":")[2] in UNEVEN_OPS:
            return (self.op,)
        return self.op, json.dumps(self.sizes), ",".join(self.dtypes)

    def what(self) -> str:
        """``gloo:all_reduce [1000] Float``."""
        shapes = " ".join("[" + ",".join(map(str, s)) + "]" for s in self.sizes)
        return " ".join(part for part in (self.op, shapes, ",".join(self.dtypes)) if part)

    def describe(self) -> str:
        """``#57 gloo:all_reduce [1000] Float on group 0``."""
        return f"#{self.seq} {self.what()} on group {self.group}"


@dataclass(frozen=True, slots=True)
class FlightRecord:
    rank: int  #: the worker's global rank when it wrote the record (-1: in no round)
    pid: int
    taken_at: float  #: wall clock of the snapshot
    entries: list[Collective]
    groups: dict[str, list[int]] = field(default_factory=dict)  #: group name -> members' global ranks
    nonce: str = ""  #: echoes the agent's request, so that an old file is not taken for the answer
    available: bool = True  #: False: this process's backend keeps no record (nothing to analyse)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def encode(self) -> bytes:
        return json.dumps(self.to_dict(), separators=(",", ":")).encode()

    def tail(self, count: int) -> FlightRecord:
        """The same record with only its newest ``count`` collectives of each group."""
        kept: list[Collective] = []
        per_group: dict[str, int] = {}
        for entry in reversed(self.entries):
            if per_group.get(entry.group, 0) < count:
                per_group[entry.group] = per_group.get(entry.group, 0) + 1
                kept.append(entry)
        return FlightRecord(self.rank, self.pid, self.taken_at, kept[::-1], self.groups, self.nonce, self.available)

    @classmethod
    def decode(cls, data: bytes | str | dict[str, Any]) -> FlightRecord:
        """The record in ``data`` (bytes, text or an already parsed object); ValueError, and
        nothing else, if any field is wrong (see the module doc)."""
        try:
            return cls._decode(data)
        except ValueError:
            raise
        except VALUE_ERRORS as e:  # whatever a value raises is a refused record, never a crash
            raise ValueError(f"{type(e).__name__}: {e}") from e

    @classmethod
    def _decode(cls, data: bytes | str | dict[str, Any]) -> FlightRecord:
        if isinstance(data, (bytes, str)):
            data = loads(data, max_bytes=MAX_RECORD_BYTES, what="a flight record")
        if not isinstance(data, dict):
            raise ValueError("a flight record must be a JSON object")
        entries = data.get("entries", [])
        if not isinstance(entries, list) or len(entries) > MAX_ENTRIES:
            raise ValueError(f"entries: need a list of at most {MAX_ENTRIES}")
        groups = data.get("groups", {})
        if not isinstance(groups, dict) or len(groups) > MAX_GROUPS:
            raise ValueError(f"groups: need an object of at most {MAX_GROUPS} groups")
        return cls(
            rank=_int(data, "rank", -1, _BIG),
            pid=_int(data, "pid", 0, _BIG),
            taken_at=_float(data, "taken_at"),
            entries=[_collective(e, i) for i, e in enumerate(entries)],
            groups={_name(name, "groups"): _ranks(members, name) for name, members in groups.items()},
            nonce=_name(data.get("nonce", ""), "nonce"),
            available=_bool(data, "available", True),
        )


def _collective(raw: Any, index: int) -> Collective:
    where = f"entries[{index}]"
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: need an object")
    state = _name(raw.get("state", "scheduled"), f"{where}.state")
    if state not in STATES:
        raise ValueError(f"{where}.state={state!r}: need one of {sorted(STATES)}")
    sizes = raw.get("sizes", [])
    if not isinstance(sizes, list) or len(sizes) > MAX_TENSORS:
        raise ValueError(f"{where}.sizes: need a list of at most {MAX_TENSORS} shapes")
    dtypes = raw.get("dtypes", [])
    if not isinstance(dtypes, list) or len(dtypes) > MAX_TENSORS:
        raise ValueError(f"{where}.dtypes: need a list of at most {MAX_TENSORS} names")
    return Collective(
        seq=_int(raw, "seq", 0, _BIG, where),
        group=_name(raw.get("group"), f"{where}.group"),
        op=_name(raw.get("op"), f"{where}.op"),
        sizes=[_shape(s, f"{where}.sizes") for s in sizes],
        dtypes=[_name(d, f"{where}.dtypes") for d in dtypes],
        state=state,
        done=_bool(raw, "done", False, where),
        enqueued_s=_float(raw, "enqueued_s", where),
        started_s=_float(raw, "started_s", where),
        ended_s=_float(raw, "ended_s", where),
    )


def _int(raw: dict[str, Any], key: str, low: int, high: int, where: str = "") -> int:
    value = raw.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ValueError(f"{where + '.' if where else ''}{key}={short(value)}: need an int in [{low}, {high}]")
    return value


def _float(raw: dict[str, Any], key: str, where: str = "") -> float:
    value = raw.get(key, 0.0)
    if not is_finite_number(value) or value < 0:
        raise ValueError(f"{where + '.' if where else ''}{key}={short(value)}: need a finite number >= 0")
    return float(value)


def _bool(raw: dict[str, Any], key: str, default: bool, where: str = "") -> bool:
    value = raw.get(key, default)
    if not isinstance(value, bool):
        raise ValueError(f"{where + '.' if where else ''}{key}={short(value)}: need a boolean")
    return value


def _name(value: Any, where: str) -> str:
    if not isinstance(value, str) or len(value) > MAX_NAME_CHARS:
        raise ValueError(f"{where}={short(value)}: need a string of at most {MAX_NAME_CHARS} characters")
    if _CONTROL.search(value):  # names end up in logs, events and terminals: no escape sequences
        raise ValueError(f"{where}={short(value)}: control characters and lone surrogates are not allowed")
    return value


def _shape(value: Any, where: str) -> list[int]:
    if (
        not isinstance(value, list)
        or len(value) > MAX_DIMS
        or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < _BIG for d in value)
    ):
        raise ValueError(f"{where}: {short(value)} is not a shape (at most {MAX_DIMS} sizes >= 0)")
    return value


def _ranks(value: Any, group: str) -> list[int]:
    if (
        not isinstance(value, list)
        or len(value) > MAX_GROUP_SIZE
        or not all(isinstance(r, int) and not isinstance(r, bool) and 0 <= r < _BIG for r in value)
    ):
        raise ValueError(f"groups[{group!r}]: need a list of global ranks")
    return value
