"""Pipeline parallelism with ``torch.distributed.pipelining``: the model's blocks in stages over
``parallel.pp_size`` ranks, the strategy (ddp, fsdp, tp, fsdp+tp) inside each stage.

The job's mesh is ``pp x`` the strategy's own (``dp``, ``tp``), so rank = pp_rank x inner +
inner_rank. A rank keeps only its stages' parts of the model in one :class:`PipelineModule` (the
embeddings on stage 0's rank, the norm and head on the last stage's: the model's
:class:`~ftrain.models.layout.ModelLayout` says which parts those are and how each is called),
under the model's own parameter names: ``blocks.5.attn.q.weight`` (or a Hugging Face model's
``model.layers.5.self_attn.q_proj.weight``) is called that at any ``pp_size`` and without a
pipeline, so DCP checkpoints (``get_state_dict`` of that module, as for every strategy) load
across layouts and ``ftrain ckpt export`` gives the whole model. Each stage is a
:class:`PipelineModule` over the same submodules; with ``interleaved_1f1b`` a rank runs several.

One step: the rank's micro-batches (the accumulation settings) go through the schedule, whose
loss is the mean per micro-batch and whose gradients are scaled by 1 / micro-batches, as without
a pipeline. Then the data-parallel reduction: under FSDP2 the stage turns gradient sync off for
every backward and reduce-scatters once at the end of the schedule (its units stay gathered
from the first backward on: ``ftrain plan`` counts it); under ddp one flat all-reduce over the
stage's ``dp`` group after the schedule (the stage would drive DDP's reducer through its
internals, and one reduction per step is what a pipeline needs anyway). Clipping takes the squared norms
of all stages (an all-reduce over ``pp``), so the norm is the whole model's.

Phases: a stage's forward and backward chunks are timed as ``forward`` and ``backward``; the rest
of the schedule's time is waiting on the neighbours (``comm_wait``), and its share of the schedule
is the step's measured bubble (:attr:`PipelineParallel.last_bubble`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from ftrain.config import Config, ConfigError
from ftrain.models.deferred_init import RECIPES, materialize
from ftrain.models.layout import ModelLayout, Parts, block_list, expand_plan, layout_of, logits_of
from ftrain.optim import param_groups
from ftrain.parallel import strategies
from ftrain.parallel.activation_checkpointing import checkpoint_blocks
from ftrain.parallel.base import Parallel
from ftrain.parallel.grad_norm import clip_grad_norm
from ftrain.parallel.pipeline_schedule import check_micro_batches
from ftrain.parallel.pipeline_stages import local_stages, stage_blocks, virtual_stages
from ftrain.parallel.strategies import Layout, Wrapper

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class PipelineModule(nn.Module):
    """Some of a model's parts under their paths in the whole model (its :class:`ModelLayout`
    says which): the shared parts, the embeddings (``first``), the blocks ``block_ids`` (keyed
    by their index in the whole model) and the head (``last``)."""

    def __init__(
        self, source: nn.Module, layout: ModelLayout, block_ids: list[int] | range, *, first: bool, last: bool
    ):
        super().__init__()
        self.layout = layout
        self.first, self.last = first, last
        for path in (*layout.shared, *(layout.embed if first else ()), *(layout.head if last else ())):
            _attach(self, path, source)
        blocks = source.get_submodule(layout.blocks)  # a container in the whole model, a ModuleDict here
        owner, name = _owner(self, layout.blocks)
        owner.add_module(name, nn.ModuleDict({str(i): blocks.get_submodule(str(i)) for i in block_ids}))

    def ftrain_layout(self) -> ModelLayout:
        names = {name for name, _ in self.named_modules()}
        keys = list(self.get_submodule(self.layout.blocks).keys())  # type: ignore[operator]  # a ModuleDict
        plan = expand_plan(self.layout.tp_plan, self.layout.blocks, keys) if self.layout.tp_plan else None
        if plan is not None:
            plan = {fqn: style for fqn, style in plan.items() if fqn in names}
        return dataclasses.replace(self.layout, tp_plan=plan)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        layout, parts = self.layout, Parts(self)
        assert layout.call_embed and layout.call_block and layout.call_head  # checked by build_pipeline
        if self.first:
            x = layout.call_embed(parts, x)
        ctx = layout.context(parts, x) if layout.context is not None else None
        for block in self.get_submodule(layout.blocks).children():
            x = layout.call_block(parts, block, x, ctx)
        if self.last:
            x = logits_of(layout.call_head(parts, x))
        return x


def _owner(root: nn.Module, path: str) -> tuple[nn.Module, str]:
    """The module that holds ``path``'s last name under ``root`` (empty modules made for the
    owners it lacks), and that name."""
    owner = root
    *owners, name = path.split(".")
    for step in owners:
        children = dict(owner.named_children())
        if step not in children:
            owner.add_module(step, nn.Module())
        owner = owner.get_submodule(step)
    return owner, name


def _attach(root: nn.Module, path: str, source: nn.Module) -> None:
    """Put the module or buffer at ``path`` in ``source`` at the same path under ``root``."""
    owner, name = _owner(root, path)
    source_owner, _ = _owner(source, path)
    buffers = dict(source_owner.named_buffers(recurse=False))
    if name in buffers:
        persistent = name in source_owner.state_dict(keep_vars=True)
        owner.register_buffer(name, buffers[name], persistent=persistent)
    else:
        owner.add_module(name, source_owner.get_submodule(name))


def pipeline_layout(model: nn.Module) -> ModelLayout:
    """The model's layout, if a pipeline can cut it; ConfigError naming the protocol if not."""
    layout = layout_of(model)
    if layout is None or not layout.splittable:
        raise ConfigError(
            "parallel.pp_size",
            f"{type(model).__name__} cannot be split into pipeline stages: it declares no ftrain_layout() saying how "
            "its embeddings, blocks and head are called (docs/models.md; Hugging Face causal LMs: "
            'model.factory = "ftrain.models.hf:causal_lm")',
        )
    if layout.tied:
        raise ConfigError(
            "parallel.pp_size",
            f"{type(model).__name__} ties {', '.join(layout.tied)} between its embeddings and its head, which a "
            "pipeline puts on different ranks: untie them (model.tie_embeddings = false; Hugging Face: "
            "tie_word_embeddings = false in model.args) or use parallel.pp_size = 1",
        )
    return layout


