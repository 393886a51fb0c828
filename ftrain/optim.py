"""Optimizer parameter groups, the learning-rate schedule, and what a resume does when it changed.

The schedule is a pure function of the step, so resuming needs no scheduler state: warmup
linearly to the peak, then cosine-decay to ``min_lr_ratio`` of the peak at ``train.steps``.
:class:`Schedule` names what it depends on; the peak scales with the data-parallel size
(``optim.lr_scaling``), so a resize is never a change of schedule.

What must stay true: a resume never reshapes the schedule silently. Each checkpoint records the
schedule in force (:meth:`Schedule.to_dict`, in the manifest's trainer state), and
:func:`decide_schedule` compares it with the configured one: unchanged, it goes on; changed,
``train.on_schedule_change`` decides (``fail``: :class:`ScheduleChangeError` naming each key,
old -> new; ``keep``: the saved schedule goes on, to the new ``train.steps``, at its floor past
its end; ``rescale``: the configured one applies from the resumed step). A checkpoint that
records none (an older ftrain's) is taken as having the configured schedule.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any

from torch import nn

from ftrain.config import LR_SCALINGS
from ftrain.contract.config import ConfigError

if TYPE_CHECKING:
    from ftrain.config import Config, OptimConfig


def param_groups(model: nn.Module, optim: OptimConfig) -> list[dict[str, Any]]:
    """Weight decay on matrices only; biases, norms and embeddings are not decayed."""
    embeddings = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 and id(p) not in embeddings else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": optim.weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def scaled_lr(lr: float, lr_scaling: str, base_world_size: int, dp_size: int) -> float:
    """``lr`` scaled to ``dp_size`` data-parallel ranks (``optim.lr_scaling``: none, linear, sqrt)."""
    ratio = dp_size / base_world_size
    if lr_scaling == "linear":
        return lr * ratio
    if lr_scaling == "sqrt":
        return lr * math.sqrt(ratio)
    return lr


def peak_lr(optim: OptimConfig, dp_size: int) -> float:
    return scaled_lr(optim.lr, optim.lr_scaling, optim.base_world_size, dp_size)


def lr_at(step: int, *, peak: float, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """Learning rate for optimizer step ``step`` (0-based)."""
    if warmup_steps and step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    floor = peak * min_lr_ratio
    return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def set_lr(param_groups_: Iterable[dict[str, Any]], lr: float) -> None:
    for group in param_groups_:
        group["lr"] = lr


SCHEDULE_POLICIES = ("fail", "keep", "rescale")


@dataclass(frozen=True, kw_only=True, slots=True)
class Schedule:
    """Everything the learning rate of a step depends on besides the step and the data-parallel
    size; each field is the config key of :data:`SCHEDULE_KEYS`."""

    total_steps: int
    """``train.steps``: where the cosine reaches the floor (the LR stays there after it)."""
    warmup_steps: int
    """``optim.warmup_steps``."""
    lr: float
    """``optim.lr``: the peak before world-size scaling."""
    min_lr_ratio: float
    """``optim.min_lr_ratio``: the floor as a fraction of the peak."""
    lr_scaling: str
    """``optim.lr_scaling``: how the peak scales with the data-parallel size."""
    base_world_size: int
    """``optim.base_world_size``: the data-parallel size at which the peak is ``lr``."""

    def __post_init__(self) -> None:
        problem = _schedule_problem(self)
        if problem is not None:
            raise ValueError(problem)

    @classmethod
    def of(cls, cfg: Config) -> Schedule:
        """The schedule ``cfg`` configures."""
        o = cfg.optim
        return cls(
            total_steps=cfg.train.steps,
            warmup_steps=o.warmup_steps,
            lr=o.lr,
            min_lr_ratio=o.min_lr_ratio,
            lr_scaling=o.lr_scaling,
            base_world_size=o.base_world_size,
        )

    def peak(self, dp_size: int) -> float:
        return scaled_lr(self.lr, self.lr_scaling, self.base_world_size, dp_size)

    def lr_at(self, step: int, dp_size: int) -> float:
        """Learning rate for optimizer step ``step`` (0-based) at ``dp_size`` data-parallel ranks."""
        return lr_at(
            step,
            peak=self.peak(dp_size),
            warmup_steps=self.warmup_steps,
            total_steps=self.total_steps,
            min_lr_ratio=self.min_lr_ratio,
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON (what a manifest records)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: Any) -> Schedule:
        """A schedule read back from :meth:`to_dict`'s JSON; ValueError naming what is wrong."""
        if not isinstance(raw, Mapping):
            raise ValueError(f"the schedule is not an object (got {type(raw).__name__})")
        names = [f.name for f in fields(cls)]
        if set(raw) != set(names):
            raise ValueError(f"the schedule must have exactly the fields {names}, got {sorted(raw)}")
        try:
            return cls(**raw)
        except TypeError as e:
            raise ValueError(f"the schedule is malformed: {e}") from e

    def changes_to(self, new: Schedule) -> list[ScheduleChange]:
        """What differs from this schedule to ``new``, by config key. ``base_world_size`` counts
        only where some ``lr_scaling`` uses it (otherwise the peak does not depend on it)."""
        scaled = self.lr_scaling != "none" or new.lr_scaling != "none"
        return [
            ScheduleChange(SCHEDULE_KEYS[f.name], getattr(self, f.name), getattr(new, f.name))
            for f in fields(self)
            if getattr(self, f.name) != getattr(new, f.name) and (f.name != "base_world_size" or scaled)
        ]


