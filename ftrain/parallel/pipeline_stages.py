"""Pipeline parallelism's arithmetic: which blocks make each stage, which rank runs each stage.

Torch-free (config validation and ``ftrain plan`` use it). A job of ``parallel.pp_size`` = P
ranks per pipeline and V virtual stages per rank (``parallel.pp_virtual_stages``: 2 by default
for ``interleaved_1f1b``, else 1) has S = P x V stages. Stage ``s`` runs on pipeline rank
``s % P`` (the looped placement torch's interleaved schedules expect), so pipeline rank ``r``
holds stages ``r, r + P, ...``. The embeddings go with stage 0, the final norm and the head
with stage S - 1, the blocks in order between them: evenly (the first stages take one more
when S does not divide them) or as ``parallel.pp_split`` says.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from ftrain.contract.config import ConfigError

if TYPE_CHECKING:
    from ftrain.config import ParallelConfig

#: the values of ``parallel.pp_schedule``
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
#: the strategies that run inside a pipeline stage
PP_STRATEGIES = ("ddp", "fsdp", "tp", "fsdp+tp")


def virtual_stages(parallel: ParallelConfig) -> int:
    """Model chunks per pipeline rank (``parallel.pp_virtual_stages``, its default resolved)."""
    if parallel.pp_virtual_stages:
        return parallel.pp_virtual_stages
    return 2 if parallel.pp_schedule == "interleaved_1f1b" else 1


def parse_split(text: str) -> tuple[int, ...]:
    """``parallel.pp_split`` as block indices; ConfigError naming the key if it is not a list of
    increasing positive ints."""
    if not text.strip():
        return ()
    try:
        points = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ConfigError("parallel.pp_split", f'expected block indices like "3,6", got {text!r}') from None
    if any(p <= 0 for p in points) or any(b <= a for a, b in zip(points, points[1:], strict=False)):
        raise ConfigError("parallel.pp_split", f"block indices must be positive and increasing, got {text!r}")
    return points


def pipeline_degrees(parallel: ParallelConfig) -> tuple[int, ...]:
    """``parallel.pp_size`` and its fallbacks (``parallel.pp_fallback``), in order of preference."""
    text = parallel.pp_fallback.strip()
    if not text:
        return (parallel.pp_size,)
    try:
        fallbacks = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ConfigError("parallel.pp_fallback", f'expected pipeline degrees like "2,1", got {text!r}') from None
    if any(f < 1 for f in fallbacks) or len(set(fallbacks)) != len(fallbacks) or parallel.pp_size in fallbacks:
        raise ConfigError(
            "parallel.pp_fallback",
            f"degrees must be >= 1, distinct and other than parallel.pp_size={parallel.pp_size}, got {text!r}",
        )
    return (parallel.pp_size, *fallbacks)


def pipeline_degree(parallel: ParallelConfig, ranks: int) -> int | None:
    """The pipeline degree a world of ``ranks`` runs at: the first of :func:`pipeline_degrees` whose
    stages tile it (pp x the strategy's fixed tensor-parallel degree divides it); None if none does."""
    from ftrain.parallel.strategies import fixed_tp_size  # the registry imports this module's names

    tp = fixed_tp_size(parallel)
    return next((pp for pp in pipeline_degrees(parallel) if ranks % (pp * tp) == 0), None)


def at_world(parallel: ParallelConfig, ranks: int) -> ParallelConfig:
    """``parallel`` as a world of ``ranks`` runs it: at the pipeline degree :func:`pipeline_degree`
    picks (``pp_fallback`` resolved away); as it is without fallbacks. ConfigError naming
    ``parallel.pp_size`` when no degree fits."""
    if not parallel.pp_fallback.strip():
        return parallel
    pp = pipeline_degree(parallel, ranks)
    if pp is None:
        raise ConfigError(
            "parallel.pp_size",
            f"no pipeline degree of {', '.join(map(str, pipeline_degrees(parallel)))} (parallel.pp_size, "
            f"parallel.pp_fallback) tiles a world of {ranks} ranks",
        )
    return dataclasses.replace(parallel, pp_size=pp, pp_fallback="")


def check_pipeline(parallel: ParallelConfig) -> None:
    """The pipeline keys of ``[parallel]`` alone (the block count is checked by :func:`stage_blocks`)."""
    if parallel.pp_size < 1:
        raise ConfigError("parallel.pp_size", f"must be >= 1, got {parallel.pp_size}")
    if parallel.pp_virtual_stages < 0:
        raise ConfigError("parallel.pp_virtual_stages", f"must be >= 0, got {parallel.pp_virtual_stages}")
    v = virtual_stages(parallel)
    if parallel.pp_schedule == "interleaved_1f1b" and v < 2:
        raise ConfigError("parallel.pp_virtual_stages", f"interleaved_1f1b needs at least 2 chunks per rank, got {v}")
    if parallel.pp_schedule != "interleaved_1f1b" and v != 1:
        raise ConfigError(
            "parallel.pp_virtual_stages",
            f"{parallel.pp_schedule} runs one chunk per rank (got {v}); use parallel.pp_schedule=interleaved_1f1b",
        )
    points = parse_split(parallel.pp_split)
    degrees = pipeline_degrees(parallel)
    if points and len(degrees) > 1:
        raise ConfigError(
            "parallel.pp_split",
            "fits one stage count only: leave it empty with parallel.pp_fallback (blocks spread evenly)",
        )
    if parallel.pp_size == 1 and max(degrees) == 1:
        if points:
            raise ConfigError("parallel.pp_split", "has no effect without a pipeline: set parallel.pp_size > 1")
        return
    if points and len(points) != parallel.pp_size * v - 1:
        raise ConfigError(
            "parallel.pp_split",
            f"{len(points)} split point(s) for {parallel.pp_size * v} stages (pp_size {parallel.pp_size} x "
            f"{v} chunk(s) per rank): give {parallel.pp_size * v - 1}",
        )
    if parallel.strategy not in PP_STRATEGIES:
        raise ConfigError(
            "parallel.strategy",
            f"{parallel.strategy!r} does not run inside a pipeline stage; with parallel.pp_size > 1 use one of "
            + ", ".join(PP_STRATEGIES),
        )
    if parallel.deterministic:
        raise ConfigError(
            "parallel.deterministic",
            "the fixed-order reduction needs every micro-batch's gradient apart, which a pipeline schedule "
            "accumulates in place: use parallel.pp_size = 1 for bitwise results at any world size",
        )


def stage_blocks(parallel: ParallelConfig, n_layer: int) -> list[range]:
    """The blocks of every stage, in stage order; ConfigError naming the key when some stage
    would get none."""
    stages = parallel.pp_size * virtual_stages(parallel)
    points = parse_split(parallel.pp_split)
    if points:
        if points[-1] >= n_layer:
            raise ConfigError(
                "parallel.pp_split", f"block {points[-1]} does not exist: the model has model.n_layer={n_layer}"
            )
        bounds = [0, *points, n_layer]
        return [range(a, b) for a, b in zip(bounds, bounds[1:], strict=False)]
    if n_layer < stages:
        raise ConfigError(
            "parallel.pp_size",
            f"{stages} stages (pp_size {parallel.pp_size} x {virtual_stages(parallel)} chunk(s) per rank) need "
            f"at least as many blocks; model.n_layer={n_layer}",
        )
    base, extra = divmod(n_layer, stages)
    out, start = [], 0
    for s in range(stages):
        size = base + (1 if s < extra else 0)
        out.append(range(start, start + size))
        start += size
    return out


def local_stages(pp_rank: int, pp_size: int, virtual: int) -> list[int]:
    """The stages pipeline rank ``pp_rank`` runs, in order."""
    return [pp_rank + i * pp_size for i in range(virtual)]
