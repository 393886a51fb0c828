"""ftrain in your own training loop: verified, fenced checkpoints, resume at any world size and the
node agent's supervision, around a loop that ftrain does not own (docs/library.md).

```python
import ftrain

with ftrain.Session("s3://bucket/my-job", interval_steps=100) as session:   # or a local directory
    model, optimizer = build()                      # your code: DDP, FSDP2, TP, anything DCP saves
    state = {"model": model, "optim": optimizer, "sched": scheduler, "sampler": sampler}
    for step in range(session.load(state), total_steps):   # 0, or the step it resumes after
        train_one_step(step)
        session.step(step + 1, state)               # heartbeat; an asynchronous save when due
    session.finish(total_steps, state)              # the final save, committed before it returns
```

**What a session is.** It joins the process group the launcher describes (``torchrun``'s
``RANK``/``WORLD_SIZE``/``MASTER_ADDR``, or ``ftrain agent``'s, which adds a heartbeat socket and
the commit fence), or makes a group of one when nothing launched it; a group already initialised
is used as it is. Its checkpoints are ``ftrain train``'s: DCP shards with a digest per file and a
``manifest.json`` committed last (through the agent's etcd fence when there is one: a worker of
a stale round cannot commit), verified before any byte is used, loaded at any world size and
sharding (DCP reshards), retained (``keep_last``), the newest corrupt step falling back to the
one before.

**What it saves** (``state``: name -> object): at most one ``nn.Module`` (DDP, FSDP2 and TP
modules included) with its optimizers (``torch.optim.Optimizer``), through
``torch.distributed.checkpoint.state_dict`` (each rank writes its own shards); every other entry
by its ``state_dict()``/``load_state_dict()`` (an LR scheduler, :class:`ftrain.sampler.ResumableSampler`,
a ``GradScaler``, your own counters), kept in the step's own verified file ``user_state.json``
(:mod:`ftrain.session_state`, :mod:`ftrain.state_codec`): what torch's schedulers and scalers hold
comes back exactly (``inf``, NaN, int keys, tuples); a value that can never be stored (a tensor,
an object) is refused at :meth:`load` or the first :meth:`step`, naming it, before any work. Rank
0's are saved (the same on every rank of a data-parallel loop); each rank's own (its RNG streams)
are entries :class:`ftrain.RNGState` and :class:`ftrain.PerRank` mark (:mod:`ftrain.session_per_rank`).

**Under the node agent** (``ftrain agent --script train.py``): heartbeats at each :meth:`step`,
"alive" from a background thread, the commit fence and the exit message. Recovery is restart
(torchrun runs the script again), or with ``--recovery live`` in-process: the loop of one round
is a function that :meth:`run` calls again for each new round, in the same process; the state
comes from a live peer when the model is replicated, from the memory tier's snapshots when it is
spread over the ranks, else from storage (:mod:`ftrain.session_live`, :mod:`ftrain.session_tier`).
A collective that the round's end does not reach is the round watchdog's: it ends the process,
and its agent replaces it (a restart of that process only).
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from types import TracebackType
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from ftrain import state_codec
from ftrain.agent_link import fence, heartbeat
from ftrain.checkpoint.config import DEFAULTS
from ftrain.checkpoint.manager import CheckpointManager, SaveStatus
from ftrain.checkpoint.manifest import Manifest
from ftrain.checkpoint.storage import StorageOptions
from ftrain.contract import events as ev
from ftrain.contract.control import ControlFile
from ftrain.contract.worker_env import WorkerEnv
from ftrain.distributed import abort_distributed
from ftrain.recovery.peer_state import HeldState, Restored
from ftrain.recovery.round_control import RoundEnded, service_ports
from ftrain.recovery.rounds import serve_rounds
from ftrain.session_live import Drained, Round, SessionRounds, on_sigterm, refuse_start_under_live, restore_round
from ftrain.session_load import load_stored
from ftrain.session_per_rank import collective_device
from ftrain.session_replicas import ReplicaCheck, ReplicasDiffer, rolled_back
from ftrain.session_state import (
    STATE_FILE,
    USER_STATE,
    WRITER,
    SessionError,
    StateParts,
    loop_fields,
    manifest_fields,
    say,
    warn_if_large,
)
from ftrain.session_tier import SessionTier
from ftrain.session_timing import RankTimes, StepLines, StepTiming, boundary_values, read_boundary

log = logging.getLogger(__name__)

DEFAULT_JOB = "own-loop"
T = TypeVar("T")


class RoundChanged(RoundEnded):
    """Raised by :meth:`Session.step` at a step boundary, on every rank at the same step, when the
    node agents formed a new round (a peer was lost, a node joined): :meth:`Session.run` catches
    it and calls the loop's function again for the new round. Only under :meth:`Session.run`."""


