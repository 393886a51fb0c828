"""The agent → worker half of the local channel: which round a live worker serves, and as which rank.

Under ``--recovery live`` an agent owns its worker processes directly and keeps them across
rounds. Each process is started as a spare (``ftrain worker``: Python, torch and ftrain
imported, nothing else) with ``FTRAIN_CONTROL`` naming its control file; the agent writes an
:class:`Assignment` there, by rename, whenever the process is to serve a round: its rank, the
world size and where the round's store is. The worker polls the file (a ``stat`` per step) and
moves to a newer round at the next step boundary, or at once when its collectives fail.

What must stay true: a worker acts only on an assignment whose round is newer than the one it
serves (an old or replayed file changes nothing); :meth:`Assignment.decode` checks every field and
refuses the whole file if one is wrong, with :class:`ValueError` and nothing else whatever the file
holds (:meth:`ControlFile.read` too: a file that is not a regular one, or cannot be read, is a
ValueError, so that the worker's loop goes on waiting for a good one); a file is replaced whole
(write to a temporary name, then ``rename``), so a reader never sees half of one. The worker side
of the channel is the heartbeat datagrams (:mod:`ftrain.contract.heartbeat`).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import os
import re
from dataclasses import dataclass

from ftrain.contract.bounded_json import VALUE_ERRORS, loads, short
from ftrain.contract.local_files import create_new, read_regular, replace_file
from ftrain.contract.worker_env import MAX_ROUND

MAX_WORLD_SIZE = 1 << 20
MAX_FILE_BYTES = 64 << 10  #: an assignment is a few hundred bytes
_HOST = re.compile(r"^[A-Za-z0-9][A-Za-z0-9.\-]{0,252}$")


@dataclass(frozen=True, slots=True)
class Assignment:
    """One process's part in one round (``stop``: leave instead; the other fields are then unused)."""

    round: int
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    nnodes: int
    master_addr: str
    master_port: int
    stop: bool = False
    #: the round before this one lost a member: leave it at once, not at the next step boundary
    interrupt: bool = False
    #: the newest committed step when the round was launched (-1: none known): state held in
    #: memory that is older was left behind by the rounds that trained on without this process
    committed_step: int = -1

    def __post_init__(self) -> None:
        _check_int("round", self.round, 0, MAX_ROUND)
        _check_int("world_size", self.world_size, 1, MAX_WORLD_SIZE)
        _check_int("rank", self.rank, 0, self.world_size - 1)
        _check_int("local_world_size", self.local_world_size, 1, self.world_size)
        _check_int("local_rank", self.local_rank, 0, self.local_world_size - 1)
        _check_int("nnodes", self.nnodes, 1, self.world_size)
        _check_int("node_rank", self.node_rank, 0, self.nnodes - 1)
        _check_int("master_port", self.master_port, 1, 65535)
        _check_int("committed_step", self.committed_step, -1, 2**62)
        for name in ("stop", "interrupt"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r}: need true or false")
        if not isinstance(self.master_addr, str) or not _valid_host(self.master_addr):
            raise ValueError(f"master_addr={short(self.master_addr)}: need a host name or IP address")

    def encode(self) -> bytes:
        return json.dumps(dataclasses.asdict(self)).encode()

    @classmethod
    def decode(cls, data: bytes) -> Assignment:
        """The assignment in ``data``; ValueError (and nothing else) naming the field if any is
        missing or wrong."""
        try:
            return cls._decode(data)
        except ValueError:
            raise
        except VALUE_ERRORS as e:
            raise ValueError(f"{type(e).__name__}: {e}") from e

    @classmethod
    def _decode(cls, data: bytes) -> Assignment:
        raw = loads(data, max_bytes=MAX_FILE_BYTES, what="assignment")
        if not isinstance(raw, dict):
            raise ValueError("not a JSON object")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - names)
        if unknown:
            raise ValueError(f"unknown field(s) {short(unknown)}")
        missing = sorted(n for n in names - set(raw) if n not in ("stop", "interrupt", "committed_step"))
        if missing:
            raise ValueError(f"missing field(s) {missing}")
        return cls(**raw)

    def env(self) -> dict[str, str]:
        """torchrun's environment contract for this rank (what ``init_process_group`` and the
        runtime read), plus the round."""
        return {
            "RANK": str(self.rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(self.local_rank),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
            "GROUP_RANK": str(self.node_rank),
            "NODE_RANK": str(self.node_rank),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
            "FTRAIN_ROUND": str(self.round),
        }


def _check_int(name: str, value: object, low: int, high: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ValueError(f"{name}={short(value)}: need an int in [{low}, {high}]")


def _valid_host(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return bool(_HOST.fullmatch(host))


class ControlFile:
    """One worker process's control file: the agent :meth:`write`\\ s, the worker :meth:`read`\\ s."""

    def __init__(self, path: str):
        self.path = path
        self._seen: tuple[int, int] | None = None  #: (inode, mtime_ns) of the file last read

    def write(self, assignment: Assignment) -> None:
        replace_file(self.path, assignment.encode(), 0o600)  # never through a link planted there

    def read(self) -> Assignment | None:
        """The assignment in the file, None while there is none; ValueError if it is unusable
        (not a regular file, unreadable, too long, or not an assignment)."""
        try:
            data = read_regular(self.path, MAX_FILE_BYTES)  # a FIFO or link planted there is refused, not waited on
        except FileNotFoundError:
            return None
        except OSError as e:
            raise ValueError(f"control file {self.path}: {e}") from e
        return Assignment.decode(data)

    @property
    def ready_path(self) -> str:
        """Created by the worker once it is warm (imports done, first step paid): spares with it
        are taken first."""
        return self.path + ".ready"

    def mark_ready(self) -> None:
        try:
            os.close(create_new(self.ready_path))
        except FileExistsError:  # marked before, or something planted there: never written through
            pass

    def is_ready(self) -> bool:
        return os.path.exists(self.ready_path)

    def changed(self) -> bool:
        """Whether the file was replaced since the last call (one ``stat``; cheap enough per step)."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return False
        seen = (st.st_ino, st.st_mtime_ns)
        if seen == self._seen:
            return False
        self._seen = seen
        return True
