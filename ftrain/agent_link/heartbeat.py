"""The worker's end of the agent channel: heartbeats, stack dumps on request, and a watchdog.

Started from the environment the agent sets (:class:`ftrain.contract.worker_env.WorkerEnv`; nothing
happens without an agent):

- ``FTRAIN_HEARTBEAT``: the agent's Unix datagram socket; one JSON datagram per step (see
  ``ftrain.agents.heartbeat``), plus an "alive" datagram every ``ALIVE_INTERVAL_S`` from a background
  thread, so that a frozen worker (SIGSTOP, a stopped cgroup) is told from one busy with a long
  load or save within the hang timeout, not the start timeout. Each "alive" also carries this
  rank's oldest collective in flight (:func:`ftrain.agent_link.flight_recorder.oldest_in_flight`: what and
  for how long), so that its agent tells a rank stuck in a collective from one that computes,
  whatever the thread says. Sending never blocks and never fails the worker.
- ``FTRAIN_STACK_DIR``: SIGUSR1 makes :mod:`faulthandler` write every thread's Python stack to
  ``<dir>/<pid>.txt``. It runs in the C signal handler, so it works while Python is stuck in
  a collective or a lock.
- the flight recorder (:mod:`ftrain.agent_link.flight_recorder`): on the agent's request, this rank's last
  collectives to ``<dir>/<pid>.flight.json``, answered from a thread while the main one waits.
- ``FTRAIN_AGENT_PID``: a watchdog thread ends this worker (SIGKILL to itself) within about a
  second once the agent is gone, or once its own parent (torchrun) is gone, so no worker of
  an old round outlives its agent, even one killed with SIGKILL.

A malformed ``FTRAIN_ROUND`` or ``FTRAIN_AGENT_PID`` stops the worker at start with an error
naming the variable (:class:`ftrain.contract.worker_env.WorkerEnvError`).
Beats carry the checkpoint health (failed commits in a row, the last error); the exit message
carries the error the worker failed with and whether a restart can help (``fatal``).
"""

from __future__ import annotations

import dataclasses
import faulthandler
import logging
import os
import signal
import socket
import threading
import time
from typing import Any, TextIO

from ftrain.agent_link import flight_recorder
from ftrain.agent_link.flight_recorder import FlightServer
from ftrain.contract.heartbeat import Message
from ftrain.contract.local_files import open_append, private_dir
from ftrain.contract.worker_env import WorkerEnv

log = logging.getLogger(__name__)

