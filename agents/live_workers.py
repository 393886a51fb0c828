"""This node's live workers (``--recovery live``): processes the agent owns and keeps across rounds.

Under ``--recovery restart`` a round's workers are a torchrun (:class:`ftrain.agents.workers.WorkerGroup`)
and a new round kills them. Here the agent starts ``python -m ftrain worker`` processes itself,
``nproc_per_node`` of them serving the round plus ``spares`` started ahead of need (Python, torch
and ftrain imported, waiting on their control file). For each round every local rank gets an
:class:`~ftrain.contract.control.Assignment` (:mod:`ftrain.contract.control`): the process that served that
local rank in the previous round keeps it if it is still alive; a dead one's place goes to a
spare (or, with none left, to a process started now), and the spares are topped up behind it.

A worker that dies takes no sibling with it: :meth:`LiveWorkers.crashed` names it, the agent
reports the failure, and the survivors wait (``recovering``) for the next round's assignment.

A process that exits with an error before it is ready (an import error, a script that fails at
its first lines) is a **start-up failure**: counted in a row (:attr:`LiveWorkers.startup_failures`,
back to 0 once a process is ready), and once the count reaches ``startup_failure_limit`` no spare
is started ahead of need any more (:meth:`LiveWorkers.failing_at_start`: the agent says so): a
round still gets its processes, whose failure the agent reports like any other.

What must stay true: only processes this object started are ever signalled (they are its
children, tracked by their :class:`subprocess.Popen`, so a PID cannot be mistaken for another
process's); every process gets a parent-death signal and watches the agent's PID, so none
outlives a SIGKILLed agent; :meth:`kill` leaves no process behind, spares included.
"""

from __future__ import annotations

import itertools
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from ftrain.agents.workers import Launch, die_with_parent, dump_stacks, signal_pids
from ftrain.contract.control import Assignment, ControlFile
from ftrain.contract.local_files import open_append, private_dir
from ftrain.contract.worker_env import CONTROL

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Process:
    popen: subprocess.Popen[bytes]
    control: ControlFile
    started_at: float  #: monotonic
    rounds: list[int] = field(default_factory=list)  #: rounds it was assigned
    counted: bool = False  #: its exit was looked at for a start-up failure

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None


