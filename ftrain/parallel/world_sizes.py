"""Which world sizes a job's config can run at, told before any worker starts.

A worker checks its layout when it starts (:class:`ftrain.train.Trainer`): the pipeline degree a
world of that size runs at (:func:`~ftrain.parallel.pipeline_stages.at_world`), the strategy's
layout (:func:`~ftrain.parallel.strategies.compute_layout`) and the split of
``train.global_batch_size`` into micro-batches of ``train.micro_batch_size`` over the
data-parallel ranks (:func:`~ftrain.data.cursor.micro_steps`). :func:`check_world_size` makes
the same checks, as a pure function of the config and the world, so that ``ftrain agent`` can
ask it for every node count of ``--nnodes MIN:MAX`` and never form a round its workers would
refuse (a refused size is a config error, not a failure to restart from).

What must stay true: these are the worker's own functions, called as the worker calls them
(what the model itself refuses, e.g. a factory's heads, is not known here: the agent's leader
leaves out a size whose workers fail on a config error); torch-free.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from ftrain.contract.config import ConfigError
from ftrain.data.cursor import micro_steps
from ftrain.parallel.pipeline_stages import at_world
from ftrain.parallel.strategies import compute_layout

if TYPE_CHECKING:
    from ftrain.config import Config

#: how many node counts :func:`workable_node_counts` names at most
SHOWN = 12


def check_world_size(cfg: Config, world_size: int, *, local_world_size: int) -> None:
    """Nothing if ``cfg`` runs on ``world_size`` ranks of ``local_world_size`` per node; else the
    :class:`ConfigError` a worker would stop on, naming the setting (``train.global_batch_size``,
    ``parallel.pp_size``, ``parallel.tp_size``, ...)."""
    if world_size < 1:
        raise ConfigError("agent.nnodes", f"a world of {world_size} ranks cannot run")
    parallel = at_world(cfg.parallel, world_size)
    n_head = cfg.model.n_head if not cfg.model.factory else None
    layout = compute_layout(
        parallel, world_size=world_size, rank=0, local_world_size=min(local_world_size, world_size), n_head=n_head
    )
    micro_steps(cfg.train.global_batch_size, cfg.train.micro_batch_size, layout.dp_size, uneven=parallel.deterministic)


def refusal(cfg: Config, world_size: int, *, local_world_size: int) -> ConfigError | None:
    """Why ``cfg`` cannot run on ``world_size`` ranks (None: it can): :func:`check_world_size`'s error."""
    try:
        check_world_size(cfg, world_size, local_world_size=local_world_size)
    except ConfigError as e:
        return e
    return None


def node_count_refusals(cfg: Config, node_counts: Iterable[int], nproc_per_node: int) -> dict[int, ConfigError]:
    """The node counts of ``node_counts`` (of ``nproc_per_node`` ranks each) that ``cfg`` cannot
    run, each with why; the others are absent."""
    out = {}
    for nodes in node_counts:
        problem = refusal(cfg, nodes * nproc_per_node, local_world_size=nproc_per_node)
        if problem is not None:
            out[nodes] = problem
    return out


def workable_node_counts(cfg: Config, nproc_per_node: int, up_to: int, *, limit: int = SHOWN) -> list[int]:
    """The first ``limit`` node counts from 1 to ``up_to`` that ``cfg`` runs on."""
    found: list[int] = []
    for nodes in range(1, up_to + 1):
        if refusal(cfg, nodes * nproc_per_node, local_world_size=nproc_per_node) is None:
            found.append(nodes)
            if len(found) == limit:
                break
    return found


__all__ = ["check_world_size", "node_count_refusals", "refusal", "workable_node_counts"]
