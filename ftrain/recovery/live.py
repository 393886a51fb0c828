"""A live worker: one process that serves round after round without restarting.

``ftrain worker`` is what an agent under ``--recovery live`` starts, ahead of need (a spare:
Python, torch and ftrain imported, the config loaded). :func:`serve` then waits for an
:class:`~ftrain.contract.control.Assignment` in its control file and, for each round it is given
(the loop is :func:`ftrain.recovery.rounds.serve_rounds`, the one :meth:`ftrain.Session.run` serves
its rounds with; what is ``ftrain train``'s is :class:`_TrainerRounds`):

1. sets torchrun's environment contract for its rank (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
   ...) and ``FTRAIN_ROUND``, and joins the round's process group (a store under the round's
   master port: a new store per round, so a worker of an older round cannot join);
2. builds the trainer for the round's layout (the strategy re-wrapped at the new world size);
3. agrees with its peers on the state to go on from (:func:`restore`, through the choice a
   session's rounds make: :func:`ftrain.session_live.restore_round`): the newest step that a
   rank holds in memory, handed to the ranks that lack it over the process group when the
   strategy replicates everything (``live_peer``; ``memory`` when every rank already holds
   it), else the newest verified checkpoint loaded in-process (``storage``);
4. trains until the job is done — or until a collective fails (a peer died) or the agent assigns
   a newer round (all ranks leave at the same step boundary). Then it keeps what it holds
   (:class:`~ftrain.recovery.peer_state.HeldState`: the last *complete* step; a half-done step is
   discarded and its batch handed out again), aborts and destroys the process group, tells its
   agent it is ``recovering`` and waits for the next assignment.

What must stay true: a worker never trains in a round older than one it has seen, and never
mixes steps: the ranks go on from one step, and a rank that held an older one takes the newer
step whole from a peer, checked against the digest its holder announced; replicas that hold the
same step with different digests make every rank fall back to storage, and so does a transfer
that any rank refuses (a header unlike its own state, another step, a digest that does not
match): the ranks agree on that before any of them goes on, so none waits alone in a
collective. An error that is not a peer's failure (a bug, bad data, a non-finite loss under
``halt``) ends the worker as under torchrun, with its exit message. Fencing is the round's: the
checkpoint fence and the event log read ``FTRAIN_ROUND``, set before the round's trainer is built.
"""

from __future__ import annotations

import functools
import importlib
import logging
import time

import torch
from torch import nn

from ftrain.agent_link import flight_recorder, heartbeat, stop_request
from ftrain.checkpoint.storage import Storage, StorageOptions
from ftrain.config import Config, ModelConfig
from ftrain.contract.control import Assignment, ControlFile
from ftrain.contract.worker_env import WorkerEnv
from ftrain.data import build_source
from ftrain.distributed import abort_distributed, init_distributed, select_device, select_dtype
from ftrain.model import build_model, count_parameters
from ftrain.models.layout import logits_of
from ftrain.recovery.memory_tier import MemoryTier
from ftrain.recovery.peer_state import HeldState, Restored
from ftrain.recovery.round_control import StopRequested, newer_round_assigned, service_ports
from ftrain.recovery.rounds import RoundOver, said_left, said_restored, serve_rounds
from ftrain.session_live import restore_round
from ftrain.train import Trainer, finish, say_goodbye

log = logging.getLogger(__name__)

#: what strategies import lazily: a spare imports it before it is needed
WARM_MODULES = ("ftrain.parallel.ddp", "ftrain.parallel.fsdp", "ftrain.parallel.tp", "ftrain.parallel.deterministic")


def hold(trainer: Trainer) -> HeldState:
    """What ``trainer`` holds at its last step boundary (:meth:`Trainer.mark_boundary`): a step
    whose update was applied since holds only the step (its batch goes out again from a peer's
    cursor or storage's)."""
    held = trainer.watch.held(trainer.committed_step())
    assert held is not None, "a trainer marks a boundary before its first step"
    return held


