"""One round's workers on this node: a torchrun local launcher and the processes it starts.

torchrun runs with a static rendezvous and ``--max-restarts=0``: membership and restarts belong
to the agents. Workers run in their own sessions (torchrun starts them so), so killing a process
group would miss them; :meth:`WorkerGroup.kill` kills every PID it knows — torchrun's
descendants found in /proc plus the PIDs the workers announced in their heartbeats.

torchrun itself gets a parent-death signal, and each worker runs a watchdog on the agent's PID
(``ftrain.agent_link.heartbeat``), so nothing of a round outlives an agent that is SIGKILLed.

PIDs are signalled only while they still are what they were (:class:`PidTracker`): a PID is
taken on only while it is a descendant of this round's torchrun, with its start time; it is
signalled (SIGKILL, SIGTERM, SIGUSR1 for stack dumps) only while the process with that PID
still has that start time. A PID announced in a heartbeat that is not a descendant — a
zombie of an old round, another user's process, a recycled PID — is never signalled.

The agent sees a round's workers through :class:`Workers` and starts them through a
:data:`Launcher` (:class:`WorkerGroup` in production), so its unit tests run without processes.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from ftrain.contract.local_files import open_append

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid``, found through each process's parent in /proc (robust to
    children started from any thread, and to processes that moved to their own session)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as fh:
                ppid = int(fh.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def start_time(pid: int) -> int | None:
    """When ``pid`` started (clock ticks since boot, /proc field 22), None if it is gone. Two
    processes that had the same PID never have the same start time."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return int(fh.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


class PidTracker:
    """The processes of one process tree, remembered by (PID, start time).

    What must stay true: :meth:`live` returns only PIDs that were descendants of ``root_pid``
    when first seen and whose process has the start time seen then (so a PID the kernel gave to
    another process since is left alone).
    """

    PID_MAX = 2**22

    def __init__(self, root_pid: int):
        self.root_pid = root_pid
        self._known: dict[int, int] = {}  #: pid -> start time when first seen as a descendant

    def refresh(self) -> None:
        """Take on every current descendant of the root."""
        for pid in descendants(self.root_pid):
            self._take(pid)

    def note(self, pids: Iterable[int]) -> None:
        """Take on ``pids`` (e.g. from heartbeats) that are descendants of the root; others are ignored."""
        new = {p for p in pids if isinstance(p, int) and 1 < p <= self.PID_MAX and p not in self._known}
        if not new:
            return
        tree = set(descendants(self.root_pid))
        for pid in new:
            if pid in tree:
                self._take(pid)
            else:
                log.warning("pid %d is not a process of torchrun %d: never signalled", pid, self.root_pid)

    def _take(self, pid: int) -> None:
        if pid not in self._known:
            started = start_time(pid)
            if started is not None:
                self._known[pid] = started

    def replaced(self, pid: int) -> bool:
        """``pid`` was taken on, and the process now holding that PID (if any) is another one."""
        started = self._known.get(pid)
        return started is not None and start_time(pid) != started

    def is_ours(self, pid: int) -> bool:
        """``pid`` was taken on and still is the same process (alive or a zombie)."""
        started = self._known.get(pid)
        return started is not None and start_time(pid) == started

    def live(self) -> list[int]:
        """Known processes still running as the same process (not zombies)."""
        return sorted(p for p in self._known if self.is_ours(p) and process_state(p) not in (None, "Z", "X"))


def process_state(pid: int) -> str | None:
    """The one-letter state from /proc (R, S, T for stopped, Z, ...), None if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[0].decode()
    except (OSError, IndexError):
        return None


def signal_pids(pids: Iterable[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


@dataclass(frozen=True, slots=True)
class Launch:
    """What a round asks of this node's torchrun."""

    round: int
    nnodes: int
    node_rank: int
    nproc_per_node: int
    master_addr: str
    master_port: int
    worker_args: tuple[str, ...]  #: after ``-m ftrain train``: CONFIG.toml and overrides (or the script's arguments)
    #: the round replaces one that lost a member (live workers leave that one at once)
    interrupt: bool = False
    #: the newest committed step when the round was launched: live workers holding an older one
    #: must not go on from it (they were left out of the rounds that trained past it)
    committed_step: int = -1
    #: a user's training script (``ftrain agent --script``: its loop uses ftrain.Session) that
    #: torchrun runs instead of ``-m ftrain train``
    script: str = ""

    def command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nnodes={self.nnodes}",
            f"--node-rank={self.node_rank}",
            f"--nproc-per-node={self.nproc_per_node}",
            f"--master-addr={self.master_addr}",
            f"--master-port={self.master_port}",
            "--rdzv-backend=static",
            "--max-restarts=0",
            "--monitor-interval=0.2",
            *([self.script] if self.script else ["-m", "ftrain", "train"]),
            *self.worker_args,
        ]


