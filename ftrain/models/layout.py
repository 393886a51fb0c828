"""The model protocol: what the runtime must know of a model's structure, and how it finds out.

A model tells ftrain where its repeated blocks are (any module path: FSDP shards them one unit
each, activation checkpointing recomputes them one by one, a pipeline splits between them), how
its parts are called (so a pipeline stage can run the embeddings, some blocks or the head on
their own), and its tensor-parallel plan. It does so with a method::

    def ftrain_layout(self) -> ftrain.models.layout.ModelLayout: ...

or, for models it cannot edit, through a factory that sets that attribute on the instance (the
shipped :mod:`ftrain.models.hf` and :mod:`ftrain.models.titan` do). :func:`layout_of` reads it;
a model without one still trains under every strategy but the pipeline and tensor parallelism,
its blocks found by :func:`find_blocks` (the largest list of same-class modules). The layout is
checked at start (:mod:`ftrain.models.checks`). ``docs/models.md`` is the user's guide.

Parts are named by their paths in the whole model, so a stage's module keeps the whole model's
parameter names (checkpoints load across pipeline layouts).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

#: a container of repeated blocks
Blocks = nn.ModuleList | nn.Sequential | nn.ModuleDict
#: tensor-parallel styles a plan may name
TP_STYLES = ("colwise", "rowwise")
#: sequence-parallel roles (``parallel.sequence_parallel``): the module whose output enters the
#: sequence-sharded region (the embedding), a norm run on its sequence shard, a module whose only
#: positional input (the hidden states) is gathered back to the whole sequence before its
#: column-split layers, and the module after the region whose input is gathered (the head)
SP_STYLES = ("enter", "sequence", "gather", "exit")


class Parts:
    """A model's (or a pipeline stage's) modules and buffers by their paths in the whole model."""

    def __init__(self, root: nn.Module):
        self.root = root

    def __getitem__(self, path: str) -> Any:
        owner, _, name = path.rpartition(".")
        module = self.root.get_submodule(owner) if owner else self.root
        buffers = dict(module.named_buffers(recurse=False))
        return buffers[name] if name in buffers else module.get_submodule(name)


@dataclass(frozen=True)
class ModelLayout:
    """Where a model's parts are and how they are called.

    ``embed``/``head``: paths of the modules (or buffers) run before/after the blocks, which go
    with a pipeline's first/last stage; ``shared``: parameter-free modules or buffers every stage
    needs (rotary tables). ``call_embed(parts, tokens) -> hidden``, ``context(parts, hidden) -> ctx``
    (computed once per stage, e.g. the rotary cos/sin; None: no context),
    ``call_block(parts, block, hidden, ctx) -> hidden``, ``call_head(parts, hidden) -> logits``.
    """

    blocks: str
    embed: tuple[str, ...] = ()
    head: tuple[str, ...] = ()
    shared: tuple[str, ...] = ()
    tp_plan: Mapping[str, str] | None = None
    sp_plan: Mapping[str, str] | None = None
    """Sequence parallelism (module path, ``*`` = each block -> one of :data:`SP_STYLES`); with
    it, the tp plan's rowwise layers leave their output sharded along the sequence."""
    call_embed: Callable[[Parts, torch.Tensor], torch.Tensor] | None = None
    context: Callable[[Parts, torch.Tensor], Any] | None = None
    call_block: Callable[[Parts, nn.Module, torch.Tensor, Any], torch.Tensor] | None = None
    call_head: Callable[[Parts, torch.Tensor], torch.Tensor] | None = None
    tied: tuple[str, ...] = ()
    """Parameters the embeddings and the head share (a pipeline cannot put them on two ranks)."""
    source: str = "declared"
    """Where the layout came from: declared (``ftrain_layout()``), or found (blocks only)."""
    heads: int | None = None
    """Attention (query) heads per block; None: unknown. Tensor parallelism gives each rank
    ``heads / tp`` of them, so the tp degree must divide it (checked at start and in the plan)."""
    kv_heads: int | None = None
    """Key/value heads per block (fewer than ``heads`` under grouped-query attention); None: unknown.
    Each tensor-parallel rank runs ``kv_heads / tp`` of them."""

    @property
    def splittable(self) -> bool:
        """Whether a pipeline can cut the model: every part's call is declared."""
        return None not in (self.call_embed, self.call_block, self.call_head)

    def with_blocks_only(self, blocks: str) -> ModelLayout:
        return dataclasses.replace(self, blocks=blocks)


