"""ftrain's checkpoints, resume and the node agent's supervision for a Hugging Face
``transformers.Trainer`` (docs/hf-trainer.md).

```python
import ftrain
from ftrain.integrations.hf_trainer import FtrainTrainer

args = TrainingArguments(..., save_strategy="no")        # ftrain saves; the Trainer writes nothing
with ftrain.Session("s3://bucket/run", interval_steps=500) as session:
    trainer = FtrainTrainer(session, model=model, args=args, train_dataset=data)
    trainer.train()                                      # resumes after the newest commit, if any
```

Under ``ftrain agent --recovery live`` the same lines go into a function of one round that
``ftrain.Session(...).run(train)`` calls again, in the same process, for each new round (the
``TrainingArguments`` created inside it: they set accelerate's process state up for the round's
group); a new round's Trainer goes on from a live peer's state (docs/hf-trainer.md).

**Why a subclass, not only a callback.** A ``TrainerCallback`` sees each step end, so the callback
here saves (``session.step`` at ``on_step_end``, ``session.finish`` at ``on_train_end``), but a
callback cannot resume exactly: the Trainer creates the optimizer and the scheduler inside
``train()``, and decides its step, its epoch and the batches to skip from
``train(resume_from_checkpoint=...)`` before the first callback (``on_train_begin``) runs.
:meth:`FtrainTrainer.train` therefore creates the optimizer and the scheduler first (the Trainer's
public ``create_optimizer_and_scheduler``; the Trainer keeps what exists), loads the newest
committed step into them and the model, and hands the Trainer a directory holding only the saved
``trainer_state.json``: the Trainer's own resume path restores its step, epoch and callback
states and skips the batches already trained. Its loaders of model, optimizer, scaler and RNG
files are told that this directory holds nothing for them (ftrain loaded those it has).

**What is saved** (every ``interval_steps`` and after the last step, as a session saves): the
model (DCP, each rank its part), the optimizer (AdamW's moments), the LR scheduler, fp16's
``GradScaler``, and the ``TrainerState`` (``global_step``, epoch, log history, the states of
stateful callbacks) in the step's state file (:mod:`ftrain.session_state`: exact, NaN losses too;
a log history of every step stays loadable far past the 16 MiB that the manifest once bounded).
``global_step`` is the data position: the Trainer's sampler is seeded
(``accelerator_config.use_seedable_sampler``, on by default), so the batches after it are the same
in a new process at the same global batch size. Not saved: RNG states
(dropout draws other masks after a resume; a model that draws none resumes bitwise).

**Metrics.** With ``Session(metrics_path=...)`` each step's line carries its ``loss``: rank 0's,
summed over the step's micro-batches as the Trainer scales them (the Trainer's own logged loss is
that, averaged over its logging steps and the ranks): ``ftrain report``'s loss curve.

**Invariants.** ``session.step`` runs once per optimizer update with ``global_step``; a manifest's
step is the ``global_step`` its ``TrainerState`` holds; the Trainer writes no checkpoints of its
own. Refused, each with a message that says the fix: ``save_strategy`` other than ``"no"``,
``resume_from_checkpoint``, ``model_init``, ``auto_find_batch_size``, hyper-parameter search,
DeepSpeed and FSDP (the optimizer is created after the model is sharded there); one process and
DDP are what this supports and tests.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import tempfile
from typing import Any

from transformers import Trainer, TrainerCallback
from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import TrainOutput

from ftrain.session import Session, SessionError

log = logging.getLogger(__name__)

#: the file the Trainer's resume path reads its TrainerState from
TRAINER_STATE_NAME = "trainer_state.json"


class HFTrainerError(SessionError):
    """A Trainer set up in a way this integration cannot checkpoint or resume; the message says the fix."""


class FtrainTrainer(Trainer):
    """A ``transformers.Trainer`` whose checkpoints and resume are ``session``'s (see the module doc).

    ``session``: a started :class:`ftrain.Session` (``interval_steps`` sets how often it saves);
    every other argument is the Trainer's. After :meth:`train`, ``ftrain_resumed_step`` is the
    step it resumed after (0: it started fresh) and ``ftrain_state`` the mapping the session saves.
    """

    def __init__(self, session: Session, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        _check_supported(self)
        if not isinstance(session, Session):
            raise HFTrainerError(
                f"FtrainTrainer(session=...): an ftrain.Session, not {type(session).__name__} "
                "(FtrainTrainer(session, model=..., args=...))"
            )
        if not session.started:
            raise HFTrainerError(
                "FtrainTrainer(session=...): the session is not started; start it before the Trainer "
                "(`with ftrain.Session(...) as session:` or ftrain.Session(...).start())"
            )
        self.ftrain_session = session
        self.ftrain_resumed_step = 0
        self.ftrain_state: dict[str, Any] = {}
        self._ftrain_resume_dir = ""
        self._ftrain_step_loss: Any = None
        self.add_callback(_SessionCallback(self))

    def train(  # type: ignore[override]
        self, resume_from_checkpoint: str | bool | None = None, trial: Any = None, **kwargs: Any
    ) -> TrainOutput:
        """Load the newest committed step (if any), then train from there; the session saves every
        ``interval_steps`` and after the last step."""
        if resume_from_checkpoint not in (None, False):
            raise HFTrainerError(
                f"FtrainTrainer.train(resume_from_checkpoint={resume_from_checkpoint!r}): ftrain resumes by itself "
                "from the newest committed step under the session's checkpoint root; call train() without it"
            )
        if trial is not None:
            raise HFTrainerError("FtrainTrainer.train(trial=...): hyper-parameter search is not supported")
        max_steps = self.args.max_steps
        if max_steps <= 0:
            max_steps = self.set_initial_training_values(self.args, self.get_train_dataloader())[-1]
        if self.optimizer is None or self.lr_scheduler is None:
            self.create_optimizer_and_scheduler(num_training_steps=max_steps)
            # train() would build a new scheduler in place of one it made itself; this one is restored
            self._created_lr_scheduler = False
        entry = _TrainerStateEntry(self)
        state: dict[str, Any] = {"model": self.model, "optim": self.optimizer, "sched": self.lr_scheduler}
        if self.accelerator.scaler is not None:
            state["scaler"] = self.accelerator.scaler
        state["trainer"] = entry
        self.ftrain_state = state
        step = self.ftrain_session.load(state)
        self.ftrain_resumed_step = step
        if step == 0:
            return super().train(**kwargs)
        saved = entry.trainer_state_to_resume(step)
        if step >= max_steps:
            log.info("step %d is committed and max_steps is %d: nothing to train", step, max_steps)
            return TrainOutput(step, 0.0, {})
        self._ftrain_resume_dir = tempfile.mkdtemp(prefix="ftrain-hf-resume-")
        try:
            with open(os.path.join(self._ftrain_resume_dir, TRAINER_STATE_NAME), "w", encoding="utf-8") as f:
                json.dump(saved, f)
            log.info("resumed after step %d: the Trainer skips the batches of steps 1..%d", step, step)
            return super().train(resume_from_checkpoint=self._ftrain_resume_dir, **kwargs)
        finally:
            shutil.rmtree(self._ftrain_resume_dir, ignore_errors=True)
            self._ftrain_resume_dir = ""

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's micro-batch step; its loss (scaled for gradient accumulation, as the Trainer
        scales it) adds up to the optimizer step's loss, this rank's, which the session's metrics
        line carries as ``loss`` (``Session(metrics_path=...)``; no device sync on other ranks)."""
        loss = super().training_step(*args, **kwargs)
        self._ftrain_step_loss = loss if self._ftrain_step_loss is None else self._ftrain_step_loss + loss
        return loss

    def ftrain_take_step_loss(self) -> Any:
        """The loss summed since the last optimizer step (None before any), and a fresh sum."""
        loss, self._ftrain_step_loss = self._ftrain_step_loss, None
        return loss

    # The Trainer's resume path looks for these files in the directory train() gave it; ftrain's
    # directory holds only trainer_state.json (the rest was loaded from ftrain's checkpoint).
    def _from_ftrain(self, checkpoint: str | None) -> bool:
        return bool(self._ftrain_resume_dir) and checkpoint == self._ftrain_resume_dir

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        if not self._from_ftrain(resume_from_checkpoint):
            super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if not self._from_ftrain(checkpoint):
            super()._load_optimizer_and_scheduler(checkpoint)

    def _load_scaler(self, checkpoint: str | None) -> None:
        if not self._from_ftrain(checkpoint):
            super()._load_scaler(checkpoint)

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if not self._from_ftrain(checkpoint):
            super()._load_rng_state(checkpoint)