class LiveWorkers:
    """The :class:`ftrain.agents.workers.Workers` of ``--recovery live``, plus :meth:`reassign`,
    :meth:`crashed` and :meth:`kill_ranks`. ``log_path`` collects every process's output.

    Built at the agent's start, before any round: ``standby`` processes start warming up at once
    (the node's workers and its spares), so that a node joining a running job is ready when its
    first round comes (:meth:`ready` is in the agent's status; the leader waits for it)."""

    def __init__(
        self,
        env: dict[str, str],
        log_path: str,
        *,
        worker_args: tuple[str, ...],
        standby: int,
        spares: int,
        script: str = "",
        startup_failure_limit: int = 0,
    ):
        """``startup_failure_limit``: start-up failures in a row after which no spare is started
        ahead of need (0: never stop)."""
        self.env = dict(env)
        #: what each process runs: ``ftrain worker`` with the config, or a user's script (its loop
        #: serves rounds through ftrain.Session.run) with its arguments
        self.command = [sys.executable, script] if script else [sys.executable, "-m", "ftrain", "worker"]
        self.log_path = log_path
        self.worker_args = worker_args
        self.spares_wanted = spares
        # the agent writes each process's assignment there: a directory someone else could plant
        # files or links in is refused (UnsafeLocalDirError names agent.run_dir)
        self.control_dir = str(
            private_dir(os.path.join(os.path.dirname(os.path.abspath(log_path)), "control"), "agent.run_dir")
        )
        self._slots = itertools.count()
        self._spares: list[_Process] = []
        self._assigned: dict[int, _Process] = {}
        self._reported: set[int] = set()  #: local ranks whose exit this round was already returned
        #: the round served; before the first, a placeholder of round -1 (no process serves it)
        self.launch = Launch(
            round=-1, nnodes=1, node_rank=0, nproc_per_node=0, master_addr="", master_port=0, worker_args=worker_args
        )
        self.started_at = time.monotonic()
        self.terminating = False
        self.last_kept: list[int] = []
        self.last_started: list[int] = []
        self.startup_failure_limit = startup_failure_limit
        self.startup_failures = 0  #: processes in a row that exited with an error before they were ready
        self.startup_exit_code = 0  #: the last such process's exit code
        self._spares = [self._start() for _ in range(standby)]

    # -- rounds -------------------------------------------------------------------------------
    @property
    def round(self) -> int:
        return self.launch.round

    @property
    def pid(self) -> int:
        """The first local rank's process (the agent logs one PID per round)."""
        return self._assigned[min(self._assigned)].pid

    def reassign(self, launch: Launch) -> bool:
        """Serve ``launch``'s round with the processes that are alive, spares filling the gaps."""
        self.launch = launch
        self.started_at = time.monotonic()
        self.terminating = False
        self._reported.clear()
        self._assign(launch)
        return True

    def _assign(self, launch: Launch) -> None:
        previous, kept, started = self._assigned, [], []
        self._assigned = {}
        for local_rank in range(launch.nproc_per_node):
            proc = previous.pop(local_rank, None)
            if proc is not None and proc.alive():
                kept.append(proc.pid)
            else:
                proc = self._take_spare()
                started.append(proc.pid)
            self._assigned[local_rank] = proc
        for proc in previous.values():  # fewer local ranks than before: those left over go
            self._stop(proc)
        for local_rank, proc in self._assigned.items():
            proc.rounds.append(launch.round)
            proc.control.write(
                Assignment(
                    round=launch.round,
                    rank=launch.node_rank * launch.nproc_per_node + local_rank,
                    world_size=launch.nnodes * launch.nproc_per_node,
                    local_rank=local_rank,
                    local_world_size=launch.nproc_per_node,
                    node_rank=launch.node_rank,
                    nnodes=launch.nnodes,
                    master_addr=launch.master_addr,
                    master_port=launch.master_port,
                    interrupt=launch.interrupt,
                    committed_step=launch.committed_step,
                )
            )
        self.last_kept, self.last_started = kept, started
        self._top_up()
        log.info(
            "round %d: local ranks served by pids %s (kept %s, new to the round %s), %d spare(s)",
            launch.round,
            [p.pid for _, p in sorted(self._assigned.items())],
            kept,
            started,
            len(self._spares),
        )

    def refill(self, nproc: int) -> None:
        """Between rounds: forget processes that died and start new ones, so that ``nproc`` of
        them (survivors first) can serve the next round with the spares on top (none while
        :meth:`failing_at_start`)."""
        for proc in self._assigned.values():
            if not proc.alive():
                self._exited(proc)
        self._assigned = {r: p for r, p in self._assigned.items() if p.alive()}
        self._prune_spares()
        while len(self._assigned) + len(self._spares) < nproc + self.spares_wanted and not self.failing_at_start():
            self._spares.append(self._start())

    def failing_at_start(self) -> bool:
        """``startup_failure_limit`` processes in a row exited with an error before they were ready."""
        return 0 < self.startup_failure_limit <= self.startup_failures

    def _exited(self, proc: _Process) -> None:
        """Count ``proc`` (exited) as a start-up failure if it failed before it was ready."""
        code = proc.popen.poll()
        if proc.counted or code is None:
            return
        proc.counted = True
        if code and not proc.control.is_ready():
            self.startup_failures += 1
            self.startup_exit_code = code

    def _prune_spares(self) -> None:
        """Forget the spares that exited (counting start-up failures); a ready one ends the count."""
        alive = []
        for proc in self._spares:
            if proc.alive():
                alive.append(proc)
            else:
                self._exited(proc)
                _unlink(proc.control.path)
                _unlink(proc.control.ready_path)
        self._spares = alive
        if any(p.control.is_ready() for p in self._all()):
            self.startup_failures = 0

    def _take_spare(self) -> _Process:
        """A warm spare if there is one, else the oldest (the nearest to warm), else a new process."""
        self._prune_spares()
        warm = [p for p in self._spares if p.control.is_ready()]
        if warm or self._spares:
            proc = (warm or self._spares)[0]
            self._spares.remove(proc)
            return proc
        return self._start()

    def _top_up(self) -> None:
        self._prune_spares()
        while len(self._spares) < self.spares_wanted and not self.failing_at_start():
            self._spares.append(self._start())

    def _start(self) -> _Process:
        slot = next(self._slots)
        control = ControlFile(os.path.join(self.control_dir, f"worker-{os.getpid()}-{slot}.json"))
        env = {**self.env, CONTROL: control.path}
        with os.fdopen(open_append(self.log_path), "ab") as out:  # never through a planted link
            popen = subprocess.Popen(
                [*self.command, *self.worker_args],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                preexec_fn=die_with_parent,
                start_new_session=True,  # the agent's terminal signals are the agent's to handle
            )
        return _Process(popen, control, time.monotonic())

    def _stop(self, proc: _Process) -> None:
        signal_pids([proc.pid], signal.SIGKILL)
        proc.popen.wait()
        _unlink(proc.control.path)
        _unlink(proc.control.ready_path)

    # -- the Workers protocol ---------------------------------------------------------------------
    def poll(self) -> int | None:
        """None while any local rank's process runs; then 0 if every one exited 0, else the first
        non-zero exit code by local rank."""
        codes = [p.popen.poll() for _, p in sorted(self._assigned.items())]
        if any(c is None for c in codes):
            return None
        return next((c for c in codes if c), 0)

    def crashed(self, settled: Callable[[int, int, int], bool] | None = None) -> dict[int, int]:
        """Local ranks whose process died (non-zero exit) while the others run, each returned once
        per round: local rank -> exit code (negative: the signal). ``settled(local_rank, pid,
        code)``: whether what the agent knows of that death is complete (its exit message read, or
        a grace over); one not settled yet is returned by a later call."""
        out = {}
        for local_rank, proc in sorted(self._assigned.items()):
            code = proc.popen.poll()
            if code and local_rank not in self._reported and (settled is None or settled(local_rank, proc.pid, code)):
                self._reported.add(local_rank)
                self._exited(proc)
                out[local_rank] = code
        return out

    def note_pids(self, pids: Iterable[int]) -> None:
        """Nothing to learn: these processes are the agent's own children."""

    def gone(self, pid: int) -> bool:
        proc = next((p for p in self._all() if p.pid == pid), None)
        return proc is None or not proc.alive()

    def terminate(self) -> None:
        """Graceful stop: SIGTERM to each serving process (finish the step, save); spares go now."""
        self.terminating = True
        for proc in self._spares:
            self._stop(proc)
        self._spares = []
        signal_pids([p.pid for p in self._assigned.values() if p.alive()], signal.SIGTERM)

    def kill_ranks(self, local_ranks: Iterable[int]) -> list[int]:
        """SIGKILL the processes serving ``local_ranks`` (a hang: their sockets close, so the
        survivors' collectives fail and they move on); their PIDs."""
        pids = [self._assigned[r].pid for r in local_ranks if r in self._assigned]
        for r in local_ranks:
            if r in self._assigned:
                self._assigned[r].counted = True  # ended by the agent: no start-up failure
        signal_pids(pids, signal.SIGCONT)
        signal_pids(pids, signal.SIGKILL)
        for r in local_ranks:
            if r in self._assigned:
                self._assigned[r].popen.wait()
        return pids

    def kill(self, timeout_s: float = 5.0) -> int | None:
        """SIGKILL every process, spares too; the serving processes' combined exit code."""
        procs = self._all()
        for proc in procs:
            proc.counted = True  # ended by the agent: no start-up failure
        pids = [p.pid for p in procs if p.alive()]
        signal_pids(pids, signal.SIGCONT)
        signal_pids(pids, signal.SIGKILL)
        deadline = time.monotonic() + timeout_s
        for proc in procs:
            try:
                proc.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.error("worker pid %d did not exit after SIGKILL", proc.pid)
            _unlink(proc.control.path)
            _unlink(proc.control.ready_path)
        self._spares = []
        return self.poll()

    def wait(self, timeout_s: float) -> int | None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            code = self.poll()
            if code is not None:
                return code
            time.sleep(0.05)
        return self.poll()

    def dump_stacks(self, stack_dir: str) -> dict[int, str]:
        return dump_stacks([p.pid for p in self._assigned.values() if p.alive()], stack_dir)

    def pids(self) -> dict[int, int]:
        """local rank -> PID of the process serving it."""
        return {r: p.pid for r, p in self._assigned.items()}

    def spare_pids(self) -> list[int]:
        return [p.pid for p in self._spares if p.alive()]

    def warming(self) -> int:
        """Spares started and not warm yet (their start-up competes with the workers for CPUs)."""
        return sum(1 for p in self._spares if p.alive() and not p.control.is_ready())

    def ready(self) -> int:
        """Processes warm and free to serve a round: warm spares, and the serving ones."""
        serving = sum(1 for p in self._assigned.values() if p.alive())
        return serving + sum(1 for p in self._spares if p.alive() and p.control.is_ready())

    def _all(self) -> list[_Process]:
        return [*self._assigned.values(), *self._spares]


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