def tp_head_problem(tp: int, heads: int | None, kv_heads: int | None) -> str | None:
    """Why ``tp`` tensor-parallel ranks cannot split attention with these heads (each rank runs
    an equal share of the query and of the key/value heads), with the degrees that would; None if
    they can, or if the heads are unknown."""
    known = [n for n in (heads, kv_heads) if n is not None]
    if tp <= 1 or all(n % tp == 0 for n in known):
        return None
    common = math.gcd(*known)
    fits = [str(d) for d in range(1, common + 1) if common % d == 0]
    counts = ", ".join(f"{name}={n}" for name, n in (("n_head", heads), ("n_kv_heads", kv_heads)) if n is not None)
    return (
        f"{tp} does not divide the model's attention heads ({counts}): each tensor-parallel rank runs an "
        f"equal share of them; a degree of {', '.join(fits[:-1]) + ' or ' if len(fits) > 1 else ''}{fits[-1]} would"
    )


def layout_of(model: nn.Module) -> ModelLayout | None:
    """The model's declared layout, else one with the blocks :func:`find_blocks` finds, else None."""
    declare = getattr(model, "ftrain_layout", None)
    if callable(declare):
        layout = declare()
        if not isinstance(layout, ModelLayout):
            raise TypeError(
                f"{type(model).__name__}.ftrain_layout() returned {type(layout).__name__}, not a ModelLayout"
            )
        return layout
    path = find_blocks(model)
    return ModelLayout(blocks=path, source="found") if path is not None else None


def find_blocks(model: nn.Module) -> str | None:
    """The path of the model's repeated blocks: of the containers holding two or more modules of
    one class, the one with the most parameters (the decoder layers of a transformer); None if
    there is none."""
    best: tuple[int, str] | None = None
    for path, module in model.named_modules():
        if not isinstance(module, Blocks) or len(module) < 2:
            continue
        children = list(module.children())
        if len({type(c) for c in children}) != 1:
            continue
        size = sum(p.numel() for p in module.parameters())
        if best is None or size > best[0]:
            best = (size, path)
    return best[1] if best else None


def block_container(model: nn.Module) -> Blocks | None:
    """The container of the model's repeated blocks (None if it has none)."""
    layout = layout_of(model)
    if layout is None:
        return None
    blocks = model.get_submodule(layout.blocks)
    return blocks if isinstance(blocks, Blocks) else None


def block_list(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks, in order ([] if it has none)."""
    blocks = block_container(model)
    if isinstance(blocks, nn.ModuleDict):
        return list(blocks.values())
    return list(blocks or [])


def declare(model: nn.Module, layout: ModelLayout) -> nn.Module:
    """Give ``model`` (an instance, not its class) the ``ftrain_layout()`` returning ``layout``."""
    vars(model)["ftrain_layout"] = lambda: layout
    return model


def logits_of(output: Any) -> torch.Tensor:
    """A model's forward output as logits: a tensor as it is, else its ``.logits`` (Hugging Face)."""
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    raise TypeError(f"the model's forward returned {type(output).__name__}: expected logits or an output with .logits")


def expand_plan(plan: Mapping[str, str], blocks: str, block_keys: list[str]) -> dict[str, str]:
    """A tensor-parallel plan whose ``*`` stands for each block (``layers.*.mlp.up``), expanded
    over ``block_keys`` (the container's keys: indices, or a stage's subset of them)."""
    out: dict[str, str] = {}
    for fqn, style in plan.items():
        if "*" in fqn:
            for key in block_keys:
                out[fqn.replace("*", key, 1)] = style
        else:
            out[fqn] = style
    return out


def _block_keys(model: nn.Module) -> list[str]:
    blocks = block_container(model)
    return list(blocks.keys()) if isinstance(blocks, nn.ModuleDict) else [str(i) for i in range(len(blocks or []))]


def sp_plan_of(model: nn.Module) -> dict[str, str] | None:
    """The model's sequence-parallel plan with every ``*`` expanded; None if it declares none."""
    layout = layout_of(model)
    if layout is None or layout.sp_plan is None:
        return None
    return expand_plan(layout.sp_plan, layout.blocks, _block_keys(model))


def tp_plan_of(model: nn.Module) -> dict[str, str] | None:
    """The model's tensor-parallel plan with every ``*`` expanded: its layout's, else a ``tp_plan()``
    method's (the older protocol, still honoured); None if it has neither."""
    layout = layout_of(model)
    if layout is not None and layout.tp_plan is not None:
        return expand_plan(layout.tp_plan, layout.blocks, _block_keys(model))
    plan_fn = getattr(model, "tp_plan", None)
    return dict(plan_fn()) if callable(plan_fn) else None
