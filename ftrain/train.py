"""The training loop: one optimizer step per global batch, whatever the world size.

Each step takes the next global batch from the world-size-independent cursor, runs this
data-parallel rank's contiguous block of micro-batches (accumulating gradients without
communication until the last), reduces gradients, clips, checks the loss and gradient norm are
finite, sets the scheduled LR and steps the optimizer; then it reports (metrics JSON line,
progress, peak memory per rank), checkpoints when due, and checks replicas when due.
SIGTERM is a graceful stop: finish the step, save synchronously, exit 0.

Checkpoint health is never silent: every heartbeat carries the failed commits in a row and the
last error, and past ``checkpoint.max_failed_commits`` failures in a row (0: never) the worker
stops with :class:`CheckpointFailuresError` — naming the count, the key and the last error —
rather than train on with nothing protecting the work. The agents restart from the last
commit (an outage may have passed); if the same error comes back at the same step, their
deterministic-failure rule stops the job with it in the final status instead of spending the
restart budget. Every exception is sent to the agent (error, step, and whether a restart can
help at all: ``fatal``) before the worker leaves.

**Size.** Over 600 lines: the trainer is one object whose step, resume, save and exit paths share
its state (model, optimizer, cursor, phases, manager); what could stand alone already does
(:mod:`ftrain.checkpointing`, :mod:`ftrain.consistency`, :mod:`ftrain.parallel`, the rooms).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ftrain.agent_link import flight_recorder, heartbeat, stop_request
from ftrain.checkpoint.errors import CheckpointError
from ftrain.checkpointing import (
    Checkpointing,
    current_round,
    step_to_resume,
)
from ftrain.config import Config
from ftrain.consistency import ConsistencyError, Verdict, check_replicas
from ftrain.contract import events as ev
from ftrain.contract.events import EventLog
from ftrain.contract.flight import EVENT_TAIL
from ftrain.contract.worker_env import WorkerEnv
from ftrain.data import (
    DataCursor,
    GlobalBatch,
    Ledger,
    Source,
    build_source,
    identity_of,
    micro_batches,
    micro_block,
    micro_steps,
)
from ftrain.data.files import atomic_output
from ftrain.distributed import init_distributed, select_device, select_dtype, shutdown_distributed
from ftrain.faults import (
    after_update,
    maybe_crash,
    maybe_crash_inside,
    maybe_poison_loss,
    maybe_skip_collective,
    maybe_slow_down,
)
from ftrain.model import count_parameters
from ftrain.models import init_shards
from ftrain.models.checks import check_model
from ftrain.models.deferred_init import is_deferred, materialize
from ftrain.models.hf_weights import model_record
from ftrain.models.init_weights import InitFromNotReadError, load_initial_weights
from ftrain.models.layout import logits_of
from ftrain.observability.metrics import MetricsWriter, peak_memory_bytes, resident_bytes
from ftrain.observability.progress import Progress
from ftrain.observability.step_phases import StepPhases
from ftrain.optim import Schedule, set_lr
from ftrain.parallel import strategies
from ftrain.parallel.base import Parallel
from ftrain.parallel.parallelize import build_for, parallelize
from ftrain.parallel.pipeline import PipelineParallel
from ftrain.parallel.pipeline_stages import at_world
from ftrain.parallel.strategies import compute_layout
from ftrain.recovery.round_control import RoundEnded
from ftrain.session_live import BoundaryWatch
from ftrain.session_per_rank import RNGState
from ftrain.session_state import StateParts
from ftrain.session_tier import SessionTierView
from ftrain.torch_compat import all_gather_single

if TYPE_CHECKING:
    from ftrain.recovery.memory_tier import MemoryTier

log = logging.getLogger(__name__)


class NonFiniteError(RuntimeError):
    """The loss or gradient norm is not finite and ``train.on_nonfinite = "halt"``."""


class CheckpointFailuresError(CheckpointError):
    """``checkpoint.max_failed_commits`` checkpoint commits in a row failed: stop, do not train
    on unprotected. Not fatal: the cause may pass (an etcd or storage outage), so the agents
    restart from the last commit; a cause that stays (bad credentials) fails again at the same
    step with the same error, and the agents' deterministic-failure rule ends the job."""


def describe_failure(e: BaseException) -> str:
    """One line for the agent: the exception's type and message (its lines joined; the heartbeat
    channel truncates it)."""
    lines = [line.strip() for line in f"{type(e).__name__}: {e}".splitlines() if line.strip()]
    return " | ".join(lines) if lines else type(e).__name__