def _check_supported(trainer: Trainer) -> None:
    """HFTrainerError for a Trainer set up in a way this integration cannot checkpoint or resume."""
    args = trainer.args
    if args.save_strategy != "no":
        strategy = getattr(args.save_strategy, "value", args.save_strategy)
        raise HFTrainerError(
            f"TrainingArguments(save_strategy={strategy!r}): the Trainer would write checkpoints of its own beside "
            "ftrain's; pass save_strategy='no' (ftrain saves every Session(interval_steps=N) steps and after the last)"
        )
    if trainer.model_init is not None:
        raise HFTrainerError(
            "FtrainTrainer(model_init=...): train() would build a new model after ftrain loaded the checkpoint "
            "into the old one; pass model=... instead"
        )
    if args.auto_find_batch_size:
        raise HFTrainerError(
            "TrainingArguments(auto_find_batch_size=True): a retry with a smaller batch changes the steps that the "
            "restored scheduler and data position count; set a batch size"
        )
    if trainer.is_deepspeed_enabled or trainer.is_fsdp_enabled or trainer.is_fsdp_xla_enabled:
        raise HFTrainerError(
            "FtrainTrainer with DeepSpeed or FSDP: not supported yet (the Trainer creates the optimizer after it "
            "shards the model there); use one process or DDP, or ftrain.Session in your own loop (docs/library.md)"
        )


