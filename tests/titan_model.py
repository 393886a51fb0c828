"""A torchtitan-shaped decoder (``tok_embeddings``, a ModuleDict of ``layers`` called as
``layer(h, freqs_cis)``, ``norm``, ``output``, a root ``freqs_cis`` buffer), written like
torchtitan's llama3 for ``model.factory = "ftrain.models.titan:causal_lm"`` with
``model.args.builder = "tests.titan_model:build"``; ``fused = true`` fuses q, k and v into one
module whose state-dict keys (wq, wk, wv) are not its attributes, as torchtitan's default build does."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _freqs(head_dim: int, seq_len: int) -> torch.Tensor:
    inv = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    return torch.polar(torch.ones(seq_len, head_dim // 2), torch.outer(torch.arange(seq_len).float(), inv))


def _rotate(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * freqs[: x.shape[1], None, :]).flatten(3).type_as(x)


class FusedQKVLinear(nn.Module):
    """q, k and v in one weight, saved as three (a state-dict hook renames them)."""

    def __init__(self, dim: int):
        super().__init__()
        self.wqkv = nn.Linear(dim, 3 * dim, bias=False)
        self._register_state_dict_hook(FusedQKVLinear._split)

    @staticmethod
    def _split(module, state_dict, prefix, local_metadata):
        fused = state_dict.pop(prefix + "wqkv.weight")
        for name, part in zip(("wq", "wk", "wv"), fused.chunk(3), strict=True):
            state_dict[f"{prefix}{name}.weight"] = part
        return state_dict

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.wqkv(x).chunk(3, dim=-1)


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int, fused: bool):
        super().__init__()
        self.head_dim = dim // n_heads
        self.fused = FusedQKVLinear(dim) if fused else None
        if not fused:
            self.wq, self.wk, self.wv = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        qkv = self.fused(x) if self.fused is not None else (self.wq(x), self.wk(x), self.wv(x))
        q, k, v = (y.view(b, t, -1, self.head_dim) for y in qkv)
        q, k = _rotate(q, freqs_cis), _rotate(k, freqs_cis)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1, self.w3 = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, dim: int, n_heads: int, fused: bool):
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.attention = Attention(dim, n_heads, fused)
        self.feed_forward = FeedForward(dim, 3 * dim)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, vocab: int, dim: int, n_layers: int, n_heads: int, seq_len: int, fused: bool = False):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.register_buffer("freqs_cis", _freqs(dim // n_heads, seq_len), persistent=False)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(dim, n_heads, fused) for i in range(n_layers)})
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis)
        return self.output(self.norm(h))


def build(cfg) -> Transformer:
    return Transformer(
        cfg.vocab_size, cfg.d_model, cfg.n_layer, cfg.n_head, cfg.seq_len, fused=bool(cfg.args.get("fused", False))
    )
