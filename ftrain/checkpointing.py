"""What the train loop checkpoints, and how it resumes.

State: model and optimizer through ``get_state_dict`` (sharded DTensors for FSDP/TP, plain for
DDP: DCP reshards across world sizes and strategies), each rank's torch/numpy/python RNG
states as small uint8 tensors under ``rng.rank<r>``, and in the manifest the trainer state
(step, data cursor, the LR schedule in force), the resolved config and its hash, the layout and
the fencing round. The LR is a pure function of the step and that schedule, so it needs no
other state.

A resume compares the schedule a step records with the configured one before it reads any file
(:func:`ftrain.optim.decide_schedule`, ``train.on_schedule_change``): a change is refused
(:class:`~ftrain.optim.ScheduleChangeError`, a fatal config error), kept or rescaled, never
silent; the schedule it goes on with is what the next saves record (so a second resume after a
``keep`` still knows it). A step that records none (an older ftrain's) is taken as having the
configured schedule, with a warning.

Resume trusts nothing it reads: before a step is loaded, :func:`validate_trainer_state` checks
the manifest's trainer state (a cursor of the right shape, at the manifest's step); a step that
fails is corrupt for the checkpoint service (marked, fall back). A step that a
:class:`ftrain.Session` wrote (``layout.writer``) is not ftrain train's, and not corrupt either:
:class:`~ftrain.checkpoint.loading.ForeignStepError` (fatal) names it, and nothing is marked.
When steps exist but none can be loaded, :class:`~ftrain.checkpoint.loading.NoLoadableStepError`
ends the worker (after a ``resume_failed`` event and one error line) unless
``checkpoint.on_no_loadable_step=fresh``. Manifests carry the job id
(:func:`ftrain.config.worker_job_id`) and another job's steps are refused.
"""

from __future__ import annotations

import json
import logging
import random
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ftrain import optim_state
from ftrain.agent_link import fence
from ftrain.checkpoint.errors import CheckpointError, ManifestError
from ftrain.checkpoint.loading import TRAIN_WRITER, ForeignStepError, NoLoadableStepError
from ftrain.checkpoint.manager import CheckpointManager, SaveStatus
from ftrain.checkpoint.manifest import Manifest
from ftrain.checkpoint.storage import StorageOptions
from ftrain.config import Config, ConfigError, worker_job_id
from ftrain.contract import events as ev
from ftrain.contract.events import EventLog
from ftrain.contract.worker_env import WorkerEnv
from ftrain.data import DataChangeError, DataCursor, DataError
from ftrain.faults import maybe_pause_after_fence, maybe_pause_before_clear, maybe_pause_before_gc
from ftrain.models.hf_weights import WeightsConfigError, check_resumed_model
from ftrain.optim import KEPT, RESCALED, UNRECORDED, Schedule, ScheduleChangeError, ScheduleDecision, decide_schedule
from ftrain.parallel.base import Parallel

log = logging.getLogger(__name__)


def current_round() -> int:
    """The rendezvous round (fencing token) the agent started this worker in; 0 without an agent.

    ``FTRAIN_ROUND`` must be a plain non-negative decimal int: it is written into manifests and
    compared by the fence, so a garbled value is a start-up error, not a silent 0.
    """
    return WorkerEnv.from_env().round


def step_to_resume(cfg: Config) -> int:
    """Collective, before the model is built: the step a resume from storage will load as far as
    a listing can tell — ``checkpoint.load_step`` when pinned, else the newest committed step
    under ``checkpoint.uri`` (rank 0 lists it); -1: none, or no resume. The load itself may still
    refuse it (and fall back, or start fresh under ``checkpoint.on_no_loadable_step = "fresh"``)."""
    c = cfg.checkpoint
    if not c.uri or not c.resume:
        return -1
    if c.load_step >= 0:
        return c.load_step
    lister = CheckpointManager(
        url=c.uri,
        options=StorageOptions(endpoint_url=c.endpoint_url, region=c.region),
        async_mode="off",
        hmac_key_env=c.hmac_key_env,
        job=worker_job_id(cfg),
        fence=fence.from_env(),
    )
    try:
        return lister.newest_committed_step()
    finally:
        lister.close()