WATCHDOG_INTERVAL_S = 0.5
ALIVE_INTERVAL_S = 1.0  #: a background thread says "alive" this often (see ftrain.agents.heartbeat)


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
        self._sender = Message(kind="beat", round=round_, rank=rank, local_rank=local_rank, pid=os.getpid())
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.setblocking(False)
        self._stack_file: TextIO | None = None
        self._dropped = 0
        self._closing = threading.Event()
        self.flight: FlightServer | None = None  #: answers the agent's requests for this rank's flight record

    @property
    def rank(self) -> int:
        return self._sender.rank

    def assign(self, round_: int, rank: int, local_rank: int) -> None:
        """A live worker moved to another round (and maybe rank): its messages say so from now on."""
        self._sender = dataclasses.replace(self._sender, round=round_, rank=rank, local_rank=local_rank)

    def beat(
        self,
        step: int,
        *,
        phase: str = "training",
        step_time_s: float = 0.0,
        committed_step: int = -1,
        ckpt_duration_s: float = 0.0,
        ckpt_failures: int = 0,
        ckpt_failures_total: int = 0,
        ckpt_error: str = "",
        phases_s: dict[str, float] | None = None,
        corruptions: int = 0,
    ) -> None:
        """``phase``: ``training`` (the agent expects the next beat within its hang timeout) or
        anything else (``starting``, ``loading``, ``saving``: the longer start timeout applies).
        ``ckpt_failures``: commits failed in a row; ``ckpt_error``: the last one's error;
        ``corruptions``: times the consistency check found this rank's state corrupt."""
        self._send(
            kind="beat",
            phase=phase,
            step=step,
            step_time_s=step_time_s,
            committed_step=committed_step,
            ckpt_duration_s=ckpt_duration_s,
            ckpt_failures=ckpt_failures,
            ckpt_failures_total=ckpt_failures_total,
            ckpt_error=ckpt_error,
            phases_s=phases_s or {},
            corruptions=corruptions,
        )

    def exit(
        self, step: int, *, finished: bool, committed_step: int = -1, error: str = "", fatal: bool = False
    ) -> None:
        """The last message: ``error`` says why the worker fails (empty on success), ``fatal``
        that restarting it cannot help (the agent then ends the job instead)."""
        self._send(
            kind="exit",
            phase="exiting",
            step=step,
            finished=finished,
            committed_step=committed_step,
            error=error,
            fatal=fatal,
        )

    def _send(self, **fields: Any) -> None:
        msg = dataclasses.replace(self._sender, **fields, time=time.time()).encode()
        try:
            self._sock.sendto(msg, self.path)
        except OSError:  # agent busy (buffer full) or gone: the watchdog handles the latter
            self._dropped += 1

    def enable_stack_dumps(self, stack_dir: str) -> None:
        # the agent's run dir: never written through a link planted there (nor in another's directory)
        fd = open_append(private_dir(stack_dir, "agent.run_dir") / f"{os.getpid()}.txt")
        os.ftruncate(fd, 0)
        self._stack_file = os.fdopen(fd, "w")  # kept open for the handler
        faulthandler.register(signal.SIGUSR1, file=self._stack_file, all_threads=True, chain=False)

    def start_alive(self, interval_s: float = ALIVE_INTERVAL_S) -> None:
        """Send "alive" every ``interval_s`` from a daemon thread until :meth:`close`."""

        def run() -> None:
            while not self._closing.wait(interval_s):
                self._send(kind="alive", **in_flight_fields())

        threading.Thread(target=run, name="heartbeat-alive", daemon=True).start()

    def close(self) -> None:
        self._closing.set()
        self._sock.close()
        if self.flight is not None:
            self.flight.close()


_in_flight_failed = False  #: the recorder could not be read once (logged once; "alive" goes on without it)


def in_flight_fields() -> dict[str, Any]:
    """The "alive" datagram's in-flight fields (:class:`ftrain.contract.heartbeat.Message`): this rank's
    oldest collective in flight, or that none is, or (recording off, or the recorder unreadable)
    that nothing is known."""
    global _in_flight_failed
    if not any(os.environ.get(name, "0") not in ("", "0") for name in flight_recorder.BUFFER_ENV):
        return {}
    try:
        oldest = flight_recorder.oldest_in_flight()
    except Exception as e:  # noqa: BLE001 - a diagnostic must never stop the liveness signal
        if not _in_flight_failed:
            _in_flight_failed = True
            log.warning("the flight recorder's in-flight collective could not be read: %s", e)
        return {}
    if oldest is None:
        return {"recording": True}
    return {
        "recording": True,
        "in_flight_seq": max(0, oldest.seq),
        "in_flight_group": oldest.group,
        "in_flight": oldest.what(),
        # no enqueue time (0): "since now", and the agent keeps the first sighting of the collective
        "in_flight_s": min(max(0.0, time.time() - oldest.enqueued_s), 1e6) if oldest.enqueued_s > 0 else 0.0,
    }


def _watchdog(agent_pid: int, parent_pid: int) -> None:
    while True:
        time.sleep(WATCHDOG_INTERVAL_S)
        if process_gone(agent_pid) or os.getppid() != parent_pid:
            log.error("agent %d (or launcher %d) is gone: this worker exits", agent_pid, parent_pid)
            os.kill(os.getpid(), signal.SIGKILL)


def from_env(rank: int, local_rank: int) -> Heartbeat | None:
    """The heartbeat of a worker started by an agent (None otherwise); also arms the watchdog."""
    env = WorkerEnv.from_env()
    if not env.heartbeat:
        return None
    hb = Heartbeat(env.heartbeat, round_=env.round, rank=rank, local_rank=local_rank)
    if env.stack_dir:
        hb.enable_stack_dumps(env.stack_dir)
        hb.flight = FlightServer(env.stack_dir, lambda: hb.rank)
    hb.start_alive()
    if env.agent_pid:
        threading.Thread(
            target=_watchdog, args=(env.agent_pid, os.getppid()), name="agent-watchdog", daemon=True
        ).start()
    return hb