class Workers(Protocol):
    """One round's started workers on this node, as the agent supervises them."""

    launch: Launch
    log_path: str
    started_at: float  #: when they were started, on the agent's monotonic clock
    terminating: bool  #: :meth:`terminate` was called: a graceful stop is under way

    @property
    def round(self) -> int: ...

    @property
    def pid(self) -> int:
        """The launcher's process id (torchrun's)."""
        ...

    def poll(self) -> int | None:
        """The launcher's exit code, None while it runs."""
        ...

    def note_pids(self, pids: Iterable[int]) -> None:
        """PIDs the workers announced (heartbeats): taken on only if they are the launcher's."""
        ...

    def gone(self, pid: int) -> bool:
        """The worker process ``pid`` announced is gone (exited, a zombie, or its PID reused)."""
        ...

    def terminate(self) -> None:
        """Ask the workers to stop gracefully (finish the step, save)."""
        ...

    def kill(self, timeout_s: float = 5.0) -> int | None:
        """Kill the launcher and every worker; the launcher's exit code (None if not reaped)."""
        ...

    def wait(self, timeout_s: float) -> int | None:
        """The launcher's exit code once it exits within ``timeout_s``, else None."""
        ...

    def dump_stacks(self, stack_dir: str) -> dict[int, str]:
        """Every live worker's Python stack: pid -> text (or why there is none)."""
        ...


#: starts a round's workers: (launch, environment, log path) -> the started workers
Launcher = Callable[[Launch, dict[str, str], str], Workers]


class WorkerGroup:
    """A started torchrun for one round (see :class:`Launch`): the production :class:`Workers`."""

    def __init__(self, launch: Launch, env: dict[str, str], log_path: str):
        self.launch = launch
        self.log_path = log_path
        self.started_at = time.monotonic()
        self.terminating = False  #: terminate() was called: a graceful stop is under way
        with os.fdopen(open_append(log_path), "ab") as out:  # never through a planted link
            self.proc = subprocess.Popen(
                launch.command(),
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                preexec_fn=die_with_parent,
            )
        self.pids = PidTracker(self.proc.pid)
        log.info(
            "round %d: started torchrun pid %d (node rank %d of %d, %d worker(s)), log %s",
            launch.round,
            self.proc.pid,
            launch.node_rank,
            launch.nnodes,
            launch.nproc_per_node,
            log_path,
        )

    @property
    def round(self) -> int:
        return self.launch.round

    @property
    def pid(self) -> int:
        return self.proc.pid

    def poll(self) -> int | None:
        return self.proc.poll()

    def note_pids(self, pids: Iterable[int]) -> None:
        """PIDs from heartbeats: taken on only if they are torchrun's descendants (see PidTracker)."""
        self.pids.note(pids)

    def gone(self, pid: int) -> bool:
        """``pid`` exited (or is a zombie), or the PID now belongs to another process."""
        return process_state(pid) in (None, "Z", "X") or self.pids.replaced(pid)

    def dump_stacks(self, stack_dir: str) -> dict[int, str]:
        return dump_stacks(self.worker_pids(), stack_dir)

    def worker_pids(self) -> list[int]:
        """Live worker processes: torchrun's descendants, now or when first seen, still the same
        processes (safe to signal)."""
        self.pids.refresh()
        return self.pids.live()

    def terminate(self) -> None:
        """Ask the workers to stop gracefully (they finish the step and save): SIGTERM to each
        worker, not to torchrun, so that torchrun sees them exit and exits cleanly itself."""
        self.terminating = True
        signal_pids(self.worker_pids(), signal.SIGTERM)

    def kill(self, timeout_s: float = 5.0) -> int | None:
        """SIGKILL torchrun and every worker; wait for torchrun to be reaped. Returns its exit code."""
        pids = [self.proc.pid, *self.worker_pids()]
        signal_pids(pids, signal.SIGCONT)  # a stopped process dies of SIGKILL too, but be explicit
        signal_pids(pids, signal.SIGKILL)
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            log.error("torchrun pid %d did not exit after SIGKILL", self.proc.pid)
            return None

    def wait(self, timeout_s: float) -> int | None:
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None


