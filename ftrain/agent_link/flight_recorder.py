"""The worker's flight recorder: the last collectives of this rank, for its agent on request.

torch keeps a ring buffer of every collective a process group issues when
``TORCH_FR_BUFFER_SIZE`` is set before the first group is created (sequence number, op, sizes,
dtypes, state, times). There are two buffers, read apart: NCCL's (``_dump_nccl_trace_json``,
compiled only into CUDA builds of torch) and every other backend's (``_dump_fr_trace_json``:
gloo). A worker on GPUs has both (NCCL for training, gloo for the memory tier and the
checkpoints' group), so every read here merges what each buffer this torch has holds, a group's
id prefixed with its buffer's name (:data:`DUMPS`). :func:`enable` sets the size from
``logging.flight_recorder_entries``; :func:`snapshot` turns the buffers into a
:class:`ftrain.contract.flight.FlightRecord` of the current world's groups (entries of groups that an
earlier round of a live worker left behind are dropped: their names and numbers repeat).

:func:`oldest_in_flight` says, cheaply enough for a once-a-second thread, which collective of
the current world has waited longest (see there for how, and what it costs).

:class:`FlightServer` answers the agent: a daemon thread waits on an abstract Unix datagram
socket named after this process (``ftrain-flight-<pid>``) and, for each request its agent sends,
writes the record to ``<stack_dir>/<pid>.flight.json`` (a new file under a random name that no
link can stand in for, then a rename). It runs while the main thread is blocked inside a
collective (the wait releases the GIL), which is when the record matters; a stopped process
cannot answer, and that silence is itself the agent's evidence. Recording costs torch one small
entry per collective; the server costs nothing until asked (``bench/flight_recorder.py``
measures both, and a flood of requests).

What must stay true: the socket's name is public, so the server trusts nothing a datagram says
(:mod:`ftrain.agent_link.flight_gate`: only the agent's pid and this user's uid, as the kernel attaches
them, are answered; datagrams, answers and snapshots are rate-limited), and nothing about it
may stop the worker: a name already taken leaves the worker training without a recorder.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from ftrain.agent_link import flight_gate
from ftrain.contract.flight import BUFFER_ENV, STATES, Collective, FlightRecord, record_path, socket_name
from ftrain.contract.local_files import create_new, private_dir
from ftrain.contract.worker_env import STACK_DIR, WorkerEnv

log = logging.getLogger(__name__)

#: torch's dumps of its flight recorder buffers -> the prefix of their groups' ids here
DUMPS = {"_dump_nccl_trace_json": "nccl", "_dump_fr_trace_json": "fr"}
EXACT_AFTER_S = 1.0  #: a collective in flight this long is looked up in the buffer (see oldest_in_flight)

_world_since_ns = 0  #: when this process last joined a world: older entries belong to an earlier one


class _InFlight:
    """What :func:`oldest_in_flight` learnt about one group's oldest unfinished collective."""

    __slots__ = ("collective", "exact", "seen_at_s", "status")

    def __init__(self, status: tuple[int, int], collective: Collective | None):
        self.status = status  #: (last completed, last enqueued) sequence numbers when learnt
        self.collective = collective  #: None: the buffer holds no unfinished collective of this world there
        self.exact = False  #: read from the buffer (else: estimated from the group's status)
        self.seen_at_s = time.monotonic()


_in_flight: dict[str, _InFlight] = {}  #: torch's backend id of a group -> its oldest unfinished collective
_group_names: dict[str, str] = {}  #: backend id -> group name, as the buffer showed them in this world
_old_backends: set[str] = set()  #: backend ids of earlier worlds (torch keeps their status for good)
_in_flight_lock = threading.Lock()
_unreadable: set[str] = set()  #: dumps (DUMPS) that failed once: said once


def enable(entries: int) -> None:
    """Before the first process group: keep the last ``entries`` collectives (0: off). A size
    the user already set in the environment wins."""
    if entries > 0 and not any(os.environ.get(name) for name in BUFFER_ENV):
        os.environ["TORCH_FR_BUFFER_SIZE"] = str(entries)


def new_world() -> None:
    """This process is about to join a (new) default process group."""
    global _world_since_ns
    _world_since_ns = time.time_ns()
    with _in_flight_lock:
        _in_flight.clear()
        _group_names.clear()
        _old_backends.update(_read_pg_status() or {})


