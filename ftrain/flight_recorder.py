"""The worker's flight recorder: the last collectives of this rank, for its agent on request.

torch keeps a ring buffer of every collective a process group issues when
``TORCH_FR_BUFFER_SIZE`` is set before the first group is created (gloo and NCCL alike in torch
2.13: sequence number, op, sizes, dtypes, state, times). :func:`enable` sets it from
``logging.flight_recorder_entries``; :func:`snapshot` turns the buffer into a
:class:`contract.flight.FlightRecord` of the current world's groups (entries of groups that an
earlier round of a live worker left behind are dropped: their names and numbers repeat).

:class:`FlightServer` answers the agent: a daemon thread waits on an abstract Unix datagram
socket named after this process (``ftrain-flight-<pid>``) and, for each request, writes the
record to ``<stack_dir>/<pid>.flight.json`` (a temporary name, then a rename). It runs while
the main thread is blocked inside a collective (the wait releases the GIL), which is when the
record matters; a stopped process cannot answer, and that silence is itself the agent's
evidence. Recording costs torch one small entry per collective; the server costs nothing until
asked (``bench/flight_recorder.py`` measures both).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from contract.flight import STATES, Collective, FlightRecord, record_path, socket_name

log = logging.getLogger(__name__)

BUFFER_ENV = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")  #: torch reads the first one set
MAX_REQUEST_BYTES = 256

_world_since_ns = 0  #: when this process last joined a world: older entries belong to an earlier one


def enable(entries: int) -> None:
    """Before the first process group: keep the last ``entries`` collectives (0: off). A size
    the user already set in the environment wins."""
    if entries > 0 and not any(os.environ.get(name) for name in BUFFER_ENV):
        os.environ["TORCH_FR_BUFFER_SIZE"] = str(entries)


def new_world() -> None:
    """This process is about to join a (new) default process group."""
    global _world_since_ns
    _world_since_ns = time.time_ns()


def snapshot(rank: int, *, nonce: str = "") -> FlightRecord:
    """This rank's collectives of the current world, oldest first."""
    raw = _torch_dump()
    groups = _groups()
    entries = []
    for e in (raw or {}).get("entries", []):
        if e.get("is_p2p") or int(e.get("time_created_ns", 0)) < _world_since_ns:
            continue
        name = str((e.get("process_group") or ["?"])[0])
        if groups and name not in groups:
            continue
        state = str(e.get("state", "scheduled"))
        entries.append(
            Collective(
                seq=int(e.get("collective_seq_id", 0)),
                group=name,
                op=str(e.get("profiling_name", "?")),
                sizes=[[int(d) for d in s] for s in e.get("input_sizes", [])],
                dtypes=[str(d) for d in e.get("input_dtypes", [])],
                state=state if state in STATES else "scheduled",
                done=bool(e.get("retired", False)) or state == "completed",
                enqueued_s=int(e.get("time_created_ns", 0)) / 1e9,
                started_s=int(e.get("time_discovered_started_ns", 0) or 0) / 1e9,
                ended_s=int(e.get("time_discovered_completed_ns", 0) or 0) / 1e9,
            )
        )
    return FlightRecord(
        rank=rank,
        pid=os.getpid(),
        taken_at=time.time(),
        entries=entries,
        groups=groups,
        nonce=nonce,
        available=raw is not None,
    )


def _torch_dump() -> dict[str, Any] | None:
    """torch's flight recorder buffer (None: this torch or backend keeps none)."""
    if not any(os.environ.get(name, "0") not in ("", "0") for name in BUFFER_ENV):
        return None
    try:
        from torch._C._distributed_c10d import _dump_fr_trace_json  # type: ignore[attr-defined]  # noqa: PLC0415
    except ImportError:
        return None
    try:
        dumped: dict[str, Any] = json.loads(_dump_fr_trace_json(True, False))
    except (RuntimeError, ValueError) as e:
        log.warning("the flight recorder could not be read: %s", e)
        return None
    return dumped


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
    """Answers the agent's requests from a daemon thread (see the module doc)."""

    def __init__(self, stack_dir: str, rank_of: Callable[[], int]):
        self.stack_dir = stack_dir
        self._rank_of = rank_of
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(socket_name(os.getpid()))
        self._thread = threading.Thread(target=self._run, name="flight-recorder", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                request = self._sock.recv(MAX_REQUEST_BYTES)
            except OSError:
                return  # closed
            try:
                self.write(request.decode(errors="replace").strip()[:64])
            except Exception as e:  # noqa: BLE001 - never fail the worker for a diagnostic
                log.warning("could not write the flight record: %s", e)

    def write(self, nonce: str = "") -> str:
        """Write the record now; returns its path."""
        os.makedirs(self.stack_dir, exist_ok=True)
        path = record_path(self.stack_dir, os.getpid())
        tmp = f"{path}.tmp"
        with open(tmp, "wb") as fh:
            fh.write(snapshot(self._rank_of(), nonce=nonce).encode())
        os.replace(tmp, path)
        return path

    def close(self) -> None:
        self._sock.close()
