"""The memory model of one pipeline rank in ``ftrain plan`` (and the bubble of its schedule).

With ``parallel.pp_size`` P > 1 every pipeline rank holds different parameters and activations,
so the plan is one :class:`~ftrain.planning.memory.MemoryEstimate` per pipeline rank (for its first
data-parallel, first tensor-parallel rank: the others of its stage hold the same), built from
:func:`ftrain.planning.memory.estimate_with` on the rank's own parameters:

- Parameters: the blocks of its stages (:func:`ftrain.parallel.pipeline_stages.stage_blocks`,
  ``local_stages``), the root parameters registered before the first block (the built-in GPT's
  ``tok_emb``, ``pos_emb``) on the rank of stage 0, those after the blocks (``ln_f``, ``head``)
  on the rank of the last stage; then sharded, split or replicated over the stage's
  ``dp_size x tp_size`` ranks as the inner strategy says (``Strategy.shard_count``, ...).
- Activations: each stage's bytes per micro-batch (its blocks, as :func:`ftrain.planning.memory.activations`
  counts one block; its output, which the pipeline stage keeps for backward, except on the last
  stage, which keeps the final norm's and the loss's: the logits and cross-entropy's fp32
  log-softmax), summed over the micro-batches the rank's schedule has in flight at its worst
  moment (:func:`ftrain.parallel.pipeline_schedule.peak_in_flight` weighted by those bytes), plus the
  loss's backward on the last stage. The embedding's output is the first block's input, already
  counted with the block.
- P2P buffers: torch's ``PipelineStage`` allocates, for all m micro-batches of a step at once
  and for the whole run, a receive buffer for each non-first stage's input and for each
  non-last stage's output gradient; autograd adds each input's gradient to its buffer and
  keeps it until the next step. Counted whole in the backward and step peaks (an upper bound:
  the input gradients build up through backward).
- The inner strategy as ``ftrain.parallel.pipeline`` runs it (:func:`ftrain.planning.memory.estimate_with`):
  ddp is plain gradients and one flat all-reduce (no DDP buckets); FSDP2 units and their fp32
  gradients stay unsharded from the first backward to the step, as torch's stage sets them.
- Start-up: on a GPU only the rank's stages move to the device; on a CPU the whole model the
  train loop builds is in the same memory.
- The bubble: :func:`ftrain.parallel.pipeline_schedule.simulate` of the configured schedule.

What must stay true: the schedule's order, the in-flight rule and the micro-batch count
(m = ``train.global_batch_size / (train.micro_batch_size x dp_size)``) are the runtime's
(``ftrain.parallel.pipeline_schedule``); the logits stay inside the schedule (``step(...,
return_outputs=False)``: otherwise the last stage keeps every micro-batch's logits to the end of
the step and concatenates them), so no rank holds them after backward.
"""

from __future__ import annotations

import dataclasses
import functools

from ftrain.config import Config, ConfigError
from ftrain.parallel import strategies
from ftrain.parallel.pipeline_schedule import check_micro_batches, peak_in_flight, simulate
from ftrain.parallel.pipeline_stages import local_stages, stage_blocks, virtual_stages
from ftrain.parallel.strategies import Layout
from ftrain.planning.memory import (
    Activations,
    MemoryEstimate,
    ModelStats,
    StageTerms,
    Target,
    activations,
    estimate_with,
    precision_mode,
)

# --------------------------------------------------------------------------------------------
# One pipeline rank.