def snapshot(rank: int, *, nonce: str = "") -> FlightRecord:
    """This rank's collectives of the current world, oldest first."""
    raw = _torch_dump()
    groups = _groups()
    entries = [_collective(e) for e in (raw or {}).get("entries", []) if _of_this_world(e, groups)]
    return FlightRecord(
        rank=rank,
        pid=os.getpid(),
        taken_at=time.time(),
        entries=entries,
        groups=groups,
        nonce=nonce,
        available=raw is not None,
    )


def _of_this_world(entry: dict[str, Any], groups: dict[str, list[int]]) -> bool:
    """A collective (not p2p) of a group of the current world (see the module doc)."""
    if entry.get("is_p2p") or int(entry.get("time_created_ns", 0)) < _world_since_ns:
        return False
    return not groups or _group_name(entry) in groups


def _group_name(entry: dict[str, Any]) -> str:
    return str((entry.get("process_group") or ["?"])[0])


def _collective(entry: dict[str, Any]) -> Collective:
    state = str(entry.get("state", "scheduled"))
    return Collective(
        seq=int(entry.get("collective_seq_id", 0)),
        group=_group_name(entry),
        op=str(entry.get("profiling_name", "?")),
        sizes=[[int(d) for d in s] for s in entry.get("input_sizes", [])],
        dtypes=[str(d) for d in entry.get("input_dtypes", [])],
        state=state if state in STATES else "scheduled",
        done=bool(entry.get("retired", False)) or state == "completed",
        enqueued_s=int(entry.get("time_created_ns", 0)) / 1e9,
        started_s=int(entry.get("time_discovered_started_ns", 0) or 0) / 1e9,
        ended_s=int(entry.get("time_discovered_completed_ns", 0) or 0) / 1e9,
    )


def oldest_in_flight() -> Collective | None:
    """The oldest collective of the current world that has not completed (None: nothing is in
    flight, or recording is off); cheap enough to call every second while training runs.

    The buffer is not read on each call: under gloo torch never marks an entry completed, so
    even ``_dump_fr_trace_json(True, True)`` ("only active") serialises every entry (60-90 ms
    at 2,000 entries here). A call reads only the groups' status (last enqueued and last
    completed sequence numbers, keyed by torch's backend id, which never repeats in a process;
    the ids that existed when this process last called :func:`new_world` are an earlier
    world's, and skipped). A group whose last completed trails its last enqueued has the next
    one in flight (numbers start at 1; a new group's last completed is -1). When such a
    collective is first seen, its ``enqueued_s`` is the time of that sighting (later than the
    truth by at most the time between calls, never earlier), its ``op`` is empty and its
    ``group`` is the name if known ("" before the first look). Once it has stayed in flight for
    :data:`EXACT_AFTER_S`, the buffer is read once, with :func:`snapshot`'s filters, for the
    entry itself (op, sizes, group, the real enqueue time), kept until the group's status
    moves. A dump is thus paid only by collectives that last over :data:`EXACT_AFTER_S`, at
    most one per group per :data:`EXACT_AFTER_S`. torch marks a group's status completed a
    moment after ``wait()`` returns: a call just then may still see that collective.
    """
    status = _read_pg_status() if _recording() and dist.is_initialized() else None
    if status is None:
        return None
    found: list[Collective] = []
    with _in_flight_lock:
        for backend in [b for b in _in_flight if b not in status]:
            del _in_flight[backend]
        for backend, (completed, enqueued) in status.items():
            if backend in _old_backends or enqueued <= completed:
                _in_flight.pop(backend, None)
                continue
            known = _in_flight.get(backend)
            if (
                known is None
                or known.status[0] != completed
                or (known.collective is None and known.status[1] != enqueued)
            ):
                # a new oldest collective (or news behind one the buffer did not hold): a sighting
                name = _group_names.get(backend, "")
                sighted = Collective(max(completed, 0) + 1, name, "", enqueued_s=time.time())
                known = _in_flight[backend] = _InFlight((completed, enqueued), sighted)
            known.status = (completed, enqueued)
            if not known.exact and time.monotonic() - known.seen_at_s >= EXACT_AFTER_S:
                known.collective = _oldest_unfinished(backend)
                known.exact = True
            if known.collective is not None:
                found.append(known.collective)
    return min(found, key=lambda c: c.enqueued_s, default=None)