def validate_trainer_state(manifest: Manifest) -> None:
    """Raise ManifestError unless ``manifest.trainer`` is state this trainer can resume from:
    a ``cursor`` that is a well-formed :meth:`DataCursor.state_dict` taken at ``manifest.step``,
    and a well-formed ``schedule`` where there is one (:func:`recorded_schedule`).

    Whether it fits the current data (num_samples, seed) is not judged here: that is a config
    mismatch, reported by :meth:`DataCursor.load_state_dict`, not a corrupt step.
    """
    cursor = manifest.trainer.get("cursor")
    if not isinstance(cursor, dict):
        raise ManifestError(f"trainer.cursor is missing or not an object (got {type(cursor).__name__})")
    try:
        DataCursor.check_state(cursor)
    except DataError as e:
        raise ManifestError(f"trainer.cursor: {e}") from e
    if cursor["step"] != manifest.step:
        raise ManifestError(f"trainer.cursor.step={cursor['step']} but the manifest is of step {manifest.step}")
    recorded_schedule(manifest)


#: where a manifest's trainer state records the LR schedule in force (:meth:`Schedule.to_dict`)
SCHEDULE_KEY = "schedule"


def recorded_schedule(manifest: Manifest) -> Schedule | None:
    """The LR schedule in force when ``manifest``'s step was saved; None if it records none (a step
    saved before schedules were recorded); ManifestError if the record is malformed."""
    if SCHEDULE_KEY not in manifest.trainer:
        return None
    try:
        return Schedule.from_dict(manifest.trainer[SCHEDULE_KEY])
    except ValueError as e:
        raise ManifestError(f"trainer.{SCHEDULE_KEY}: {e}") from e


RNG_BYTES = 64 * 1024


