"""Pipeline schedules as data: each pipeline rank's compute order, its memory peak and its bubble.

Torch-free and pure (``ftrain plan``, config checks and tests use it; no process group needed).
The runtime runs ``torch.distributed.pipelining``'s ``ScheduleGPipe``, ``Schedule1F1B`` and
``ScheduleInterleaved1F1B`` with ``n_microbatches`` = m, the micro-batches one data-parallel rank
runs per optimizer step (``train.global_batch_size / (train.micro_batch_size x dp_size)``), over
P = ``parallel.pp_size`` pipeline ranks with V chunks (stages) each; stage ``s`` runs on rank
``s % P`` (:mod:`ftrain.parallel.pipeline_stages`). An action is ``(kind, micro, stage)``: kind "F"
(forward) or "B" (full backward), the micro-batch index and the stage index.

What must stay true:

- :func:`actions` is torch's compute order (torch 2.13), idle slots dropped: gpipe every forward
  then every backward (``ScheduleGPipe._step_microbatches``); 1f1b ``min(m, P - r)`` warm-up
  forwards on rank r, then backward-then-forward pairs, then the remaining backwards
  (``Schedule1F1B._step_microbatches``, what runs; its ``_get_pipeline_order`` IR differs for the
  last rank, whose first forward there is micro-batch 1); interleaved_1f1b
  ``ScheduleInterleaved1F1B._calculate_single_rank_operations`` (forward-then-backward pairs).
  tests/unit/test_pipeline_schedule.py compares gpipe and interleaved_1f1b with torch's own
  functions; when torch changes, this module changes with it.
- The in-flight rule (:func:`peak_in_flight`): a stage's activations of a micro-batch exist from
  the end of its forward to the end of its backward (torch's ``fwd_cache`` entry: autograd's
  saved tensors and the stage output), so a rank's peak is read off its own order alone.
- :func:`check_micro_batches` refuses exactly what torch's constructors refuse, as a
  ``ConfigError`` naming ``train.micro_batch_size``, before any process starts.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from ftrain.contract.config import ConfigError
from ftrain.parallel.pipeline_stages import PP_SCHEDULES

#: (kind "F" or "B", micro-batch index, stage index)
Action = tuple[str, int, int]

__all__ = [
    "Action",
    "actions",
    "bubble_fraction",
    "check_micro_batches",
    "peak_in_flight",
    "simulate",
    "timeline",
]


def _check_shape(schedule: str, pp: int, m: int, v: int) -> None:
    if schedule not in PP_SCHEDULES:
        raise ConfigError("parallel.pp_schedule", f"{schedule!r} is not one of {', '.join(PP_SCHEDULES)}")
    if pp < 1 or m < 1 or v < 1:
        raise ValueError(f"pp, m and v must be >= 1, got pp={pp} m={m} v={v}")
    if schedule != "interleaved_1f1b" and v != 1:
        raise ValueError(f"{schedule} runs one stage per rank, got v={v}")


def _valid_interleaved(m: int, pp: int) -> bool:
    return m % max(1, m // pp) == 0


def check_micro_batches(schedule: str, pp: int, m: int, v: int) -> None:
    """ConfigError naming ``train.micro_batch_size`` when torch's schedule would refuse m
    micro-batches per step over ``pp`` ranks: 1f1b needs m >= pp (``Schedule1F1B``: at least as
    many micro-batches as stages); interleaved_1f1b runs ``max(1, m // pp)`` rounds and needs m
    to be a multiple of them (``ScheduleInterleaved1F1B``; m < pp is one round, which torch
    accepts). gpipe takes any m >= 1."""
    _check_shape(schedule, pp, m, v)
    where = (
        f"{m} micro-batch(es) per step on each data-parallel rank "
        "(train.global_batch_size / (train.micro_batch_size x data-parallel ranks))"
    )
    if schedule == "1f1b" and m < pp:
        raise ConfigError(
            "train.micro_batch_size",
            f"1f1b over parallel.pp_size={pp} needs at least {pp} micro-batches per step, got {where}: "
            f"lower train.micro_batch_size or raise train.global_batch_size until there are >= {pp}",
        )
    if schedule == "interleaved_1f1b" and not _valid_interleaved(m, pp):
        rounds = max(1, m // pp)
        below = next(k for k in range(m - 1, 0, -1) if _valid_interleaved(k, pp))
        above = next(k for k in range(m + 1, 2 * m + pp) if _valid_interleaved(k, pp))
        raise ConfigError(
            "train.micro_batch_size",
            f"interleaved_1f1b over parallel.pp_size={pp} runs {where} in max(1, {m} // {pp}) = {rounds} "
            f"rounds and needs a multiple of {rounds}: make it {below} or {above} (any multiple of {pp} "
            "works) by changing train.micro_batch_size or train.global_batch_size",
        )


def _gpipe(m: int, rank: int) -> list[Action]:
    return [("F", i, rank) for i in range(m)] + [("B", i, rank) for i in range(m)]


def _one_f_one_b(pp: int, m: int, rank: int) -> list[Action]:
    warmup = min(m, pp - rank)
    out: list[Action] = [("F", i, rank) for i in range(warmup)]
    fwd, bwd = warmup, 0
    while True:  # Schedule1F1B's "1B1F" phase: a backward, then (while any are left) a forward
        out.append(("B", bwd, rank))
        bwd += 1
        if fwd == m:
            break
        out.append(("F", fwd, rank))
        fwd += 1
    out += [("B", i, rank) for i in range(bwd, m)]
    return out


def _interleaved(pp: int, m: int, v: int, rank: int) -> list[Action]:
    rounds = max(1, m // pp)
    per_round = m // rounds
    warmup = min((v - 1) * per_round + 2 * (pp - 1 - rank), m * v)
    steady = m * v - warmup

    def forward_stage(op: int) -> int:
        return ((op // per_round) % v) * pp + rank

    def backward_stage(op: int) -> int:
        return (v - 1 - ((op - warmup) // per_round) % v) * pp + rank

    next_f: dict[int, int] = defaultdict(int)
    next_b: dict[int, int] = defaultdict(int)
    out: list[Action] = []

    def emit(kind: str, stage: int, counter: dict[int, int]) -> None:
        out.append((kind, counter[stage], stage))
        counter[stage] += 1

    for op in range(warmup + steady + warmup):  # warm-up forwards, F+B pairs, cool-down backwards
        if op < warmup + steady:
            emit("F", forward_stage(op), next_f)
        if op >= warmup:
            emit("B", backward_stage(op), next_b)
    return out


def actions(schedule: str, pp: int, m: int, v: int) -> list[list[Action]]:
    """Every pipeline rank's compute actions, in the order torch's ``schedule`` runs them;
    ConfigError (:func:`check_micro_batches`) where torch would refuse m."""
    check_micro_batches(schedule, pp, m, v)
    if schedule == "gpipe":
        return [_gpipe(m, r) for r in range(pp)]
    if schedule == "1f1b":
        return [_one_f_one_b(pp, m, r) for r in range(pp)]
    return [_interleaved(pp, m, v, r) for r in range(pp)]


def peak_in_flight(
    schedule: str, pp: int, m: int, v: int, pp_rank: int, blocks_per_stage: Sequence[int] | None = None
) -> int:
    """The most activations rank ``pp_rank`` holds at once, walking its own order: the F of
    (micro, stage) adds that stage's weight, its B removes it. Without ``blocks_per_stage``
    every stage weighs 1 (the count of (micro, stage) pairs alive: 1f1b gives min(m, pp - r),
    gpipe m); with it (one entry per stage, all pp*v of them) the stage's entry: its block
    count, or any per-micro-batch size such as bytes (``ftrain.planning.plan_pipeline`` passes bytes)."""
    if not 0 <= pp_rank < pp:
        raise ValueError(f"pp_rank {pp_rank} is not in 0..{pp - 1}")
    if blocks_per_stage is not None and len(blocks_per_stage) != pp * v:
        raise ValueError(f"blocks_per_stage has {len(blocks_per_stage)} entries for {pp * v} stages")
    held = peak = 0
    for kind, _micro, stage in actions(schedule, pp, m, v)[pp_rank]:
        weight = 1 if blocks_per_stage is None else blocks_per_stage[stage]
        held += weight if kind == "F" else -weight
        peak = max(peak, held)
    return peak


def timeline(
    order: Sequence[Sequence[Action]], forward_s: float = 1.0, backward_s: float = 2.0
) -> dict[Action, tuple[float, float]]:
    """(start, end) of every action of ``order`` (one list per pipeline rank, stages
    0..max) in the earliest timeline that keeps each rank's order: the F of (micro, s) starts
    after the F of (micro, s - 1) ends, the B of (micro, s) after the B of (micro, s + 1) and
    its own F; a rank runs one action at a time; P2P costs nothing. ValueError if the order
    deadlocks (some rank waits for an action queued behind another rank's wait)."""
    last_stage = max((a[2] for rank in order for a in rank), default=0)
    done: dict[Action, tuple[float, float]] = {}
    nxt, clock = [0] * len(order), [0.0] * len(order)
    remaining = sum(len(a) for a in order)
    while remaining:
        progressed = False
        for r, mine in enumerate(order):
            while nxt[r] < len(mine):
                kind, micro, stage = action = mine[nxt[r]]
                if kind == "F":
                    deps = [("F", micro, stage - 1)] if stage > 0 else []
                else:
                    deps = [("F", micro, stage)] + ([("B", micro, stage + 1)] if stage < last_stage else [])
                if any(d not in done for d in deps):
                    break
                start = max([clock[r], *(done[d][1] for d in deps)])
                clock[r] = start + (forward_s if kind == "F" else backward_s)
                done[action] = (start, clock[r])
                nxt[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            waiting = {r: order[r][nxt[r]] for r in range(len(order)) if nxt[r] < len(order[r])}
            raise ValueError(f"the order deadlocks: each rank's next action waits for another ({waiting})")
    return done


def simulate(schedule: str, pp: int, m: int, v: int, forward_s: float = 1.0, backward_s: float = 2.0) -> float:
    """The bubble fraction of the :func:`timeline` of ``schedule``'s :func:`actions`:
    1 - busy / makespan, averaged over the ranks, with every stage's forward of a micro-batch
    taking ``forward_s`` and its backward ``backward_s`` (uniform stages).

    Against :func:`bubble_fraction`: equal for gpipe and 1f1b, whatever the two times. Equal
    for interleaved_1f1b too when m >= pp (even m not a multiple of pp); when m < pp it is larger
    (tests/unit/test_pipeline_schedule.py checks both): the (p-1)/(v*m+p-1) bound assumes rank 0
    has another micro-batch's chunk to run while the first one travels through the other ranks,
    and with fewer micro-batches than ranks it waits for that micro-batch to come round again
    before its next chunk."""
    order = actions(schedule, pp, m, v)
    spans = timeline(order, forward_s, backward_s)
    makespan = max(end for _, end in spans.values())
    busy = [sum(spans[a][1] - spans[a][0] for a in mine) for mine in order]
    return sum(1 - b / makespan for b in busy) / pp


def bubble_fraction(schedule: str, pp: int, m: int, v: int) -> float:
    """The textbook bubble fraction, idle time over total time (Narayanan et al. 2021):
    (p-1)/(m+p-1) for gpipe and 1f1b, (p-1)/(v*m+p-1) for interleaved_1f1b."""
    _check_shape(schedule, pp, m, v)
    chunks = v if schedule == "interleaved_1f1b" else 1
    return (pp - 1) / (chunks * m + pp - 1)