def _read_pg_status() -> dict[str, tuple[int, int]] | None:
    """torch's backend id of each group (prefixed with its buffer's) -> (last completed, last
    enqueued) collective sequence numbers (None: none to read)."""
    dumps = _dumps(include_collectives=False, only_active=True)
    if not dumps:
        return None
    try:
        return {
            f"{prefix}:{backend}": (
                int(s.get("last_completed_collective", -1)),
                int(s.get("last_enqueued_collective", -1)),
            )
            for prefix, dumped in dumps
            for backend, s in dumped.get("pg_status", {}).items()
        }
    except (TypeError, ValueError, AttributeError) as e:
        log.debug("no process group status from the flight recorder: %s", e)
        return None


def _oldest_unfinished(backend: str) -> Collective | None:
    """The oldest entry of the group with torch's backend id ``backend`` in the buffer that has
    not completed (caller holds the lock); learns the names of this world's groups on the way."""
    groups = _groups()
    oldest = None
    for entry in (_torch_dump(only_active=True) or {}).get("entries", []):
        if not _of_this_world(entry, groups):
            continue
        _group_names[str(entry.get("pg_id"))] = _group_name(entry)
        if oldest is None and str(entry.get("pg_id")) == backend:
            collective = _collective(entry)
            oldest = None if collective.done else collective
    return oldest


def _recording() -> bool:
    return any(os.environ.get(name, "0") not in ("", "0") for name in BUFFER_ENV)


def _torch_dump(*, only_active: bool = False) -> dict[str, Any] | None:
    """torch's flight recorder buffers as one dump, entries oldest first, each entry's ``pg_id``
    prefixed with its buffer's (None: this torch keeps none)."""
    if not _recording():
        return None
    dumps = _dumps(include_collectives=True, only_active=only_active)
    if not dumps:
        return None
    entries = []
    for prefix, dumped in dumps:
        for entry in dumped.get("entries", []):
            if isinstance(entry, dict):
                entries.append({**entry, "pg_id": f"{prefix}:{entry.get('pg_id')}"})
    if len(dumps) > 1:
        entries.sort(key=lambda e: int(e.get("time_created_ns", 0) or 0))
    return {"entries": entries}


def _dumps(*, include_collectives: bool, only_active: bool) -> list[tuple[str, dict[str, Any]]]:
    """(prefix, parsed dump) of each of torch's flight recorder buffers that this torch has and
    that could be read (:data:`DUMPS`)."""
    from torch._C import _distributed_c10d as c10d  # noqa: PLC0415

    found = []
    for name, prefix in DUMPS.items():
        dump = getattr(c10d, name, None)
        if dump is None:  # a CPU build of torch has no NCCL buffer
            continue
        try:
            dumped = json.loads(dump(include_collectives, only_active))
        except (RuntimeError, ValueError, TypeError) as e:
            # read every second while training runs: said once per buffer, then quietly
            log.log(logging.DEBUG if name in _unreadable else logging.WARNING, "%s failed: %s", name, e)
            _unreadable.add(name)
            continue
        if isinstance(dumped, dict):
            found.append((prefix, dumped))
    return found


def _groups() -> dict[str, list[int]]:
    """Name -> global ranks of every process group of the current world."""
    if not dist.is_initialized():
        return {}
    groups: dict[str, list[int]] = {}
    for pg, name in list(dist.distributed_c10d._world.pg_names.items()):  # noqa: SLF001 - no public listing
        try:
            groups[str(name)] = dist.get_process_group_ranks(pg)
        except (RuntimeError, ValueError):  # a group being torn down
            continue
    return groups


