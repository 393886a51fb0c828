"""What autograd really keeps for backward (CPU), for checking ``ftrain plan``'s activation formulas."""

from __future__ import annotations

import torch

from ftrain.config import ModelConfig
from ftrain.model import build_model


def saved_bytes(cfg: ModelConfig, micro: int, mode: str) -> int:
    """Bytes of the floating-point tensors saved for backward by one forward of ``micro`` sequences;
    ``mode``: fp32, autocast (bf16 autocast; its cast weight copies left out: a transient of their
    own) or mp (FSDP2's MixedPrecisionPolicy: bf16 parameters and activations)."""
    torch.manual_seed(0)
    model = build_model(cfg)
    if mode == "mp":
        model = model.to(torch.bfloat16)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params and t.is_floating_point():
            storages[ptr] = t.untyped_storage().nbytes()
        return t

    tokens = torch.randint(0, cfg.vocab_size, (micro, cfg.seq_len))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "autocast"):
            model(tokens)
    linear = sum(p.numel() for m in model.modules() if isinstance(m, torch.nn.Linear) for p in m.parameters())
    return sum(storages.values()) - (2 * linear if mode == "autocast" else 0)