#: :class:`Schedule` field -> the config key it comes from
SCHEDULE_KEYS = {
    "total_steps": "train.steps",
    "warmup_steps": "optim.warmup_steps",
    "lr": "optim.lr",
    "min_lr_ratio": "optim.min_lr_ratio",
    "lr_scaling": "optim.lr_scaling",
    "base_world_size": "optim.base_world_size",
}


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _schedule_problem(s: Schedule) -> str | None:
    """Why ``s`` is no schedule this trainer can run (as the config checks would say), or None."""
    if not _is_int(s.total_steps) or s.total_steps < 0:
        return f"total_steps must be an int >= 0, got {s.total_steps!r}"
    if not _is_int(s.warmup_steps) or s.warmup_steps < 0:
        return f"warmup_steps must be an int >= 0, got {s.warmup_steps!r}"
    if not _is_int(s.base_world_size) or s.base_world_size < 1:
        return f"base_world_size must be an int >= 1, got {s.base_world_size!r}"
    for name in ("lr", "min_lr_ratio"):
        value = getattr(s, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return f"{name} must be a finite number, got {value!r}"
    if s.lr <= 0:
        return f"lr must be > 0, got {s.lr!r}"
    if not 0.0 <= s.min_lr_ratio <= 1.0:
        return f"min_lr_ratio must be in [0, 1], got {s.min_lr_ratio!r}"
    if s.lr_scaling not in LR_SCALINGS:
        return f"lr_scaling must be one of {LR_SCALINGS}, got {s.lr_scaling!r}"
    return None


@dataclass(frozen=True, slots=True)
class ScheduleChange:
    """One config key whose value differs from the one the checkpoint was trained with."""

    key: str
    old: Any
    new: Any

    def __str__(self) -> str:
        return f"{self.key} {self.old!r} -> {self.new!r}"


class ScheduleChangeError(ConfigError):
    """A resume would change the learning-rate schedule and ``train.on_schedule_change=fail``."""

    #: Restarting cannot help (the same config meets the same checkpoint): a supervisor that reads
    #: this attribute (ftrain's node agent does) ends the job with the message instead.
    fatal = True

    def __init__(self, step: int, changes: list[ScheduleChange]):
        self.step = step
        self.changes = list(changes)
        keys = "that key" if len(self.changes) == 1 else "those keys"
        super().__init__(
            "train.on_schedule_change",
            f"checkpoint step {step} was trained on another learning-rate schedule: "
            f"{', '.join(map(str, self.changes))}. Resume with --train.on_schedule_change=keep (the saved schedule "
            "goes on, to train.steps; past its end the LR stays at its floor) or --train.on_schedule_change=rescale "
            f"(the configured schedule applies from step {step}), or set {keys} back.",
        )


#: :attr:`ScheduleDecision.outcome` values
SAME, KEPT, RESCALED, UNRECORDED = "same", "kept", "rescaled", "unrecorded"


@dataclass(frozen=True, slots=True)
class ScheduleDecision:
    """What a resume goes on with (:func:`decide_schedule`)."""

    schedule: Schedule
    """The schedule in force from the resumed step (and recorded by the next checkpoints)."""
    outcome: str
    """``same`` (nothing changed), ``kept`` / ``rescaled`` (something changed: the policy), or
    ``unrecorded`` (the checkpoint records no schedule: the configured one is taken)."""
    changes: tuple[ScheduleChange, ...] = ()
    """Saved -> configured, by config key (empty unless kept or rescaled)."""


def decide_schedule(saved: Schedule | None, configured: Schedule, policy: str, *, step: int) -> ScheduleDecision:
    """The schedule a resume from checkpoint ``step`` goes on with: ``saved`` is the schedule
    the checkpoint records (None: it records none), ``configured`` this config's, ``policy``
    ``train.on_schedule_change``. Raises :class:`ScheduleChangeError` when they differ and the
    policy is ``fail``."""
    if policy not in SCHEDULE_POLICIES:
        raise ConfigError("train.on_schedule_change", f"must be one of {', '.join(SCHEDULE_POLICIES)}, got {policy!r}")
    if saved is None:
        return ScheduleDecision(configured, UNRECORDED)
    changes = saved.changes_to(configured)
    if not changes:
        return ScheduleDecision(configured, SAME)
    if policy == "fail":
        raise ScheduleChangeError(step, changes)
    if policy == "keep":
        return ScheduleDecision(saved, KEPT, tuple(changes))
    return ScheduleDecision(configured, RESCALED, tuple(changes))
