"""Parallel strategies: one module per strategy, found by name. Torch-free at import.

Every module of this package other than ``base`` (and ``_``-prefixed helpers) defines
``STRATEGY``, an instance of :class:`~ftrain.parallel.strategies.base.Strategy`. The registry imports them
all when this package is imported and lists them by ``Strategy.position``. Everything that
differs between strategies dispatches through :func:`get`: the config's choices and checks
(``ftrain.config``), the layout (:func:`compute_layout`), the model wrapping
(``ftrain.parallel.parallelize``), the replica check (``ftrain.consistency``) and the memory model
and recommendation (``ftrain.planning.plan``). So adding a strategy is adding one module here, plus its
tests; ``tests/unit/test_strategy_registry.py`` runs its contract against every registered one.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from typing import TYPE_CHECKING

from ftrain.contract.config import ConfigError
from ftrain.parallel.strategies.base import Layout, Strategy, Wrapper

if TYPE_CHECKING:
    from ftrain.config import Config, ParallelConfig

__all__ = [
    "STRATEGIES",
    "Layout",
    "Strategy",
    "Wrapper",
    "by_preference",
    "check_config",
    "check_parallel",
    "compute_layout",
    "discover",
    "full_replica",
    "get",
    "fixed_tp_size",
    "registered",
    "shards_model",
]


def discover(package: str) -> tuple[Strategy, ...]:
    """The strategies defined by the modules of ``package``, in listing order.

    TypeError if a module defines no ``STRATEGY``, or two strategies share a name, a position or
    a preference (the listings and the recommendation need one order)."""
    found: list[Strategy] = []
    for info in pkgutil.iter_modules(importlib.import_module(package).__path__):
        if info.name == "base" or info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{package}.{info.name}")
        strategy = getattr(module, "STRATEGY", None)
        if not isinstance(strategy, Strategy):
            raise TypeError(f"{module.__name__} must define STRATEGY, a Strategy instance (got {strategy!r})")
        found.append(strategy)
    for attribute in ("name", "position", "preference"):
        values = [getattr(s, attribute) for s in found]
        repeated = sorted({v for v in values if values.count(v) > 1})
        if repeated:
            raise TypeError(f"strategies in {package} share a {attribute}: {repeated}")
    return tuple(sorted(found, key=lambda s: s.position))


_REGISTERED = discover(__name__)
_BY_NAME = {s.name: s for s in _REGISTERED}

#: The values of ``parallel.strategy``, in listing order.
STRATEGIES: tuple[str, ...] = tuple(_BY_NAME)


def get(name: str) -> Strategy:
    """The strategy called ``name``; a ConfigError naming ``parallel.strategy`` and the choices if none is."""
    strategy = _BY_NAME.get(name)
    if strategy is None:
        raise ConfigError("parallel.strategy", f"{name!r} is not one of {', '.join(STRATEGIES)}")
    return strategy


def registered() -> tuple[Strategy, ...]:
    """Every strategy, in listing order."""
    return _REGISTERED


def by_preference() -> tuple[Strategy, ...]:
    """Every strategy, least communication first (the order ``ftrain plan`` recommends in)."""
    return tuple(sorted(_REGISTERED, key=lambda s: s.preference))


def compute_layout(
    parallel: ParallelConfig, *, world_size: int, rank: int, local_world_size: int, n_head: int | None
) -> Layout:
    """This rank's layout under ``parallel.strategy``; ConfigError naming the key that cannot work
    at this size. A pure function of the settings and the world (``n_head`` None: not checked).

    With ``parallel.pp_size`` P > 1 the strategy lays out each stage's world_size / P ranks (the
    ranks of pipeline rank p are ``p * inner .. (p + 1) * inner - 1``)."""
    pp = parallel.pp_size
    if world_size % pp:
        raise ConfigError(
            "parallel.pp_size",
            f"{pp} does not divide the world size {world_size}: the job needs a multiple of {pp} ranks",
        )
    inner = world_size // pp
    layout = get(parallel.strategy).layout(
        parallel, world_size=inner, rank=rank % inner, local_world_size=min(local_world_size, inner), n_head=n_head
    )
    if pp == 1:
        return layout
    return dataclasses.replace(layout, world_size=world_size, rank=rank, pp_size=pp, pp_rank=rank // inner)


def full_replica(layout: Layout) -> bool:
    """Whether every rank of ``layout`` holds the whole model and optimizer state (a survivor can
    hand a joiner everything): the strategy's say, and no pipeline (a stage holds its part)."""
    return get(layout.strategy).full_replica and layout.pp_size == 1


def shards_model(layout: Layout) -> bool:
    """Whether ``layout`` leaves a rank only part of the model's parameters (sharded, split or
    staged): the model is then built on the meta device and each rank materializes its part
    (:func:`ftrain.parallel.parallelize.build_for`), and ``ftrain plan`` counts that start-up."""
    return layout.pp_size > 1 or layout.tp_size > 1 or get(layout.strategy).wrapper is Wrapper.FSDP


def fixed_tp_size(parallel: ParallelConfig) -> int:
    """The tensor-parallel degree whatever the world size (fsdp+tp's groups; tp itself takes any
    world): with the pipeline degree, what a world size must be a multiple of."""
    return (parallel.tp_size or 2) if parallel.strategy == "fsdp+tp" else 1


def check_parallel(parallel: ParallelConfig) -> None:
    """``ParallelConfig``'s strategy checks: the strategy exists and takes ``parallel.deterministic``."""
    strategy = get(parallel.strategy)
    if parallel.deterministic and not strategy.supports_deterministic:
        able = "/".join(s.name for s in _REGISTERED if s.supports_deterministic)
        raise ConfigError(
            "parallel.deterministic",
            f"the fixed-order reduction supports parallel.strategy={able} only, not {parallel.strategy!r}",
        )


def check_config(cfg: Config) -> None:
    """``Config``'s strategy checks: what the strategy cannot run with in other sections."""
    get(cfg.parallel.strategy).check_config(cfg)
