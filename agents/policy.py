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
from ftrain.agents.records import Report


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
    #: node counts whose world size the job cannot run for another reason, each with it naming the
    #: setting: the training config's checks (``ftrain.parallel.world_sizes``, asked by ``ftrain
    #: agent`` at start) or the workers' own refusal (a config error at that size, learnt by the leader)
    refused: tuple[tuple[int, str], ...] = ()

    @classmethod
    def from_config(
        cls,
        config: AgentConfig,
        *,
        pipeline_degrees: tuple[int, ...] = (1,),
        fixed_tp_size: int = 1,
        refused: tuple[tuple[int, str], ...] = (),
    ) -> Policy:
        keys = {f.name for f in dataclasses.fields(cls)} - {"pipeline_degrees", "fixed_tp_size", "refused"}
        return cls(
            **{k: getattr(config, k) for k in keys},
            pipeline_degrees=pipeline_degrees,
            fixed_tp_size=fixed_tp_size,
            refused=refused,
        )

    @classmethod
    def of(
        cls,
        pipeline_degrees: tuple[int, ...] = (1,),
        fixed_tp_size: int = 1,
        refused: tuple[tuple[int, str], ...] = (),
        **settings: Any,
    ) -> Policy:
        """From ``[agent]`` keys as keyword arguments (see :meth:`AgentConfig.of`); the rest default."""
        return cls.from_config(
            AgentConfig.of(**settings), pipeline_degrees=pipeline_degrees, fixed_tp_size=fixed_tp_size, refused=refused
        )

    def pipeline_at(self, nodes: int) -> int | None:
        """The pipeline degree a round of ``nodes`` nodes runs at; None: it cannot run."""
        ranks = nodes * self.nproc_per_node
        return next((pp for pp in self.pipeline_degrees if ranks % (pp * self.fixed_tp_size) == 0), None)

    def refusal(self, nodes: int) -> str:
        """Why the job cannot run at ``nodes`` nodes besides the pipeline's tiling (empty: no reason known)."""
        return next((why for n, why in self.refused if n == nodes), "")

    def runs(self, nodes: int) -> bool:
        """A round of ``nodes`` nodes can run: the pipeline tiles its ranks and nothing refused it."""
        return self.pipeline_at(nodes) is not None and not self.refusal(nodes)

    def refused_round(self, nodes: int) -> str:
        """Why a round of ``nodes`` nodes (at most ``max_nodes``) is not formed when the training
        config or its workers refused that size (empty: not refused, or the pipeline's tiling is why)."""
        nodes = min(nodes, self.max_nodes)
        if self.pipeline_at(nodes) is None or not self.refusal(nodes):
            return ""
        return (
            f"a round with it would be {self.cannot_run(nodes)}: it waits as a spare, and joins a round of a node "
            "count the job runs at (more nodes, or after a member is lost)"
        )

    def refused_note(self, nodes: int, why: str) -> str:
        """What the leader says once when the workers of a round of ``nodes`` nodes refused its
        world size for ``why`` (empty when that size was refused already: nothing new)."""
        if self.refusal(nodes):
            return ""
        return (
            f"the workers refused world size {nodes * self.nproc_per_node} ({nodes} node(s) x {self.nproc_per_node}) "
            f"with a config error: {why}; no round of {nodes} node(s) is formed again"
        )

    def refusing(self, *refused: tuple[int, str]) -> Policy:
        """This policy with rounds of these node counts refused, each for its reason (a count
        refused already keeps its first)."""
        new = {n: why for n, why in refused if not self.refusal(n)}
        return dataclasses.replace(self, refused=tuple(sorted((*self.refused, *new.items())))) if new else self

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
        while count > 0 and not self.runs(count):
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
        if nodes < 1 or self.runs(nodes):
            return ""
        ranks = nodes * self.nproc_per_node
        if self.pipeline_at(nodes) is not None:
            return f"{nodes} node(s) x {self.nproc_per_node} proc = world size {ranks}, which the job cannot run: " + (
                self.refusal(nodes)
            )
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
            f"({self.layout_needs()}{self.refused_text()}), fewer than the {self.min_nodes} of --nnodes "
            f"{self.min_nodes}:{self.max_nodes}; add nodes"
        )

    def refused_text(self) -> str:
        """The refused node counts in words (``; not 3 node(s): why``), empty when there are none."""
        return "".join(f"; not {n} node(s): {why}" for n, why in self.refused)

    def backoff_s(self, recent_failures: int) -> float:
        """No wait for the first failure in the window, then initial, 2x initial, ... capped."""
        if recent_failures <= 1:
            return 0.0
        return min(self.backoff_max_s, self.backoff_initial_s * 2 ** (recent_failures - 2))


#: how a worker's exit message starts when it stopped on a config error (``ftrain.train.describe_failure``)
CONFIG_ERROR = "ConfigError: "


def workers_refused(reports: list[Report]) -> str:
    """The config error the failing workers stopped on (their own message, naming the setting:
    ``train.global_batch_size: ...``), empty when none did. Told by the exit message, not the exit
    code: torchrun exits 1 whatever its workers' codes (a config error's is ``exits.USAGE``), and
    that code also stands for an unreachable service, which a smaller world would not fix."""
    return next((r.error.removeprefix(CONFIG_ERROR) for r in reports if r.error.startswith(CONFIG_ERROR)), "")


__all__ = ["CONFIG_ERROR", "Policy", "workers_refused"]