def job_mesh(layout: Layout, device: torch.device) -> tuple[DeviceMesh, DeviceMesh]:
    """The ``pp x`` inner mesh of the job, and the inner (one stage's ``dp``/``tp``) submesh."""
    shape, names = layout.mesh_shape or ((layout.dp_size,), ("dp",))
    mesh = init_device_mesh(device.type, (layout.pp_size, *shape), mesh_dim_names=("pp", *names))
    return mesh, mesh[names if len(names) > 1 else names[0]]


def build_pipeline(
    model: nn.Module, cfg: Config, layout: Layout, device: torch.device, compute_dtype: torch.dtype, accum: int
) -> PipelineParallel:
    """``model`` (whole, on the CPU) cut to this rank's stages, split, sharded and scheduled."""
    parts = pipeline_layout(model)
    parallel = cfg.parallel
    strategy = strategies.get(layout.strategy)
    v = virtual_stages(parallel)
    num_stages = layout.pp_size * v
    check_micro_batches(parallel.pp_schedule, layout.pp_size, accum, v)
    blocks_of = stage_blocks(parallel, len(block_list(model)))
    mine = local_stages(layout.pp_rank, layout.pp_size, v)
    mesh, inner = job_mesh(layout, device)
    recipes = getattr(model, RECIPES, None)  # a deferred model: this rank's stages materialized below
    kept = PipelineModule(
        model, parts, [b for s in mine for b in blocks_of[s]], first=0 in mine, last=num_stages - 1 in mine
    )
    if recipes is None:
        kept = kept.to(device)
    del model  # what this rank does not run is freed once the caller drops the model too
    strategy.apply_tensor_parallel(kept, inner, sequence_parallel=False)  # refused with a pipeline (config)
    if parallel.activation_checkpointing:
        checkpoint_blocks(kept)
    chunks: list[nn.Module] = [
        PipelineModule(kept, parts, blocks_of[s], first=s == 0, last=s == num_stages - 1) for s in mine
    ]
    if strategy.wrapper is Wrapper.FSDP:
        chunks = [strategy.apply_data_parallel(c, parallel, layout, inner, device, compute_dtype) for c in chunks]
    if recipes is not None:
        for chunk in chunks:  # each FSDP unit resets its shards as it is materialized
            materialize(chunk, device, recipes)
        materialize(kept, device, recipes)  # what no chunk holds (buffers), moved
    optimizer = strategy.make_optimizer(param_groups(kept, cfg.optim), cfg.optim)
    pp_group = mesh.get_group("pp")
    dp_group = inner.get_group("dp") if "dp" in (inner.mesh_dim_names or ()) else None
    return PipelineParallel(
        kept,
        optimizer,
        layout,
        device,
        compute_dtype,
        stages=[PipelineStage(c, s, num_stages, device, group=pp_group) for c, s in zip(chunks, mine, strict=True)],
        schedule_name=parallel.pp_schedule,
        accum=accum,
        pp_group=pp_group,
        dp_group=dp_group if strategy.wrapper is Wrapper.DDP and layout.dp_size > 1 else None,
        fsdp=strategy.wrapper is Wrapper.FSDP,
    )


