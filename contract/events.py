"""Lifecycle events as JSON lines (ckpt_staged, ckpt_committed, ckpt_corrupt, resumed, ...).

Workers, agents and chaos write them; reports, ``ftrain status`` and the chaos invariants read them.

Every rank appends to the same file; each event is one ``write`` of one line, which appends
atomically on local filesystems. Events feed reports and the chaos suite's checks.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Any


log = logging.getLogger(__name__)


class EventLog:
    def __init__(self, path: str = "", *, rank: int = 0, round_: int = 0):
        self.path = path
        self.rank = rank
        self.round = round_
        self._lock = threading.Lock()
        self._fd = -1
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def emit(self, event: str, **fields: Any) -> None:
        record = {"time": time.time(), "event": event, "rank": self.rank, "round": self.round, "pid": os.getpid(),
                  **fields}
        log.debug("event %s", record)
        if self._fd < 0:
            return
        line = (json.dumps(record, default=str, separators=(",", ":")) + "\n").encode()
        with self._lock:
            os.write(self._fd, line)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Read a JSON-lines file (metrics, events), skipping a torn line left by a killed writer."""
    records = []
    with open(path) as fh:
        for line in fh:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records


read_events = read_jsonl
