"""The settings the leader's decisions follow (:class:`Policy`): the ``[agent]`` keys it uses and
what the training layout says about usable world sizes, with the words it states its decisions in.

Pure: no clock, no I/O; :mod:`ftrain.agents.leader` decides with it, :mod:`ftrain.agents.agent_options`
checks a node range with it before anything starts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ftrain.agents.config import AgentConfig


@dataclass(frozen=True, slots=True)
class Policy:
    """The settings :func:`decide` follows, derived from the ``[agent]`` section
    (:class:`~ftrain.agents.config.AgentConfig` holds their one definition and default: none here)."""

    min_nodes: int
    max_nodes: int
    nproc_per_node: int
    settle_s: float
    start_timeout_s: float
    max_restarts: int
    restart_window_s: float
    backoff_initial_s: float
    backoff_max_s: float
    scale_up: str  #: checkpoint | immediate
    #: the same worker error at the same step this many times in a row ends the job (0: never)
    deterministic_failures: int
    recovery: str  #: live | restart: under live, a joining node enters once its workers are warm
    on_straggler: str  #: off | warn | evict
    straggler_factor: float  #: slow: busy per step this many times the other nodes' median
    straggler_after_s: float  #: slow this long without a break: a straggler
    straggler_rejoin_s: float  #: evict: how long an evicted node is kept out
    #: not ``[agent]`` keys: the training config's say (``ftrain.parallel.pipeline_stages.pipeline_degrees``,
    #: ``ftrain.parallel.strategies.fixed_tp_size``): a world size runs at the first pipeline degree whose
    #: stages of ``fixed_tp_size``-rank groups tile it, and a size none tiles cannot run
    pipeline_degrees: tuple[int, ...] = (1,)
    fixed_tp_size: int = 1

    @classmethod
    def from_config(
        cls, config: AgentConfig, *, pipeline_degrees: tuple[int, ...] = (1,), fixed_tp_size: int = 1
    ) -> Policy:
        keys = {f.name for f in dataclasses.fields(cls)} - {"pipeline_degrees", "fixed_tp_size"}
        return cls(
            **{k: getattr(config, k) for k in keys}, pipeline_degrees=pipeline_degrees, fixed_tp_size=fixed_tp_size
        )

    @classmethod
    def of(cls, pipeline_degrees: tuple[int, ...] = (1,), fixed_tp_size: int = 1, **settings: Any) -> Policy:
        """From ``[agent]`` keys as keyword arguments (see :meth:`AgentConfig.of`); the rest default."""
        return cls.from_config(
            AgentConfig.of(**settings), pipeline_degrees=pipeline_degrees, fixed_tp_size=fixed_tp_size
        )

    def pipeline_at(self, nodes: int) -> int | None:
        """The pipeline degree a round of ``nodes`` nodes runs at; None: it cannot run."""
        ranks = nodes * self.nproc_per_node
        return next((pp for pp in self.pipeline_degrees if ranks % (pp * self.fixed_tp_size) == 0), None)

    def stages_of(self, node_rank: int, nodes: int) -> frozenset[int]:
        """The pipeline stages node ``node_rank``'s ranks run in a round of ``nodes`` nodes."""
        first, last = self.stage_spans(nodes, node_rank, node_rank + 1)[0]
        return frozenset(range(first, last + 1))

    def stage_spans(self, nodes: int, start: int = 0, stop: int | None = None) -> list[tuple[int, int]]:
        """The first and last pipeline stage of each node rank in ``[start, stop)`` (default:
        all) of a round of ``nodes`` nodes: a node's ranks are contiguous, so it runs every stage
        from its first rank's to its last rank's (:meth:`stages_of`)."""
        per_stage = max(1, nodes * self.nproc_per_node // (self.pipeline_at(nodes) or 1))
        n = self.nproc_per_node
        return [
            (k * n // per_stage, ((k + 1) * n - 1) // per_stage) for k in range(start, nodes if stop is None else stop)
        ]

    def usable_nodes(self, count: int) -> int:
        """The most of ``count`` nodes (at most ``max_nodes``) whose ranks make a usable world size."""
        count = min(count, self.max_nodes)
        while count > 0 and self.pipeline_at(count) is None:
            count -= 1
        return count

    def layout_needs(self) -> str:
        """What a usable world size is, in words."""
        sizes = " or ".join(str(pp * self.fixed_tp_size) for pp in self.pipeline_degrees)
        return f"a multiple of {sizes} ranks"

    def layout_text(self) -> str:
        """The training layout's settings that decide the usable world sizes, as the user wrote
        them: ``parallel.pp_size=2`` (with ``parallel.pp_fallback`` and a fixed tensor-parallel
        degree when there are)."""
        pp, *fallback = self.pipeline_degrees
        text = f"parallel.pp_size={pp}"
        if fallback:
            text += f', parallel.pp_fallback="{",".join(map(str, fallback))}"'
        if self.fixed_tp_size > 1:
            text += f" x tensor-parallel {self.fixed_tp_size}"
        return text

    def cannot_run(self, nodes: int) -> str:
        """Why a round of ``nodes`` nodes cannot run (empty: it can), naming what would fix it."""
        if nodes < 1 or self.pipeline_at(nodes) is not None:
            return ""
        ranks = nodes * self.nproc_per_node
        fix = (
            "add nodes"
            if len(self.pipeline_degrees) > 1
            else 'set parallel.pp_fallback (e.g. "1": no pipeline while too few nodes are left) or add nodes'
        )
        return (
            f"{nodes} node(s) x {self.nproc_per_node} proc = world size {ranks}, which {self.layout_text()} "
            f"cannot run (it needs {self.layout_needs()}); {fix}"
        )

    def too_few(self, live: int) -> str:
        """Why no round forms with ``live`` nodes, fewer than ``min_nodes`` (and what else would stop it)."""
        why = (
            f"cannot form a round: {live} of at least {self.min_nodes} nodes live "
            f"(--nnodes {self.min_nodes}:{self.max_nodes}); waiting for more nodes to join"
        )
        layout = self.cannot_run(live)
        return f"{why} (besides, {layout})" if layout else why

    def unusable(self, nodes: int, usable: int) -> str:
        """Why no round forms of ``nodes`` live nodes when only ``usable`` of them make a world size
        the layout can run, fewer than ``min_nodes``."""
        layout = self.cannot_run(nodes)
        if layout:
            return f"cannot form a round: {layout}"
        return (
            f"cannot form a round: of {nodes} live nodes, {usable} make a world size {self.layout_text()} can run "
            f"({self.layout_needs()}), fewer than the {self.min_nodes} of --nnodes "
            f"{self.min_nodes}:{self.max_nodes}; add nodes"
        )

    def backoff_s(self, recent_failures: int) -> float:
        """No wait for the first failure in the window, then initial, 2x initial, ... capped."""
        if recent_failures <= 1:
            return 0.0
        return min(self.backoff_max_s, self.backoff_initial_s * 2 ** (recent_failures - 2))


__all__ = ["Policy"]
