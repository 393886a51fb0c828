"""Pipeline parallelism in ``ftrain plan``: one memory estimate per pipeline rank of a job
(the model of one rank is :mod:`ftrain.planning.stages`), the pipeline that would make a job fit
when nothing does, and the rows and bubble line the report shows.
"""

from __future__ import annotations

import dataclasses

from ftrain.config import Config, ConfigError
from ftrain.parallel import strategies
from ftrain.parallel.pipeline_schedule import bubble_fraction
from ftrain.parallel.pipeline_stages import PP_STRATEGIES, stage_blocks, virtual_stages
from ftrain.planning.memory import (
    MemoryEstimate,
    ModelStats,
    Target,
    changed,
    gib,
    layout_for,
    model_stats,
    resolve_target,
)
from ftrain.planning.plan import PREFERENCE, estimate
from ftrain.planning.stages import micro_batches, schedule_bubble
from ftrain.planning.tables import memory_cells, memory_header, table_lines

#: pipeline degrees the recommendation tries when nothing fits without a pipeline, smallest first
PP_DEGREES = (2, 4, 8)


def estimates_for(
    stats: ModelStats, cfg: Config, strategy: str, *, world_size: int, gpus_per_node: int, target: Target
) -> list[MemoryEstimate]:
    """One estimate per pipeline rank of ``strategy`` inside the stages; ConfigError if it cannot run."""
    inner_cfg = changed(cfg, "parallel", strategy=strategy)
    inner = world_size // cfg.parallel.pp_size
    return [
        estimate(
            stats,
            inner_cfg,
            layout_for(inner_cfg, strategy, world_size=world_size, gpus_per_node=gpus_per_node, rank=r * inner),
            target,
        )
        for r in range(cfg.parallel.pp_size)
    ]


def stage_estimates(
    cfg: Config, *, world_size: int, device_memory_bytes: int | None = None, gpus_per_node: int = 8
) -> list[MemoryEstimate]:
    """One :class:`~ftrain.planning.memory.MemoryEstimate` per pipeline rank of ``cfg`` (its strategy inside
    each stage), for rank ``pp_rank x dp_size x tp_size`` (dp rank 0, tp rank 0); one estimate
    at ``parallel.pp_size`` = 1. With ``device_memory_bytes``, a rank that does not fit in it
    says so in its notes. ConfigError naming the key when the job cannot run so."""
    target = resolve_target(cfg)
    stats = model_stats(cfg.model, cfg.optim)
    out = estimates_for(
        stats, cfg, cfg.parallel.strategy, world_size=world_size, gpus_per_node=gpus_per_node, target=target
    )
    if device_memory_bytes is None:
        return out
    return [
        e
        if e.fits(device_memory_bytes)
        else dataclasses.replace(
            e, notes=(*e.notes, f"needs {gib(e.total_bytes)}, more than the {gib(device_memory_bytes)} given")
        )
        for e in out
    ]


# --------------------------------------------------------------------------------------------
# Decisions.


def fitting_pipeline(
    stats: ModelStats, cfg: Config, *, world_size: int, gpus_per_node: int, target: Target, memory: int
) -> list[MemoryEstimate] | None:
    """The stage estimates of the first inner strategy (:data:`~ftrain.planning.plan.PREFERENCE` order)
    whose every pipeline rank fits at ``cfg.parallel.pp_size``, or None."""
    for s in PREFERENCE:
        if s not in PP_STRATEGIES or (strategies.get(s).needs_tp_plan and not stats.has_tp_plan):
            continue
        try:
            found = estimates_for(stats, cfg, s, world_size=world_size, gpus_per_node=gpus_per_node, target=target)
        except ConfigError:
            continue
        if all(e.fits(memory) for e in found):
            return found
    return None


def pipeline_suggestion(
    stats: ModelStats, cfg: Config, *, world_size: int, gpus_per_node: int, target: Target, memory: int
) -> str | None:
    """The smallest pipeline degree (:data:`PP_DEGREES` that divide the world and leave every
    stage a block) at which some inner strategy fits, as a suggestion line; None if none does."""
    if cfg.parallel.deterministic:
        return None  # the fixed-order reduction does not run under a pipeline
    v = virtual_stages(cfg.parallel)
    for pp in PP_DEGREES:
        if world_size % pp or pp * v > stats.num_blocks:
            continue
        try:
            piped = changed(cfg, "parallel", pp_size=pp, strategy="ddp")
        except ConfigError:
            continue
        found = fitting_pipeline(
            stats, piped, world_size=world_size, gpus_per_node=gpus_per_node, target=target, memory=memory
        )
        if found is not None:
            worst = max(found, key=lambda e: e.total_bytes)
            return (
                f"set parallel.pp_size={pp} (a {cfg.parallel.pp_schedule} pipeline): {worst.strategy} fits on "
                f"every stage (at most {gib(worst.total_bytes)} per rank, pipeline rank {worst.pp_rank}; "
                f"{worst.bubble_fraction:.0%} of each step idle in the bubble)"
            )
    return None


