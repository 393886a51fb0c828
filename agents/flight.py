"""The agent's end of the flight recorder: ask this node's workers for their records.

Each worker answers on an abstract Unix datagram socket named after its pid (see
``ftrain.agent_link.flight_recorder``) by writing ``<stack_dir>/<pid>.flight.json`` with the request's
nonce in it; :func:`collect` sends one request to every worker at once and waits, up to a
deadline, for the answers of those that can answer. A stopped process (state T) is not waited
for: it cannot run, and its silence names it. A file is untrusted input: it is read with a size
limit and decoded field by field (:meth:`ftrain.contract.flight.FlightRecord.decode`); a bad one is a
reason, not a record.

Ask before dumping the stacks: dumping continues a stopped worker, which may then move on.
"""

from __future__ import annotations

import logging
import secrets
import socket
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from ftrain.agents.flight_verdict import Verdict, analyze
from ftrain.agents.workers import process_state
from ftrain.contract.flight import EVENT_TAIL, MAX_RECORD_BYTES, FlightRecord, record_path, socket_name
from ftrain.contract.local_files import read_regular

log = logging.getLogger(__name__)

ANSWER_TIMEOUT_S = 1.0  #: a running worker answers in milliseconds; the deadline is for a busy machine


@dataclass(slots=True)
class Collected:
    records: dict[int, FlightRecord] = field(default_factory=dict)  #: pid -> its record
    missing: dict[int, str] = field(default_factory=dict)  #: pid -> why it gave none


def collect(
    pids: Iterable[int], stack_dir: str, *, stopped: Iterable[int] = (), timeout_s: float = ANSWER_TIMEOUT_S
) -> Collected:
    """The flight records of ``pids``; ``stopped``: pids known to be stopped (asked, not waited for)."""
    pids, stopped = list(pids), set(stopped)
    nonce = secrets.token_hex(8)
    out = Collected()
    pending = set()
    deadline = time.monotonic() + timeout_s
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.setblocking(False)
        for pid in pids:
            why = _send(sock, nonce, pid, deadline)
            if why:
                out.missing[pid] = why
            elif pid in stopped:
                out.missing[pid] = "stopped (SIGSTOP), so it cannot answer"
            else:
                pending.add(pid)
    while pending:
        for pid in list(pending):
            answer = _read(record_path(stack_dir, pid), nonce)
            if answer is not None:
                pending.discard(pid)
                if isinstance(answer, FlightRecord):
                    out.records[pid] = answer
                else:
                    out.missing[pid] = answer
        if not pending or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    for pid in pending:
        out.missing[pid] = f"no answer within {timeout_s:.1f} s (frozen or busy)"
    return out


def _send(sock: socket.socket, nonce: str, pid: int, deadline: float) -> str:
    """Send ``nonce`` to the worker ``pid``; why it could not be sent ("" once sent). A full queue
    (someone else's datagrams, or a worker not reading) is retried until ``deadline``."""
    while True:
        try:
            sock.sendto(nonce.encode(), socket_name(pid))
            return ""
        except BlockingIOError as e:
            if time.monotonic() > deadline:
                return f"no flight recorder answers (its queue stayed full: {e.strerror or e})"
            time.sleep(0.01)
        except OSError as e:  # no recorder there (an older worker, recording off, the name taken)
            return f"no flight recorder answers ({e.strerror or e})"


def _read(path: str, nonce: str) -> FlightRecord | str | None:
    """The record at ``path`` if it answers ``nonce``; a reason if it is unusable; None: not yet."""
    try:
        data = read_regular(path, MAX_RECORD_BYTES)  # a FIFO or link planted there is refused, not waited on
    except FileNotFoundError:
        return None
    except OSError as e:
        return f"unreadable flight record {path}: {e}"
    try:
        record = FlightRecord.decode(data)
    except ValueError as e:  # torn files cannot happen (the worker renames); anything else is refused
        return f"refused flight record {path}: {e}"
    return record if record.nonce == nonce else None


@dataclass(slots=True)
class Evidence:
    """What this node's workers say about a hang, by global rank."""

    records: dict[int, FlightRecord]
    missing: dict[int, str]  #: why a rank gave no record
    frozen: list[int]  #: stopped, or silent (no "alive" datagram) past the agent's limit
    verdict: Verdict


def hang_evidence(
    pid_ranks: dict[int, int],
    stack_dir: str,
    *,
    silent: Iterable[int] = (),
    min_wait_s: float = 0.0,
    where: Mapping[int, str] | None = None,
) -> Evidence:
    """Collect the records of the workers ``pid_ranks`` (pid -> global rank) and judge them;
    ``silent``: global ranks the agent already knows stopped talking; ``min_wait_s`` and
    ``where`` (rank -> where it runs): see :func:`ftrain.agents.flight_verdict.analyze`."""
    stopped = {pid for pid in pid_ranks if process_state(pid) == "T"}
    got = collect(pid_ranks, stack_dir, stopped=stopped)
    records = {pid_ranks[pid]: record.tail(EVENT_TAIL) for pid, record in got.records.items()}
    missing = {pid_ranks[pid]: why for pid, why in got.missing.items()}
    frozen = sorted(set(silent) | {pid_ranks[pid] for pid in stopped})
    verdict = analyze(records, frozen=frozen, missing=missing, now=time.time(), min_wait_s=min_wait_s, where=where)
    return Evidence(records, missing, frozen, verdict)