def _rng_tensor() -> torch.Tensor:
    numpy_state = np.random.get_state(legacy=True)
    assert isinstance(numpy_state, tuple)  # legacy=True: the 5-tuple form, never the dict
    state = {
        "torch": torch.get_rng_state().tolist(),
        "numpy": [numpy_state[0], numpy_state[1].tolist(), *numpy_state[2:]],
        "python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state().tolist()
    blob = json.dumps(state).encode()
    if len(blob) > RNG_BYTES:
        raise ValueError(f"RNG state of {len(blob)} bytes exceeds {RNG_BYTES}")
    # fixed size (space-padded JSON): a load builds a same-shaped tensor before reading
    return torch.frombuffer(bytearray(blob.ljust(RNG_BYTES)), dtype=torch.uint8).clone()


def _restore_rng(t: torch.Tensor, step: int) -> None:
    """Restore the RNG states saved by :func:`_rng_tensor`; CheckpointError naming the step if
    the (digest-verified) bytes do not hold them."""
    try:
        state = json.loads(bytes(t.tolist()).decode())
        torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state(torch.tensor(state["cuda"], dtype=torch.uint8))
    except (ValueError, TypeError, KeyError, RuntimeError, RecursionError) as e:
        raise CheckpointError(
            f"checkpoint step {step}: the saved RNG state is unusable ({type(e).__name__}: {str(e)[:200]})"
        ) from e


def _optim_form(manifest: Manifest | None) -> str | None:
    """The form ``manifest``'s step stores optimizer state in (:mod:`ftrain.optim_state`; None:
    the nested form of steps that record none); a new save's is ``per_param``."""
    return optim_state.PER_PARAM if manifest is None else manifest.layout.get(optim_state.FORMAT_KEY)


def training_state(par: Parallel, rank: int, manifest: Manifest | None = None) -> dict[str, Any]:
    """What a checkpoint of this rank holds: model, optimizer
    (``get_state_dict``: DTensor shards for FSDP/TP, in :mod:`ftrain.optim_state`'s ``per_param``
    form, or the form ``manifest``'s step was saved in) and this rank's RNG states."""
    model_sd, optim_sd = optim_state.model_and_optim(par.model, par.optimizer, _optim_form(manifest))
    return {"model": model_sd, "optim": optim_sd, f"rng.rank{rank}": _rng_tensor()}


def load_target(par: Parallel, rank: int, manifest: Manifest) -> dict[str, Any]:
    """The state dict a load of ``manifest``'s step fills (no RNG entry for a rank that did not
    exist when the step was saved); ConfigError if the step's form cannot load at this layout."""
    if optim_state.state_options(_optim_form(manifest)) is None and par.layout.pp_size > 1:
        raise ConfigError(
            "parallel.pp_size",
            f"checkpoint step {manifest.step} was saved by an older ftrain, with one optimizer param_groups "
            "list for all ranks, which pipeline stages cannot share: resume it once with parallel.pp_size=1 "
            "(its next save is in the new form), then with the pipeline",
        )
    sd = training_state(par, rank, manifest)
    if rank >= manifest.world_size:
        del sd[f"rng.rank{rank}"]
    return sd


def manifest_fields(
    cfg: Config,
    par: Parallel,
    cursor: DataCursor,
    round_: int,
    *,
    schedule: Schedule | None = None,
    model_record: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The manifest fields of a save besides its files (see :class:`ftrain.checkpoint.manifest.Manifest`);
    ``schedule``: the LR schedule in force (None: the one ``cfg`` configures); ``model_record``: what
    the model was built from beyond ``[model]`` (:func:`ftrain.models.hf_weights.model_record`), kept
    in the config's model section so that an export never re-reads ``model.args.config``."""
    layout = par.layout
    schedule = schedule if schedule is not None else Schedule.of(cfg)
    config = cfg.to_dict()
    if model_record:
        config["model"] = {**config["model"], **model_record}
    return {
        "round": round_,
        "world_size": layout.world_size,
        "layout": {**layout.describe(), optim_state.FORMAT_KEY: optim_state.PER_PARAM},
        "config": config,
        "config_hash": cfg.digest(),
        "trainer": {"cursor": cursor.state_dict(), SCHEDULE_KEY: schedule.to_dict()},
    }


def apply_loaded(par: Parallel, cursor: DataCursor, rank: int, manifest: Manifest, sd: dict[str, Any]) -> None:
    """Put a loaded state dict (:func:`load_target`, filled) into the model, optimizer, cursor
    and RNG after a load from storage."""
    try:
        optim_state.load_into(par.model, par.optimizer, sd["model"], sd["optim"], _optim_form(manifest))
    except ValueError as e:
        raise CheckpointError(f"checkpoint step {manifest.step}: {e}") from e
    cursor.load_state_dict(manifest.trainer["cursor"])
    rng = sd.get(f"rng.rank{rank}")
    if rng is not None:
        _restore_rng(rng, manifest.step)


class Checkpointing:
    """Connects a running job (model, optimizer, cursor) to the checkpoint service."""

    def __init__(
        self,
        cfg: Config,
        par: Parallel,
        cursor: DataCursor,
        events: EventLog,
        model_record: dict[str, Any] | None = None,
    ):
        self.cfg = cfg
        self.par = par
        self.cursor = cursor
        self.events = events
        #: what the model was built from beyond [model]: every save records it, a resume compares it
        self.model_record = dict(model_record or {})
        self.rank = dist.get_rank()
        self.round = current_round()
        self.job = worker_job_id(cfg)
        #: the LR schedule in force: the configured one, or what the last resume decided
        #: (``train.on_schedule_change``); every save records it
        self.schedule = Schedule.of(cfg)
        c = cfg.checkpoint
        self.manager = CheckpointManager(
            url=c.uri,
            options=StorageOptions(endpoint_url=c.endpoint_url, region=c.region),
            async_mode=c.async_mode,
            when_busy=c.when_busy,
            digest=c.digest,
            hmac_key_env=c.hmac_key_env,
            job=self.job,
            keep_last=c.keep_last,
            keep_every=c.keep_every,
            gc_grace_s=c.gc_grace_s,
            on_no_loadable_step=c.on_no_loadable_step,
            on_event=events.emit,
            device_type=par.device.type,
            local_cache_dir=c.local_cache_dir,
            fence=fence.from_env(),  # whenever an agent set one up: a round-0 worker there is stale too
            after_fence=maybe_pause_after_fence,
            before_clear=maybe_pause_before_clear,
            before_gc=maybe_pause_before_gc,
            round=self.round,  # fences its corrupt markers and retention (saves carry it too)
        )
        if not c.hmac_key_env and self.manager.storage.protocol not in ("file", "memory") and self.rank == 0:
            self._warn_unsigned()

    def _warn_unsigned(self) -> None:
        """Shared storage without an HMAC key: say once, at start, what is not protected."""
        log.warning(
            "checkpoints under %s are not signed (checkpoint.hmac_key_env is empty): digests catch damage, "
            "but anyone who can write there can replace a step with other weights that this job will "
            "load. Set checkpoint.hmac_key_env to the name of a variable holding a secret key "
            "(e.g. `export FTRAIN_CKPT_KEY=$(openssl rand -hex 32)`).",
            self.cfg.checkpoint.uri,
        )
        self.events.emit(ev.CkptUnsigned(uri=self.cfg.checkpoint.uri))

    # -- save ---------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """This rank's state dict, as a save writes it (:func:`training_state`)."""
        return training_state(self.par, self.rank)

    def fields(self) -> dict[str, Any]:
        """The manifest fields of a save now (:func:`manifest_fields`)."""
        return manifest_fields(
            self.cfg, self.par, self.cursor, self.round, schedule=self.schedule, model_record=self.model_record
        )

    def due(self, steps_done: int) -> bool:
        interval = self.cfg.checkpoint.interval
        return interval > 0 and steps_done % interval == 0

    def save(self, steps_done: int, *, sync: bool = False) -> bool:
        return self.manager.save(steps_done, self.state(), self.fields(), sync=sync)

    def poll(self) -> SaveStatus:
        return self.manager.poll()

    def finish(self, steps_done: int) -> SaveStatus:
        """Final synchronous save (unless this step is already saved), then wait for uploads."""
        status = self.manager.wait()
        if self.cfg.checkpoint.final_save and status.last_committed_step != steps_done:
            self.save(steps_done, sync=True)
        return self.manager.wait()

    # -- load ---------------------------------------------------------------------------
    def resume(self) -> Manifest | None:
        """Load the newest verified checkpoint (or checkpoint.load_step) into model, optimizer,
        cursor and RNG; returns its manifest, or None when starting fresh. Its LR schedule and
        the configured one decide :attr:`schedule` (:meth:`schedule_decision`) before any file is
        read: :class:`~ftrain.optim.ScheduleChangeError` under ``train.on_schedule_change=fail``."""
        holder: dict[str, Any] = {}
        self.events.emit(ev.ResumeStarted())

        def build(manifest: Manifest) -> dict[str, Any]:
            recorded = manifest.config.get("model")
            check_resumed_model(  # WeightsConfigError: the model computes otherwise than the step's did
                recorded if isinstance(recorded, dict) else {}, self.cfg.model, self.model_record, manifest.step
            )
            try:
                holder["decision"] = self.schedule_decision(manifest)
            except ManifestError:  # a malformed record: validate_trainer_state refuses the step (fall back)
                holder.pop("decision", None)
            try:  # other data than the step's: DataChangeError under data.on_mixture_change=fail, before any read
                self.cursor.check_resume(manifest.trainer.get("cursor"))
            except DataChangeError:
                raise
            except DataError:  # a malformed cursor: validate_trainer_state refuses the step (fall back)
                pass
            holder["sd"] = load_target(self.par, self.rank, manifest)
            return holder["sd"]

        try:
            manifest = self.manager.load(
                build, load_step=self.cfg.checkpoint.load_step, validate=validate_trainer_state, writer=TRAIN_WRITER
            )
        except NoLoadableStepError as e:
            self.events.emit(ev.ResumeFailed(refused=[str(r)[:1000] for r in e.refusals], load_step=e.load_step))
            log.error("ftrain: cannot resume: %s", e)
            raise
        except ForeignStepError as e:  # another kind of loop's step: intact, refused, never marked
            self.events.emit(ev.ResumeFailed(refused=[str(e)[:1000]], load_step=self.cfg.checkpoint.load_step))
            log.error("ftrain: cannot resume: %s", e)
            raise
        except WeightsConfigError as e:  # the model would compute otherwise than the step's did
            self.events.emit(ev.ResumeFailed(refused=[str(e)[:1000]], load_step=self.cfg.checkpoint.load_step))
            raise
        except (ScheduleChangeError, DataChangeError) as e:  # *.on_*_change=fail: said by the CLI, fatal
            self.events.emit(
                ev.ResumeFailed(refused=[f"step {e.step}: {e}"[:1000]], load_step=self.cfg.checkpoint.load_step)
            )
            raise
        if manifest is None:
            return None
        decision: ScheduleDecision = holder.get("decision") or self.schedule_decision(manifest)
        apply_loaded(self.par, self.cursor, self.rank, manifest, holder["sd"])
        self.schedule = decision.schedule
        if manifest.config_hash != self.cfg.digest():
            log.info(
                "resuming step %d saved with a different config (hash %s, now %s)",
                manifest.step,
                manifest.config_hash,
                self.cfg.digest(),
            )
        self._say_schedule(manifest.step, decision)
        self.manager.status.last_committed_step = max(self.manager.status.last_committed_step, manifest.step)
        self.events.emit(
            ev.Resumed(
                step=manifest.step,
                from_world_size=manifest.world_size,
                world_size=self.par.layout.world_size,
                round=self.round,
                schedule=decision.schedule.to_dict(),
                schedule_outcome=decision.outcome,
                schedule_changes=[str(c) for c in decision.changes],
            )
        )
        return manifest

    def schedule_decision(self, manifest: Manifest) -> ScheduleDecision:
        """The LR schedule a resume from ``manifest``'s step goes on with (see :func:`ftrain.optim.decide_schedule`)."""
        return decide_schedule(
            recorded_schedule(manifest),
            Schedule.of(self.cfg),
            self.cfg.train.on_schedule_change,
            step=manifest.step,
        )

    def _say_schedule(self, step: int, decision: ScheduleDecision) -> None:
        """A warning (rank 0) when the resumed step's schedule is not simply the configured one."""
        if self.rank != 0:
            return
        changed = ", ".join(map(str, decision.changes))
        if decision.outcome == KEPT:
            log.warning(
                "resuming step %d: the configured LR schedule differs from the saved one (%s); "
                "train.on_schedule_change=keep: the saved schedule goes on (it reaches its floor at step %d; "
                "training runs to train.steps=%d)",
                step,
                changed,
                decision.schedule.total_steps,
                self.cfg.train.steps,
            )
        elif decision.outcome == RESCALED:
            log.warning(
                "resuming step %d: the LR schedule changes (%s); train.on_schedule_change=rescale: the configured "
                "schedule applies from step %d",
                step,
                changed,
                step,
            )
        elif decision.outcome == UNRECORDED:
            log.warning(
                "resuming step %d: the checkpoint records no LR schedule (saved by an older ftrain): taking it as "
                "the configured one (%s); the next checkpoints record it",
                step,
                decision.schedule,
            )

    def close(self, *, abandon: bool = False) -> None:
        """``abandon``: see :meth:`ftrain.checkpoint.manager.CheckpointManager.close`."""
        self.manager.close(abandon=abandon)