class PipelineParallel(Parallel):
    """This rank's stages and their schedule; :meth:`run` is one step's forwards and backwards."""

    def __init__(
        self,
        model: PipelineModule,
        optimizer: torch.optim.Optimizer,
        layout: Layout,
        device: torch.device,
        compute_dtype: torch.dtype,
        *,
        stages: list[PipelineStage],
        schedule_name: str,
        accum: int,
        pp_group: dist.ProcessGroup,
        dp_group: dist.ProcessGroup | None,
        fsdp: bool,
    ):
        super().__init__(model, optimizer, layout, device, compute_dtype)
        self.uses_autocast = not fsdp  # FSDP's MixedPrecisionPolicy casts
        self.stages = stages
        self.first = any(s.is_first for s in stages)
        self.last = any(s.is_last for s in stages)
        self.pp_group = pp_group
        self.dp_group = dp_group
        self._loss_fn: LossFn | None = None
        if schedule_name == "interleaved_1f1b":
            self.schedule: Any = ScheduleInterleaved1F1B(list(stages), n_microbatches=accum, loss_fn=self._loss)
        else:
            cls = ScheduleGPipe if schedule_name == "gpipe" else Schedule1F1B
            self.schedule = cls(stages[0], n_microbatches=accum, loss_fn=self._loss)
        self.last_bubble = 0.0  #: the last step: share of the schedule's time spent waiting on neighbours
        self._compute_s = 0.0  #: the step in progress: seconds in its stages' forward and backward chunks
        self._phases: Any = None  #: the step in progress: where its times go (ftrain.observability.step_phases)
        for stage in stages:  # timed for good: the phases and the bubble of every step
            stage.forward_one_chunk = self._timed(stage.forward_one_chunk, "forward")  # type: ignore[method-assign]
            stage.backward_one_chunk = self._timed(stage.backward_one_chunk, "backward")  # type: ignore[method-assign]

    def _loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        assert self._loss_fn is not None
        return self._loss_fn(output, target)

    def _timed(self, fn: Callable[..., Any], phase: str) -> Callable[..., Any]:
        """``fn`` (a stage's chunk of compute), its time counted as ``phase`` of the step in progress."""

        def call(*args: Any, **kwargs: Any) -> Any:
            began = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - began
                self._compute_s += elapsed
                self._phases.add(phase, elapsed)

        return call

    def run(self, tokens: torch.Tensor, loss_fn: LossFn, phases: Any) -> list[torch.Tensor]:
        """One step's micro-batches (``tokens``: this rank's, concatenated, inputs and targets
        one apart) through the schedule; the micro-batch losses on the last stage's rank, [] elsewhere."""
        self._loss_fn, self._phases, self._compute_s = loss_fn, phases, 0.0
        losses: list[torch.Tensor] = []
        args = (tokens[:, :-1],) if self.first else ()
        kwargs: dict[str, Any] = {"target": tokens[:, 1:], "losses": losses} if self.last else {}
        began = time.perf_counter()
        with self.autocast():
            self.schedule.step(*args, return_outputs=False, **kwargs)  # the losses are all this loop needs
        wall = time.perf_counter() - began
        phases.add("comm_wait", max(0.0, wall - self._compute_s))
        self.last_bubble = max(0.0, 1.0 - self._compute_s / wall) if wall > 0 else 0.0
        return [loss.detach() for loss in losses]

    def reduce_gradients(self) -> None:
        """ddp inside the stage: the mean of the stage's gradients over its data-parallel ranks."""
        if self.dp_group is None:
            return
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.dp_group)
        flat /= self.layout.dp_size
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    def clip_grad_norm(self, max_norm: float) -> float:
        return clip_grad_norm(self.model.parameters(), max_norm, across=self.pp_group)

    def full_state_dict(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """The whole model's state on rank 0 (every stage's, gathered from the first rank of each)."""
        options = StateDictOptions(full_state_dict=True)  # every rank of a stage gets its stage whole
        model_sd = get_model_state_dict(self.model, options=options)
        optim_sd = get_optimizer_state_dict(self.model, self.optimizer, options=options)
        mine = None
        if self.layout.dp_rank == 0 and self.layout.tp_rank == 0:
            mine = (_to_cpu(model_sd), _to_cpu(optim_sd.get("state", {})))
        parts: list[Any] = [None] * self.layout.world_size if self.layout.rank == 0 else []
        dist.gather_object(mine, parts if self.layout.rank == 0 else None, dst=0)
        if self.layout.rank != 0:
            return {}, {}
        model_all: dict[str, Any] = {}
        state_all: dict[str, Any] = {}
        for part in parts:
            if part is not None:
                model_all.update(part[0])
                state_all.update(part[1])
        return model_all, {"state": state_all}


def _to_cpu(tree: Any) -> Any:
    if torch.is_tensor(tree):
        return tree.detach().cpu()
    if isinstance(tree, dict):
        return {k: _to_cpu(v) for k, v in tree.items()}
    return tree