def restore(trainer: Trainer, held: HeldState | None, committed_step: int = -1) -> Restored:
    """Collective: agree on the step to go on from and put that state into ``trainer``
    (:func:`ftrain.session_live.restore_round`, a session's choice: a live peer, the memory tier,
    else the newest verified checkpoint); ``committed_step``: the newest commit record the round's
    assignment saw in etcd (the same on every rank): when it is newer than any rank knows of,
    storage's listing decides, and state held in memory (or in the tier) that is older is not
    gone on from."""
    ckpt = trainer.ckpt

    def heal(committed: int) -> tuple[int, int] | None:
        step = trainer.tier_restore(committed)
        return None if step is None else (step, committed)

    newest_listed = ckpt.manager.newest_committed_step if ckpt is not None else None
    got = restore_round(held, trainer.parts, trainer.device, committed_step, heal, newest_listed, trainer.events)
    if got is not None:
        restored, committed = got
        if ckpt is not None:
            status = ckpt.manager.status
            status.last_committed_step = max(status.last_committed_step, committed)
        trainer.mark_boundary()
        return restored
    manifest = ckpt.resume() if ckpt is not None and trainer.cfg.checkpoint.resume else None
    trainer.mark_boundary()
    return Restored("storage" if manifest is not None else "fresh", manifest.step if manifest else 0)


#: a model larger than this in fp32 is not what a spare warms up with: it is trained only under a
#: layout that gives each rank part of it (a 70B Llama), and a whole copy could not fit
WARM_UP_MODEL_MAX_BYTES = 1 << 30


def warm_up_model(cfg: ModelConfig) -> nn.Module:
    """The model a spare warms up with, on the CPU: the configured one up to
    :data:`WARM_UP_MODEL_MAX_BYTES`, else the built-in GPT of the default sizes (its kernels are
    not the model's, but the imports, the allocator and the CUDA context are paid as well)."""
    try:
        with torch.device("meta"):
            size_bytes = 4 * count_parameters(build_model(cfg))
    except Exception:  # noqa: BLE001 - a factory that cannot build on the meta device: count it built
        size_bytes = 0
    if size_bytes <= WARM_UP_MODEL_MAX_BYTES:
        return build_model(cfg)
    log.info("warming up with the built-in GPT: the model (%.1f GiB in fp32) is trained sharded", size_bytes / 2**30)
    return build_model(ModelConfig())


def warm_up(cfg: Config, device: torch.device) -> None:
    """Pay, before any assignment, what a process's first trainer would pay on the critical path:
    the lazy imports (the first optimizer imports ``torch._dynamo``: 3 s here), the parallel
    wrappers' modules, the checkpoint storage's client (s3fs), and the first forward, backward and
    optimizer step (kernels, allocator; on a GPU the CUDA context). Nothing is kept (the data
    source is built once by :func:`serve`; :func:`~ftrain.recovery.rounds.serve_rounds` times it)."""
    for module in WARM_MODULES:
        importlib.import_module(module)
    if cfg.checkpoint.uri:
        Storage(
            cfg.checkpoint.uri, StorageOptions(endpoint_url=cfg.checkpoint.endpoint_url, region=cfg.checkpoint.region)
        )
    model = warm_up_model(cfg.model).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), **cfg.optim.adamw_kwargs())
    tokens = torch.zeros(1, min(8, cfg.model.seq_len) + 1, dtype=torch.long, device=device)
    logits = logits_of(model(tokens[:, :-1]))
    torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten()).backward()
    optimizer.step()


def serve(cfg: Config) -> None:
    """Serve rounds until the job is done (returns), an assignment says stop (returns), or an
    error that is not a peer's failure (raised, after the exit message)."""
    env = WorkerEnv.from_env()
    if not env.control:
        raise RuntimeError("ftrain worker needs FTRAIN_CONTROL (it is started by ftrain agent --recovery live)")
    control = ControlFile(env.control)
    flight_recorder.enable(cfg.logging.flight_recorder_entries)
    device = select_device(cfg.train)
    hb = heartbeat.from_env(-1, 0)
    stop_request.install()  # before anything slow: a SIGTERM from here on is kept (see that module)
    keep_ports = service_ports(cfg.checkpoint.endpoint_url, *env.etcd)
    rounds = _TrainerRounds(cfg, select_dtype(cfg.train, device), control, hb, keep_ports)
    spare = functools.partial(warm_up, cfg, device)
    serve_rounds(rounds, control, hb, keep_ports, cfg.parallel.timeout_s, stop_request.requested, spare)


