"""torchtitan-style models under every strategy: ``model.factory = "ftrain.models.titan:causal_lm"``.

A torchtitan-style decoder (torchtitan's llama3 ``Transformer`` and models written like it) has
``tok_embeddings``, ``layers`` (an ``nn.ModuleDict`` keyed "0", "1", ...), ``norm``, ``output`` and
the rotary table ``freqs_cis`` as a buffer of the root; each layer is called as
``layer(h, freqs_cis)`` and has ``attention.{wq,wk,wv,wo}`` and ``feed_forward.{w1,w2,w3}``.
``[model.args] builder = "pkg.module:function"`` names the function that builds it (called with
the ModelConfig, like any factory); this module declares its layout (:func:`titan_layout`), its
heads read from what the model exposes (:func:`titan_heads`).

torchtitan's default build fuses q, k and v into one module whose state-dict keys are not its
attributes; the start-up check (:mod:`ftrain.models.checks`) refuses it with the fix.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ftrain.config import ConfigError, ModelConfig
from ftrain.model import load_factory
from ftrain.models.layout import ModelLayout, Parts, declare

#: what a torchtitan-style model has
PARTS = ("tok_embeddings", "layers", "norm", "output")


def causal_lm(cfg: ModelConfig) -> nn.Module:
    """The factory: ``model.args.builder``'s model, its layout declared."""
    builder = cfg.args.get("builder")
    if not isinstance(builder, str) or ":" not in builder:
        raise ConfigError("model.args.builder", f'expected "pkg.module:function" building the model, got {builder!r}')
    model = load_factory(builder, "model.args.builder")(cfg)
    if not isinstance(model, nn.Module):
        raise ConfigError("model.args.builder", f"{builder} returned {type(model).__name__}, not an nn.Module")
    return declare_layout(model)


def declare_layout(model: nn.Module) -> nn.Module:
    """Give a torchtitan-style model its ``ftrain_layout()`` (a user's factory can call this)."""
    return declare(model, titan_layout(model))


def titan_layout(model: nn.Module) -> ModelLayout:
    missing = [p for p in PARTS if not isinstance(getattr(model, p, None), nn.Module)]
    if "freqs_cis" not in dict(model.named_buffers(recurse=False)):
        missing.append("the freqs_cis buffer")
    if missing:
        raise ConfigError(
            "model.args.builder", f"{type(model).__name__} is not torchtitan-shaped: it lacks {', '.join(missing)}"
        )
    plan = {f"layers.*.attention.{w}": "colwise" for w in ("wq", "wk", "wv")}
    plan |= {"layers.*.attention.wo": "rowwise", "layers.*.feed_forward.w2": "rowwise"}
    plan |= {f"layers.*.feed_forward.{w}": "colwise" for w in ("w1", "w3")}
    tied = getattr(model.output, "weight", None) is getattr(model.tok_embeddings, "weight", 0)
    heads, kv_heads = titan_heads(model)
    return ModelLayout(
        blocks="layers",
        embed=("tok_embeddings",),
        head=("norm", "output"),
        shared=("freqs_cis",),
        tp_plan=plan,
        call_embed=_embed,
        call_block=_layer,
        call_head=_head,
        tied=("output.weight",) if tied else (),
        heads=heads,
        kv_heads=kv_heads,
    )


def titan_heads(model: nn.Module) -> tuple[int | None, int | None]:
    """The attention and key/value heads of a torchtitan-style model: its first layer's
    ``attention.n_heads`` / ``n_kv_heads`` (torchtitan's ``Attention``), else its ``model_args``'
    (``n_kv_heads`` None: one per query head, as torchtitan reads it), else the widths of
    ``attention.wq`` / ``wk`` over ``attention.head_dim``; None for what none of them tells."""
    attention = getattr(next(iter(model.get_submodule("layers").children()), None), "attention", None)
    args = getattr(model, "model_args", None)
    for owner in (attention, args):
        heads = _count(getattr(owner, "n_heads", None))
        if heads is not None:
            return heads, _count(getattr(owner, "n_kv_heads", None)) or heads
    head_dim = _count(getattr(attention, "head_dim", None))
    wq, wk = getattr(attention, "wq", None), getattr(attention, "wk", None)
    if head_dim and isinstance(wq, nn.Linear) and isinstance(wk, nn.Linear):
        return wq.out_features // head_dim, wk.out_features // head_dim
    return None, None


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _embed(parts: Parts, tokens: torch.Tensor) -> torch.Tensor:
    return parts["tok_embeddings"](tokens)


def _layer(parts: Parts, layer: nn.Module, x: torch.Tensor, ctx: Any) -> torch.Tensor:
    return layer(x, parts["freqs_cis"])


def _head(parts: Parts, x: torch.Tensor) -> torch.Tensor:
    return parts["output"](parts["norm"](x))