@dataclass(frozen=True, slots=True)
class StepStats:
    """What one all-gather per step tells every rank."""

    loss: float  #: mean over the whole global batch
    peaks: list[int]  #: per rank: peak memory
    busy_s: list[float]  #: per rank: time so far not blocked on communication
    comm_wait_s: list[float]  #: per rank: blocked on communication so far
    pp_bubble: list[float]  #: per rank: the step's pipeline schedule's share of time waiting on neighbours
    completed_at: float  #: time.time() as the gather returned: the round completed the step


@dataclass(slots=True)
class TrainResult:
    steps: int
    final_loss: float
    entropy_floor_nats: float | None
    wall_time_s: float
    world_size: int
    stopped_early: bool = False


def train(cfg: Config) -> TrainResult:
    flight_recorder.enable(cfg.logging.flight_recorder_entries)
    device = select_device(cfg.train)
    dtype = select_dtype(cfg.train, device)
    hb = heartbeat.from_env(int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0")))
    if hb is not None:
        hb.beat(-1, phase="starting")
    rank, world_size, local_world = init_distributed(cfg.parallel, device)
    trainer = None
    tier = None
    if cfg.checkpoint.memory_dir and cfg.checkpoint.memory_interval != 0:
        from ftrain.recovery.memory_tier import MemoryTier

        tier = MemoryTier(cfg, cfg.checkpoint.memory_dir)  # its snapshots there outlive this process
    try:
        trainer = Trainer(cfg, device, dtype, rank, world_size, local_world, hb, tier=tier)
        result = trainer.run()
    except BaseException as e:
        # No collective teardown on failure: peers may be stuck in a collective, and a barrier
        # or destroy here would hang; the launcher ends the job.
        say_goodbye(hb, trainer, e)
        if trainer is not None:
            trainer.record_flight(e)
            trainer.close()
        raise
    finish(trainer, result)
    if tier is not None:
        tier.close(job_done=not result.stopped_early)
    return result


def say_goodbye(hb: heartbeat.Heartbeat | None, trainer: Trainer | None, e: BaseException) -> None:
    """Tell the agent why this worker fails (its exit message), before it leaves."""
    if hb is not None and not isinstance(e, KeyboardInterrupt):
        hb.exit(
            trainer.cursor.step if trainer is not None else -1,
            finished=False,
            committed_step=trainer.committed_step() if trainer is not None else -1,
            error=describe_failure(e),
            fatal=bool(getattr(e, "fatal", False)),
        )


def finish(trainer: Trainer, result: TrainResult, teardown: Callable[[], None] = shutdown_distributed) -> None:
    """After a successful run: close, tear the process group down (``teardown``: with a barrier,
    unless the peers will not wait in one), say so to the agent."""
    trainer.close()
    teardown()
    if trainer.hb is not None:
        trainer.hb.exit(result.steps, finished=not result.stopped_early, committed_step=trainer.committed_step())


#: the trainer's entries besides the model and optimizer (as a session's state names them)
CURSOR, SCHEDULE, RNG = "cursor", "schedule", "rng"


class _InForce:
    """The LR schedule in force as an entry of the trainer's state: what the run's last resume
    decided (``train.on_schedule_change``), which a process that takes its state from a live peer
    must go on with, not its configured one."""

    def __init__(self, trainer: Trainer):
        self.trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        return self.trainer.lr_schedule().to_dict()

    def load_state_dict(self, raw: Any) -> None:
        try:
            schedule = Schedule.from_dict(raw)
        except ValueError as e:  # the sender's digest was checked, its values were not
            log.error("the state's LR schedule is not one (%s): going on with the configured one", e)
            return
        if self.trainer.ckpt is not None:  # what its next saves record
            self.trainer.ckpt.schedule = schedule


class Trainer:
    def __init__(
        self,
        cfg: Config,
        device: torch.device,
        dtype: torch.dtype,
        rank: int,
        world_size: int,
        local_world: int,
        hb: heartbeat.Heartbeat | None = None,
        round_ended: Callable[[], bool] | None = None,
        source: Source | None = None,
        tier: MemoryTier | None = None,
    ):
        cfg = dataclasses.replace(cfg, parallel=at_world(cfg.parallel, world_size))  # its pipeline degree here
        self.cfg = cfg
        self.hb = hb
        self.node = WorkerEnv.from_env().node  #: this worker's node ("" without an agent)
        #: times the consistency check found this rank's copies corrupt (its replicas' majority differed)
        self.corruptions = 0
        self.round_ended = round_ended  #: live workers: whether the agent assigned a newer round
        self.last_step_time_s = 0.0  #: wall time of the last completed step
        self.device = device
        self.rank = rank
        n_head = cfg.model.n_head if not cfg.model.factory else None
        self.layout = compute_layout(
            cfg.parallel, world_size=world_size, rank=rank, local_world_size=local_world, n_head=n_head
        )
        self.uneven = cfg.parallel.deterministic  #: blocks of micro-batches may differ by one between ranks
        self.micro_per_step = micro_steps(
            cfg.train.global_batch_size, cfg.train.micro_batch_size, self.layout.dp_size, uneven=self.uneven
        )
        lo, hi = micro_block(self.micro_per_step, self.layout.dp_rank, self.layout.dp_size)
        self.accum = hi - lo  #: this rank's micro-batches per step
        self.source = source if source is not None else build_source(cfg.data, cfg.model)
        host_before = resident_bytes()
        torch.manual_seed(cfg.train.seed)
        model = build_for(cfg.model, self.layout)  # parameters left on meta where this rank holds part of them
        check_model(model, cfg, tp_size=self.layout.tp_size)
        self.model_record = model_record(model, cfg.model)  #: what every checkpoint records of the model
        #: the step a resume was to load instead of model.init_from (-1: init_from read, or not set)
        self.init_from_skipped_for = step_to_resume(cfg) if cfg.model.init_from else -1
        init_files: dict[str, str] = {}
        init_into_parts: init_shards.Surveyed | None = None  #: read into each rank's part once parallel
        if cfg.model.init_from and self.init_from_skipped_for < 0:
            if is_deferred(model) and dist.is_initialized():
                init_into_parts = init_shards.survey(model, cfg.model)  # checked on every rank before any read
            else:
                if is_deferred(model):
                    model = materialize(model, torch.device("cpu"))
                init_files = load_initial_weights(model, cfg.model)  # read whole on rank 0, sent to the others
        if self.init_from_skipped_for >= 0 and rank == 0:
            log.info(
                "model.init_from is not read: checkpoint step %d under %s is to be resumed",
                self.init_from_skipped_for,
                cfg.checkpoint.uri,
            )
        self.num_params = count_parameters(model)
        deferred = is_deferred(model)
        self.par: Parallel = parallelize(model, cfg, self.layout, device, dtype, self.micro_per_step)
        init_read_bytes: list[int] = []
        if init_into_parts is not None:
            loaded = init_shards.load(init_into_parts, self.par.model)
            init_files, init_read_bytes = loaded.files, loaded.read_bytes_by_rank
        self.phases = StepPhases(self.par.model)  #: where this rank's time goes (ftrain.observability.step_phases)
        self.cursor = DataCursor(
            self.source.num_samples,
            cfg.train.global_batch_size,
            cfg.data.seed,
            data=identity_of(self.source, cfg.data.seed),  # checked on resume (data.on_mixture_change)
            on_change=cfg.data.on_mixture_change,
        )
        self.round = current_round()  #: the round this trainer was built for (a live worker builds one per round)
        self.events = EventLog(cfg.logging.events_path, rank=rank, round_=self.round)
        self.events.emit(
            ev.ModelBuilt(
                model_fp32_bytes=4 * self.num_params,
                deferred=deferred,
                host_before_bytes=host_before,
                host_peak_bytes=resident_bytes(peak=True),
                device_peak_bytes=peak_memory_bytes(device) if device.type == "cuda" else 0,
            )
        )
        if init_files and rank == 0:
            self.events.emit(
                ev.WeightsLoaded(path=cfg.model.init_from, files=init_files, read_bytes_by_rank=init_read_bytes)
            )
        self.ledger = (
            Ledger(cfg.data.ledger_dir, self.layout.dp_rank, round_=self.round, data=self.cursor.data_digest)
            if cfg.data.ledger_dir and self.layout.reads_data
            else None
        )
        self.metrics = MetricsWriter(cfg.logging.metrics_path) if cfg.logging.metrics_path and rank == 0 else None
        self.progress = Progress(cfg.train.steps, cfg.logging.progress if rank == 0 else "off", cfg.logging.log_every)
        self.ckpt = (
            Checkpointing(cfg, self.par, self.cursor, self.events, self.model_record) if cfg.checkpoint.uri else None
        )
        #: the state as a session's: the model and optimizer, the data cursor, the LR schedule in force
        #: and each rank's RNG states. What a live worker holds between rounds (sent to a peer that lacks
        #: it where every rank holds the model whole; else only the step) and what the memory tier keeps
        self.parts = StateParts.of(
            {
                "model": self.par.model,
                "optim": self.par.optimizer,
                CURSOR: self.cursor,
                SCHEDULE: _InForce(self),
                RNG: RNGState(),
            },
            spread=not strategies.full_replica(self.layout),
        )
        self.watch = BoundaryWatch()  #: the last step boundary, and whether an update moved past it
        #: the memory tier: for strategies that keep no full replica, and with checkpoint.memory_dir for
        #: every strategy (ddp heals a lost rank from a live peer; a snapshot kept on the node's tmpfs
        #: outlives the workers when every one of them is lost)
        self.tier = tier if tier is not None and tier.enabled and self._tier_helps(tier) else None
        self.tier_view: SessionTierView | None = None  #: the memory tier's view of the state
        if self.tier is not None:
            self.tier.join_round(rank, world_size, local_world, device.type, self.events)
            self.tier_view = self.tier_view_of(self.tier)
        #: what copies the state in the background between a step boundary and the next update
        self.staging_waits: list[Callable[[], object]] = [
            *([self.ckpt.manager.wait_staged] if self.ckpt is not None else []),
            *([self.tier.wait_staged] if self.tier is not None else []),
        ]
        self.floor = getattr(self.source, "entropy_floor_nats", None)
        self.skipped_steps = 0
        self.max_failed_commits = cfg.checkpoint.max_failed_commits
        self._failures_at_last_commit = 0  #: saves_failed when a commit last succeeded
        self._last_commit_seen = -1
        self.dtype = dtype

    # -- lifecycle --------------------------------------------------------------------
    @property
    def stop_requested(self) -> bool:
        """This process was asked to stop (SIGTERM: its node drains); its peers stop with it. The
        request is the process's (:mod:`ftrain.agent_link.stop_request`), so one that arrived
        before this trainer existed (a live worker between rounds) is not lost."""
        return stop_request.requested()

    def _stop_agreed(self) -> bool:
        """All ranks stop at the same step if any of them was asked to; all leave for a newer
        round (:class:`RoundEnded`) at the same step if any of them was assigned one."""
        ended = self.round_ended is not None and self.round_ended()
        flags = torch.tensor([float(self.stop_requested), float(ended)], device=self.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        if flags[1].item():
            raise RoundEnded(f"a newer round was assigned: leaving after step {self.cursor.step}")
        return bool(flags[0].item())

    def run(self, *, resume: bool = True) -> TrainResult:
        """Train to ``train.steps`` (or a graceful stop); ``resume=False``: the state is already
        in place (a live worker restored it from its peers)."""
        stop_request.install()
        cfg, layout = self.cfg, self.layout
        self.events.emit(
            ev.WorkerStarted(
                world_size=layout.world_size,
                strategy=layout.strategy,
                node=self.node,
                local_rank=int(os.environ.get("LOCAL_RANK", "0")),
            )
        )
        if resume and (self.ckpt is not None or self.tier is not None) and cfg.checkpoint.resume:
            self._resume()
        if self.init_from_skipped_for >= 0 and self.cursor.step == 0:  # nothing restored (saves follow a step)
            raise InitFromNotReadError(self.init_from_skipped_for, cfg.checkpoint.uri)
        self.progress.message(
            f"ftrain: {self.num_params / 1e6:.2f}M params, {layout.strategy} on {layout.world_size} rank(s) "
            f"(dp={layout.dp_size} tp={layout.tp_size}"
            + (f" pp={layout.pp_size} {cfg.parallel.pp_schedule}" if layout.pp_size > 1 else "")
            + f"), accumulation {self.accum} x micro-batch "
            f"{cfg.train.micro_batch_size} = global batch {cfg.train.global_batch_size}, {self.device.type} "
            f"{str(self.dtype).removeprefix('torch.')}, starting at step {self.cursor.step}"
            + (f", entropy floor {self.floor:.4f} nats" if self.floor is not None else "")
        )
        start = time.perf_counter()
        loss = float("nan")
        stopped_early = False
        self.mark_boundary()
        while self.cursor.step < cfg.train.steps:
            loss = self._step()
            self.mark_boundary()
            done = self.cursor.step
            checkpointed = self.ckpt is not None and self.ckpt.due(done) and done < cfg.train.steps
            interval = cfg.consistency.interval
            if interval and (done % interval == 0 or checkpointed):  # before a save: nothing corrupt is committed
                self._check_consistency(done)
                if self.cursor.step != done:  # rolled back (every rank alike): go on from the checkpoint
                    continue
            if checkpointed and self.ckpt is not None:
                # A blocking save, or one that first waits for the previous upload (when_busy =
                # wait), may take longer than the hang timeout: the agent applies the start
                # timeout meanwhile. Otherwise the save blocks only for staging.
                if cfg.checkpoint.async_mode == "off" or self.ckpt.manager.uploading:
                    self._beat(done, "saving")
                with self.phases.phase("ckpt_staging"):
                    self.ckpt.save(done)
                self._check_commit_failures()
            if self.tier is not None and self.tier_view is not None:
                with self.phases.phase("ckpt_staging"):
                    self.tier.maybe_snapshot(
                        done, self.tier_view, checkpointed=checkpointed, last=done >= cfg.train.steps
                    )
            maybe_crash(done, self.rank)
            maybe_slow_down()
            with self.phases.phase("comm_wait"):
                stop = self._stop_agreed()
            if stop:
                stopped_early = done < cfg.train.steps
                if self.tier is not None and self.tier_view is not None and stopped_early:  # the rest heal from it
                    with self.phases.phase("ckpt_staging"):
                        self.tier.snapshot_before_leaving(done, self.tier_view)
                self.progress.message(f"graceful stop requested: stopping after step {done}")
                self.events.emit(ev.GracefulStop(step=done))
                break
        wall = time.perf_counter() - start
        if self.ckpt is not None:
            self._beat(self.cursor.step, "saving")
            status = self.ckpt.finish(self.cursor.step)
            if status.saves_failed:
                self.progress.message(f"warning: {status.saves_failed} checkpoint save(s) failed: {status.last_error}")
        if cfg.train.save_final_path:
            self._save_final()
        gap = f" vs entropy floor {self.floor:.4f} (+{loss - self.floor:.4f} nats)" if self.floor is not None else ""
        self.progress.message(f"done: step {self.cursor.step}, loss {loss:.4f}{gap} in {wall:.1f}s")
        return TrainResult(self.cursor.step, loss, self.floor, wall, layout.world_size, stopped_early)

    def _beat(self, step: int, phase: str, step_time_s: float = 0.0, phases: dict[str, float] | None = None) -> None:
        if self.hb is not None:
            status = self.ckpt.manager.status if self.ckpt else None
            self.hb.beat(
                step,
                phase=phase,
                step_time_s=step_time_s,
                phases_s=phases or {},
                committed_step=self.committed_step(),
                ckpt_duration_s=status.last_save_duration_s if status else 0.0,
                ckpt_failures=self.consecutive_commit_failures(),
                ckpt_failures_total=status.saves_failed if status else 0,
                ckpt_error=status.last_error if status and self.consecutive_commit_failures() else "",
                corruptions=self.corruptions,
            )

    def mark_boundary(self) -> None:
        """The state is at a step boundary (a step done, a restore, a rollback): what a live worker
        holds if its round ends before the next one (:class:`~ftrain.session_live.BoundaryWatch`:
        nothing but the step once the optimizer updates past it)."""
        step = self.cursor.step
        entries = self.parts.user_state(step)
        self.watch.mark(step, self.parts, entries)
        if self.tier_view is not None:
            self.tier_view.mark(step, self.parts, entries, self.last_step_time_s)

    def committed_step(self) -> int:
        return self.ckpt.manager.status.last_committed_step if self.ckpt is not None else -1

    def consecutive_commit_failures(self) -> int:
        """Checkpoint saves failed since the last commit (the manager's own count once it has one)."""
        if self.ckpt is None:
            return 0
        status = self.ckpt.manager.status
        counted = getattr(status, "consecutive_failures", None)
        if counted is not None:
            return int(counted)
        if status.last_committed_step != self._last_commit_seen:
            self._last_commit_seen, self._failures_at_last_commit = status.last_committed_step, status.saves_failed
        return status.saves_failed - self._failures_at_last_commit

    def _check_commit_failures(self) -> None:
        """Stop once ``checkpoint.max_failed_commits`` commits in a row have failed (0: never)."""
        if self.ckpt is None:  # no checkpoints, no commits to fail
            return
        failures = self.consecutive_commit_failures()
        if not self.max_failed_commits or failures < self.max_failed_commits:
            return
        error = self.ckpt.manager.status.last_error or "(no error recorded)"
        self.events.emit(ev.CkptFailuresExceeded(failures=failures, limit=self.max_failed_commits, error=error))
        raise CheckpointFailuresError(
            f"{failures} checkpoint commits in a row failed (checkpoint.max_failed_commits={self.max_failed_commits}): "
            f"stopping rather than training unprotected; last error: {error}. Fix the storage or the etcd fence, or "
            "raise checkpoint.max_failed_commits (0: never stop)"
        )

    def _resume(self) -> None:
        self._beat(-1, "loading")
        if self.tier is not None and self.cfg.checkpoint.load_step < 0 and self._resume_from_tier():
            return
        if self.ckpt is None:
            return
        manifest = self.ckpt.resume()
        if manifest is not None:
            self.progress.message(
                f"resumed from checkpoint step {manifest.step} "
                f"(saved at world size {manifest.world_size}, round {manifest.round})"
            )
            self._check_consistency(self.cursor.step)

    def lr_schedule(self) -> Schedule:
        """The LR schedule in force: what the last resume from storage decided (``train.on_schedule_change``:
        the saved one or the configured one), else the configured one. A memory-tier or live-peer restore
        (this run's state, under this config) goes on with the schedule that state was trained on."""
        return self.ckpt.schedule if self.ckpt is not None else Schedule.of(self.cfg)

    # -- the memory tier ---------------------------------------------------------------
    def tier_view_of(self, tier: MemoryTier) -> SessionTierView:
        """What ``tier`` snapshots and restores of this trainer (a session's view of its state,
        bound to what ``tier`` is bound to), at the current step boundary."""
        view = SessionTierView(
            self.parts, self.device, self.rank, self.layout.world_size, self.round, self.events, tier.binding
        )
        step = self.cursor.step
        view.mark(step, self.parts, self.parts.user_state(step), self.last_step_time_s)
        return view

    def tier_restore(self, committed: int) -> int | None:
        """Collective: the newest snapshot the tier holds that is not older than ``committed``,
        put into the state (:meth:`MemoryTier.restore`); its step, or None (every rank alike)."""
        if self.tier is None or self.tier_view is None:
            return None
        return self.tier.restore(self.tier_view, committed)

    def _tier_helps(self, tier: MemoryTier) -> bool:
        return bool(tier.memory_dir) or not strategies.full_replica(self.layout)

    def _resume_from_tier(self) -> bool:
        """Collective: the newest snapshot the memory tier holds (``checkpoint.memory_dir``: what
        this node and the buddies kept before a restart), if it is not older than the newest
        committed checkpoint; False (every rank alike) when storage must be read instead."""
        assert self.tier is not None
        began = time.monotonic()
        committed = self.ckpt.manager.newest_committed_step() if self.ckpt is not None else -1
        step = self.tier_restore(committed)
        if step is None:
            return False
        if self.ckpt is not None:
            status = self.ckpt.manager.status
            status.last_committed_step = max(status.last_committed_step, committed)
        self.events.emit(
            ev.MemoryRestored(
                step=step,
                committed_step=committed,
                world_size=self.layout.world_size,
                seconds=round(time.monotonic() - began, 4),
            )
        )
        self.progress.message(f"resumed from the memory tier at step {step} (newest committed checkpoint: {committed})")
        self._check_consistency(self.cursor.step)
        return True

    def _wait_staged(self) -> None:
        """Before the update changes the parameters and optimizer state: the background copies
        of them that a save or a memory-tier snapshot started at the last step boundary, done."""
        for wait in self.staging_waits:
            wait()

    def record_flight(self, e: BaseException) -> None:
        """This rank's last collectives into the event log as it fails (its agent cannot ask a
        process that is gone): where it was when the error came."""
        if isinstance(e, KeyboardInterrupt):
            return
        record = flight_recorder.snapshot(self.rank).tail(EVENT_TAIL)
        if record.available:
            self.events.emit(ev.FlightRecorded(record=record.to_dict(), why=describe_failure(e)[:500]))

    def close(self, *, broken: bool = False) -> None:
        """``broken``: the round ended with its process groups aborted (a live worker leaving
        it): a checkpoint save still in flight is abandoned, not waited for."""
        self.watch.release()
        if self.tier is not None:  # its exchange ends with the round (the caller aborted a broken one)
            self.tier.leave_round()
        if self.ckpt is not None:
            self.ckpt.close(abandon=broken)
        for part in (self.metrics, self.ledger, self.events):
            if part is not None:
                part.close()

    # -- one step ---------------------------------------------------------------------
    def _step(self) -> float:
        cfg, par, phases = self.cfg, self.par, self.phases
        step = self.cursor.step
        t0 = time.perf_counter()
        with phases.phase("data"):
            batch = self.cursor.next_global_batch()
            micros = micro_batches(
                batch, self.layout.dp_rank, self.layout.dp_size, cfg.train.micro_batch_size, uneven=self.uneven
            )
        if self.ledger is not None:  # before any collective: once this rank's gradients are in a reduction,
            self.ledger.record(batch, micros)  # its peers may complete the step without it (live recovery)

        def loss_of(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
            return maybe_poison_loss(step + 1, self.rank, loss)

        if isinstance(par, PipelineParallel):
            with phases.phase("data"):
                ids = np.concatenate([micro.sample_ids for micro in micros])
                tokens = torch.from_numpy(self.source.sample(ids)).to(self.device, non_blocking=True)
            losses = par.run(tokens, loss_of, phases)
        else:
            losses = self._forward_backward(micros, loss_of)
        with phases.phase("comm_wait"):
            par.reduce_gradients()
            grad_norm = par.clip_grad_norm(cfg.train.grad_clip)
        stats = self._step_stats(step + 1, losses)
        lr = self.lr_schedule().lr_at(step, self.layout.dp_size)
        with phases.phase("ckpt_staging"):
            self._wait_staged()
        loss = stats.loss
        with phases.phase("optimizer"):
            if math.isfinite(loss) and math.isfinite(grad_norm):
                set_lr(par.optimizer.param_groups, lr)
                par.optimizer.step()
                after_update(step + 1, self.rank, par.model, par.optimizer)
            else:
                self._on_nonfinite(step + 1, loss, grad_norm)
            par.optimizer.zero_grad(set_to_none=True)
        self._report(step + 1, batch, grad_norm, lr, stats, time.perf_counter() - t0)
        return loss

    def _forward_backward(self, micros: list, loss_of: Callable[..., torch.Tensor]) -> list[torch.Tensor]:
        """This rank's micro-batches one after the other, gradients accumulated; their losses."""
        par, phases = self.par, self.phases
        losses = []
        for i, micro in enumerate(micros):
            with phases.phase("data"):
                tokens = torch.from_numpy(self.source.sample(micro.sample_ids)).to(self.device, non_blocking=True)
            with par.grad_sync(is_last=i == self.accum - 1):
                with phases.phase("forward"):
                    with par.autocast():
                        logits = logits_of(par.model(tokens[:, :-1]))
                    micro_loss = loss_of(logits, tokens[:, 1:])
                with phases.backward():
                    par.backward(micro_loss, i, self.accum)
            losses.append(micro_loss.detach())
        return losses

    def _on_nonfinite(self, step: int, loss: float, grad_norm: float) -> None:
        policy = self.cfg.train.on_nonfinite
        self.events.emit(ev.Nonfinite(step=step, loss=str(loss), grad_norm=str(grad_norm), policy=policy))
        log.warning("step %d: non-finite loss %s / grad norm %s -> %s", step, loss, grad_norm, policy)
        if policy == "halt":
            raise NonFiniteError(f"step {step}: loss {loss}, grad norm {grad_norm} (train.on_nonfinite=halt)")
        if policy == "rollback" and self.ckpt is not None:
            self.par.optimizer.zero_grad(set_to_none=True)
            self._rollback(f"non-finite values at step {step}")
            return
        self.skipped_steps += 1  # skip: the batch is consumed, the update is not applied

    def _rollback(self, why: str) -> None:
        if self.ckpt is None:
            raise ConsistencyError(
                f"{why}, and checkpointing is off (checkpoint.uri is empty): nothing to roll back to"
            )
        self.ckpt.manager.wait()
        manifest = self.ckpt.resume()
        if manifest is None:
            raise ConsistencyError(f"{why}, and there is no verified checkpoint to roll back to")
        if self.ledger is not None:
            self.ledger.rolled_back()
        self.mark_boundary()
        self.events.emit(ev.RolledBack(step=manifest.step, reason=why))
        self.progress.message(f"rolled back to checkpoint step {manifest.step}: {why}")

    def _check_consistency(self, step: int) -> None:
        mismatches = check_replicas(self.par, self.node)
        if not mismatches:
            return
        verdict = Verdict.of(mismatches, self.rank)
        self.corruptions += verdict.mine  # the agent counts them per node (agent.drain_after_corruptions)
        policy, ranks = self.cfg.consistency.on_mismatch, verdict.ranks
        verdict.say(step, policy, self.events)
        if policy == "halt":
            raise ConsistencyError(f"step {step}: replicas differ on ranks {ranks} (consistency.on_mismatch=halt)")
        if policy == "rollback":
            if self.ckpt is None:
                raise ConsistencyError(f"step {step}: replicas differ on ranks {ranks}; no checkpoint.uri to roll back")
            self._rollback(f"replicas differ on ranks {ranks} at step {step}")

    def _step_stats(self, step: int, losses: list[torch.Tensor]) -> StepStats:
        """All ranks' micro-batch losses, peak memory and time so far (busy, waiting) in one
        all-gather.

        The loss is summed in float64 in global micro-batch order (ranks of one tensor-parallel
        group hold the same losses, the first of each counts; under a pipeline the last stage's
        ranks hold them), so it does not depend on how the micro-batches were spread over ranks.
        """
        layout = self.layout
        width = -(-self.micro_per_step // layout.dp_size)  # the largest block (blocks may differ by one)
        padding = [0.0] * (width - len(losses))
        local = torch.tensor(
            [float(x) for x in losses]
            + padding
            + [
                float(peak_memory_bytes(self.device)),
                self.phases.busy_s(),
                self.phases.so_far("comm_wait"),
                self.par.last_bubble if isinstance(self.par, PipelineParallel) else 0.0,
            ],
            dtype=torch.float64,
            device=self.device,
        )
        gathered = torch.empty(layout.world_size * local.numel(), dtype=torch.float64, device=self.device)
        maybe_crash_inside(step, self.rank, lambda: all_gather_single(gathered, local, async_op=True))
        if maybe_skip_collective(step, self.rank):  # a desync: this rank's peers wait in it
            gathered = local.repeat(layout.world_size)
        else:
            with self.phases.phase("comm_wait"):
                all_gather_single(gathered, local)
        completed_at = time.time()  # the step's last collective: its metrics line's time, even if stamped later
        rows = gathered.view(layout.world_size, -1).cpu()
        total, count = 0.0, 0
        for rank, dp_rank in layout.loss_ranks():
            lo, hi = micro_block(self.micro_per_step, dp_rank, layout.dp_size)
            for value in rows[rank, : hi - lo].tolist():
                total += value
                count += 1
        return StepStats(
            loss=total / count,
            peaks=[int(v) for v in rows[:, -4].tolist()],
            busy_s=[round(v, 6) for v in rows[:, -3].tolist()],
            comm_wait_s=[round(v, 6) for v in rows[:, -2].tolist()],
            pp_bubble=[round(v, 4) for v in rows[:, -1].tolist()],
            completed_at=completed_at,
        )

    def _report(
        self, step: int, batch: GlobalBatch, grad_norm: float, lr: float, stats: StepStats, step_time_s: float
    ) -> None:
        phases = {k: round(v, 6) for k, v in self.phases.take().items()}
        record: dict[str, Any] = {
            "step": step,
            "loss": stats.loss,
            "grad_norm": grad_norm,
            "lr": lr,
            "tokens_per_s": self.cfg.train.global_batch_size * self.cfg.model.seq_len / step_time_s,
            "step_time_s": step_time_s,
            "world_size": self.layout.world_size,
            "dp_size": self.layout.dp_size,
            "accum_steps": self.accum,
            "epoch": batch.epoch,
            "peak_mem_bytes": stats.peaks,
            "phases_s": phases,  #: this rank's (rank 0's) interval since the last report, by phase
            "rank_busy_s": stats.busy_s,  #: per rank: time of this step not blocked on communication
            "rank_comm_wait_s": stats.comm_wait_s,  #: per rank: waiting on communication before the losses' gather
            "comm_overlap": self.par.comm_overlap(),
            "skipped_steps": self.skipped_steps,
            **({"pp_size": self.layout.pp_size, "rank_pp_bubble": stats.pp_bubble} if self.layout.pp_size > 1 else {}),
            "round": self.round,  #: the round that completed the step (the chaos invariants read it)
            "time": stats.completed_at,  #: not now: a host frozen since (SIGSTOP) would date the step late
        }
        if self.ckpt is not None:
            status = self.ckpt.poll()
            record.update(
                ckpt_last_committed_step=status.last_committed_step,
                ckpt_saves_failed=status.saves_failed,
                ckpt_in_flight=status.in_flight_step,
                ckpt_last_error=status.last_error,
                ckpt_consecutive_failures=self.consecutive_commit_failures(),
            )
        if self.metrics is not None:
            self.metrics.write(record)
        self.last_step_time_s = step_time_s
        self._beat(step, "training", step_time_s, phases)
        self.progress.update(step, record)

    def _save_final(self) -> None:
        model_sd, optim_sd = self.par.full_state_dict()
        if dist.get_rank() == 0:
            with atomic_output(self.cfg.train.save_final_path) as fh:  # whole or not at all; no planted link followed
                torch.save(
                    {
                        "model": model_sd,
                        "optim": optim_sd,
                        "cursor": self.cursor.state_dict(),
                        "config": self.cfg.to_dict(),
                        "layout": self.layout.describe(),
                    },
                    fh,
                )
