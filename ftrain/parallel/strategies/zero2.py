"""zero2: FSDP2 with ``reshard_after_forward=False`` (ZeRO-2). Gradients and optimizer state
sharded over every rank, gradients reduce-scattered; parameters are sharded between steps but
each unit stays gathered from its forward to the end of its backward (no second all-gather).
No rank holds a replica.
"""

from __future__ import annotations

from ftrain.parallel.strategies.fsdp import FSDP


class Zero2(FSDP):
    name = "zero2"
    position = 2
    preference = 2
    reshard_after_forward = False
    textbook_difference = (
        "fp32 shards and grads with bf16/fp32 units gathered on demand: 16Ψ/N + transients, not 2Ψ + 14Ψ/N"
    )

    def textbook_model_state_bytes(self, num_params: int, *, shard: int, tp_split: int, tp: int) -> int:
        return 2 * num_params + 14 * num_params // shard


STRATEGY = Zero2()
