"""The contract of a parallel strategy, and the layout it gives a rank. Torch-free at import.

A :class:`Strategy` is everything ftrain knows about one value of ``parallel.strategy``, in one
object: its name and place in listings, the config it accepts, the :class:`Layout` of a rank (data-
and tensor-parallel coordinates, device mesh), how it wraps the model and builds the optimizer,
which ranks hold identical copies (the consistency check), and its memory model for ``ftrain plan``.

What must stay true:

- Importing a strategy module imports no torch. ``ftrain.config`` takes the strategy names and
  checks from the registry, and config validation runs in torch-free processes (the node agent).
  The torch-side mechanisms a strategy combines (``ftrain.parallel.ddp``, ``fsdp``, ``tp``, ...)
  are imported inside the methods that use them.
- Config errors are :class:`ftrain.contract.config.ConfigError` naming the key.
- The framework fixes the order of wrapping for every strategy (``ftrain.parallel.parallelize``):
  mesh, :meth:`Strategy.apply_tensor_parallel`, activation checkpointing,
  :meth:`Strategy.apply_data_parallel`, :meth:`Strategy.make_optimizer`, :meth:`Strategy.make_parallel`.
"""

from __future__ import annotations

import abc
import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh

    from ftrain.config import Config, OptimConfig, ParallelConfig
    from ftrain.parallel.base import Parallel
    from ftrain.planning.memory import MemoryEstimate, ModelStats


class Wrapper(enum.Enum):
    """What holds the parameters for data parallelism, as ``ftrain plan`` counts memory."""

    DDP = enum.auto()
    """Replicated plain tensors; gradient buckets persist through backward (unless
    ``parallel.deterministic``) and accumulation adds fresh gradients beside them; a foreach
    AdamW step on CUDA."""
    FSDP = enum.auto()
    """FSDP2 units sharded over :meth:`Strategy.shard_count` ranks with dim 0 padded, bf16 by a
    MixedPrecisionPolicy (not autocast), units gathered in forward and backward."""
    NONE = enum.auto()
    """The parameters as they are (plain, or tensor-parallel DTensors)."""


#: A device mesh as (shape, dimension names), what ``init_device_mesh`` takes.
MeshShape = tuple[tuple[int, ...], tuple[str, ...]]


@dataclass(frozen=True, slots=True)
class Layout:
    """Where this rank sits: world, data-parallel and tensor-parallel coordinates, and the mesh."""

    strategy: str
    world_size: int
    rank: int
    dp_size: int
    dp_rank: int
    tp_size: int = 1
    shard_size: int = 0  # HSDP: ranks per shard group
    deterministic: bool = False
    mesh_shape: MeshShape | None = None
    """The device mesh the strategy's wrappers run on, as (shape, dimension names); None: none.
    With a pipeline: the mesh inside one stage (``dp``/``tp``); the job's mesh adds ``pp`` in front."""
    pp_size: int = 1
    """Pipeline stages' ranks: rank = pp_rank x (dp_size x tp_size) + dp_rank x tp_size + tp_rank."""
    pp_rank: int = 0

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def reads_data(self) -> bool:
        """Whether this rank records its data-parallel rank's samples (the first of its tensor-
        parallel group, in the first pipeline stage: the others read the same micro-batches)."""
        return self.tp_rank == 0 and self.pp_rank == 0

    def loss_ranks(self) -> list[tuple[int, int]]:
        """(rank, dp_rank) of the ranks whose micro-batch losses count: one per data-parallel
        rank, the first of its tensor-parallel group in the last pipeline stage."""
        last_stage = (self.pp_size - 1) * self.dp_size * self.tp_size
        return [(last_stage + d * self.tp_size, d) for d in range(self.dp_size)]

    def describe(self) -> dict[str, object]:
        """What manifests and final saves record about the layout."""
        return {
            "strategy": self.strategy,
            "world_size": self.world_size,
            "dp_size": self.dp_size,
            "tp_size": self.tp_size,
            "shard_size": self.shard_size,
            "deterministic": self.deterministic,
            "pp_size": self.pp_size,
        }


