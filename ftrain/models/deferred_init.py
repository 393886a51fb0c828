"""Build a model without its weights, then give each rank only the weights it holds.

A sharding strategy (fsdp, zero2, hsdp, tp, fsdp+tp, pipelines) would otherwise build the whole
fp32 model on every rank before cutting it up: 262 GiB for a 70B Llama. :func:`build_deferred`
builds the model with every parameter on the meta device (no memory) while keeping the exact
random stream of a normal build, and :func:`materialize` later fills each rank's parameters —
whole, sharded DTensors or pipeline stages — with the values a normal build would have given
them, one parameter at a time. The weights are bitwise those of ``torch.manual_seed(seed);
build()``, at any world size and layout: the parity and bitwise tests hold, and a job resharded
between layouts starts from the same model.

How: while the model is built,

- every parameter registered (``module.weight = nn.Parameter(...)``) is swapped for a meta one of
  the same shape (the value it was created with is kept until something overwrites it, so a
  parameter made by ``torch.ones`` keeps its ones);
- every in-place op on a parameter is recorded: a random fill (``normal_``, ``uniform_``, ...:
  ops tagged ``nondeterministic_seeded``) with the generator's state before it, and then run on a
  scratch tensor of the parameter's shape so the generator moves on exactly as it would have; a
  fill or copy replaces what was recorded; other in-place ops (``mul_``, ``clamp_``,
  ``erfinv_``) are kept in order after it;
- torch.nn.init's functions that do nothing on a meta tensor (``trunc_normal_``, ``orthogonal_``,
  ...: :data:`SKIP_META`) are recorded as one call, run on a scratch tensor the same way.

:func:`materialize` replays a parameter's ops on one CPU tensor of its full shape, with the
recorded generator states, and copies this rank's part out of it. Host memory at start-up is the
model's buffers, the largest single parameter and this rank's share — not the model.

A build this cannot record (an in-place op on part of a parameter, an op that mixes a parameter
with another meta tensor, a parameter whose value comes from another parameter) is built the
normal way instead, from the same random state, and a log line says why.
"""

from __future__ import annotations

import inspect
import logging
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

log = logging.getLogger(__name__)

#: the attribute of a deferred model that holds its recipes (parameter name -> Recipe)
RECIPES = "_ftrain_deferred_recipes"
#: the names module wrappers put into a parameter's path (activation checkpointing, torch.compile)
WRAPPER_NAMES = ("_checkpoint_wrapped_module", "_orig_mod")


@dataclass
class Step:
    """One in-place op on a parameter: ``func(param, *args, **kwargs)`` (the parameter's place in
    ``args`` holds None), with the generator's state before it for a random op."""

    func: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    rng_state: torch.Tensor | None = None


@dataclass
class Recipe:
    """How to make one parameter's value: its first value (a tensor made at creation, or None when
    a fill replaced it), then the in-place ops applied to it."""

    shape: torch.Size
    dtype: torch.dtype
    initial: torch.Tensor | None
    steps: list[Step] = field(default_factory=list)

    def value(self, scratch: Scratch) -> torch.Tensor:
        """The parameter's value a normal build gives it, on the CPU, in ``scratch``'s memory
        (valid until its next use)."""
        out = scratch.get(self.shape, self.dtype)
        if self.initial is not None:
            out.copy_(self.initial)
        for step in self.steps:
            kwargs = dict(step.kwargs)
            if step.rng_state is not None:
                generator = torch.Generator()
                generator.set_state(step.rng_state)
                kwargs["generator"] = generator
            step.func(out, *step.args, **kwargs)
        return out


