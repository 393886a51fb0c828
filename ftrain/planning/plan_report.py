"""``ftrain plan``'s report: the table of every strategy's (or every pipeline stage's) memory,
the recommendation, and what would make a job fit when nothing does.

The numbers are :mod:`ftrain.planning.plan`'s (the memory model); this module only decides what to show
and says it. Torch is used only to read the device's memory when planning for the GPU present.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from ftrain.config import Config, ConfigError
from ftrain.parallel import strategies
from ftrain.planning.memory import (
    CUDA_RUNTIME_BYTES,
    DEFAULT_DEVICE_MEMORY_BYTES,
    TIGHT_FRACTION,
    MemoryEstimate,
    ModelStats,
    Target,
    changed,
    gib,
    model_stats,
    overhead_bytes,
    resolve_target,
)
from ftrain.planning.plan import best_fitting, estimate_all, recommend
from ftrain.planning.plan_pipeline import pipeline_report, pipeline_suggestion
from ftrain.planning.tables import gradient_reduce_cell, memory_cells, memory_header, table_lines


def suggestions(
    stats: ModelStats,
    cfg: Config,
    *,
    world_size: int,
    gpus_per_node: int,
    target: Target,
    device_memory_bytes: int,
    max_world_size: int = 65536,
) -> list[str]:
    """What would make some strategy fit, when none does at this configuration; without a
    pipeline, among them the smallest that fits at this world size
    (``ftrain.planning.plan_pipeline.pipeline_suggestion``)."""
    out = []
    memory = device_memory_bytes
    overhead = overhead_bytes(cfg, target)
    if overhead > memory:
        return [f"nothing can: the per-rank overhead alone ({gib(overhead)}) exceeds the device memory"]
    if cfg.parallel.pp_size == 1:  # a stage alone goes to a GPU: the full-model floor need not hold
        piped = pipeline_suggestion(
            stats, cfg, world_size=world_size, gpus_per_node=gpus_per_node, target=target, memory=memory
        )
        if piped is not None:
            out.append(piped)
    if not cfg.parallel.activation_checkpointing:
        best = best_fitting(
            stats, changed(cfg, "parallel", activation_checkpointing=True), world_size, gpus_per_node, target, memory
        )
        if best is not None:
            out.append(
                f"--parallel.activation_checkpointing=true: {best.strategy} fits ({gib(best.total_bytes)} per rank)"
            )
    b = cfg.train.micro_batch_size
    for micro in sorted((d for d in range(1, b) if cfg.train.global_batch_size % d == 0), reverse=True):
        best = best_fitting(
            stats, changed(cfg, "train", micro_batch_size=micro), world_size, gpus_per_node, target, memory
        )
        if best is not None:
            out.append(f"--train.micro_batch_size={micro}: {best.strategy} fits ({gib(best.total_bytes)} per rank)")
            break
    # more ranks shrink every sharded term (start-up included: ftrain.models.deferred_init)
    world = world_size * 2
    while world <= max_world_size:
        best = best_fitting(stats, cfg, world, gpus_per_node, target, memory)
        if best is not None:
            extra = ""
            if cfg.train.global_batch_size % (cfg.train.micro_batch_size * best.dp_size):
                extra = (
                    f"; train.global_batch_size={cfg.train.global_batch_size} must then be a multiple "
                    f"of {cfg.train.micro_batch_size * best.dp_size}"
                )
            out.append(f"{world} ranks: {best.strategy} fits ({gib(best.total_bytes)} per rank){extra}")
            break
        world *= 2
    if not out:
        out.append(
            "nothing tried fits: combine activation checkpointing, micro batch 1 and more ranks, "
            "or use devices with more memory"
        )
    return out


def default_device_memory_bytes(target: Target) -> int:
    if target.device == "cuda" and torch.cuda.is_available():
        return int(torch.cuda.get_device_properties(0).total_memory)
    return DEFAULT_DEVICE_MEMORY_BYTES


#: host copies of a rank's checkpointed state the memory tier keeps between snapshots: its own
#: snapshot and its buddy's (staging buffers are freed once a snapshot is written); while a
#: snapshot is taken and exchanged, the previous pair, the staged copy and the new files too
#: (measured 2.2x and 5.5x: bench/checkpoint.py part e, tests/distributed/test_memory_tier_host_memory.py)
MEMORY_TIER_COPIES, MEMORY_TIER_PEAK_COPIES = 2, 6


def memory_tier_notes(cfg: Config, estimates: Sequence[MemoryEstimate]) -> list[str]:
    """What the memory tier (``checkpoint.memory_interval``, live recovery of strategies with no
    full replica) costs in host memory per rank, for each such strategy estimated."""
    if getattr(cfg, "checkpoint", None) is None or cfg.checkpoint.memory_interval == 0:
        return []
    out = []
    for e in estimates:
        if strategies.get(e.strategy).full_replica:
            continue
        state = e.params_bytes + e.optimizer_bytes
        where = (
            f"the snapshots in {cfg.checkpoint.memory_dir} (tmpfs: host memory), kept across restarts"
            if cfg.checkpoint.memory_dir
            else "live recovery"
        )
        out.append(
            f"  - {e.strategy}: memory tier ({where}) in host memory: {gib(MEMORY_TIER_COPIES * state)} "
            f"per rank between snapshots ({MEMORY_TIER_COPIES} x its {gib(state)} of params + optimizer state: its "
            f"snapshot and its buddy's), up to {gib(MEMORY_TIER_PEAK_COPIES * state)} while a snapshot is taken; "
            "checkpoint.memory_interval=0 turns it off"
        )
    return out


def plan_report(cfg: Config, *, world_size: int, device_memory_bytes: int | None = None, gpus_per_node: int = 8) -> str:
    """The table ``ftrain plan`` prints: every feasible strategy's per-rank memory, and a pick."""
    if world_size < 1:
        raise ConfigError("", f"--world-size must be >= 1, got {world_size}")
    if gpus_per_node < 1:
        raise ConfigError("", f"--gpus-per-node must be >= 1, got {gpus_per_node}")
    target = resolve_target(cfg)
    memory = device_memory_bytes if device_memory_bytes is not None else default_device_memory_bytes(target)
    target = dataclasses.replace(target, memory_bytes=memory)  # parallel.gradient_reduce=auto is judged against it
    stats = model_stats(cfg.model, cfg.optim)
    psi = stats.num_params
    lines = [
        f"ftrain plan: {stats.name} with {psi / 1e6:.2f}M parameters (Ψ, counted on the meta device), "
        f"{world_size} rank(s), {gpus_per_node} per node",
        f"target: {target.device} {target.dtype}"
        + (
            " (train.device=auto plans for GPUs; --train.device=cpu plans a CPU run)"
            if cfg.train.device == "auto"
            else ""
        )
        + f", {gib(memory)} per rank",
        f"micro batch {cfg.train.micro_batch_size} x seq {cfg.model.seq_len}, activation checkpointing "
        f"{'on' if cfg.parallel.activation_checkpointing else 'off'}",
        "",
    ]
    if cfg.parallel.pp_size > 1:
        lines += pipeline_report(
            stats, cfg, world_size=world_size, gpus_per_node=gpus_per_node, target=target, memory=memory
        )
        return "\n".join(lines)
    estimates, skipped = estimate_all(stats, cfg, world_size=world_size, gpus_per_node=gpus_per_node, target=target)
    rows = [["strategy", "layout", "gradient_reduce", *memory_header(memory)]]
    rows += [
        [e.strategy, strategies.get(e.strategy).layout_text(e), gradient_reduce_cell(e), *memory_cells(e, memory)]
        for e in estimates
    ]
    lines += table_lines(rows, text_columns=3)
    for sk in skipped:
        lines.append(f"skipped {sk.strategy}: {sk.reason}")
    lines.append("")
    best = recommend(estimates, memory)
    if best is not None:
        tight = " (tight: leave room for allocator fragmentation)" if best.total_bytes > TIGHT_FRACTION * memory else ""
        lines.append(f"recommended: {best.strategy} (the least communication of those that fit){tight}")
    else:
        lines.append("recommended: none: no strategy fits in " + gib(memory) + " per rank. What would:")
        lines += [
            f"  - {s}"
            for s in suggestions(
                stats,
                cfg,
                world_size=world_size,
                gpus_per_node=gpus_per_node,
                target=target,
                device_memory_bytes=memory,
            )
        ]
    lines.append("")
    lines.append("notes:")
    lines.append(
        "  - total/rank = overhead + the largest of: backward (params + optimizer state + activations "
        "+ backward extra, + gradients for ddp/zero1 whose buckets persist; other strategies free "
        "gradients after each step and re-create them as activations are freed), step (params + "
        "grads + optimizer + step extra), init (start-up: the full fp32 model for ddp and zero1; for "
        "the others the rank's part and one parameter made whole to cut it); the phase is named when "
        "it is not backward"
    )
    lines.append(
        "  - backward extra: unsharded FSDP units and buffers, bf16 autocast weight copies, gradients "
        "accumulated between micro-batches; step extra: AdamW temporaries and the last logits"
    )
    if any(e.gradient_reduce for e in estimates):
        lines.append(
            f"  - gradient_reduce (parallel.gradient_reduce={cfg.parallel.gradient_reduce}): when FSDP strategies "
            "reduce-scatter under accumulation; last_micro_batch (once per step) holds the whole model's unsharded "
            "fp32 gradients between micro-batches, every_micro_batch (per micro-batch) only their shards; auto "
            "takes last_micro_batch where it fits" + (" (a CPU plan: always)" if target.device == "cpu" else "")
        )
    for e in estimates:
        if e.model_state_bytes != e.textbook_model_state_bytes:
            why = strategies.get(e.strategy).textbook_difference
            lines.append(
                f"  - {e.strategy}: model states {gib(e.model_state_bytes)} here vs "
                f"{gib(e.textbook_model_state_bytes)} textbook ({why})"
            )
        lines += [f"  - {n}" for n in e.notes]
    if cfg.model.factory:
        lines.append("  - activations assume a GPT-like model with the configured model.* sizes")
    if getattr(cfg, "checkpoint", None) is not None and cfg.checkpoint.uri:
        lines.append(
            "  - not included: checkpoint staging (an async save copies this rank's params and optimizer "
            "state to host memory first)"
        )
    lines += memory_tier_notes(cfg, estimates)
    if target.device == "cuda":
        lines.append(
            f"  - overhead: CUDA context, workspaces and NCCL buffers, assumed {gib(CUDA_RUNTIME_BYTES)} "
            "(not in torch.cuda.max_memory_allocated)"
        )
    else:
        lines.append("  - overhead: torch + gloo process baseline (measured) + the data cursor's permutation")
        lines.append(
            "  - CPU peak RSS matches these (live) bytes with MALLOC_MMAP_THRESHOLD_=65536 "
            "MALLOC_TRIM_THRESHOLD_=0; glibc's defaults added 10-50% of fragmentation in "
            "bench/plan_vs_measured.py"
        )
    return "\n".join(lines)
