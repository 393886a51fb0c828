"""Hugging Face weights in and out: ``model.init_from`` (a local checkpoint directory) and
``ftrain ckpt export --format hf``."""

from __future__ import annotations

from torch import nn

from ftrain.config import ModelConfig


def load_hf_weights(model: nn.Module, cfg: ModelConfig) -> None:
    """Load ``cfg.init_from``'s safetensors into ``model`` (whole, on the CPU, before sharding)."""
    raise NotImplementedError("model.init_from")