class Scratch:
    """One CPU buffer per dtype, grown to the largest tensor asked for. Random fills run, and
    values are made, in memory that is reused rather than allocated and freed per parameter:
    glibc serves such sizes from its heap once it has freed a larger block, and kept ~1.3x the
    model resident when each parameter had a tensor of its own (measured)."""

    def __init__(self) -> None:
        self.buffers: dict[torch.dtype, torch.Tensor] = {}

    def get(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        numel = math.prod(shape)
        buffer = self.buffers.get(dtype)
        if buffer is None or buffer.numel() < numel:
            self.buffers.pop(dtype, None)  # freed before its successor is allocated
            buffer = self.buffers[dtype] = torch.empty(numel, dtype=dtype)
        return buffer[:numel].view(shape)


def storage_key(t: torch.Tensor) -> int:
    """A tensor's storage's identity (tied weights share one), for real and meta tensors alike."""
    return t.untyped_storage()._cdata  # noqa: SLF001 - the storage's identity (a meta tensor has no address)


def _whole(t: torch.Tensor, param: torch.Tensor) -> bool:
    """``t`` is ``param`` itself or an alias of all of it (``.data``, ``detach()``)."""
    return t.shape == param.shape and t.stride() == param.stride() and t.storage_offset() == param.storage_offset()


#: torch.nn.init's functions that return at once for a meta tensor (no op reaches the recorder):
#: called on a deferred parameter, each is recorded whole and run on a scratch tensor instead
SKIP_META = ("_no_grad_trunc_normal_", "dirac_", "orthogonal_", "sparse_")


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.recipes: dict[int, tuple[torch.Tensor, Recipe]] = {}  # storage key -> (meta param, recipe)
        self.failure: str | None = None
        self.scratch = Scratch()

    def defer(self, param: nn.Parameter) -> nn.Parameter | None:
        if param.is_meta:
            return None  # already deferred (a tied weight assigned again), or the user's own meta
        meta = nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=param.requires_grad)
        self.recipes[storage_key(meta)] = (meta, Recipe(param.shape, param.dtype, param.detach()))
        return meta

    def wrap(self, fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        """``fn`` (one of :data:`SKIP_META`), recording a call on a deferred parameter as one step."""
        takes_generator = "generator" in inspect.signature(fn).parameters

        def call(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            entry = self.recipes.get(storage_key(tensor)) if tensor.is_meta else None
            if entry is None or self.failure is not None:
                return fn(tensor, *args, **kwargs)
            param, recipe = entry
            if not _whole(tensor, param):
                self._fail(f"{fn.__name__} writes part of a parameter of shape {tuple(param.shape)}")
                return tensor
            state = None
            if takes_generator:
                generator = kwargs.get("generator") or torch.default_generator
                if generator.device.type != "cpu":
                    self._fail(f"{fn.__name__} draws from a generator that is not the CPU's")
                    return tensor
                state = generator.get_state()
            fn(self.scratch.get(recipe.shape, recipe.dtype), *args, **kwargs)  # moves the generator on
            rest = {k: v for k, v in kwargs.items() if k != "generator"}
            recipe.initial, recipe.steps = None, [Step(fn, args, rest, state)]
            return tensor

        return call

    def _fail(self, why: str) -> None:
        if self.failure is None:
            self.failure = why

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat, _ = tree_flatten((args, kwargs))
        metas = [t for t in flat if isinstance(t, torch.Tensor) and t.is_meta]
        touched = [self.recipes.get(storage_key(t)) for t in metas]
        if self.failure is None and any(touched):
            schema = func._schema  # noqa: SLF001 - an op's schema, as dispatch modes read it
            first = schema.arguments[0] if schema.arguments else None
            writes_first = first is not None and first.alias_info is not None and first.alias_info.is_write
            if writes_first and args and isinstance(args[0], torch.Tensor) and args[0].is_meta:
                self._record(func, args, kwargs)
            elif schema.is_mutable:
                self._fail(f"{func} writes a parameter other than through its first argument")
        return func(*args, **kwargs)

    def _record(self, func: Any, args: tuple, kwargs: dict) -> None:
        target = args[0]
        entry = self.recipes.get(storage_key(target))
        if entry is None:
            self._fail(f"{func} writes a parameter's value into another meta tensor")
            return
        param, recipe = entry
        if not _whole(target, param):
            self._fail(f"{func} writes part of a parameter of shape {tuple(param.shape)}")
            return
        if any(isinstance(a, torch.Tensor) and a.is_meta for a in tree_flatten((args[1:], kwargs))[0]):
            self._fail(f"{func} computes a parameter from another meta tensor")
            return
        rest = tree_map(lambda a: a.detach().clone() if isinstance(a, torch.Tensor) else a, args[1:])
        step_kwargs = {k: v for k, v in kwargs.items() if k != "generator"}
        if torch.Tag.nondeterministic_seeded in func.tags:
            generator = kwargs.get("generator") or torch.default_generator
            if not isinstance(generator, torch.Generator) or generator.device.type != "cpu":
                self._fail(f"{func} draws from a generator that is not the CPU's")
                return
            state = generator.get_state()
            func(self.scratch.get(recipe.shape, recipe.dtype), *rest, **kwargs)  # moves the generator on
            recipe.initial, recipe.steps = None, [Step(func, rest, step_kwargs, state)]
        elif func.__name__.split(".")[0] in ("fill_", "zero_", "copy_"):
            recipe.initial, recipe.steps = None, [Step(func, rest, step_kwargs)]
        else:  # reads what is there: mul_, add_, clamp_, erfinv_, ...
            recipe.steps.append(Step(func, rest, step_kwargs))


@contextmanager
def _recording() -> Iterator[_Recorder]:
    recorder = _Recorder()
    # the hook's return value replaces the parameter (torch types the hook as returning None)
    handle = nn.modules.module.register_module_parameter_registration_hook(
        lambda module, name, param: recorder.defer(param) if param is not None else None  # type: ignore[arg-type]
    )
    originals = {name: getattr(nn.init, name) for name in SKIP_META if hasattr(nn.init, name)}
    for name, fn in originals.items():
        setattr(nn.init, name, recorder.wrap(fn))
    try:
        with recorder:
            yield recorder
    finally:
        handle.remove()
        for name, fn in originals.items():
            setattr(nn.init, name, fn)


def build_deferred(build: Callable[[], nn.Module]) -> nn.Module:
    """``build()`` with its parameters on the meta device and their recipes kept on the model (the
    default CPU generator ends where a normal build leaves it). Falls back to a normal build, from
    the same random state, when the build cannot be recorded (logged)."""
    state = torch.get_rng_state()
    with _recording() as recorder:
        model = build()
    if recorder.failure is None:
        by_key = {storage_key(p): name for name, p in model.named_parameters(remove_duplicate=False)}
        missing = [name for key, name in by_key.items() if key not in recorder.recipes]
        if missing:
            recorder.failure = f"parameter {missing[0]} was not made through a module's register_parameter"
    if recorder.failure is not None:
        log.info("building the whole model on every rank (its build cannot be deferred: %s)", recorder.failure)
        torch.set_rng_state(state)
        return build()
    recipes = {name: recorder.recipes[storage_key(p)][1] for name, p in model.named_parameters(remove_duplicate=False)}
    setattr(model, RECIPES, recipes)
    return model


def is_deferred(model: nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


def own_name(name: str) -> str:
    """A parameter's name without the wrappers' parts (activation checkpointing, torch.compile)."""
    return ".".join(part for part in name.split(".") if part not in WRAPPER_NAMES)


def materialize(model: nn.Module, device: torch.device, recipes: dict[str, Recipe] | None = None) -> nn.Module:
    """Give ``model``'s meta parameters storage on ``device`` and the values a normal build gives
    them (this rank's part of a sharded or split one), one parameter at a time; buffers move to
    ``device``. ``recipes`` defaults to the ones :func:`build_deferred` kept on ``model`` (pass
    them when ``model`` is a wrapper or a pipeline stage of the model that was built)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    recipes = recipes if recipes is not None else getattr(model, RECIPES)
    if hasattr(model, RECIPES):
        delattr(model, RECIPES)  # whole now: later steps take it as a built model
    names = {id(p): name for name, p in model.named_parameters(remove_duplicate=False) if p.is_meta}
    swapping = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)  # a parameter stays one object (ties kept)
    try:
        # _apply, not to_empty(): buffers keep their values; FSDP2 resets its shards after it
        model._apply(lambda t: torch.empty_like(t, device=device) if t.is_meta else t.to(device))  # noqa: SLF001
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swapping)
    scratch = Scratch()
    with torch.no_grad():
        for param in {id(p): p for p in model.parameters()}.values():
            if id(param) not in names:
                continue  # real already (a part materialized before, or built real)
            recipe = recipes.get(own_name(names[id(param)]))
            if recipe is None:
                raise KeyError(f"no recipe for parameter {names[id(param)]!r} of the deferred model")
            full = recipe.value(scratch)
            if isinstance(param, DTensor):
                part = distribute_tensor(full.to(device), param.device_mesh, param.placements, src_data_rank=None)
                param.to_local().copy_(part.to_local())
            else:
                param.copy_(full)
    return model
