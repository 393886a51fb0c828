"""Checks of a model before its first step, so that what would crash later (at the first save, in
a pipeline stage, inside torch's tensor parallelism) fails at start with the module and the fix.

- Its state dict's keys are its parameters' and persistent buffers' names: distributed
  checkpointing (``get_state_dict``) maps one onto the other, and a module that renames its keys
  (torchtitan's fused QKV) breaks the first save.
- Its layout's paths exist: the blocks are a container of modules; the embeddings, head and
  shared parts are there; every module a tensor-parallel plan names exists and is a linear layer.
- The tensor-parallel degree divides the attention heads and key/value heads the layout declares
  (else the first forward fails on a reshape, naming neither the setting nor the fix).
- A layout that a pipeline splits reproduces the model's own forward (one short sequence).
- FSDP or activation checkpointing with no repeated blocks found is a warning naming the fix.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from ftrain.config import Config, ConfigError
from ftrain.models.layout import (
    TP_STYLES,
    Blocks,
    ModelLayout,
    Parts,
    layout_of,
    logits_of,
    tp_head_problem,
    tp_plan_of,
)
from ftrain.parallel import strategies
from ftrain.parallel.strategies import Wrapper

log = logging.getLogger(__name__)


def check_model(model: nn.Module, cfg: Config, *, tp_size: int | None = None) -> None:
    """Every check above for ``model`` as ``cfg`` will train it; ConfigError naming the problem.
    ``tp_size``: the job's tensor-parallel degree (the rank layout's); None: the one ``cfg`` fixes
    whatever the world size (:func:`configured_tp_size`)."""
    check_state_dict_names(model)
    layout = layout_of(model)
    if layout is not None:
        check_layout_paths(model, layout)
    strategy = strategies.get(cfg.parallel.strategy)
    if strategy.needs_tp_plan:
        check_tp_plan(model, cfg)
        if layout is not None:
            check_tp_heads(layout, tp_size if tp_size is not None else configured_tp_size(cfg))
    if layout is None or layout.source == "found":
        wants = [
            *(["parallel.strategy = " + cfg.parallel.strategy] if strategy.wrapper is Wrapper.FSDP else []),
            *(["parallel.activation_checkpointing"] if cfg.parallel.activation_checkpointing else []),
        ]
        if wants and layout is None:
            log.warning(
                "%s has no repeated blocks that %s could work on one by one: it runs as one unit. Declare "
                "them in an ftrain_layout() (docs/models.md).",
                type(model).__name__,
                " and ".join(wants),
            )
        elif wants:
            assert layout is not None
            log.info(
                "%s: %s work on the blocks at %r (found; no ftrain_layout())",
                type(model).__name__,
                wants,
                layout.blocks,
            )
    if cfg.parallel.pp_size > 1 and layout is not None and layout.splittable:
        if any(p.is_meta for p in model.parameters()):  # deferred (ftrain.models.deferred_init): no values yet
            log.info(
                "%s: the pipeline's calls of its layout are not compared with its forward (its weights are not "
                "built on every rank); train it once with parallel.pp_size = 1 after changing ftrain_layout()",
                type(model).__name__,
            )
        else:
            check_pipeline_calls(model, layout, cfg.model.seq_len)


def check_state_dict_names(model: nn.Module) -> None:
    """The state dict's keys are the module tree's parameter and persistent buffer names."""
    params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    buffers = {name for name, _ in model.named_buffers(remove_duplicate=False)}  # non-persistent ones are not saved
    keys = set(model.state_dict().keys())
    extra, lost = sorted(keys - params - buffers), sorted(params - keys)
    if not extra and not lost:
        return
    culprit = _owner_of(model, (extra or lost)[0])
    reports = [k.removeprefix(culprit + ".") for k in extra if k.startswith(culprit + ".")]
    holds = [k.removeprefix(culprit + ".") for k in lost if k.startswith(culprit + ".")]
    others = len({_owner_of(model, k) for k in (extra or lost)} - {culprit})
    raise ConfigError(
        "model.factory",
        f"the state dict of {type(model).__name__} does not name its parameters: module {culprit!r} "
        f"({type(model.get_submodule(culprit)).__name__}) saves {', '.join(reports) or 'nothing'} but holds "
        f"{', '.join(holds) or 'nothing'}"
        + (f" (and {others} more module(s) like it)" if others else "")
        + ". Distributed checkpointing maps state-dict keys onto parameters, so the "
        "first save would fail. Build the model without key-renaming modules (torchtitan: separate wq/wk/wv "
        "projections instead of the fused QKV), or drop the module's state-dict hooks.",
    )


def _owner_of(model: nn.Module, key: str) -> str:
    """The deepest module whose path prefixes ``key``."""
    best = ""
    for name, _ in model.named_modules():
        if name and key.startswith(name + ".") and len(name) > len(best):
            best = name
    return best


def check_layout_paths(model: nn.Module, layout: ModelLayout) -> None:
    where = f"{type(model).__name__}.ftrain_layout()"
    try:
        blocks = model.get_submodule(layout.blocks)
    except AttributeError:
        raise ConfigError("model.factory", f"{where}: blocks {layout.blocks!r} is not a module of the model") from None
    if not isinstance(blocks, Blocks):
        raise ConfigError(
            "model.factory",
            f"{where}: blocks {layout.blocks!r} is a {type(blocks).__name__}, "
            "not an nn.ModuleList, ModuleDict or Sequential",
        )
    parts = Parts(model)
    for path in (*layout.embed, *layout.head, *layout.shared):
        try:
            parts[path]
        except AttributeError:
            raise ConfigError(
                "model.factory", f"{where}: part {path!r} is not a module or buffer of the model"
            ) from None


def check_tp_plan(model: nn.Module, cfg: Config) -> None:
    """Every module the plan names exists and is a linear layer; heads split evenly."""
    plan = tp_plan_of(model)
    if plan is None:
        return  # the strategy says so, naming the protocol
    for fqn, style in plan.items():
        if style not in TP_STYLES:
            raise ConfigError(
                "parallel.strategy",
                f"the tensor-parallel plan's {fqn!r}: style {style!r} is not one of {', '.join(TP_STYLES)}",
            )
        try:
            module = model.get_submodule(fqn)
        except AttributeError:
            raise ConfigError(
                "parallel.strategy",
                f"the tensor-parallel plan of {type(model).__name__} names {fqn!r}, which is not a module of the model",
            ) from None
        if not isinstance(module, nn.Linear):
            raise ConfigError(
                "parallel.strategy",
                f"the tensor-parallel plan names {fqn!r}, a {type(module).__name__}: only nn.Linear splits",
            )


def configured_tp_size(cfg: Config) -> int:
    """The tensor-parallel degree ``cfg`` sets whatever the world size: ``parallel.tp_size``, or
    fsdp+tp's default of 2; 1 where it is the world size (tp with ``parallel.tp_size`` = 0)."""
    return cfg.parallel.tp_size or strategies.fixed_tp_size(cfg.parallel)


