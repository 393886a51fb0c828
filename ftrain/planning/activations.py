"""What one micro-batch's activations hold at the two candidate peaks of backward: the record the
formulas fill (the GPT's in :mod:`ftrain.planning.memory`, the Llama's in
:mod:`ftrain.planning.llama_activations`, a pipeline rank's in :mod:`ftrain.planning.stages`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Activations:
    """Activation memory of one micro-batch, in bytes, at the two candidate peaks of backward."""

    layers: int
    """Saved by the blocks at the end of forward (with checkpointing: each block's input)."""
    final_norm: int
    """Saved by the final norm and the head (their inputs)."""
    loss_peak: int
    """Logits side during the loss's backward: the logits the loop holds (compute dtype), the
    fp32 log-softmax output cross-entropy saves, its incoming gradient and its result."""
    logits_held: int
    """The logits the loop keeps referencing through the rest of backward and the step."""
    recompute: int
    """With checkpointing: one block's full activations while its backward recomputes them."""

    @property
    def saved_bytes(self) -> int:
        """What autograd holds at the end of forward, the logits side aside."""
        return self.layers + self.final_norm

    @property
    def at_loss_backward(self) -> int:
        """Peak A, when backward starts at the loss (before any FSDP unit is gathered again)."""
        return self.layers + self.final_norm + self.loss_peak

    @property
    def at_last_block_backward(self) -> int:
        """Peak B, when the last block's backward starts (FSDP has gathered the root and blocks)."""
        return self.layers + self.recompute + self.logits_held