# --------------------------------------------------------------------------------------------
# The report.


def _stage_text(e: MemoryEstimate, blocks: list[range]) -> str:
    last = len(blocks) - 1
    parts = []
    for s in e.stages:
        r = blocks[s]
        text = f"{s}: blocks {r.start}-{r.stop - 1}" if len(r) > 1 else f"{s}: block {r.start}"
        text += " + embeddings" if s == 0 else ""
        text += " + head" if s == last else ""
        parts.append(text)
    return "; ".join(parts)


def stage_rows(estimates: list[MemoryEstimate], blocks: list[range], memory: int) -> list[str]:
    """The per-pipeline-rank table."""
    rows = [["pp rank", "stages", "layout", "in flight", *memory_header(memory)]]
    rows += [
        [
            str(e.pp_rank),
            _stage_text(e, blocks),
            strategies.get(e.strategy).layout_text(e),
            str(e.in_flight),
            *memory_cells(e, memory),
        ]
        for e in estimates
    ]
    return table_lines(rows)


def bubble_line(cfg: Config, dp_size: int) -> str:
    """The configured schedule's bubble: the simulated timeline, and the textbook formula."""
    parallel = cfg.parallel
    pp, v, schedule = parallel.pp_size, virtual_stages(parallel), parallel.pp_schedule
    m = micro_batches(cfg, dp_size)
    simulated, textbook = schedule_bubble(schedule, pp, m, v), bubble_fraction(schedule, pp, m, v)
    formula = "(p-1)/(v*m+p-1)" if schedule == "interleaved_1f1b" else "(p-1)/(m+p-1)"
    if abs(simulated - textbook) < 1e-9:
        versus = f"the textbook {formula} agrees"
    else:
        versus = f"the textbook {formula} says {textbook:.1%}, for at least as many micro-batches as ranks"
    return (
        f"bubble: {simulated:.1%} of every rank's step idle ({schedule}, p={pp} ranks, m={m} micro-batch(es) per "
        f"step, v={v} chunk(s) per rank, in the simulated timeline of uniform stages; {versus})"
    )


def pipeline_report(
    stats: ModelStats, cfg: Config, *, world_size: int, gpus_per_node: int, target: Target, memory: int
) -> list[str]:
    """The lines of ``ftrain plan`` after its header when ``parallel.pp_size`` > 1: one row per
    pipeline rank of the configured strategy, the bubble, and whether (or what) fits."""
    blocks = stage_blocks(cfg.parallel, stats.num_blocks)
    found = estimates_for(
        stats, cfg, cfg.parallel.strategy, world_size=world_size, gpus_per_node=gpus_per_node, target=target
    )
    e0 = found[0]
    lines = [
        f"pipeline: parallel.pp_size={cfg.parallel.pp_size} ranks per pipeline, {len(blocks)} stages "
        f"({len(e0.stages)} per rank), {cfg.parallel.strategy} over {e0.dp_size * e0.tp_size} rank(s) inside "
        f"each stage, {micro_batches(cfg, e0.dp_size)} micro-batch(es) per step on each data-parallel rank",
        "",
        *stage_rows(found, blocks, memory),
        "",
        bubble_line(cfg, e0.dp_size),
    ]
    worst = max(found, key=lambda e: e.total_bytes)
    if worst.fits(memory):
        lines.append(
            f"recommended: {cfg.parallel.strategy} in a {cfg.parallel.pp_size}-stage pipeline fits on every stage "
            f"(the largest: pipeline rank {worst.pp_rank}, {gib(worst.total_bytes)})"
        )
    else:
        other = fitting_pipeline(
            stats, cfg, world_size=world_size, gpus_per_node=gpus_per_node, target=target, memory=memory
        )
        lines.append(
            f"recommended: none: pipeline rank {worst.pp_rank} needs {gib(worst.total_bytes)}, more than "
            f"{gib(memory)}"
            + (
                f"; --parallel.strategy={other[0].strategy} fits on every stage"
                if other is not None
                else "; no inner strategy fits at this pp_size: try activation checkpointing, a smaller "
                "micro batch or a larger parallel.pp_size"
            )
        )
    lines += ["", "notes:"]
    lines += [f"  - {n}" for n in dict.fromkeys(n for e in found for n in e.notes)]
    lines.append(
        "  - each row is the first rank of its stage (the stage's other data- and tensor-parallel ranks hold "
        "the same); in flight: (micro-batch, stage) activation sets the rank holds at its schedule's peak"
    )
    lines.append(
        "  - backward and step extra include the P2P buffers torch's PipelineStage allocates for every "
        "micro-batch of a step (inputs, their gradients, output gradients)"
    )
    return lines