class _TrainerStateEntry:
    """The session's ``trainer`` entry: the TrainerState (and the global batch size it was
    trained at); ``loaded`` is what :meth:`load_state_dict` got."""

    def __init__(self, trainer: FtrainTrainer):
        self.trainer = trainer
        self.loaded: dict[str, Any] = {}

    def state_dict(self) -> dict[str, Any]:
        trainer = self.trainer
        # its fields as they are, not dataclasses.asdict's deep copy (9 s for 160k log entries on a
        # busy box): the session encodes them at once, and the encoding is the copy it keeps
        state = {f.name: getattr(trainer.state, f.name) for f in dataclasses.fields(trainer.state)}
        exported: dict[str, Any] = {}
        for callback in trainer.callback_handler.callbacks:  # as the Trainer saves them
            if isinstance(callback, ExportableState):
                name = type(callback).__name__
                exported[name] = [*exported[name], callback.state()] if name in exported else [callback.state()]
        state["stateful_callbacks"] = {
            **state["stateful_callbacks"],
            **{name: states[0] if len(states) == 1 else states for name, states in exported.items()},
        }
        return {
            "trainer_state": state,
            "total_train_batch_size": trainer.get_total_train_batch_size(trainer.args),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loaded = state

    def trainer_state_to_resume(self, step: int) -> dict[str, Any]:
        """The loaded TrainerState (checked against ``step``), to write as ``trainer_state.json``."""
        saved = self.loaded.get("trainer_state")
        if not isinstance(saved, dict) or saved.get("global_step") != step:
            raise HFTrainerError(
                f"step {step}'s trainer state does not hold global_step {step} (it holds "
                f"{saved.get('global_step') if isinstance(saved, dict) else saved!r}): it was not written by "
                "FtrainTrainer; give the session a checkpoint root of its own"
            )
        then = self.loaded.get("total_train_batch_size")
        now = self.trainer.get_total_train_batch_size(self.trainer.args)
        if then != now:
            log.warning(
                "step %d was trained at a global batch of %s sequences and this run's is %s: the Trainer skips %d of "
                "its own batches, so the data position is not the saved one",
                step,
                then,
                now,
                step,
            )
        return saved


class _SessionCallback(TrainerCallback):
    """The session's part of each step: a heartbeat and, every ``interval_steps``, a save; the
    final save after the last step."""

    def __init__(self, trainer: FtrainTrainer):
        self.trainer = trainer

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        loss = self.trainer.ftrain_take_step_loss()
        metrics = None if loss is None else {"loss": loss}
        self.trainer.ftrain_session.step(state.global_step, self.trainer.ftrain_state, metrics=metrics)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.trainer.ftrain_session.finish(state.global_step, self.trainer.ftrain_state)