def dump_stacks(pids: Iterable[int], stack_dir: str, *, timeout_s: float = 3.0) -> dict[int, str]:
    """Every worker's Python stack, through the SIGUSR1 handler each worker registered.

    A stopped worker (SIGSTOP, state T) is continued once asked: it cannot run its handler
    otherwise, and its stack is what shows where it was when it stopped. Returns pid -> text (or why none).

    The signal goes to the main thread (``tgkill``), not to whichever thread the kernel picks:
    ``faulthandler`` reads the threads' frames without the GIL, so a main thread running Python
    meanwhile (a stopped worker just continued) shows a torn stack; one in the handler does not.

    A dump is read once the kernel says the handler ran to its end: SIGUSR1 is neither pending
    nor blocked by a thread that did not block it before (``faulthandler`` runs without
    ``SA_NODEFER``, so the thread in the handler blocks the signal until it returns, and it
    writes unbuffered). A file that stopped growing for a while is no proof: a process continued
    under load may pause mid-dump for longer than any quiet period one could pick.
    """
    pids = list(pids)
    states = {pid: process_state(pid) for pid in pids}
    files = {pid: os.path.join(stack_dir, f"{pid}.txt") for pid in pids}
    sizes = {pid: _size(files[pid]) for pid in pids}
    blocking_before = {pid: _usr1_blocking_threads(pid) for pid in pids}
    for pid in pids:  # before a stopped one is continued: its main thread runs the handler first thing
        _request_dump(pid, main_thread_blocks=str(pid) in blocking_before[pid])
    for pid in pids:
        if states[pid] == "T":
            signal_pids([pid], signal.SIGCONT)
    deadline = time.monotonic() + timeout_s
    pending = set(pids)
    while pending and time.monotonic() < deadline:
        for pid in list(pending):
            if _size(files[pid]) > sizes[pid] and not _usr1_in_flight(pid, blocking_before[pid]):
                pending.discard(pid)
        time.sleep(0.02)
    stacks = {}
    for pid in pids:
        prefix = f"(process state {states[pid]}: was stopped, continued to dump)\n" if states[pid] == "T" else ""
        if _size(files[pid]) <= sizes[pid]:
            stacks[pid] = prefix + "(no stack: the process did not answer SIGUSR1)"
            continue
        with open(files[pid], errors="replace") as fh:
            fh.seek(sizes[pid])
            text = fh.read()
        stacks[pid] = prefix + text + (f"(cut: still dumping after {timeout_s:.0f} s)\n" if pid in pending else "")
    return stacks


_USR1_BIT = 1 << (signal.SIGUSR1 - 1)


def _request_dump(pid: int, *, main_thread_blocks: bool) -> None:
    """SIGUSR1 to ``pid``'s main thread (its tid is the pid), or to the process where the main
    thread blocks the signal or libc has no ``tgkill``."""
    if not main_thread_blocks:
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            if libc.tgkill(pid, pid, signal.SIGUSR1) == 0:
                return
        except (OSError, AttributeError):
            pass
    signal_pids([pid], signal.SIGUSR1)


def _proc_masks(pid: int) -> dict[str, dict[str, int]] | None:
    """Each thread's signal masks from /proc (tid -> {"SigPnd", "ShdPnd", "SigBlk"}), None if gone."""
    masks = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as fh:
                fields = dict(line.split(":", 1) for line in fh if ":" in line)
            masks[tid] = {k: int(fields[k].strip(), 16) for k in ("SigPnd", "ShdPnd", "SigBlk")}
        except (OSError, KeyError, ValueError):
            continue  # a thread that ended meanwhile
    return masks


def _usr1_blocking_threads(pid: int) -> set[str]:
    return {tid for tid, m in (_proc_masks(pid) or {}).items() if m["SigBlk"] & _USR1_BIT}


def _usr1_in_flight(pid: int, blocking_before: set[str]) -> bool:
    """SIGUSR1 still pending for ``pid``, or a thread in its handler (blocking it now, not before)."""
    masks = _proc_masks(pid)
    if masks is None:
        return False  # gone: nothing more will be written
    return any(
        (m["SigPnd"] | m["ShdPnd"]) & _USR1_BIT or (m["SigBlk"] & _USR1_BIT and tid not in blocking_before)
        for tid, m in masks.items()
    )


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0