def micro_batches(cfg: Config, dp_size: int) -> int:
    """m, the micro-batches one data-parallel rank runs per step (the schedules' ``n_microbatches``)."""
    return max(1, cfg.train.global_batch_size // (cfg.train.micro_batch_size * dp_size))


def stage_stats(stats: ModelStats, blocks: list[range], stages: list[int]) -> ModelStats:
    """The parameters of ``stages`` (of ``len(blocks)``), their blocks renumbered 0.. as FSDP
    units; the root parameters registered before the first block go with stage 0, the rest
    with the last stage."""
    first_block = next((i for i, p in enumerate(stats.params) if p.unit >= 0), len(stats.params))
    mine = [b for s in stages for b in blocks[s]]
    unit = {b: i for i, b in enumerate(mine)}
    holds_first, holds_last = 0 in stages, len(blocks) - 1 in stages
    params = tuple(
        dataclasses.replace(p, unit=unit[p.unit]) if p.unit >= 0 else p
        for i, p in enumerate(stats.params)
        if (p.unit in unit) or (p.unit < 0 and (holds_first if i < first_block else holds_last))
    )
    return ModelStats(params, len(mine), stats.has_tp_plan, stats.name)


def boundary_bytes(cfg: Config, mode: str) -> int:
    """One micro-batch of the residual stream between stages (fp32 but under FSDP2's bf16)."""
    return cfg.train.micro_batch_size * cfg.model.seq_len * cfg.model.d_model * (2 if mode == "mp" else 4)


def stage_micro_bytes(cfg: Config, mode: str, tp: int, device: str, blocks: list[range]) -> tuple[list[int], int, int]:
    """Per stage, the activation bytes one micro-batch leaves on it from its forward to its
    backward; the last stage's extra during the loss's backward; one block's recompute."""
    model, b = cfg.model, cfg.train.micro_batch_size
    one = activations(
        dataclasses.replace(model, n_layer=1),
        micro_batch=b,
        mode=mode,
        tp=tp,
        device=device,
        checkpointing=cfg.parallel.activation_checkpointing,
    )
    boundary = boundary_bytes(cfg, mode)
    log_softmax = 4 * b * model.seq_len * model.vocab_size  # cross-entropy saves it in fp32
    last = len(blocks) - 1
    out = [
        len(r) * one.layers + (one.final_norm + one.logits_held + log_softmax if s == last else boundary)
        for s, r in enumerate(blocks)
    ]
    return out, one.loss_peak - one.logits_held - log_softmax, one.recompute


def p2p_buffer_bytes(cfg: Config, mode: str, stages: list[int], num_stages: int, m: int) -> int:
    """torch's P2P buffers on a rank: per non-first stage m input buffers and their m
    gradients, per non-last stage m output-gradient buffers (tensor parallelism replicates
    the residual stream, so they are whole on every rank)."""
    boundary = boundary_bytes(cfg, mode)
    per_stage = [2 * (s > 0) + (s < num_stages - 1) for s in stages]
    return m * boundary * sum(per_stage)


@functools.lru_cache(maxsize=256)
def schedule_bubble(schedule: str, pp: int, m: int, v: int) -> float:
    return simulate(schedule, pp, m, v)


def stage_estimate(stats: ModelStats, cfg: Config, layout: Layout, target: Target) -> MemoryEstimate:
    """Pipeline rank ``layout.pp_rank``'s memory (see the module docstring); ConfigError naming
    the key when the stages cannot be formed or torch's schedule refuses the micro-batch count."""
    parallel = cfg.parallel
    if layout.pp_size != parallel.pp_size:
        raise ValueError(f"layout has pp_size {layout.pp_size}, the config {parallel.pp_size}")
    if stats.num_blocks == 0:
        raise ConfigError("parallel.pp_size", f"{stats.name} has no blocks/layers/h container to split into stages")
    pp, v, schedule = layout.pp_size, virtual_stages(parallel), parallel.pp_schedule
    blocks = stage_blocks(parallel, stats.num_blocks)
    mine = local_stages(layout.pp_rank, pp, v)
    m = micro_batches(cfg, layout.dp_size)
    check_micro_batches(schedule, pp, m, v)
    mode = precision_mode(strategies.get(layout.strategy), target)
    per_micro, loss_backward, recompute = stage_micro_bytes(cfg, mode, layout.tp_size, target.device, blocks)
    saved = peak_in_flight(schedule, pp, m, v, layout.pp_rank, blocks_per_stage=per_micro)
    holds_last = len(blocks) - 1 in mine
    acts = Activations(
        layers=saved, final_norm=0, loss_peak=loss_backward if holds_last else 0, logits_held=0, recompute=recompute
    )
    sub = stage_stats(stats, blocks, mine)
    terms = StageTerms(
        buffer_bytes=p2p_buffer_bytes(cfg, mode, mine, len(blocks), m),
        pp_size=pp,
        pp_rank=layout.pp_rank,
        stages=tuple(mine),
        bubble_fraction=schedule_bubble(schedule, pp, m, v),
        in_flight=peak_in_flight(schedule, pp, m, v, layout.pp_rank),
    )
    return estimate_with(sub, cfg, layout, target, acts, terms)