def check_tp_heads(layout: ModelLayout, tp_size: int) -> None:
    """``tp_size`` divides the heads and key/value heads the layout declares (unknown ones pass)."""
    problem = tp_head_problem(tp_size, layout.heads, layout.kv_heads)
    if problem is not None:
        raise ConfigError("parallel.tp_size", problem)


def check_pipeline_calls(model: nn.Module, layout: ModelLayout, seq_len: int) -> None:
    """The layout's calls, part by part, give the model's own logits for one short sequence."""
    tokens = torch.arange(min(8, seq_len)).unsqueeze(0) % 2
    parts = Parts(model)
    training = model.training
    model.eval()  # no dropout: the two paths must agree
    try:
        got, expected = _both_ways(model, layout, parts, tokens)
    finally:
        model.train(training)
    if got.shape != expected.shape or not torch.allclose(got, expected, rtol=1e-4, atol=1e-5):
        raise ConfigError(
            "parallel.pp_size",
            f"{type(model).__name__}.ftrain_layout(): calling its embeddings, blocks and head one by one does not give "
            "the model's own logits, so its pipeline stages would compute another model: check call_embed, context, "
            "call_block and call_head against the model's forward (docs/models.md)",
        )


def _both_ways(
    model: nn.Module, layout: ModelLayout, parts: Parts, tokens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    assert layout.call_embed and layout.call_block and layout.call_head
    with torch.no_grad():
        expected = logits_of(model(tokens))
        x = layout.call_embed(parts, tokens)
        ctx = layout.context(parts, x) if layout.context is not None else None
        blocks = model.get_submodule(layout.blocks)
        for block in blocks.children():
            x = layout.call_block(parts, block, x, ctx)
        got = logits_of(layout.call_head(parts, x))
    return got, expected