class Session:
    """One process's part of a training run in its own loop (see the module doc)."""

    def __init__(
        self,
        checkpoint_uri: str,
        *,
        job: str = "",
        interval_steps: int = 0,
        keep_last: int = DEFAULTS.keep_last,
        async_save: bool = True,
        endpoint_url: str = "",
        region: str = "",
        hmac_key_env: str = "",
        on_no_loadable_step: str = DEFAULTS.on_no_loadable_step,
        backend: str = "auto",
        timeout_s: float = 600.0,
        verbose: bool = True,
        memory_interval: int = DEFAULTS.memory_interval,
        memory_dir: str = "",
        replica_check_steps: int = 0,
        on_replica_mismatch: str = "halt",
        replicated: bool | None = None,
        manifest_fields: Callable[[], Mapping[str, Any]] | None = None,
        check_resume: Callable[[Manifest], object] | None = None,
        metrics_path: str = "",
    ):
        """``checkpoint_uri``: a local directory or ``s3://bucket/prefix``; ``job``: the id every
        manifest records (default: the agent's job, else ``own-loop``); ``interval_steps``:
        :meth:`step` saves every that many steps (0: only :meth:`save` and :meth:`finish` do);
        ``async_save``: the loop waits only for the copy; ``endpoint_url``/``region``: S3's;
        ``hmac_key_env``: the variable holding the key that signs manifests;
        ``on_no_loadable_step``: ``fail`` or ``fresh`` when steps exist and none loads;
        ``backend``: the group's when the session makes one (``auto``: nccl on CUDA, else gloo);
        ``verbose``: rank 0's lines on stderr (else the ``ftrain.session`` logger);
        ``memory_interval``, ``memory_dir``: the memory tier under :meth:`run` with live recovery
        (:mod:`ftrain.session_tier`; -1: from the step time, 0: off; a node's tmpfs that keeps the
        snapshots for processes that replace these); ``replica_check_steps``,
        ``on_replica_mismatch``: the replica check (:mod:`ftrain.session_replicas`; 0: off);
        ``replicated``: False when the ranks hold different parts of a model without DTensors
        (pipeline stages): never a peer's state, and no replica check (None: no DTensor parameter
        means every rank holds the whole model); ``manifest_fields``: what the loop records in each
        step's manifest (its config, layout, trainer fields); ``check_resume(manifest)``: on every
        rank, before a load reads a step's files from storage: raise to refuse to go on from it
        (the error propagates; the step is not marked corrupt); ``metrics_path``: rank 0's metrics lines
        (:class:`~ftrain.session_timing.StepLines`, ``ftrain report``'s; empty: none). docs/library.md says more."""
        if not checkpoint_uri:
            raise SessionError("Session(checkpoint_uri=...): give a local directory or s3://bucket/prefix")
        if not isinstance(interval_steps, int) or interval_steps < 0:
            raise SessionError(f"Session(interval_steps={interval_steps!r}): an int >= 0 (0: no periodic saves)")
        self.memory_interval = SessionTier.checked_interval(memory_interval)
        self._memory_dir, self._job_done = memory_dir, False  #: the loop returned: its tmpfs snapshots can go
        self._replicas = ReplicaCheck(replica_check_steps, on_replica_mismatch, replicated)
        self._spread = replicated is False  #: the loop said its ranks hold different parameters
        self._loop_fields, self._check_resume = manifest_fields, check_resume
        self.manifest: Manifest | None = None  #: the manifest of the step the last load read from storage
        self._rollback_why = ""  #: the replicas differed: the next load reads storage and says so
        self.checkpoint_uri = checkpoint_uri
        self.job = job or WorkerEnv.from_env().job or DEFAULT_JOB
        self.interval_steps = interval_steps
        self._options = dict(
            keep_last=keep_last,
            async_mode="thread" if async_save else "off",
            hmac_key_env=hmac_key_env,
            on_no_loadable_step=on_no_loadable_step,
        )
        self._storage = StorageOptions(endpoint_url=endpoint_url, region=region)
        self._backend = backend
        self._timeout_s = timeout_s
        self.verbose = verbose
        self._closed = False  #: close() ran (a later save says so, not "before start")
        self._state_checked = False  #: the state's non-tensor entries were seen to be storable
        self._warned_large = False  #: the non-tensor state passed half its bound (said once)
        self.rank = self.world_size = self.local_rank = -1
        self.round = WorkerEnv.from_env().round
        self._manager: CheckpointManager | None = None
        self._hb: heartbeat.Heartbeat | None = None
        self._owns_group = False
        self._step = -1  #: the last step reported (-1: none yet)
        self._timing = StepTiming()  #: the interval between step() calls, and its parts (ftrain.session_timing)
        self._lines = StepLines(metrics_path)
        #: where the state of the latest load came from (None before any load)
        self.restored: Restored | None = None
        self._round: Round | None = None  #: the round served under :meth:`run` with live recovery
        self._serving = False  #: inside :meth:`run`: the ranks agree at each step boundary
        self._stop_requested = False  #: SIGTERM arrived (under :meth:`run`): stop at the next boundary
        self._tier: SessionTier | None = None  #: under :meth:`run` with live recovery: this process's, every round
        #: the round's event log: the job's under ``ftrain agent --script`` (FTRAIN_EVENTS), else none
        self._events = ev.EventLog()

    # -- life ---------------------------------------------------------------------------
    def start(self) -> Session:
        """Join (or make) the process group and open the checkpoint service; returns itself."""
        if self._manager is not None:
            raise SessionError("Session.start(): already started")
        self._closed = False
        control = WorkerEnv.from_env().control
        if control:
            raise refuse_start_under_live(control, self._timeout_s)
        if not dist.is_initialized():
            self._init_group()
        return self._open()

    def _open(self) -> Session:
        """In the group joined: the checks, the heartbeat, the checkpoint service (this round's fence)."""
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        said = {k: os.environ.get(k, "") for k in ("RANK", "WORLD_SIZE")}
        if said["RANK"] and (said["RANK"], said["WORLD_SIZE"]) != (str(self.rank), str(self.world_size)):
            raise SessionError(
                f"the launcher says RANK={said['RANK']} WORLD_SIZE={said['WORLD_SIZE']}, but the process group "
                f"this process joined is rank {self.rank} of {self.world_size}: initialise the group from the "
                "launcher's environment (dist.init_process_group() with no rank/world_size), or let the session do it"
            )
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self._hb = heartbeat.from_env(self.rank, self.local_rank) if self._round is None else self._round.hb
        self._events = ev.EventLog.or_none(WorkerEnv.from_env().events, rank=self.rank, round_=self.round)
        self._lines.open(self.rank)
        if self._hb is not None:
            self._hb.beat(-1, phase="starting")
        self._manager = CheckpointManager(
            url=self.checkpoint_uri,
            options=self._storage,
            job=self.job,
            fence=fence.from_env(),
            round=self.round,
            device_type="cuda" if dist.get_backend() == "nccl" else "cpu",  # where the async save stages from
            on_event=functools.partial(self._on_event, self._events),
            **self._options,  # type: ignore[arg-type]
        )
        return self

    def _on_event(self, events: ev.EventLog, record: ev.Record) -> None:
        """The checkpoint service's events (from the training thread or the save's): into the
        round's event log (``events``: an abandoned save's late ones are not the next round's); each
        commit, said."""
        events.emit(record)
        if isinstance(record, ev.CkptCommitted):
            self._say(f"committed step {record.step} under {self.checkpoint_uri} ({record.duration_s:.1f}s)")

    def _say(self, message: str) -> None:
        say(message, rank=self.rank, verbose=self.verbose, logger=log)

    # -- rounds (live recovery) ---------------------------------------------------------
    def run(self, train: Callable[[Session], T], *, warm_up: Callable[[], object] | None = None) -> T | None:
        """Run ``train(session)``: the loop of one round, from its start (build what depends on
        the world size, :meth:`load`) to :meth:`finish`; returns what it returns. ``warm_up()``:
        under live recovery, what a spare runs before it waits for a round (imports, a model
        built, a step on the CPU), so that its first round does not pay for it.

        Under ``ftrain agent --script ... --recovery live`` this process serves round after
        round without restarting: when a peer is lost or a node joins, :meth:`step` raises
        :class:`RoundChanged` at a step boundary (or a collective fails at once: a peer died), the
        session keeps what this rank holds, leaves the round's process group, waits for the next
        round and calls ``train`` again; its :meth:`load` then restores the state from a live peer
        or from storage (:mod:`ftrain.session_live`). Anywhere else (``torchrun``, restart
        recovery, alone) it is ``with session: return train(session)``. None when the agent
        stopped this process before the job was done."""
        if self._manager is not None or self._round is not None:
            raise SessionError("Session.run(): the session is started already; run() starts it (per round) itself")
        self._serving = True
        previous = on_sigterm(self._ask_to_stop)
        try:
            return self._run(train, warm_up)
        except Drained as e:
            committed = self._manager.status.last_committed_step if self._manager is not None else -1
            log.warning("%s; committed step: %d", e, committed)
            self._close(None, finished=False)
            return None
        finally:
            self._serving = False
            on_sigterm(previous)
            if self._tier is not None:
                self._tier.close(job_done=self._job_done)
                self._tier = None

    def _ask_to_stop(self, signum: int, frame: object) -> None:
        self._stop_requested = True

    def _run(self, train: Callable[[Session], T], warm_up: Callable[[], object] | None) -> T | None:
        env = WorkerEnv.from_env()
        if not env.control:
            self.start()
            try:
                result = self._train(train)
            except Drained:
                raise
            except BaseException as e:
                self.close(error=e)
                raise
            self.close()
            return result
        keep_ports = service_ports(self._storage.endpoint_url, *env.etcd)
        if self.memory_interval:
            key_env, uri = str(self._options["hmac_key_env"]), self.checkpoint_uri
            self._tier = SessionTier(uri, self.memory_interval, key_env, self._timeout_s, self.job, self._memory_dir)
        control = ControlFile(env.control)
        serve = lambda rnd: self._serve_round(rnd, train)  # noqa: E731
        rounds = SessionRounds(control, heartbeat.from_env(-1, 0), serve, self.close, self._leave_round, keep_ports)
        asked = lambda: self._stop_requested  # noqa: E731 - SIGTERM between rounds: leave, nothing to save
        return serve_rounds(rounds, control, rounds.hb, keep_ports, self._timeout_s, asked, warm_up)

    def _serve_round(self, rnd: Round, train: Callable[[Session], T]) -> T:
        self._round, self.round = rnd, rnd.assignment.round
        self._timing.restart()
        self._init_group()
        rnd.joined = time.monotonic()
        self._open()
        result = self._train(train)
        self._job_done = True
        return result

    def _train(self, train: Callable[[Session], T]) -> T:
        """``train(self)``; again, from the newest commit, when the replicas differed (rollback)."""
        while True:
            try:
                return train(self)
            except ReplicasDiffer as e:
                self._rollback_why = str(e)
                self._need_started("rollback").wait()  # a save in flight commits (or fails) first

    def _leave_round(self, why: BaseException | str, keep_ports: set[int]) -> HeldState | None:
        """Keep what this rank holds, end the round's process groups at once (no peer stays
        blocked on this rank), abandon a save in flight (it cannot commit for an old round), and
        tell the agent this process waits for the next round. What a rank holds is its last step
        boundary if this round's load completed; else what it held before the round."""
        rnd = self._round
        assert rnd is not None
        manager, self._manager = self._manager, None
        committed = manager.status.last_committed_step if manager is not None else -1
        held = rnd.watch.held(committed) if rnd.loaded else rnd.held
        rnd.release()
        abort_distributed(keep_ports)
        if self._tier is not None:  # after the abort: an exchange blocked on a lost peer fails now
            self._tier.leave_round()
        self._owns_group = False
        if manager is not None:
            manager.close(abandon=True)
        rnd.left(why, held, self._events)
        self._events.close()  # after the tier's thread, which writes to it, ended
        self._round = None
        return held

    def _init_group(self) -> None:
        backend = self._backend
        if backend == "auto":
            backend = "nccl" if torch.cuda.is_available() and "LOCAL_RANK" in os.environ else "gloo"
        timeout = timedelta(seconds=self._timeout_s)
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            if backend == "nccl":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group(backend, timeout=timeout)
        else:  # nothing launched it: a group of one, so that the same loop runs alone
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        self._owns_group = True

    def __enter__(self) -> Session:
        return self.start()

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, _tb: TracebackType | None
    ) -> None:
        self.close(error=error)

    def close(self, *, error: BaseException | None = None) -> None:
        """Stop the checkpoint service (a save still uploading is waited for, unless ``error``)
        and tell the agent how this worker ends. A group the session made is torn down after a
        success; after an error it is left (peers may be stuck in a collective with this rank)."""
        self._close(error, finished=error is None)

    def _close(self, error: BaseException | None, *, finished: bool) -> None:
        """``finished``: the loop ran to its end (else it stopped early: a drain)."""
        manager, self._manager = self._manager, None
        self._closed = True
        if manager is not None:
            if error is None and manager.uploading:
                self._beat("saving")  # close waits for the upload: the agent's save timeout applies
            manager.close(abandon=error is not None)
        self._lines.close()
        if self._round is not None:
            self._round.release()
            self._round = None
        if self._tier is not None:
            self._tier.leave_round()
        self._events.close()
        if self._hb is not None:
            committed = manager.status.last_committed_step if manager is not None else -1
            reason = "" if error is None else f"{type(error).__name__}: {error}"
            self._hb.exit(self._step, finished=finished, committed_step=committed, error=reason[:2000])
            self._hb.close()  # its "alive" thread and socket: said goodbye, nothing more to say
            self._hb = None
        if error is None and self._owns_group and dist.is_initialized():
            if finished:
                dist.barrier()  # no rank tears its pairs down while a peer still uses them
                dist.destroy_process_group()
            else:  # a drain: the other nodes' ranks leave without a barrier (they serve on), so none here
                abort_distributed()
            self._owns_group = False

    @property
    def started(self) -> bool:
        return self._manager is not None

    def _need_started(self, what: str) -> CheckpointManager:
        if self._manager is None and self._closed:
            raise SessionError(
                f"Session.{what}() after Session.close(): the session is closed (its checkpoint service stopped); "
                "call it before close(), inside the `with Session(...)` block"
            )
        if self._manager is None:
            raise SessionError(
                f"Session.{what}() before Session.start(): call session.start() first (or use `with Session(...)`)"
            )
        return self._manager

    # -- steps --------------------------------------------------------------------------
    def step(self, step: int, state: Mapping[str, Any], metrics: Mapping[str, Any] | None = None) -> bool:
        """At the end of step ``step`` (steps done): a heartbeat for the agent, the outcome of
        the save in the background (a failure is logged; training goes on), a metrics line (with
        ``metrics``, the loop's numbers) and a save when ``interval_steps`` says so; True when a save started."""
        manager = self._need_started("step")
        numbers = self._lines.numbers(metrics)  # a mistake is refused before the step does anything
        self._step = step
        status = manager.poll()
        timing = self._timing.step_done()  # the heartbeat's step_time_s and phases_s
        parts = StateParts.of(state, spread=self._spread)
        self._timing.watch(parts.module, parts.optimizers)  # from the next step on: its wait for peers
        if self._replicas.due(step):  # before the step is kept anywhere (a save, the tier, a boundary)
            self._replicas.check(step, parts, self.rank, self._events, self._serving)
        if self._hb is not None:
            corrupt = self._replicas.corruptions
            self._hb.beat(step, committed_step=status.last_committed_step, corruptions=corrupt, **timing)
        if not self._state_checked:  # a loop that never called load(): its first step checks the state
            parts.check_storable(step)  # SessionError now, not at the first save hours later
            self._state_checked = True
        if self._round is not None:
            self._round.boundary(step, parts)
        newer, stop, ranks = self._agreement(timing) if self._serving else (False, False, None)
        self._lines.write(step, timing, numbers, round_=self.round, world_size=self.world_size, ranks=ranks)
        if newer or stop:
            self._leave(step, state, stop)
        checkpointed = bool(self.interval_steps) and step % self.interval_steps == 0  # the same on every rank
        with self._timing.phase("ckpt_staging"):
            saved = self.save(step, state) if checkpointed else False
            if self._tier is not None:
                self._tier.snapshot(self._round, step, checkpointed=checkpointed)
        return saved

    def _agreement(self, timing: Mapping[str, Any]) -> tuple[bool, bool, RankTimes]:
        """Under :meth:`run`, at each step boundary, one all-reduce: a newer round assigned to any
        rank, a stop asked of any (SIGTERM: its node drains), every rank's step times."""
        newer = self._round is not None and self._round.newer()
        values = boundary_values((newer, self._stop_requested), timing, self.rank, self.world_size)
        values = values.to(self._device())
        with self._timing.phase("comm_wait"):  # the ranks ahead wait here for the slowest (a straggler's signal)
            dist.all_reduce(values, op=dist.ReduceOp.MAX)
        return read_boundary(values.tolist(), self.world_size)

    def _leave(self, step: int, state: Mapping[str, Any], stop: bool) -> None:
        """Every rank stops when any was asked to: the step committed, drained ranks end (``Drained``),
        others keep their state for the next round. Or every rank leaves for the newer round."""
        if stop:
            if self._tier is not None:  # this step in the peers' memory too: the ranks that stay heal from it
                self._tier.snapshot_before_leaving(self._round, step)
            self.finish(step, state)
            if self._stop_requested or self._round is None:
                raise Drained(f"stopped after step {step}: asked to (SIGTERM)")
            raise RoundChanged(f"another node drains: leaving round {self.round} after step {step}")
        raise RoundChanged(f"a newer round was assigned: leaving round {self.round} after step {step}")

    def _device(self) -> torch.device:
        """Where this rank's collectives run (the process group's device)."""
        return collective_device()

    def wait_staged(self) -> None:
        """Until the save in the background has copied the state: call it before the next
        optimizer update when you overlap a save with the forward and backward pass (:meth:`save`
        waits for it itself)."""
        self._need_started("wait_staged").wait_staged()

    # -- save and load ------------------------------------------------------------------
    def save(self, step: int, state: Mapping[str, Any], *, sync: bool = False) -> bool:
        """Save ``state`` as step ``step`` (collective: every rank, the same step). Asynchronous
        unless ``sync`` or ``async_save=False``: this returns once the state is copied; the
        commit follows (see :meth:`wait`). False when the save was skipped or failed (logged);
        a step already committed is not saved again (nothing is written). SessionError, before
        anything is written, for a state that can never be stored (it names the entry)."""
        manager = self._need_started("save")
        parts = StateParts.of(state, spread=self._spread)
        entries = parts.user_state(step)  # what cannot be stored is refused here, naming it
        self._state_checked = True
        self._warned_large = warn_if_large(entries, step, self._warned_large)
        loop = loop_fields(self._loop_fields, step)  # what the manifest could not hold is refused here
        if manager.status.last_committed_step == step:
            log.warning("step %d is committed already under %s: not saved again", step, self.checkpoint_uri)
            return False
        self._beat("saving")  # a copy, or a wait for the previous upload, may outlast the hang timeout
        try:
            manager.wait_staged()
            sd = parts.state_dict()  # collective with per-rank entries: their capacities agreed
            fields = manifest_fields(self.round, self.world_size, step, parts.capacities, loop)
            files = {STATE_FILE: state_codec.file_bytes(entries)}
            return manager.save(step, sd, fields, sync=sync, extra_files=files)
        finally:
            self._beat("training")

    def _beat(self, phase: str) -> None:
        """A heartbeat: ``saving``/``loading`` get the agent's save (start) timeout, ``training`` its hang timeout."""
        if self._hb is not None:
            committed = self._manager.status.last_committed_step if self._manager is not None else -1
            self._hb.beat(self._step, phase=phase, committed_step=committed)

    def wait(self) -> SaveStatus:
        """Until the save in flight (if any) committed or failed; the service's status."""
        manager = self._need_started("wait")
        if not manager.uploading:
            return manager.wait()
        self._beat("saving")
        status = manager.wait()
        self._beat("training")
        return status

    def finish(self, step: int, state: Mapping[str, Any]) -> SaveStatus:
        """After the last step: its save (unless step ``step`` is already committed), waited for."""
        manager = self._need_started("finish")
        self._step = step
        self._beat("saving")  # the wait for an upload and the final save: the agent's save timeout
        status = manager.wait()
        if status.last_committed_step != step:
            self.save(step, state, sync=True)
            self._beat("saving")  # the loop is over: what follows is no training step
            status = manager.wait()
        return status

    def load(self, state: Mapping[str, Any], *, step: int = -1) -> int:
        """Load the newest verified committed step (or ``step``) into ``state`` (collective);
        returns the step it was saved at, i.e. the steps done (0 when there is nothing to load)."""
        manager = self._need_started("load")
        parts = StateParts.of(state, spread=self._spread)
        rnd = self._round
        self._beat("loading")
        if rnd is not None:
            rnd.load_began()
        if rnd is not None and not rnd.loaded and self._tier is not None:
            self._tier.join(rnd, parts, self.rank, self.world_size, self._device(), self._events)
        if rnd is not None and self._rollback_why:
            rnd.rejoin_tier(parts)
        if rnd is not None and not rnd.loaded and step < 0:
            done = self._restore_live(rnd, manager, parts)
            if done is not None:
                return done
        manifest = load_stored(manager, parts, step=step, events=self._events, check=self._check_resume)
        if manifest is None:
            self.restored = Restored("fresh", 0)
            self._loaded(parts, 0)
            self._say(f"no committed step under {self.checkpoint_uri}: starting from step 0")
            return 0
        self._step = manifest.step
        manager.status.last_committed_step = max(manager.status.last_committed_step, manifest.step)
        self.restored, self.manifest = Restored("storage", manifest.step), manifest
        self._loaded(parts, manifest.step)
        self._say(
            f"resumed after step {manifest.step}, loaded from {self.checkpoint_uri} "
            f"(saved at world size {manifest.world_size})"
        )
        return manifest.step

    def _restore_live(self, rnd: Round, manager: CheckpointManager, parts: StateParts) -> int | None:
        """The state the round's ranks hold, put into ``parts`` (:func:`ftrain.session_live.restore_round`):
        the step it goes on from; None when the ranks agreed to load from storage instead (collective)."""
        committed = max(rnd.assignment.committed_step, manager.status.last_committed_step)
        held, rnd.held = rnd.held, None  # the previous round's objects: freed once this round has its state
        heal = self._tier.healer(rnd, parts, manager.newest_committed_step) if self._tier else None
        got = restore_round(held, parts, self._device(), committed, heal, events=self._events)
        if got is None:
            return None
        restored, committed = got
        manager.status.last_committed_step = max(manager.status.last_committed_step, committed)
        self._step, self.restored = restored.step, restored
        self._loaded(parts, restored.step)
        self._say(f"resumed after step {restored.step}, from {restored.said()}")
        return restored.step

    def _loaded(self, parts: StateParts, step: int) -> None:
        """The state is at a step boundary now: under :meth:`run`, what this rank holds from here;
        everywhere, a state whose non-tensor entries could never be saved is refused now."""
        if self._rollback_why:
            rolled_back(self._events, step, self._rollback_why, self._say)
            self._rollback_why = ""
        if self._round is not None:
            self._round.restored(self.restored, self._events, self.world_size)  # live_restored, once a round
            self._round.boundary(step, parts)  # encodes the entries: refuses what cannot be stored
        else:
            parts.check_storable(step)  # SessionError now, not at the first save hours later
        self._state_checked = True


__all__ = ["Restored", "RoundChanged", "Session", "SessionError", "USER_STATE", "WRITER"]