class _TrainerRounds:
    """``ftrain train``'s part of the engine of rounds (:mod:`ftrain.recovery.rounds`): a
    :class:`Trainer` per round, restored by :func:`restore`, trained until the job is done."""

    def __init__(
        self,
        cfg: Config,
        dtype: torch.dtype,
        control: ControlFile,
        hb: heartbeat.Heartbeat | None,
        keep_ports: set[int],
    ):
        self.cfg, self.dtype, self.control, self.hb, self.keep_ports = cfg, dtype, control, hb, keep_ports
        # the same for every round: built once, before any
        self.source = build_source(cfg.data, cfg.model)
        # serves every round of this process (Trainer uses it where it helps); with checkpoint.memory_dir
        # its snapshots also outlive the process: a round whose every worker is new restores from them
        self.tier = MemoryTier(cfg, cfg.checkpoint.memory_dir)
        self.held: HeldState | None = None  #: what this rank holds between rounds
        self.trainer: Trainer | None = None
        self.restored = False  #: this round's trainer holds the agreed state (restore completed)
        self.device = torch.device("cpu")
        self.began = 0.0
        self.assignment: Assignment | None = None

    def enter(self, assignment: Assignment) -> int:
        # this round's device: cuda:<local rank> on a GPU host (a spare learns its local rank only now)
        self.device = select_device(self.cfg.train)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.trainer, self.restored, self.began, self.assignment = None, False, time.monotonic(), assignment
        return self.held.step if self.held else -1

    def step_time_s(self) -> float:
        return self.trainer.last_step_time_s if self.trainer else 0.0

    def serve(self, assignment: Assignment) -> RoundOver:
        cfg, held, began = self.cfg, self.held, self.began
        rank, world_size, local_world = init_distributed(cfg.parallel, self.device)
        joined = time.monotonic()
        newer = newer_round_assigned(self.control, assignment.round)
        args = (cfg, self.device, self.dtype, rank, world_size, local_world, self.hb, newer, self.source, self.tier)
        trainer = self.trainer = Trainer(*args)
        built = time.monotonic()
        restored = restore(trainer, held, assignment.committed_step)
        held_step = held.step if held else -1
        said_restored(
            trainer.events,
            restored,
            world_size=world_size,
            held_step=held_step,
            began=began,
            joined=joined,
            built=built,
        )
        self.held, self.restored = None, True  # the trainer holds it now
        del held
        result = trainer.run(resume=False)
        if not result.stopped_early or trainer.stop_requested:
            return RoundOver(done=True, value=result)
        # another node's drain stopped the round: this process keeps its state and serves the
        # round formed without that node
        return RoundOver(done=False, why="another node drained")

    def finish(self, over: RoundOver) -> None:
        trainer, result = self.trainer, over.value
        assert trainer is not None
        if not result.stopped_early:  # the job is done
            finish(trainer, result)
            self.tier.close(job_done=True)
            return
        # this node drains (ranks stop together, after the step's save). The other nodes' workers
        # leave the round without a barrier, so this one must not wait in one for them: it failed
        # there once they were gone, and its node's drain was taken for a failure (exit 1, a
        # worker_exit round, the restart budget, backoff)
        finish(trainer, result, teardown=lambda: abort_distributed(self.keep_ports))
        self.tier.close(job_done=False)

    def failed(self, error: BaseException) -> None:
        say_goodbye(self.hb, self.trainer, error)
        if self.trainer is not None:
            self.trainer.close()

    def stopped(self, why: StopRequested) -> None:
        """Asked to stop while in no round: nothing to save (a round's drain saves); the worker
        exits 0 and its agent, draining, sees it stop."""
        log.warning("%s: leaving", why)
        self.tier.close(job_done=False)

    def leave(self, why: BaseException | str) -> None:
        """Keep what this rank holds, end the round's process groups (aborted first, so that no
        peer stays blocked on this rank), abandon a checkpoint save still in flight (one blocked
        on a pair whose peer is gone, as across a partition, would otherwise hold this rank until
        the group's timeout; it cannot commit for an old round anyway). What this rank holds is
        its trainer's last complete step only if that trainer's restore completed: one that
        failed during it holds a fresh or half-loaded model, and what the rank held before the
        round is still the truth."""
        trainer, self.trainer = self.trainer, None
        if trainer is not None and self.restored:
            self.held = hold(trainer)
        held = self.held
        abort_distributed(self.keep_ports)
        assert self.assignment is not None
        said_left(self.assignment, why, held.step if held else -1, self.hb, trainer.events if trainer else None)
        if trainer is not None:
            trainer.close(broken=True)


__all__ = ["serve", "restore", "hold", "Restored"]
