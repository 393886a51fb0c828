"""The built-in Llama-family model (``model.arch = "llama"``): RMSNorm, rotary embeddings, SwiGLU,
grouped-query attention, optionally tied embeddings.

It computes what Hugging Face's ``LlamaForCausalLM`` computes (same RMSNorm in fp32, same
half-split rotary convention, no biases), so its weights map one to one onto a Hugging Face
checkpoint (:data:`HF_NAMES`) with no permutation. Attention views its projections as
``(B, T, -1, head_dim)``, so under tensor parallelism each rank runs its local query and
key/value heads (``n_head`` and ``n_kv_heads`` both divisible by the tp degree).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ftrain.config import ModelConfig
from ftrain.models.layout import ModelLayout, Parts


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class Rotary(nn.Module):
    """The rotary tables for ``t`` positions: (cos, sin), each ``(t, head_dim)``."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, t: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq: torch.Tensor = self.inv_freq  # type: ignore[assignment]
        freqs = torch.arange(t, device=inv_freq.device, dtype=torch.float)[:, None] * inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = cfg.d_model // cfg.n_head
        self.q = nn.Linear(cfg.d_model, cfg.n_head * self.head_dim, bias=False)
        self.k = nn.Linear(cfg.d_model, cfg.kv_heads * self.head_dim, bias=False)
        self.v = nn.Linear(cfg.d_model, cfg.kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(cfg.n_head * self.head_dim, cfg.d_model, bias=False)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds n_head / tp and n_kv_heads / tp of them
        q, k, v = (proj(x).view(b, t, -1, self.head_dim).transpose(1, 2) for proj in (self.q, self.k, self.v))
        cos, sin = rope
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0, enable_gqa=True
        )
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate = nn.Linear(cfg.d_model, cfg.swiglu_dim, bias=False)
        self.up = nn.Linear(cfg.d_model, cfg.swiglu_dim, bias=False)
        self.down = nn.Linear(cfg.swiglu_dim, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class LlamaBlock(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLU(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x = x + self.drop(self.attn(self.attn_norm(x), rope=rope))  # one positional input: see sp_plan
        return x + self.drop(self.mlp(self.mlp_norm(x)))


class Llama(nn.Module):
    """Decoder-only Llama: token embedding, ``n_layer`` blocks, a final RMSNorm and the output head."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.rope = Rotary(cfg.d_model // cfg.n_head, cfg.rope_theta)
        self.blocks = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.reset_parameters()
        if cfg.tie_embeddings:
            self.head.weight = self.tok_emb.weight

    def reset_parameters(self) -> None:
        """Normal(0, 0.02) matrices, residual projections scaled by 1/sqrt(2 * n_layer), unit norms."""
        residual_std = 0.02 / math.sqrt(2 * self.cfg.n_layer)
        for name, p in self.named_parameters():
            if p.dim() == 1:
                nn.init.ones_(p)
            else:
                std = residual_std if name.endswith(("attn.o.weight", "mlp.down.weight")) else 0.02
                nn.init.normal_(p, mean=0.0, std=std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        if t > self.cfg.seq_len:
            raise ValueError(f"sequence of {t} tokens exceeds model.seq_len={self.cfg.seq_len}")
        x = self.tok_emb(tokens)
        rope = self.rope(t, x.dtype)
        for block in self.blocks:
            x = block(x, rope)
        return self.head(self.norm(x))

    def ftrain_layout(self) -> ModelLayout:
        plan = {f"blocks.*.{name}": "colwise" for name in ("attn.q", "attn.k", "attn.v", "mlp.gate", "mlp.up")}
        plan |= {f"blocks.*.{name}": "rowwise" for name in ("attn.o", "mlp.down")}
        return ModelLayout(
            blocks="blocks",
            embed=("tok_emb",),
            head=("norm", "head"),
            shared=("rope",),
            tp_plan=plan,
            sp_plan={
                "tok_emb": "enter",
                "blocks.*.attn_norm": "sequence",
                "blocks.*.attn": "gather",
                "blocks.*.mlp_norm": "sequence",
                "blocks.*.mlp": "gather",
                "norm": "sequence",
                "head": "exit",
            },
            call_embed=_embed,
            context=_rope,
            call_block=_block,
            call_head=_head,
            tied=("tok_emb.weight",) if self.cfg.tie_embeddings else (),
            heads=self.cfg.n_head,
            kv_heads=self.cfg.kv_heads,
        )


def _embed(parts: Parts, tokens: torch.Tensor) -> torch.Tensor:
    return parts["tok_emb"](tokens)


def _rope(parts: Parts, x: torch.Tensor) -> Any:
    return parts["rope"](x.shape[1], x.dtype)


def _block(parts: Parts, block: nn.Module, x: torch.Tensor, rope: Any) -> torch.Tensor:
    return block(x, rope)


def _head(parts: Parts, x: torch.Tensor) -> torch.Tensor:
    return parts["head"](parts["norm"](x))


#: ftrain's parameter names -> Hugging Face ``LlamaForCausalLM``'s (``{i}``: the block index)
HF_NAMES = {
    "tok_emb.weight": "model.embed_tokens.weight",
    "blocks.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blocks.{i}.attn.q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blocks.{i}.attn.k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blocks.{i}.attn.v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blocks.{i}.attn.o.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blocks.{i}.mlp_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blocks.{i}.mlp.gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blocks.{i}.mlp.up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blocks.{i}.mlp.down.weight": "model.layers.{i}.mlp.down_proj.weight",
    "norm.weight": "model.norm.weight",
    "head.weight": "lm_head.weight",
}


def hf_name_map(n_layer: int) -> dict[str, str]:
    """Every parameter's ftrain name -> its Hugging Face name, for a model of ``n_layer`` blocks."""
    out: dict[str, str] = {}
    for ours, theirs in HF_NAMES.items():
        if "{i}" in ours:
            out |= {ours.format(i=i): theirs.format(i=i) for i in range(n_layer)}
        else:
            out[ours] = theirs
    return out


def hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """The ``config.json`` of a Hugging Face ``LlamaForCausalLM`` that computes what ``Llama(cfg)`` does."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.swiglu_dim,
        "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.d_model // cfg.n_head,
        "max_position_embeddings": cfg.seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "rope_theta": cfg.rope_theta,
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