class FlightServer:
    """Answers the agent's requests from a daemon thread (see the module doc).

    The constructor never raises: a name that another process holds (or any other failure to
    listen) leaves :attr:`available` False and this worker training without a recorder, with
    one warning naming the socket and the cause. ``agent_pid``: the only process whose
    requests are answered (None: ``FTRAIN_AGENT_PID``; 0: any process of this user)."""

    def __init__(
        self,
        stack_dir: str,
        rank_of: Callable[[], int],
        *,
        agent_pid: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.stack_dir = stack_dir
        self.name = socket_name(os.getpid())
        self.available = False
        self.snapshots = 0  #: snapshots taken for requests
        self.answers = 0  #: requests answered (fresh or re-stamped)
        self._rank_of = rank_of
        self._clock = clock
        self._closed = threading.Event()
        self._sock: socket.socket | None = None
        self._last: tuple[bytes, float, int] | None = None  #: (encoded with the placeholder, taken at, world)
        where = "@" + self.name[1:].decode()
        self.refusals = flight_gate.Refusals(where, clock)
        try:
            self._agent_pid = _agent_pid() if agent_pid is None else agent_pid
            self._datagrams = flight_gate.Budget(flight_gate.DATAGRAMS_PER_S, flight_gate.DATAGRAMS_PER_S, clock)
            self._answers = flight_gate.Budget(flight_gate.ANSWERS_PER_S, flight_gate.ANSWERS_PER_S, clock)
            self._sock = flight_gate.listen(self.name)
            threading.Thread(target=self._serve, name="flight-recorder", daemon=True).start()
        except Exception as e:  # noqa: BLE001 - a diagnostic must never keep the worker from training
            log.warning(
                "flight recorder off for this worker: cannot listen on the abstract socket %s (%s%s); training "
                "goes on without it, and its agent will report no flight record for it",
                where,
                e,
                ": another process holds the name" if getattr(e, "errno", None) == errno.EADDRINUSE else "",
            )
            self.close()
            return
        self.available = True

    def _serve(self) -> None:
        _name_os_thread(b"flight-recorder")
        sock = self._sock
        assert sock is not None
        while not self._closed.is_set():
            if not self._datagrams.take():  # a flood: leave the rest in the kernel's short queue
                self._closed.wait(self._datagrams.wait_s())
                continue
            try:
                data, sender, cut = flight_gate.receive(sock)
            except OSError:
                return  # closed
            if self._closed.is_set():
                return
            request = flight_gate.judge(data, sender, cut, agent_pid=self._agent_pid)
            if isinstance(request, str):
                self.refusals.note(request)
            elif not self._answers.take():
                self.refusals.note(f"over {flight_gate.ANSWERS_PER_S:.0f} answers a second")
            else:
                try:
                    self.answer(request.nonce)
                except Exception as e:  # noqa: BLE001 - never fail the worker for a diagnostic
                    log.warning("could not write the flight record: %s", e)

    def answer(self, nonce: str) -> str:
        """Write the record for a request (a new snapshot at most every
        ``flight_gate.MIN_SNAPSHOT_INTERVAL_S``; the last one re-stamped with ``nonce`` in between,
        and whenever the process joined another world since); returns its path."""
        now = self._clock()
        last = self._last
        if last is None or now - last[1] >= flight_gate.MIN_SNAPSHOT_INTERVAL_S or last[2] != _world_since_ns:
            encoded = snapshot(self._rank_of(), nonce=_PLACEHOLDER).encode()
            self.snapshots += 1
            last = self._last = (encoded, now, _world_since_ns)
        path = self._publish(flight_gate.restamp(last[0], _PLACEHOLDER, nonce))
        self.answers += 1
        return path

    def write(self, nonce: str = "") -> str:
        """Write a new record now, whatever the rate limit says; returns its path."""
        return self._publish(snapshot(self._rank_of(), nonce=nonce).encode())

    def _publish(self, data: bytes) -> str:
        """``data`` as ``<stack_dir>/<pid>.flight.json``: written under a new name that no link
        can stand in for, then renamed over (readers never see half a record)."""
        folder = private_dir(self.stack_dir, STACK_DIR)
        path = record_path(str(folder), os.getpid())
        tmp = f"{path}.{secrets.token_hex(4)}.tmp"
        fd = create_new(tmp)
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return path

    def close(self) -> None:
        self._closed.set()
        sock, self._sock = self._sock, None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # wakes the serving thread's recvmsg
            sock.close()


_PLACEHOLDER = "nonce-placeholder"  #: the nonce a kept record is encoded with (re-stamped per request)


def _name_os_thread(name: bytes) -> None:
    """Give the calling thread ``name`` where the OS shows it (``top -H``, ``/proc/<pid>/task``;
    Python 3.11 names only its own objects); best effort."""
    try:
        import ctypes  # noqa: PLC0415 - only here

        ctypes.CDLL(None, use_errno=True).prctl(15, ctypes.c_char_p(name[:15]), 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def _agent_pid() -> int:
    """``FTRAIN_AGENT_PID`` (0: not set, or unusable: then any process of this user may ask)."""
    try:
        return WorkerEnv.from_env().agent_pid
    except ValueError as e:
        log.warning("flight recorder: %s; answering any process of this user", e)
        return 0
