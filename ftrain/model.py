"""Models: the reference decoder-only GPT, the built-in Llama (:mod:`ftrain.models.llama`), and
user models through ``model.factory``.

The GPT is written so every parallel strategy can take it as it is: blocks are the unit of
FSDP sharding and activation checkpointing, attention reshapes with ``view(B, T, -1, head_dim)``
so it runs on tensor-parallel local heads, and every linear layer is a plain ``nn.Linear``.
"""

from __future__ import annotations

import difflib
import importlib
import math
import pkgutil
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ftrain.config import ConfigError, ModelConfig
from ftrain.contract.config import suggest
from ftrain.models.layout import ModelLayout, Parts


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = cfg.d_model // cfg.n_head
        self.q = nn.Linear(cfg.d_model, cfg.d_model)
        self.k = nn.Linear(cfg.d_model, cfg.d_model)
        self.v = nn.Linear(cfg.d_model, cfg.d_model)
        self.out = nn.Linear(cfg.d_model, cfg.d_model)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds n_head / tp of them.
        q, k, v = (proj(x).view(b, t, -1, self.head_dim).transpose(1, 2) for proj in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.out(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model)
        self.proj = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    """Pre-LayerNorm decoder-only transformer with learned positions and an untied head."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2 initialisation; residual projections scaled by 1/sqrt(2 * n_layer)."""
        residual_std = 0.02 / math.sqrt(2 * self.cfg.n_layer)
        for name, p in self.named_parameters():
            if p.dim() == 1:
                nn.init.ones_(p) if name.endswith(("ln1.weight", "ln2.weight", "ln_f.weight")) else nn.init.zeros_(p)
            else:
                std = residual_std if name.endswith(("out.weight", "proj.weight")) else 0.02
                nn.init.normal_(p, mean=0.0, std=std)

    def ftrain_layout(self) -> ModelLayout:
        """Tensor-parallel split of each block: columns into attention/MLP, rows out of them."""
        plan = {f"blocks.*.{name}": "colwise" for name in ("attn.q", "attn.k", "attn.v", "mlp.fc")}
        plan |= {f"blocks.*.{name}": "rowwise" for name in ("attn.out", "mlp.proj")}
        return ModelLayout(
            blocks="blocks",
            embed=("tok_emb", "pos_emb"),
            head=("ln_f", "head"),
            tp_plan=plan,
            call_embed=_embed,
            call_block=_block,
            call_head=_head,
            heads=self.cfg.n_head,
            kv_heads=self.cfg.n_head,  # one key/value head per query head
        )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        if t > self.cfg.seq_len:
            raise ValueError(f"sequence of {t} tokens exceeds model.seq_len={self.cfg.seq_len}")
        pos = torch.arange(t, device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def load_factory(spec: str, key: str = "model.factory") -> Callable[[ModelConfig], nn.Module]:
    """Resolve ``"pkg.module:function"``; errors name ``key`` and what was missing (with the
    closest name there is)."""
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(key, f"cannot import module {module_name!r}: {e}{_module_hint(e)}") from e
    fn = getattr(module, attr, None)
    if not callable(fn):
        callables = [n for n in vars(module) if not n.startswith("_") and callable(getattr(module, n, None))]
        raise ConfigError(key, f"{module_name!r} has no callable {attr!r}{suggest(attr, callables)}")
    return fn


def _module_hint(e: ImportError) -> str:
    """A hint (" (did you mean 'pkg.model'?)") when the missing module has a sibling of a close name."""
    missing = getattr(e, "name", None) or ""
    parent, _, leaf = missing.rpartition(".")
    if not parent or not leaf:
        return ""
    try:
        path = getattr(importlib.import_module(parent), "__path__", None)
    except ImportError:
        return ""
    siblings = [m.name for m in pkgutil.iter_modules(path)] if path else []
    close = difflib.get_close_matches(leaf, siblings, n=1)
    return f" (did you mean {f'{parent}.{close[0]}'!r}?)" if close else ""


def _embed(parts: Parts, tokens: torch.Tensor) -> torch.Tensor:
    return parts["tok_emb"](tokens) + parts["pos_emb"](torch.arange(tokens.shape[1], device=tokens.device))


def _block(parts: Parts, block: nn.Module, x: torch.Tensor, ctx: object) -> torch.Tensor:
    return block(x)


def _head(parts: Parts, x: torch.Tensor) -> torch.Tensor:
    return parts["head"](parts["ln_f"](x))


def build_model(cfg: ModelConfig) -> nn.Module:
    """Build the configured model on the CPU in fp32 (strategies move, cast and shard it)."""
    if cfg.factory:
        model = load_factory(cfg.factory)(cfg)
        if not isinstance(model, nn.Module):
            raise ConfigError("model.factory", f"{cfg.factory} returned {type(model).__name__}, not an nn.Module")
        return model
    if cfg.arch == "llama":
        from ftrain.models.llama import Llama

        return Llama(cfg)
    return GPT(cfg)


def count_parameters(model: nn.Module) -> int:
    """Distinct parameters (a tied weight counts once)."""
    return sum(p.numel() for p in model.parameters())
