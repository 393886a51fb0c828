"""A session's load from storage: the newest verified committed step (or the one asked for)
into the loop's state, told to the job's event log as ``ftrain train``'s resumes are
(``resume_started``, then ``resumed`` or ``resume_failed``): the chaos invariants and the recovery
bench read a user's loop's resumes where they read the trainer's."""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist

from ftrain.checkpoint.loading import ForeignStepError, NoLoadableStepError
from ftrain.checkpoint.manager import CheckpointManager
from ftrain.checkpoint.manifest import Manifest
from ftrain.contract import events as ev
from ftrain.session_state import WRITER, SessionError, StateParts, StateReader, validate


def load_stored(
    manager: CheckpointManager,
    parts: StateParts,
    *,
    step: int,
    events: ev.EventLog,
    check: Callable[[Manifest], object] | None = None,
) -> Manifest | None:
    """Load step ``step`` (-1: the newest committed one that verifies) into ``parts``; its
    manifest, or None when nothing was ever committed. ``check(manifest)``, the loop's
    (``Session(check_resume=...)``), runs on every rank before any file of the step is read, after
    its manifest and the session's state file verified: what it raises refuses the resume.
    Raises :class:`SessionError` for a step another kind of loop wrote or one of another shape
    than ``parts`` and :class:`~ftrain.checkpoint.loading.NoLoadableStepError` when steps exist but
    none can be loaded (none of these marks a step corrupt); each failure after a
    ``resume_failed`` event."""
    reader = StateReader()

    def build(manifest: Manifest) -> dict:
        if check is not None:
            check(manifest)
        parts.check_fits(manifest, reader.saved(manifest))  # a step of another shape is not corrupt: not marked
        return parts.state_dict(manifest)

    events.emit(ev.ResumeStarted())
    try:
        manifest = manager.load(build, load_step=step, validate=validate, writer=WRITER, side=reader)
    except Exception as e:
        refused = [str(r) for r in e.refusals] if isinstance(e, NoLoadableStepError) else [f"{type(e).__name__}: {e}"]
        events.emit(ev.ResumeFailed(refused=[r[:1000] for r in refused], load_step=step))
        if isinstance(e, ForeignStepError):  # ftrain train's step: intact, refused, never marked
            raise SessionError(str(e)) from e
        raise
    if manifest is None:
        return None
    saved = reader.saved(manifest)
    assert saved is not None  # validate() refused the step otherwise (it would not have loaded)
    parts.apply(manifest, saved)
    world_size = dist.get_world_size()
    events.emit(
        ev.Resumed(step=manifest.step, from_world_size=manifest.world_size, world_size=world_size, round=events.round)
    )
    return manifest
