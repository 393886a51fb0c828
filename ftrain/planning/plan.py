"""``ftrain plan``'s decisions: the estimate of a layout, every strategy's at a world size, and
which to recommend.

- :func:`estimate` gives one layout's per-rank bytes as a
  :class:`~ftrain.planning.memory.MemoryEstimate`: the memory model
  (:mod:`ftrain.planning.memory`) on the strategy's activations, or, under pipeline parallelism
  (``parallel.pp_size`` > 1), one pipeline rank's (:mod:`ftrain.planning.stages`);
- :func:`estimate_all` estimates every registered strategy that can run;
- :func:`recommend` picks the fitting strategy with the least communication;
- :mod:`ftrain.planning.plan_report` renders the table ``ftrain plan`` prints, and what would make
  a job fit when nothing does.
"""

from __future__ import annotations

from collections.abc import Iterable

from ftrain.config import Config, ConfigError
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
        kv_heads = cfg.model.kv_heads if cfg.model.arch == "llama" and not cfg.model.factory else layout.tp_size
        if kv_heads % layout.tp_size:  # each rank runs n_kv_heads / tp key/value heads
            skipped.append(Skipped(s, f"tp {layout.tp_size} does not divide model.n_kv_heads={kv_heads}"))
            continue
        if strategy.needs_several_ranks and world_size == 1:
            skipped.append(Skipped(s, "needs more than one rank"))
            continue
        estimates.append(estimate(stats, cfg, layout, target))
    return estimates, skipped


def recommend(
    estimates: Iterable[MemoryEstimate], device_memory_bytes: int, *, include_init: bool = True
) -> MemoryEstimate | None:
    """The fitting strategy with the least communication (:data:`PREFERENCE` order), or None.

    ``include_init=False`` ignores the start-up peak of the full fp32 model (as if the model
    were initialised on the meta device and materialised shard by shard)."""
    fitting = {e.strategy: e for e in estimates if e.fits(device_memory_bytes, include_init=include_init)}
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
    include_init: bool = True,
) -> MemoryEstimate | None:
    estimates, _ = estimate_all(stats, cfg, world_size=world_size, gpus_per_node=gpus_per_node, target=target)
    return recommend(estimates, memory, include_init=include_init)
