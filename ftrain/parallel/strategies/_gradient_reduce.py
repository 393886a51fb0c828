"""``parallel.gradient_reduce``: its values and ``auto``'s rule. Torch-free, imports nothing of ftrain.

The config checks the values (``ftrain.config``), the FSDP strategies apply the mode
(``ftrain.parallel.fsdp``) and ``ftrain plan`` counts it (``ftrain.planning.memory``); all three
take them from here, so the runtime and the plan decide ``auto`` by one rule.
"""

from __future__ import annotations

EVERY_MICRO_BATCH, LAST_MICRO_BATCH = "every_micro_batch", "last_micro_batch"
#: The values of ``parallel.gradient_reduce``.
GRADIENT_REDUCE_MODES = ("auto", EVERY_MICRO_BATCH, LAST_MICRO_BATCH)
#: The model attribute :meth:`FSDP.apply_data_parallel` records ``parallel.gradient_reduce`` in, for
#: :meth:`FSDP.make_parallel` (which the framework hands no ParallelConfig).
GRADIENT_REDUCE_ATTR = "ftrain_gradient_reduce"


def choose_gradient_reduce(setting: str, *, accum_steps: int, last_bytes: int | None, memory_bytes: int | None) -> str:
    """``parallel.gradient_reduce`` resolved. An explicit mode stays as it is. ``auto``: the mode
    that fits, then the faster: ``last_micro_batch`` (one reduction per step) when a step has one
    micro-batch per rank (both modes are the same then), when memory is not judged (``last_bytes`` or
    ``memory_bytes`` None: a CPU, whose memory is treated as fitting) or when ``last_bytes`` (the
    peak with the accumulated unsharded gradients) fits in ``memory_bytes``; ``every_micro_batch``
    otherwise, also when neither fits (it needs less)."""
    if setting != "auto":
        return setting
    if accum_steps <= 1 or last_bytes is None or memory_bytes is None or last_bytes <= memory_bytes:
        return LAST_MICRO_BATCH
    return EVERY_MICRO_BATCH
