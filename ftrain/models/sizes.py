"""Named sizes of the built-in Llama (``model.size``): torch-free, for config validation and ``ftrain plan``.

A size fixes the architecture keys it lists; the 1B..70B sizes are Llama 3's shapes (their vocabulary
of 128,256 tokens and RoPE base 500,000 included), the small ones are for tests and laptops.
"""

from __future__ import annotations

from typing import Any

#: ``model.size`` -> the ``[model]`` keys it sets
LLAMA_SIZES: dict[str, dict[str, Any]] = {
    "debug": {"n_layer": 2, "d_model": 64, "n_head": 4, "n_kv_heads": 2, "ffn_dim": 192},
    "tiny": {"n_layer": 4, "d_model": 128, "n_head": 4, "n_kv_heads": 2, "ffn_dim": 384},
    "small": {"n_layer": 8, "d_model": 512, "n_head": 8, "n_kv_heads": 4, "ffn_dim": 1536},
    "1B": {
        "n_layer": 16, "d_model": 2048, "n_head": 32, "n_kv_heads": 8, "ffn_dim": 8192,
        "vocab_size": 128256, "rope_theta": 500000.0, "tie_embeddings": True,
    },
    "3B": {
        "n_layer": 28, "d_model": 3072, "n_head": 24, "n_kv_heads": 8, "ffn_dim": 8192,
        "vocab_size": 128256, "rope_theta": 500000.0, "tie_embeddings": True,
    },
    "8B": {
        "n_layer": 32, "d_model": 4096, "n_head": 32, "n_kv_heads": 8, "ffn_dim": 14336,
        "vocab_size": 128256, "rope_theta": 500000.0,
    },
    "70B": {
        "n_layer": 80, "d_model": 8192, "n_head": 64, "n_kv_heads": 8, "ffn_dim": 28672,
        "vocab_size": 128256, "rope_theta": 500000.0,
    },
}  # fmt: skip


def default_ffn_dim(d_model: int) -> int:
    """SwiGLU's hidden size when ``model.ffn_dim`` is 0: 8/3 of ``d_model`` (the parameters of a 4x
    GELU MLP), rounded up to a multiple of 64."""
    return -(-(8 * d_model // 3) // 64) * 64
