"""``ftrain plan``'s decisions: the estimate of a layout, every strategy's at a world size, and
which to recommend.

- :func:`estimate` gives one layout's per-rank bytes as a
  :class:`~ftrain.planning.memory.MemoryEstimate`: the memory model
  (:mod:`ftrain.planning.memory`) on the strategy's activations, or, under pipeline parallelism
  (``parallel.pp_size`` > 1), one pipeline rank's (:mod:`ftrain.planning.stages`);
- :func:`estimate_all` estimates every registered strategy that can run;
- :func:`attention_heads` reads the heads a tensor-parallel degree must divide from the model's
  layout (a meta-device build, once per model configuration);
- :func:`recommend` picks the fitting strategy with the least communication;
- :mod:`ftrain.planning.plan_report` renders the table ``ftrain plan`` prints, and what would make
  a job fit when nothing does.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch

from ftrain.config import Config, ConfigError, ModelConfig
from ftrain.model import build_model
from ftrain.models.layout import layout_of, tp_head_problem
from ftrain.parallel import strategies
from ftrain.parallel.strategies import Layout
from ftrain.planning.memory import (
    MemoryEstimate,
    ModelStats,
    Skipped,
    Target,
    activations,
    estimate_with,
    layout_for,
    precision_mode,
)
from ftrain.planning.stages import stage_estimate

#: Least communication first (``Strategy.preference``): the recommendation is the first
#: strategy in this order that fits.
PREFERENCE = tuple(s.name for s in strategies.by_preference())
#: :func:`attention_heads` by ``repr(ModelConfig)``: the plan asks once per strategy and world size
_HEADS: dict[str, tuple[int | None, int | None]] = {}
_HEADS_KEPT = 16

log = logging.getLogger(__name__)


def estimate(stats: ModelStats, cfg: Config, layout: Layout, target: Target) -> MemoryEstimate:
    """Per-rank memory of ``layout.strategy`` for this model, batch and precision, from the
    strategy's memory model (``Strategy.wrapper``, ``shard_count``, ``optimizer_numel``, ...).
    Under a pipeline (``layout.pp_size`` > 1): pipeline rank ``layout.pp_rank``'s, its stages'
    parameters and its schedule's activations (``ftrain.planning.stages.stage_estimate``)."""
    if layout.pp_size > 1:
        return stage_estimate(stats, cfg, layout, target)
    acts = activations(
        cfg.model,
        micro_batch=cfg.train.micro_batch_size,
        mode=precision_mode(strategies.get(layout.strategy), target),
        tp=layout.tp_size,
        device=target.device,
        checkpointing=cfg.parallel.activation_checkpointing,
    )
    return estimate_with(stats, cfg, layout, target, acts)


def estimate_all(
    stats: ModelStats, cfg: Config, *, world_size: int, gpus_per_node: int, target: Target
) -> tuple[list[MemoryEstimate], list[Skipped]]:
    """Every strategy that can run at this world size, and the reason for each that cannot."""
    estimates, skipped = [], []
    for strategy in strategies.registered():
        s = strategy.name
        if strategy.needs_tp_plan and not stats.has_tp_plan:
            skipped.append(Skipped(s, f"{stats.name} has no tp_plan()"))
            continue
        try:
            layout = layout_for(cfg, s, world_size=world_size, gpus_per_node=gpus_per_node)
        except ConfigError as e:
            skipped.append(Skipped(s, str(e)))
            continue
        # each tensor-parallel rank runs heads / tp query and kv_heads / tp key/value heads
        problem = tp_head_problem(layout.tp_size, *attention_heads(cfg.model)) if layout.tp_size > 1 else None
        if problem is not None:
            skipped.append(Skipped(s, f"parallel.tp_size: {problem}"))
            continue
        if strategy.needs_several_ranks and world_size == 1:
            skipped.append(Skipped(s, "needs more than one rank"))
            continue
        estimates.append(estimate(stats, cfg, layout, target))
    return estimates, skipped


def attention_heads(model_cfg: ModelConfig) -> tuple[int | None, int | None]:
    """The attention and key/value heads the model's layout declares (``ModelLayout.heads``,
    ``kv_heads``), from a meta-device build; None for each it does not declare, or when the model
    cannot be built there (:func:`~ftrain.planning.memory.model_stats` reports that)."""
    key = repr(model_cfg)
    if key not in _HEADS:
        try:
            with torch.device("meta"):
                layout = layout_of(build_model(model_cfg))
        except Exception as e:  # noqa: BLE001 - a user factory's failure; the plan counts parameters without it
            log.debug("cannot build the model on the meta device to read its heads: %s", e)
            layout = None
        if len(_HEADS) >= _HEADS_KEPT:
            _HEADS.clear()
        _HEADS[key] = (layout.heads, layout.kv_heads) if layout is not None else (None, None)
    return _HEADS[key]


def recommend(estimates: Iterable[MemoryEstimate], device_memory_bytes: int) -> MemoryEstimate | None:
    """The fitting strategy with the least communication (:data:`PREFERENCE` order), or None."""
    fitting = {e.strategy: e for e in estimates if e.fits(device_memory_bytes)}
    for s in PREFERENCE:
        if s in fitting:
            return fitting[s]
    return None


def best_fitting(
    stats: ModelStats,
    cfg: Config,
    world_size: int,
    gpus_per_node: int,
    target: Target,
    memory: int,
) -> MemoryEstimate | None:
    estimates, _ = estimate_all(stats, cfg, world_size=world_size, gpus_per_node=gpus_per_node, target=target)
    return recommend(estimates, memory)
