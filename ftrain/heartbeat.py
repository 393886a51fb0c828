"""The worker's end of the agent channel: heartbeats, stack dumps on request, and a watchdog.

Started from the environment the agent sets (nothing happens without an agent):

- ``FTRAIN_HEARTBEAT``: the agent's Unix datagram socket; one JSON datagram per step (see
  ``agents.heartbeat``). Sending never blocks and never fails the worker.
- ``FTRAIN_STACK_DIR``: SIGUSR1 makes :mod:`faulthandler` write every thread's Python stack to
  ``<dir>/<pid>.txt``. It runs in the C signal handler, so it works while Python is stuck in
  a collective or a lock.
- ``FTRAIN_AGENT_PID``: a watchdog thread ends this worker (SIGKILL to itself) within about a
  second once the agent is gone, or once its own parent (torchrun) is gone, so no worker of
  an old round outlives its agent, even one killed with SIGKILL.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import signal
import socket
import threading
import time

log = logging.getLogger(__name__)

WATCHDOG_INTERVAL_S = 0.5


def process_gone(pid: int) -> bool:
    """True when ``pid`` no longer runs (absent, or a zombie waiting to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            state = fh.read().rsplit(b")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError, ProcessLookupError):
        return True
    except OSError:
        return False
    return state in (b"Z", b"X")


class Heartbeat:
    def __init__(self, path: str, *, round_: int, rank: int, local_rank: int):
        self.path = path
        self._base = {"round": round_, "rank": rank, "local_rank": local_rank, "pid": os.getpid()}
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.setblocking(False)
        self._stack_file = None
        self._dropped = 0

    def beat(self, step: int, *, phase: str = "training", step_time_s: float = 0.0, committed_step: int = -1,
             ckpt_duration_s: float = 0.0) -> None:
        """``phase``: ``training`` (the agent expects the next beat within its hang timeout) or
        anything else (``starting``, ``loading``, ``saving``: the longer start timeout applies)."""
        self._send({"kind": "beat", "phase": phase, "step": step, "step_time_s": step_time_s,
                    "committed_step": committed_step, "ckpt_duration_s": ckpt_duration_s})

    def exit(self, step: int, *, finished: bool, committed_step: int = -1) -> None:
        self._send({"kind": "exit", "phase": "exiting", "step": step, "finished": finished, "committed_step": committed_step})

    def _send(self, fields: dict) -> None:
        msg = json.dumps({**self._base, **fields, "time": time.time()}).encode()
        try:
            self._sock.sendto(msg, self.path)
        except OSError:  # agent busy (buffer full) or gone: the watchdog handles the latter
            self._dropped += 1

    def enable_stack_dumps(self, stack_dir: str) -> None:
        os.makedirs(stack_dir, exist_ok=True)
        self._stack_file = open(os.path.join(stack_dir, f"{os.getpid()}.txt"), "w")  # kept open for the handler
        faulthandler.register(signal.SIGUSR1, file=self._stack_file, all_threads=True, chain=False)

    def close(self) -> None:
        self._sock.close()


def _watchdog(agent_pid: int, parent_pid: int) -> None:
    while True:
        time.sleep(WATCHDOG_INTERVAL_S)
        if process_gone(agent_pid) or os.getppid() != parent_pid:
            log.error("agent %d (or launcher %d) is gone: this worker exits", agent_pid, parent_pid)
            os.kill(os.getpid(), signal.SIGKILL)


def from_env(rank: int, local_rank: int) -> Heartbeat | None:
    """The heartbeat of a worker started by an agent (None otherwise); also arms the watchdog."""
    path = os.environ.get("FTRAIN_HEARTBEAT")
    if not path:
        return None
    hb = Heartbeat(path, round_=int(os.environ.get("FTRAIN_ROUND", "0")), rank=rank, local_rank=local_rank)
    stack_dir = os.environ.get("FTRAIN_STACK_DIR")
    if stack_dir:
        hb.enable_stack_dumps(stack_dir)
    agent_pid = int(os.environ.get("FTRAIN_AGENT_PID", "0"))
    if agent_pid:
        threading.Thread(target=_watchdog, args=(agent_pid, os.getppid()), name="agent-watchdog",
                         daemon=True).start()
    return hb