class Strategy(abc.ABC):
    """One parallel strategy. Subclasses set the class attributes and implement the abstract methods;
    the defaults fit a strategy without tensor parallelism whose replicas are plain tensors."""

    # -- identity -------------------------------------------------------------------------
    name: ClassVar[str]
    """The value of ``parallel.strategy``."""
    position: ClassVar[int]
    """Place in listings (config choices and help, the ``ftrain plan`` table); unique."""
    preference: ClassVar[int]
    """Communication rank, least first: ``ftrain plan`` recommends the first that fits; unique."""

    # -- what it accepts and needs --------------------------------------------------------
    supports_deterministic: ClassVar[bool] = False
    """Whether ``parallel.deterministic`` (the fixed-order gradient reduction) works with it."""
    needs_tp_plan: ClassVar[bool] = False
    """Needs the model's ``tp_plan()`` (``ftrain plan`` skips it for models without one)."""
    needs_several_ranks: ClassVar[bool] = False
    """Pointless or impossible on one rank (``ftrain plan`` skips it at world size 1)."""
    full_replica: ClassVar[bool] = False
    """Every rank holds the whole model and optimizer state (plain tensors), so after a failure
    any survivor can hand a joiner everything (``ftrain.recovery.live``); otherwise state comes from storage."""

    # -- memory model (ftrain plan does the arithmetic from these and the methods below) ---
    wrapper: ClassVar[Wrapper]
    """What holds the parameters for data parallelism."""
    reshard_after_forward: ClassVar[bool] = True
    """FSDP2 only: re-shard each unit after its forward (ZeRO-3) or keep it gathered (ZeRO-2).
    Both ``apply_data_parallel`` and the memory model read it."""
    textbook_difference: ClassVar[str] = "padding"
    """Why the model states ftrain holds differ from the ZeRO paper's, shown when they do."""

    def __repr__(self) -> str:
        return f"<strategy {self.name}>"

    # -- config ---------------------------------------------------------------------------
    def check_config(self, cfg: Config) -> None:  # noqa: B027  (a hook: most strategies add nothing)
        """Reject, with a ConfigError naming the key, a whole config this strategy cannot run
        (called from ``Config.__post_init__``)."""

    # -- layout ---------------------------------------------------------------------------
    @abc.abstractmethod
    def layout(
        self, parallel: ParallelConfig, *, world_size: int, rank: int, local_world_size: int, n_head: int | None
    ) -> Layout:
        """This rank's layout, or a ConfigError naming the key that cannot work at this size.
        Settings left at 0 (``tp_size``, ``shard_size``) get the strategy's default here."""

    # -- the model (torch; imported lazily) -----------------------------------------------
    def apply_tensor_parallel(  # noqa: B027  (a hook)
        self, model: nn.Module, mesh: DeviceMesh | None, *, sequence_parallel: bool
    ) -> None:
        """Split the model's layers in place, before activation checkpointing (default: nothing);
        ``sequence_parallel``: ``parallel.sequence_parallel``."""

    def apply_data_parallel(
        self,
        model: nn.Module,
        parallel: ParallelConfig,
        layout: Layout,
        mesh: DeviceMesh | None,
        device: torch.device,
        compute_dtype: torch.dtype,
    ) -> nn.Module:
        """Wrap or shard the model for data parallelism; returns the module to train (default: as is)."""
        return model

    def make_optimizer(self, groups: list[dict[str, object]], optim: OptimConfig) -> torch.optim.Optimizer:
        """The optimizer over the wrapped model's parameter groups (default: AdamW)."""
        import torch

        return torch.optim.AdamW(groups, **optim.adamw_kwargs())

    def make_parallel(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        layout: Layout,
        device: torch.device,
        compute_dtype: torch.dtype,
        micro_per_step: int,
    ) -> Parallel:
        """The train loop's handle on model and optimizer (default: no gradient sync to do)."""
        from ftrain.parallel.base import Parallel

        return Parallel(model, optimizer, layout, device, compute_dtype)

    # -- replicas (the consistency check) -------------------------------------------------
    @abc.abstractmethod
    def replica_group(self, layout: Layout) -> int | None:
        """The group of ranks whose :meth:`replicated_tensors` must be identical to this rank's,
        as a key equal on exactly those ranks; None if this rank holds no replicated state."""

    def replicated_tensors(self, par: Parallel) -> list[torch.Tensor]:
        """What must match within the replica group, in a fixed order (default: the plain, not
        tensor-parallel, parameters and their optimizer state)."""
        import torch
        from torch.distributed.tensor import DTensor

        plain: list[torch.Tensor] = [p for p in par.model.parameters() if not isinstance(p, DTensor)]
        plain += [
            t
            for p in plain
            for t in par.optimizer.state.get(p, {}).values()
            if torch.is_tensor(t) and not isinstance(t, DTensor)
        ]
        return plain

    # -- memory model ---------------------------------------------------------------------
    @abc.abstractmethod
    def shard_count(self, layout: Layout) -> int:
        """Ranks one parameter's model states are sharded over (1: replicated)."""

    def optimizer_numel(self, stats: ModelStats, layout: Layout, local_numel: int) -> int:
        """Parameters whose AdamW state this rank holds (default: those it stores)."""
        return local_numel

    @abc.abstractmethod
    def textbook_model_state_bytes(self, num_params: int, *, shard: int, tp_split: int, tp: int) -> int:
        """Mixed-precision Adam model states per rank as in the ZeRO paper (16 bytes per parameter:
        2 fp16 params + 2 fp16 grads + 12 fp32 master, m, v). ``tp_split``: parameters split by TP."""

    def layout_text(self, estimate: MemoryEstimate) -> str:
        """The layout column of the ``ftrain plan`` table."""
        return f"dp={estimate.dp_size}"
